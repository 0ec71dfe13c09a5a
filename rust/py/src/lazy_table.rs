//! The block tables of the steps handed out, read lazily: a step keeps the table version it
//! was returned at, and its snapshot is frozen when first read, or earlier, before the
//! table's journal forgets the changes it needs.

use std::sync::{Arc, OnceLock, Weak};

use dflash_core::{Scheduler, SnapshotPool, TableSnapshot};
use pyo3::prelude::*;

use crate::errors::IntoPyResult;

/// The version of the table a step was returned at, and its snapshot once made.
#[derive(Debug)]
pub(crate) struct LazyTable {
    /// The table's version when the step was returned.
    pub(crate) version: u64,
    /// The snapshot, once made.
    pub(crate) snapshot: OnceLock<Arc<TableSnapshot>>,
}

/// The tables of the steps a scheduler handed out: the pool their snapshots come from, and
/// the unread ones, which bound how far the journal may be trimmed.
pub(crate) struct LazyTables {
    /// Frozen block tables of the steps handed out.
    snapshots: SnapshotPool,
    /// Tables of steps handed out and not read yet, oldest first: the journal keeps what they
    /// need, or they are frozen before it forgets.
    unread: Vec<Weak<LazyTable>>,
    /// Journaled table changes past which the journal is trimmed.
    journal_cap: usize,
}

impl LazyTables {
    /// Turns on `inner`'s block-table journal, which the tables of the steps are read from.
    pub(crate) fn new(inner: &mut Scheduler) -> Self {
        inner.enable_block_table_journal();
        // A few steps of appends (one change per block), and no more: at 16 bytes a change it
        // stays in cache, written for every block allocated.
        let journal_cap = inner
            .config()
            .max_num_seqs
            .saturating_mul(4)
            .clamp(4096, 1 << 20);
        Self {
            snapshots: SnapshotPool::new(),
            unread: Vec::new(),
            journal_cap,
        }
    }

    /// The table of a step handed out now (at `inner`'s current table version), unread.
    pub(crate) fn hand_out(&mut self, inner: &Scheduler) -> Arc<LazyTable> {
        let lazy = Arc::new(LazyTable {
            version: inner.block_table().version(),
            snapshot: OnceLock::new(),
        });
        self.unread.push(Arc::downgrade(&lazy));
        lazy
    }

    /// Freezes `lazy`'s table (at its version) unless done: a snapshot nothing changes while
    /// held.
    pub(crate) fn freeze(
        &mut self,
        py: Python<'_>,
        inner: &Scheduler,
        lazy: &LazyTable,
    ) -> PyResult<Arc<TableSnapshot>> {
        if let Some(s) = lazy.snapshot.get() {
            return Ok(s.clone());
        }
        let snapshot = self
            .snapshots
            .take(inner.block_table(), lazy.version)
            .py(py)?;
        Ok(lazy.snapshot.get_or_init(|| snapshot).clone())
    }

    /// Bounds the table's journal: once it holds more than `journal_cap` changes, the unread
    /// tables that need its older half are frozen and that half is dropped.
    pub(crate) fn maintain_journal(
        &mut self,
        py: Python<'_>,
        inner: &mut Scheduler,
    ) -> PyResult<()> {
        let Some(journal) = inner.block_table().journal() else {
            return Ok(());
        };
        let over = journal.len() > self.journal_cap;
        if !over && self.unread.len() < 64 {
            return Ok(());
        }
        let unread_now = |w: &Weak<LazyTable>| w.upgrade().filter(|t| t.snapshot.get().is_none());
        self.unread.retain(|w| unread_now(w).is_some());
        if !over {
            return Ok(());
        }
        let cutoff = journal.end() - (self.journal_cap / 2) as u64;
        for table in self.unread.clone().iter().filter_map(unread_now) {
            if table.version < cutoff {
                self.freeze(py, inner, &table)?;
            }
        }
        self.unread.retain(|w| unread_now(w).is_some());
        inner.trim_block_table_journal(cutoff);
        Ok(())
    }
}
