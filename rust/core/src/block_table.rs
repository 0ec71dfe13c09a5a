//! The persistent block table handed to the model runner: one int32 row per batch slot,
//! `width = cdiv(max_model_len, block_size)` columns, plus a block count per row.
//!
//! Rows are updated incrementally (appends, row moves when a request leaves) and entries past a
//! row's count always hold 0 (the null block), never a stale id of an earlier occupant. Every
//! change is journaled (which row, which columns), so a [`crate::table_snapshot`] copy can be
//! brought up to date by copying only what changed since it was last synced.

use crate::error::{try_filled_vec, CoreError, CoreResult};

/// Columns `[lo, hi)` of `row` (and its count) changed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RowChange {
    /// The row.
    pub row: u32,
    /// First changed column.
    pub lo: u32,
    /// One past the last changed column.
    pub hi: u32,
    /// For a one-entry change, the entry written (a copy need not read the table); -1 for a
    /// range, whose current contents are in the table.
    pub value: i32,
}

/// The recent changes of a table, numbered: `changes[i]` is change number `start + i`, and the
/// table's version is `start + changes.len()`. Bounded: the older half is dropped when full.
#[derive(Debug, Clone)]
struct Journal {
    start: u64,
    changes: Vec<RowChange>,
    capacity: usize,
}

impl Journal {
    fn new(capacity: usize) -> Self {
        Self {
            start: 0,
            changes: Vec::new(),
            capacity,
        }
    }

    fn version(&self) -> u64 {
        self.start + self.changes.len() as u64
    }

    #[inline]
    fn record(&mut self, row: usize, lo: usize, hi: usize) {
        if lo < hi {
            self.push(row, lo, hi, -1);
        }
    }

    #[inline]
    fn push(&mut self, row: usize, lo: usize, hi: usize, value: i32) {
        if self.changes.len() == self.capacity {
            let dropped = self.capacity / 2;
            self.changes.drain(..dropped);
            self.start += dropped as u64;
        }
        self.changes.push(RowChange {
            row: row as u32,
            lo: lo as u32,
            hi: hi as u32,
            value,
        });
    }

    fn since(&self, version: u64) -> Option<&[RowChange]> {
        let offset = version.checked_sub(self.start)?;
        self.changes.get(offset as usize..)
    }
}

/// Row-major `[num_rows, width]` int32 table with per-row counts.
#[derive(Debug, Clone)]
pub struct BlockTable {
    table: Box<[i32]>,
    counts: Box<[i32]>,
    width: usize,
    journal: Journal,
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
            // A few steps of appends to every row, and a floor for small tables.
            journal: Journal::new(num_rows.saturating_mul(8).clamp(1024, 1 << 20)),
        })
    }

    /// Number of changes made so far: equal versions mean equal contents.
    pub fn version(&self) -> u64 {
        self.journal.version()
    }

    /// The changes made since `version`, oldest first, or `None` when some of them are no longer
    /// journaled (copy the whole table then).
    pub fn changes_since(&self, version: u64) -> Option<&[RowChange]> {
        self.journal.since(version)
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
        match blocks {
            // The common append (one new block): the journal carries the entry itself.
            &[block] => self.journal.push(row, count, count + 1, block as i32),
            _ => self.journal.record(row, count, count + blocks.len()),
        }
    }

    /// Zeroes the used entries of `row` and sets its count to 0.
    pub fn clear(&mut self, row: usize) {
        let start = row * self.width;
        let count = self.counts[row] as usize;
        self.table[start..start + count].fill(0);
        self.counts[row] = 0;
        self.journal.record(row, 0, count);
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
        self.journal.record(dst, 0, count);
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
        let used = self.counts[a].max(self.counts[b]) as usize;
        self.journal.record(a, 0, used);
        self.journal.record(b, 0, used);
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
