//! Transparent huge pages for the pool's per-block arrays.
//!
//! A step touches a few entries of each per-block array (block records, free-queue positions,
//! prefix buckets, token copies) for every block it allocates or caches, scattered over arrays
//! of tens of megabytes for a large pool. With 4 KiB pages nearly every such access also misses
//! the TLB. Where transparent huge pages are enabled only on request (`madvise`, the default of
//! several distributions), this asks for them on the arrays' memory before it is first written.
//! A hint only: without THP, or elsewhere than Linux, nothing changes.

/// Arrays smaller than this are left alone (a huge page is 2 MiB).
pub const MIN_BYTES: usize = 4 << 20;

/// Asks the OS to back `v`'s allocated capacity with huge pages, if it is large enough. Call it
/// before the memory is first written.
pub fn advise<T>(v: &Vec<T>) {
    let bytes = v.capacity().saturating_mul(std::mem::size_of::<T>());
    if bytes >= MIN_BYTES {
        advise_range(v.as_ptr().cast(), bytes);
    }
}

#[cfg(target_os = "linux")]
fn advise_range(start: *const u8, bytes: usize) {
    const PAGE: usize = 4096;
    let begin = (start as usize).next_multiple_of(PAGE);
    let end = (start as usize + bytes) & !(PAGE - 1);
    if end > begin {
        // SAFETY: [begin, end) lies inside the vector's own allocation; MADV_HUGEPAGE changes
        // only how the kernel backs the range, never its contents or validity. A failure (THP
        // disabled, an old kernel) is harmless and ignored.
        unsafe {
            libc::madvise(begin as *mut libc::c_void, end - begin, libc::MADV_HUGEPAGE);
        }
    }
}

#[cfg(not(target_os = "linux"))]
fn advise_range(_start: *const u8, _bytes: usize) {}
