//! The redo/undo log of a block table's changes.
//!
//! Change number `v` turns the table at version `v` into the table at version `v + 1`. Each
//! change records enough to redo and undo it (an append its entries, a clear what it erased; a
//! row move or swap nothing, as a copy holds the row itself), so a copy of the table at any
//! journaled version can be moved to any other journaled version without reading the live
//! table: forward by redoing, backward by undoing. This lets a step's block table be frozen
//! lazily ([`super::table_snapshot`]): nothing is copied until someone reads it, however much
//! the table changed meanwhile.
//!
//! The journal only grows; its owner trims it ([`TableJournal::trim`]) once no copy needs the
//! old changes.

/// One change of a row, with what it takes to redo and undo it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Op {
    /// Entry `at` was written with `block` (it held 0: an append); the count became `at + 1`.
    Write {
        /// The column (the count before).
        at: u32,
        /// The block written.
        block: u32,
    },
    /// Entries `[0, count)` were zeroed and the count set to 0; what they held is `count`
    /// entries of the journal's arena at `old`.
    Clear {
        /// The count before.
        count: u32,
        /// Where the erased entries are kept.
        old: u32,
    },
    /// The row's `count` entries were copied to the empty row `to`.
    Move {
        /// The destination row.
        to: u32,
        /// Entries copied.
        count: u32,
    },
    /// The row was swapped with row `with` (contents and counts).
    Swap {
        /// The other row.
        with: u32,
    },
}

/// A change of the table: an [`Op`] on a row, packed in 16 bytes (the journal is written for
/// every appended block, so it stays small enough to stay in cache).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RowChange {
    row: u32,
    kind: u32,
    a: u32,
    b: u32,
}

impl RowChange {
    /// `op` on `row`.
    pub fn new(row: u32, op: Op) -> Self {
        let (kind, a, b) = match op {
            Op::Write { at, block } => (0, at, block),
            Op::Clear { count, old } => (1, count, old),
            Op::Move { to, count } => (2, to, count),
            Op::Swap { with } => (3, with, 0),
        };
        Self { row, kind, a, b }
    }

    /// The row changed.
    pub fn row(&self) -> u32 {
        self.row
    }

    /// How.
    pub fn op(&self) -> Op {
        match self.kind {
            0 => Op::Write {
                at: self.a,
                block: self.b,
            },
            1 => Op::Clear {
                count: self.a,
                old: self.b,
            },
            2 => Op::Move {
                to: self.a,
                count: self.b,
            },
            _ => Op::Swap { with: self.a },
        }
    }
}

/// Changes `[start, start + changes.len())` of one table, with the entries clears erased.
#[derive(Debug, Clone, Default)]
pub struct TableJournal {
    start: u64,
    changes: Vec<RowChange>,
    arena: Vec<i32>,
}

impl TableJournal {
    /// A journal whose first change will be number `version`.
    pub fn starting_at(version: u64) -> Self {
        Self {
            start: version,
            ..Self::default()
        }
    }

    /// The oldest version the journal can reach.
    pub fn start(&self) -> u64 {
        self.start
    }

    /// The version after the last change (the table's).
    pub fn end(&self) -> u64 {
        self.start + self.changes.len() as u64
    }

    /// Changes held.
    pub fn len(&self) -> usize {
        self.changes.len()
    }

    /// Whether no change is held.
    pub fn is_empty(&self) -> bool {
        self.changes.is_empty()
    }

    /// Whether `version` can be reached.
    pub fn covers(&self, version: u64) -> bool {
        (self.start..=self.end()).contains(&version)
    }

    /// Keeps `values` (entries a clear erases); returns where.
    pub fn store(&mut self, values: &[i32]) -> u32 {
        let at = self.arena.len() as u32;
        self.arena.extend_from_slice(values);
        at
    }

    /// Appends the next change.
    #[inline]
    pub fn push(&mut self, row: u32, op: Op) {
        // The journal's tail line is seldom in cache (the table's other work evicts it between
        // steps): ask for the lines a few changes ahead so that appends do not wait for them.
        crate::memory::prefetch::read(self.changes.as_ptr().wrapping_add(self.changes.len() + 16));
        self.changes.push(RowChange::new(row, op));
    }

    /// Change number `version` (journaled).
    pub fn change(&self, version: u64) -> RowChange {
        self.changes[(version - self.start) as usize]
    }

    /// `dst.len()` stored entries from `at`.
    pub fn stored(&self, at: u32, len: usize) -> &[i32] {
        &self.arena[at as usize..at as usize + len]
    }

    /// Drops the changes before `version` (at most up to the end).
    pub fn trim(&mut self, version: u64) {
        let drop = version.clamp(self.start, self.end()) - self.start;
        if drop == 0 {
            return;
        }
        self.changes.drain(..drop as usize);
        self.start += drop;
        // Stored entries are in change order: keep them from the first retained clear on, and
        // shift the retained clears' offsets.
        let keep_from = self
            .changes
            .iter()
            .find_map(|c| match c.op() {
                Op::Clear { old, .. } => Some(old),
                _ => None,
            })
            .unwrap_or(self.arena.len() as u32);
        if keep_from > 0 {
            self.arena.drain(..keep_from as usize);
            for c in &mut self.changes {
                if c.kind == 1 {
                    c.b -= keep_from;
                }
            }
        }
    }
}
