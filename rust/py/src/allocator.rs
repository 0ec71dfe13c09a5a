//! The extension's allocator: mimalloc, with its memory faulted in before the steps need it.
//!
//! mimalloc backs its arenas with transparent huge pages where the OS allows (`madvise`), which
//! a step's walk over the requests' vectors gains from (5-7% of a decode step). The price is
//! paid on first touch: the kernel zeroes a whole 2 MiB page inside whichever call first writes
//! to it, a stall of 0.5-6 ms in one engine step (the prefill step's update, a later step whose
//! vector outgrew its capacity). So the module never hands memory it freed back to the OS, and
//! a thread that builds a scheduler first touches a warm reserve, which the pages its steps
//! allocate are carved from.

use std::alloc::{alloc, dealloc, Layout};
use std::cell::Cell;

/// mimalloc for every Rust allocation of the extension (Python's own objects keep Python's
/// allocator). `local_dynamic_tls` because the module is loaded with `dlopen`.
#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

/// mimalloc's `mi_option_purge_delay`, which `libmimalloc-sys` names no constant for: in
/// mimalloc v3's numbering it comes right before `mi_option_use_numa_nodes`.
const OPTION_PURGE_DELAY: libmimalloc_sys::mi_option_t =
    libmimalloc_sys::mi_option_use_numa_nodes - 1;

/// The warm reserve is touched in pieces of this size (a mimalloc large page), so that each
/// lands at the first free span of the thread's arena chunk, where later pages are carved.
const PIECE: usize = 4 << 20;

/// The smallest warm reserve of a thread.
const MIN_WARM: usize = 16 << 20;
/// The largest warm reserve of a thread.
const MAX_WARM: usize = 64 << 20;

thread_local! {
    /// Bytes this thread has warmed so far.
    static WARMED: Cell<usize> = const { Cell::new(0) };
}

/// Keeps what the extension frees committed: mimalloc reuses it, already faulted in, instead
/// of returning it to the OS after a delay and faulting it in again on the next burst.
pub(crate) fn keep_freed_memory() {
    // SAFETY: mi_option_set only stores the option's value.
    unsafe { libmimalloc_sys::mi_option_set(OPTION_PURGE_DELAY, -1) };
}

/// The warm reserve for a scheduler holding up to `max_num_seqs` requests of up to
/// `max_model_len` tokens: about 8 bytes a token (its id, its share of block hashes and ids),
/// between 16 and 64 MiB.
pub(crate) fn warm_bytes(max_num_seqs: usize, max_model_len: usize) -> usize {
    max_num_seqs
        .saturating_mul(max_model_len)
        .saturating_mul(8)
        .clamp(MIN_WARM, MAX_WARM)
}

/// Faults in `bytes` of the calling thread's allocator memory (beyond what it warmed before),
/// then frees it for the thread's later allocations. Best effort: stops at the first failed
/// allocation.
pub(crate) fn warm_thread(bytes: usize) {
    let done = WARMED.with(Cell::get);
    if done >= bytes {
        return;
    }
    let layout = Layout::from_size_align(PIECE, 4096).expect("a valid constant layout");
    let mut pieces = Vec::with_capacity((bytes - done).div_ceil(PIECE));
    while done + pieces.len() * PIECE < bytes {
        // SAFETY: `layout` has a non-zero size.
        let p = unsafe { alloc(layout) };
        if p.is_null() {
            break;
        }
        for offset in (0..PIECE).step_by(4096) {
            // SAFETY: `offset` lies inside the PIECE-byte allocation at `p`.
            unsafe { p.add(offset).write_volatile(0) };
        }
        pieces.push(p);
    }
    WARMED.with(|w| w.set(done + pieces.len() * PIECE));
    for p in pieces {
        // SAFETY: `p` came from `alloc(layout)` above and is freed once.
        unsafe { dealloc(p, layout) };
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_purge_delay_option_is_the_one_set() {
        // Its default (1,000 ms in mimalloc v3) tells it from its neighbours.
        // SAFETY: mi_option_get only reads the option's value.
        let get = |o| unsafe { libmimalloc_sys::mi_option_get(o) };
        assert_ne!(get(OPTION_PURGE_DELAY - 1), 1000);
        assert_ne!(get(OPTION_PURGE_DELAY + 1), 1000);
        if get(OPTION_PURGE_DELAY) != -1 {
            assert_eq!(get(OPTION_PURGE_DELAY), 1000);
        }
        keep_freed_memory();
        assert_eq!(get(OPTION_PURGE_DELAY), -1);
    }

    #[test]
    fn warm_bytes_scales_with_the_config_within_bounds() {
        assert_eq!(warm_bytes(1, 1), MIN_WARM);
        assert_eq!(warm_bytes(256, 16_384), 32 << 20);
        assert_eq!(warm_bytes(1024, 131_072), MAX_WARM);
        assert_eq!(warm_bytes(usize::MAX, usize::MAX), MAX_WARM);
    }

    #[test]
    fn a_thread_warms_once_up_to_the_largest_request() {
        std::thread::spawn(|| {
            warm_thread(PIECE);
            assert_eq!(WARMED.with(Cell::get), PIECE);
            warm_thread(PIECE);
            assert_eq!(WARMED.with(Cell::get), PIECE);
            warm_thread(3 * PIECE);
            assert_eq!(WARMED.with(Cell::get), 3 * PIECE);
        })
        .join()
        .unwrap();
    }
}
