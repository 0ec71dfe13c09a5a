//! Frozen copies of the block table for the steps a caller holds.
//!
//! A step's block table must read the same for as long as the caller holds the step, while the
//! scheduler keeps changing its own table (appends, rows moved when a request leaves, a reset).
//! A step only records the table's version; [`SnapshotPool::take`] makes a [`TableSnapshot`] of
//! the table at that version when someone first reads it, however much the table changed
//! meanwhile, by replaying the table's journal forward or backward on an idle copy. The copy is
//! handed out behind an `Arc`: nothing writes to it while any clone of that `Arc` lives. Copies
//! no longer held are reused, so a caller that reads every step's table costs a few scattered
//! entries per step (the appends since the copy was last used), and one that never reads it
//! costs nothing.

use std::sync::Arc;

use crate::batch::block_table::BlockTable;
use crate::batch::table_journal::{Op, TableJournal};
use crate::error::{broken, try_zeroed_i32, CoreResult};

/// A copy of a [`BlockTable`]'s entries and row counts at one version.
#[derive(Debug)]
pub struct TableSnapshot {
    table: Box<[i32]>,
    counts: Box<[i32]>,
    width: usize,
    version: u64,
}

impl TableSnapshot {
    /// A copy of `src` as it is now. Only the used entries are written: the zero tails stay
    /// pages the OS has not mapped yet, so a copy costs memory in proportion to the blocks in use.
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
        self.version = src.version();
    }

    /// Makes this copy (of `src`'s shape) the table at `version`: `src` itself when that is its
    /// version, else a version its journal covers.
    pub fn sync_to(&mut self, src: &BlockTable, version: u64) -> CoreResult<()> {
        debug_assert_eq!(self.table.len(), src.as_slice().len(), "snapshot shape");
        if self.version == version {
            return Ok(());
        }
        let journal = src.journal().filter(|j| j.covers(version));
        let Some(journal) = journal else {
            if version != src.version() {
                return Err(broken!(
                    "block table version {version} is no longer journaled (now {})",
                    src.version()
                ));
            }
            self.copy_rows(src);
            return Ok(());
        };
        if !journal.covers(self.version) {
            self.copy_rows(src);
        }
        if self.version < version {
            self.redo(journal, version);
        } else {
            self.undo(journal, version);
        }
        Ok(())
    }

    /// Replays changes `[self.version, version)`.
    fn redo(&mut self, journal: &TableJournal, version: u64) {
        // Appends are scattered over the rows, a cache miss each: ask for the line of the
        // change a few iterations ahead.
        const AHEAD: u64 = 16;
        for v in self.version..version {
            if v + AHEAD < version {
                let next = journal.change(v + AHEAD);
                if let Op::Write { at, .. } = next.op() {
                    let at = next.row() as usize * self.width + at as usize;
                    crate::memory::prefetch::read(self.table[at..].as_ptr());
                }
            }
            let c = journal.change(v);
            let (row, base) = (c.row() as usize, c.row() as usize * self.width);
            match c.op() {
                Op::Write { at, block } => {
                    self.table[base + at as usize] = block as i32;
                    self.counts[row] = at as i32 + 1;
                }
                Op::Clear { count, .. } => {
                    self.table[base..base + count as usize].fill(0);
                    self.counts[row] = 0;
                }
                Op::Move { to, count } => {
                    let to = to as usize;
                    let n = count as usize;
                    self.table.copy_within(base..base + n, to * self.width);
                    self.counts[to] = count as i32;
                }
                Op::Swap { with } => self.swap(row, with as usize),
            }
        }
        self.version = version;
    }

    /// Reverts changes `[version, self.version)`, newest first.
    fn undo(&mut self, journal: &TableJournal, version: u64) {
        for v in (version..self.version).rev() {
            let c = journal.change(v);
            let (row, base) = (c.row() as usize, c.row() as usize * self.width);
            match c.op() {
                Op::Write { at, .. } => {
                    self.table[base + at as usize] = 0;
                    self.counts[row] = at as i32;
                }
                Op::Clear { count, old } => {
                    let n = count as usize;
                    self.table[base..base + n].copy_from_slice(journal.stored(old, n));
                    self.counts[row] = count as i32;
                }
                Op::Move { to, count } => {
                    let to = to as usize * self.width;
                    self.table[to..to + count as usize].fill(0);
                    self.counts[to / self.width] = 0;
                }
                Op::Swap { with } => self.swap(row, with as usize),
            }
        }
        self.version = version;
    }

    /// Swaps two rows' used entries and counts.
    fn swap(&mut self, a: usize, b: usize) {
        let used = self.counts[a].max(self.counts[b]) as usize;
        let (lo, hi) = (a.min(b), a.max(b));
        let (left, right) = self.table.split_at_mut(hi * self.width);
        left[lo * self.width..lo * self.width + used].swap_with_slice(&mut right[..used]);
        self.counts.swap(a, b);
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

/// Snapshots kept for reuse beyond those held.
const MAX_IDLE: usize = 3;

impl SnapshotPool {
    /// An empty pool.
    pub fn new() -> Self {
        Self::default()
    }

    /// A snapshot of `table` at `version` (now, or a version its journal covers), that nothing
    /// changes while the returned `Arc` (or a clone of it) lives.
    pub fn take(&mut self, table: &BlockTable, version: u64) -> CoreResult<Arc<TableSnapshot>> {
        // The idle snapshot closest to `version` has the least to replay.
        let distance = |s: &TableSnapshot| s.version.abs_diff(version);
        let mut best: Option<usize> = None;
        let mut idle = 0;
        for (i, s) in self.snapshots.iter().enumerate() {
            if Arc::strong_count(s) == 1 {
                idle += 1;
                if best.is_none_or(|b| distance(s) < distance(&self.snapshots[b])) {
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
            .sync_to(table, version)?;
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

    fn journaled(rows: usize, width: usize) -> BlockTable {
        let mut t = BlockTable::new(rows, width).unwrap();
        t.enable_journal();
        t
    }

    #[test]
    fn held_snapshots_never_change_and_reused_ones_catch_up() {
        let mut t = journaled(4, 6);
        let mut pool = SnapshotPool::new();
        t.append(0, &[1, 2]);
        t.append(1, &[3]);
        let a = pool.take(&t, t.version()).unwrap();
        let frozen: Vec<i32> = a.as_slice().to_vec();
        t.move_row(1, 0);
        t.append(2, &[7, 8, 9]);
        t.swap_rows(0, 2);
        assert_eq!(a.as_slice(), &frozen[..], "a held snapshot changed");
        let b = pool.take(&t, t.version()).unwrap();
        assert!(same(&b, &t));
        assert!(!Arc::ptr_eq(&a, &b), "a held snapshot was reused");
        drop(a);
        t.clear(0);
        t.append(3, &[4]);
        let c = pool.take(&t, t.version()).unwrap();
        assert!(same(&c, &t), "a reused snapshot did not catch up");
        assert_eq!(pool.len(), 2);
    }

    #[test]
    fn any_journaled_version_can_be_taken_later() {
        let mut t = journaled(3, 4);
        let mut pool = SnapshotPool::new();
        let mut seen = vec![(t.version(), t.as_slice().to_vec(), t.counts().to_vec())];
        let ops: [&dyn Fn(&mut BlockTable); 7] = [
            &|t| t.append(0, &[1]),
            &|t| t.append(1, &[5, 6]),
            &|t| t.clear(0),
            &|t| t.append(0, &[2]),
            &|t| t.swap_rows(0, 1),
            &|t| t.move_row(1, 2),
            &|t| t.append(2, &[7]),
        ];
        for op in ops {
            op(&mut t);
            seen.push((t.version(), t.as_slice().to_vec(), t.counts().to_vec()));
        }
        // Out of order, with held copies in between: forward, backward and refreshed syncs.
        for &i in &[3usize, 7, 0, 5, 1, 6, 2, 4] {
            let (version, table, counts) = &seen[i];
            let s = pool.take(&t, *version).unwrap();
            assert_eq!(
                (s.as_slice(), s.counts()),
                (&table[..], &counts[..]),
                "version {i}"
            );
        }
    }

    #[test]
    fn a_trimmed_version_is_refused_and_the_current_one_always_served() {
        let mut t = journaled(2, 2);
        let mut pool = SnapshotPool::new();
        t.append(0, &[1]);
        let old = t.version();
        t.append(1, &[2]);
        t.trim_journal(t.version());
        assert!(pool.take(&t, old).is_err());
        let s = pool.take(&t, t.version()).unwrap();
        assert!(same(&s, &t));
        let mut plain = BlockTable::new(2, 2).unwrap();
        plain.append(0, &[3]);
        assert!(
            same(&pool_take(&plain), &plain),
            "a table without journal: its version now"
        );
    }

    fn pool_take(t: &BlockTable) -> Arc<TableSnapshot> {
        SnapshotPool::new().take(t, t.version()).unwrap()
    }

    #[test]
    fn idle_snapshots_are_bounded() {
        let t = journaled(2, 2);
        let mut pool = SnapshotPool::new();
        let held: Vec<_> = (0..10).map(|_| pool.take(&t, 0).unwrap()).collect();
        assert_eq!(pool.len(), 10);
        drop(held);
        let _s = pool.take(&t, 0).unwrap();
        assert!(pool.len() <= MAX_IDLE + 1, "{} snapshots kept", pool.len());
    }
}
