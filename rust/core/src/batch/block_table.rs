//! The persistent block table handed to the model runner: one int32 row per batch slot,
//! `width = cdiv(max_model_len, block_size)` columns, plus a block count per row.
//!
//! Rows are updated incrementally (appends, row moves when a request leaves) and entries past a
//! row's count always hold 0 (the null block), never a stale id of an earlier occupant. Every
//! change bumps the table's version; with the journal on ([`BlockTable::enable_journal`]) it is
//! also recorded with its redo and undo data ([`crate::batch::table_journal`]), so a
//! [`crate::batch::table_snapshot`] copy can be moved to any journaled version.

use crate::batch::table_journal::{Op, TableJournal};
use crate::error::{try_filled_vec, CoreError, CoreResult};

/// Row-major `[num_rows, width]` int32 table with per-row counts.
#[derive(Debug, Clone)]
pub struct BlockTable {
    table: Box<[i32]>,
    counts: Box<[i32]>,
    width: usize,
    version: u64,
    journal: Option<TableJournal>,
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
            version: 0,
            journal: None,
        })
    }

    /// Number of changes made so far: equal versions mean equal contents.
    pub fn version(&self) -> u64 {
        self.version
    }

    /// Starts journaling the changes (from the current version on).
    pub fn enable_journal(&mut self) {
        if self.journal.is_none() {
            self.journal = Some(TableJournal::starting_at(self.version));
        }
    }

    /// The journal, when on.
    pub fn journal(&self) -> Option<&TableJournal> {
        self.journal.as_ref()
    }

    /// Drops the journaled changes before `version` (no copy may need them any more).
    pub fn trim_journal(&mut self, version: u64) {
        if let Some(j) = &mut self.journal {
            j.trim(version);
        }
    }

    /// Counts a change of `row` and journals it (`op` builds it, storing data if needed).
    #[inline]
    fn note(&mut self, row: usize, op: impl FnOnce(&mut TableJournal) -> Op) {
        self.version += 1;
        if let Some(j) = &mut self.journal {
            let op = op(j);
            j.push(row as u32, op);
        }
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
                crate::memory::prefetch::read(dst);
            }
        }
    }

    /// Appends block ids to `row` after its current count.
    #[inline]
    pub fn append(&mut self, row: usize, blocks: &[u32]) {
        // Most steps give a decoding request no new block: no call then.
        if !blocks.is_empty() {
            self.append_blocks(row, blocks);
        }
    }

    /// [`Self::append`] of at least one block.
    fn append_blocks(&mut self, row: usize, blocks: &[u32]) {
        let count = self.counts[row] as usize;
        debug_assert!(
            count + blocks.len() <= self.width,
            "row {row} overflows the table width"
        );
        let start = row * self.width + count;
        for (d, &b) in self.table[start..start + blocks.len()]
            .iter_mut()
            .zip(blocks)
        {
            *d = b as i32;
        }
        let end = count + blocks.len();
        self.counts[row] = end as i32;
        if let Some(j) = &mut self.journal {
            for (i, &block) in blocks.iter().enumerate() {
                let at = (count + i) as u32;
                j.push(row as u32, Op::Write { at, block });
            }
        }
        self.version += blocks.len() as u64;
    }

    /// Zeroes the used entries of `row` and sets its count to 0.
    pub fn clear(&mut self, row: usize) {
        let start = row * self.width;
        let count = self.counts[row] as usize;
        if count == 0 {
            return;
        }
        let old = &self.table[start..start + count];
        self.version += 1;
        if let Some(j) = &mut self.journal {
            let old = j.store(old);
            let count = count as u32;
            j.push(row as u32, Op::Clear { count, old });
        }
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
        if count > 0 {
            self.note(src, |_| Op::Move {
                to: dst as u32,
                count: count as u32,
            });
        }
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
        self.note(a, |_| Op::Swap { with: b as u32 });
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
