//! Frozen copies of the block table for the steps a caller holds.
//!
//! A step's block table must read the same for as long as the caller holds the step, while the
//! scheduler keeps changing its own table (appends, rows moved when a request leaves, a reset).
//! [`SnapshotPool::take`] hands out a [`TableSnapshot`] behind an `Arc`: nothing writes to it
//! while any clone of that `Arc` lives. A snapshot no longer held is reused for a later step and
//! brought up to date by copying only the rows' columns that changed since it was last synced
//! (the table's journal), so a steady decode step copies a few entries, not the table.

use std::sync::Arc;

use crate::block_table::BlockTable;
use crate::error::{try_zeroed_i32, CoreResult};

/// A copy of a [`BlockTable`]'s entries and row counts at one version.
#[derive(Debug)]
pub struct TableSnapshot {
    table: Box<[i32]>,
    counts: Box<[i32]>,
    width: usize,
    version: u64,
}

impl TableSnapshot {
    /// A full copy of `src`. Only the used entries are written: the zero tails stay pages the
    /// OS has not mapped yet, so a snapshot costs memory in proportion to the blocks in use.
    pub fn copy_of(src: &BlockTable) -> CoreResult<Self> {
        let mut snapshot = Self {
            table: try_zeroed_i32(src.as_slice().len(), "block table snapshot")?.into_boxed_slice(),
            counts: try_zeroed_i32(src.num_rows(), "block table snapshot counts")?
                .into_boxed_slice(),
            width: src.width(),
            version: src.version(),
        };
        snapshot.copy_rows(src);
        Ok(snapshot)
    }

    /// Copies every row's used entries from `src` and zeroes what this copy used beyond them.
    fn copy_rows(&mut self, src: &BlockTable) {
        let (table, counts) = (src.as_slice(), src.counts());
        for (row, (&new, old)) in counts.iter().zip(self.counts.iter_mut()).enumerate() {
            let base = row * self.width;
            let (new, old_count) = (new as usize, *old as usize);
            self.table[base..base + new].copy_from_slice(&table[base..base + new]);
            if old_count > new {
                self.table[base + new..base + old_count].fill(0);
            }
            *old = new as i32;
        }
    }

    /// Makes this copy equal to `src` (of the same shape), copying only what changed since
    /// the last sync when the journal still covers it.
    pub fn sync(&mut self, src: &BlockTable) {
        debug_assert_eq!(self.table.len(), src.as_slice().len(), "snapshot shape");
        if self.version == src.version() {
            return;
        }
        let (table, counts) = (src.as_slice(), src.counts());
        match src.changes_since(self.version) {
            Some(changes) => {
                // Entries are scattered over the rows, a cache miss each: ask for the line of
                // the change a few iterations ahead.
                const AHEAD: usize = 16;
                for (i, c) in changes.iter().enumerate() {
                    if let Some(next) = changes.get(i + AHEAD) {
                        let at = next.row as usize * self.width + next.lo as usize;
                        crate::prefetch::read(self.table[at..].as_ptr());
                        if next.value < 0 {
                            crate::prefetch::read(table[at..].as_ptr());
                        }
                    }
                    let base = c.row as usize * self.width;
                    let (lo, hi) = (base + c.lo as usize, base + c.hi as usize);
                    if c.value >= 0 {
                        // Replayed in order, a later change of the entry overwrites this one.
                        self.table[lo] = c.value;
                    } else {
                        self.table[lo..hi].copy_from_slice(&table[lo..hi]);
                    }
                }
                self.counts.copy_from_slice(counts);
            }
            None => self.copy_rows(src),
        }
        self.version = src.version();
    }

    /// The table version this copy holds.
    pub fn version(&self) -> u64 {
        self.version
    }

    /// Columns per row.
    pub fn width(&self) -> usize {
        self.width
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
}

/// Snapshots of one table, reused once no longer held.
#[derive(Debug, Default)]
pub struct SnapshotPool {
    snapshots: Vec<Arc<TableSnapshot>>,
}

/// Snapshots kept for reuse beyond those held (a step in flight, the one being built, async's
/// second step).
const MAX_IDLE: usize = 3;

impl SnapshotPool {
    /// An empty pool.
    pub fn new() -> Self {
        Self::default()
    }

