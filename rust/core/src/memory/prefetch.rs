//! Software prefetch hints for the per-step loops.
//!
//! A step touches a few cold cache lines per request (its record, then the tails of its token,
//! hash and block vectors) and per new block (pool metadata). Where a loop's iterations are long
//! enough that the CPU cannot overlap those misses on its own, or an address depends on an
//! earlier miss, the loop asks for the lines of a request a few iterations ahead; elsewhere a
//! hint measured nothing and is left out. A hint never faults and never changes results; on
//! targets without a stable prefetch instruction it compiles to nothing.

/// How many requests ahead the per-request loops prefetch what a request's record points to
/// (vector tails), which reads the record.
pub const DISTANCE: usize = 4;

/// How many free-queue entries past the head the pool prefetches the records of, when it pops
/// blocks (the next pops take them).
pub const POP_DISTANCE: usize = 4;

/// Hints that the cache line holding `*ptr` will be read soon.
#[inline(always)]
pub fn read<T>(ptr: *const T) {
    #[cfg(target_arch = "x86_64")]
    // SAFETY: PREFETCHT0 is a hint: it never faults, even for an invalid address, and has no
    // effect visible to the program.
    unsafe {
        std::arch::x86_64::_mm_prefetch::<{ std::arch::x86_64::_MM_HINT_T0 }>(ptr.cast());
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = ptr;
}

/// Hints the line holding the last element of `v` (where appends and tail reads land).
#[inline(always)]
pub fn tail<T>(v: &[T]) {
    if let Some(last) = v.last() {
        read(last);
    }
}
