//! The persistent block table handed to the model runner: one int32 row per batch slot,
//! `width = cdiv(max_model_len, block_size)` columns, plus a block count per row.
//!
//! Rows are updated incrementally (appends, row moves when a request leaves) and entries past a
//! row's count always hold 0 (the null block), never a stale id of an earlier occupant. The
//! buffers never move, so they can be exposed to Python without copying.

use crate::error::{try_filled_vec, CoreError, CoreResult};

/// Row-major `[num_rows, width]` int32 table with per-row counts.
#[derive(Debug, Clone)]
pub struct BlockTable {
    table: Box<[i32]>,
    counts: Box<[i32]>,
    width: usize,
}

impl BlockTable {
    /// Bytes [`Self::new`] allocates for `num_rows` rows of `width` entries.
    pub fn bytes_for(num_rows: usize, width: usize) -> u128 {
        let entries = (num_rows as u128)
            .saturating_mul(width as u128)
            .saturating_add(num_rows as u128);
        entries.saturating_mul(std::mem::size_of::<i32>() as u128)
    }

    /// A zeroed table.
    pub fn new(num_rows: usize, width: usize) -> CoreResult<Self> {
        let len = num_rows.checked_mul(width).ok_or_else(|| {
            CoreError::InvalidArgument(format!(
                "a block table of {num_rows} x {width} entries does not fit in memory"
            ))
        })?;
        Ok(Self {
            table: try_filled_vec(len, 0, "block table").map(Vec::into_boxed_slice)?,
            counts: try_filled_vec(num_rows, 0, "block table row counts")
                .map(Vec::into_boxed_slice)?,
            width,
        })
    }

    /// Columns per row.
    pub fn width(&self) -> usize {
        self.width
    }

    /// Rows in the table.
    pub fn num_rows(&self) -> usize {
        self.counts.len()
    }

    /// The whole row-major buffer.
    pub fn as_slice(&self) -> &[i32] {
        &self.table
    }

    /// Block counts of every row.
    pub fn counts(&self) -> &[i32] {
        &self.counts
    }

    /// The used entries of `row`.
    pub fn row(&self, row: usize) -> &[i32] {
        let start = row * self.width;
        &self.table[start..start + self.counts[row] as usize]
    }

    /// The full `row`, used entries and zero tail.
    pub fn full_row(&self, row: usize) -> &[i32] {
        &self.table[row * self.width..(row + 1) * self.width]
    }

    /// Prefetches where the next [`Self::append`] to `row` writes (nothing for a row out of
    /// range).
    pub fn prefetch_append(&self, row: usize) {
        if let Some(&count) = self.counts.get(row) {
            if let Some(dst) = self.table.get(row * self.width + count as usize) {
                crate::prefetch::read(dst);
            }
        }
    }

    /// Appends block ids to `row` after its current count.
    pub fn append(&mut self, row: usize, blocks: &[u32]) {
        let count = self.counts[row] as usize;
        debug_assert!(
            count + blocks.len() <= self.width,
            "row {row} overflows the table width"
        );
        let start = row * self.width + count;
        for (dst, &b) in self.table[start..start + blocks.len()]
            .iter_mut()
            .zip(blocks)
        {
            *dst = b as i32;
        }
        self.counts[row] = (count + blocks.len()) as i32;
    }

    /// Zeroes the used entries of `row` and sets its count to 0.
    pub fn clear(&mut self, row: usize) {
        let start = row * self.width;
        let count = self.counts[row] as usize;
        self.table[start..start + count].fill(0);
        self.counts[row] = 0;
    }

    /// Moves `src` into the (cleared) row `dst` and clears `src`.
    pub fn move_row(&mut self, src: usize, dst: usize) {
        if src == dst {
            return;
        }
        self.clear(dst);
        let count = self.counts[src] as usize;
        let (s, d) = (src * self.width, dst * self.width);
        self.table.copy_within(s..s + count, d);
        self.counts[dst] = count as i32;
        self.clear(src);
    }

    /// Swaps the contents of two rows.
    pub fn swap_rows(&mut self, a: usize, b: usize) {
        if a == b {
            return;
        }
        let (lo, hi) = (a.min(b), a.max(b));
        let (left, right) = self.table.split_at_mut(hi * self.width);
        left[lo * self.width..(lo + 1) * self.width].swap_with_slice(&mut right[..self.width]);
        self.counts.swap(a, b);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn append_move_clear_leave_no_stale_ids() {
        let mut t = BlockTable::new(3, 4).unwrap();
        t.append(0, &[5, 6]);
        t.append(1, &[7]);
        t.append(0, &[8]);
        assert_eq!(t.row(0), [5, 6, 8]);
        t.move_row(0, 1);
        assert_eq!(t.full_row(1), [5, 6, 8, 0]);
        assert_eq!(t.full_row(0), [0, 0, 0, 0]);
        t.swap_rows(1, 2);
        assert_eq!(t.full_row(2), [5, 6, 8, 0]);
        assert_eq!(t.counts(), [0, 0, 3]);
        t.clear(2);
        assert!(t.as_slice().iter().all(|&x| x == 0));
    }
}