    /// A snapshot equal to `table` now, that nothing changes while the returned `Arc` (or a
    /// clone of it) lives.
    pub fn take(&mut self, table: &BlockTable) -> CoreResult<Arc<TableSnapshot>> {
        // The idle snapshot closest to the table's version has the least to copy.
        let mut best: Option<usize> = None;
        let mut idle = 0;
        for (i, s) in self.snapshots.iter().enumerate() {
            if Arc::strong_count(s) == 1 {
                idle += 1;
                if best.is_none_or(|b| s.version > self.snapshots[b].version) {
                    best = Some(i);
                }
            }
        }
        let index = match best {
            Some(i) => i,
            None => {
                self.snapshots
                    .push(Arc::new(TableSnapshot::copy_of(table)?));
                self.snapshots.len() - 1
            }
        };
        Arc::get_mut(&mut self.snapshots[index])
            .expect("an idle snapshot has no other owner")
            .sync(table);
        let taken = Arc::clone(&self.snapshots[index]);
        if idle > MAX_IDLE {
            self.release_idle(index);
        }
        Ok(taken)
    }

    /// Drops idle snapshots beyond [`MAX_IDLE`] (after a caller held many steps at once).
    fn release_idle(&mut self, keep: usize) {
        let mut idle = 0;
        let mut i = 0;
        self.snapshots.retain(|s| {
            let held = i == keep || Arc::strong_count(s) > 1;
            i += 1;
            held || {
                idle += 1;
                idle <= MAX_IDLE
            }
        });
    }

    /// Snapshots allocated (held and idle).
    pub fn len(&self) -> usize {
        self.snapshots.len()
    }

    /// Whether no snapshot was allocated yet.
    pub fn is_empty(&self) -> bool {
        self.snapshots.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn same(s: &TableSnapshot, t: &BlockTable) -> bool {
        s.as_slice() == t.as_slice() && s.counts() == t.counts()
    }

    #[test]
    fn held_snapshots_never_change_and_reused_ones_catch_up() {
        let mut t = BlockTable::new(4, 6).unwrap();
        let mut pool = SnapshotPool::new();
        t.append(0, &[1, 2]);
        t.append(1, &[3]);
        let a = pool.take(&t).unwrap();
        let frozen: Vec<i32> = a.as_slice().to_vec();
        t.move_row(1, 0);
        t.append(2, &[7, 8, 9]);
        t.swap_rows(0, 2);
        assert_eq!(a.as_slice(), &frozen[..], "a held snapshot changed");
        let b = pool.take(&t).unwrap();
        assert!(same(&b, &t));
        assert!(!Arc::ptr_eq(&a, &b), "a held snapshot was reused");
        drop(a);
        t.clear(0);
        t.append(3, &[4]);
        let c = pool.take(&t).unwrap();
        assert!(same(&c, &t), "a reused snapshot did not catch up");
        assert_eq!(pool.len(), 2);
    }

    #[test]
    fn a_rewritten_entry_reads_its_last_value() {
        let mut t = BlockTable::new(2, 3).unwrap();
        let mut pool = SnapshotPool::new();
        drop(pool.take(&t).unwrap());
        t.append(0, &[1]);
        t.append(1, &[5, 6]);
        t.clear(0);
        t.append(0, &[2]);
        t.swap_rows(0, 1);
        t.append(0, &[7]);
        let s = pool.take(&t).unwrap();
        assert!(same(&s, &t));
        assert_eq!(s.row(0), [5, 6, 7]);
        assert_eq!(s.row(1), [2]);
    }

    #[test]
    fn a_snapshot_behind_the_journal_is_copied_whole() {
        let mut t = BlockTable::new(2, 2).unwrap();
        let mut pool = SnapshotPool::new();
        drop(pool.take(&t).unwrap());
        for i in 0..5000u32 {
            t.clear(0);
            t.append(0, &[i, i + 1]);
        }
        assert!(t.changes_since(0).is_none(), "the journal is bounded");
        let s = pool.take(&t).unwrap();
        assert!(same(&s, &t));
    }

    #[test]
    fn idle_snapshots_are_bounded() {
        let t = BlockTable::new(2, 2).unwrap();
        let mut pool = SnapshotPool::new();
        let held: Vec<_> = (0..10).map(|_| pool.take(&t).unwrap()).collect();
        assert_eq!(pool.len(), 10);
        drop(held);
        let _s = pool.take(&t).unwrap();
        assert!(pool.len() <= MAX_IDLE + 1, "{} snapshots kept", pool.len());
    }
}
