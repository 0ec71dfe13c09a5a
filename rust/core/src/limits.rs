//! Bounds on a configuration, checked before anything is allocated.
//!
//! A scheduler allocates, and zero-fills, its tables at construction: the block table
//! (`max_num_seqs` rows of `cdiv(max_model_len, block_size)` int32 entries) and the pool's
//! per-block tables (a 64-byte record, free-queue entries, a prefix-cache bucket and, with
//! prefix caching, a copy of the block's `block_size` tokens). Everything else grows with the
//! requests actually submitted. Two rules bound what a config may ask for:
//!
//! - **int32.** Block ids, token positions and token counts reach the model runner as int32
//!   (the block table, `num_blocks_per_row`, `query_start_loc`, `num_computed_tokens`), so
//!   `num_blocks`, `block_size`, `max_model_len`, `max_num_seqs` and `max_num_batched_tokens`
//!   are at most [`MAX_INT32_FIELD`].
//! - **Memory.** The tables need at most the machine's installed memory in all. A larger
//!   allocation can never succeed, and it does not even fail cleanly: Linux overcommits, so the
//!   reservation succeeds and zero-filling it gets the process OOM-killed. The bound is the
//!   installed memory rather than the free memory so that whether a config is legal does not
//!   depend on the moment; a tighter limit (a cgroup) is not seen. Where the installed memory
//!   is unknown (not Linux) the bound is [`FALLBACK_MEMORY_BYTES`].

use crate::batch::batch_rows::BatchRows;
use crate::error::{invalid, CoreResult};
use crate::pool::block_pool::BlockPool;

/// Largest value of a field that reaches the model runner as int32.
pub const MAX_INT32_FIELD: usize = i32::MAX as usize;

/// The memory bound where the installed memory cannot be read: 1 TiB.
pub const FALLBACK_MEMORY_BYTES: u128 = 1 << 40;

/// Refuses `value` above [`MAX_INT32_FIELD`], naming the field.
pub fn check_int32(field: &str, value: usize) -> CoreResult<()> {
    if value > MAX_INT32_FIELD {
        return Err(invalid!(
            "{field} ({value}) must be at most 2**31 - 1 = {MAX_INT32_FIELD}: block ids, token \
             positions and counts reach the model runner as int32"
        ));
    }
    Ok(())
}

/// Bytes of installed memory ([`FALLBACK_MEMORY_BYTES`] where unknown).
pub fn memory_bytes() -> u128 {
    installed_memory().unwrap_or(FALLBACK_MEMORY_BYTES)
}

#[cfg(target_os = "linux")]
fn installed_memory() -> Option<u128> {
    // SAFETY: sysconf reads a system constant; it has no preconditions.
    let (pages, page_size) = unsafe {
        (
            libc::sysconf(libc::_SC_PHYS_PAGES),
            libc::sysconf(libc::_SC_PAGESIZE),
        )
    };
    (pages > 0 && page_size > 0).then(|| pages as u128 * page_size as u128)
}

#[cfg(not(target_os = "linux"))]
fn installed_memory() -> Option<u128> {
    None
}

/// A size in bytes for messages: "2.0 TiB", "512 B".
pub fn human_bytes(bytes: u128) -> String {
    const UNITS: [&str; 6] = ["KiB", "MiB", "GiB", "TiB", "PiB", "EiB"];
    if bytes < 1024 {
        return format!("{bytes} B");
    }
    let mut value = bytes as f64 / 1024.0;
    let mut unit = 0;
    while value >= 1024.0 && unit + 1 < UNITS.len() {
        value /= 1024.0;
        unit += 1;
    }
    format!("{value:.1} {}", UNITS[unit])
}

/// Refuses tables of `bytes` in all (described by `parts`) above [`memory_bytes`].
fn check_memory(bytes: u128, parts: &str) -> CoreResult<()> {
    let limit = memory_bytes();
    if bytes > limit {
        return Err(invalid!(
            "the config needs {} up front, more than the {} of memory this machine has: {parts}",
            human_bytes(bytes),
            human_bytes(limit)
        ));
    }
    Ok(())
}

fn pool_part(num_blocks: usize, block_size: usize, caching: bool) -> (u128, String) {
    let bytes = BlockPool::bytes_for(num_blocks, block_size, caching);
    let what = format!(
        "the pool's per-block tables (num_blocks = {num_blocks} blocks{}) take {}",
        if caching {
            format!(", each with a copy of its block_size = {block_size} tokens")
        } else {
            String::new()
        },
        human_bytes(bytes)
    );
    (bytes, what)
}

/// The bounds of a standalone pool of `num_blocks` blocks of `block_size` tokens (int32 and
/// memory), for sequences up to `max_model_len`.
pub fn check_pool(
    num_blocks: usize,
    block_size: usize,
    max_model_len: usize,
    caching: bool,
) -> CoreResult<()> {
    check_int32("num_blocks", num_blocks)?;
    check_int32("block_size", block_size)?;
    check_int32("max_model_len", max_model_len)?;
    let (bytes, what) = pool_part(num_blocks, block_size, caching);
    check_memory(bytes, &what)
}

/// The memory bound of a scheduler: its block table and its pool.
pub fn check_scheduler_memory(
    num_blocks: usize,
    block_size: usize,
    max_model_len: usize,
    max_num_seqs: usize,
    caching: bool,
) -> CoreResult<()> {
    let width = max_model_len.div_ceil(block_size);
    let table = BatchRows::bytes_for(max_num_seqs, width);
    let (pool, pool_what) = pool_part(num_blocks, block_size, caching);
    let what = format!(
        "the block table (max_num_seqs = {max_num_seqs} rows of cdiv(max_model_len = \
         {max_model_len}, block_size = {block_size}) = {width} int32 entries) takes {}, and {}",
        human_bytes(table),
        pool_what
    );
    check_memory(table.saturating_add(pool), &what)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_read_in_binary_units() {
        assert_eq!(human_bytes(512), "512 B");
        assert_eq!(human_bytes(2 << 40), "2.0 TiB");
        assert_eq!(human_bytes(3 << 19), "1.5 MiB");
    }

    #[test]
    fn the_installed_memory_is_read_on_linux() {
        let bytes = memory_bytes();
        assert!(bytes >= 1 << 26, "{bytes}");
        if cfg!(target_os = "linux") {
            assert!(installed_memory().is_some());
        }
    }
}
