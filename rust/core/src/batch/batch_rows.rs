//! Assignment of block-table rows to running requests.
//!
//! Running requests occupy rows `[0, len)` densely. When a request leaves, the last row moves
//! into its hole. Before a step is handed out, scheduled requests are partitioned to the front
//! (stable), so rows `[0, num_scheduled)` are the batch in order.

use crate::batch::block_table::BlockTable;
use crate::error::{CoreError, CoreResult};
use crate::requests::request_store::RequestStore;

/// Row owners and the block table they index.
#[derive(Debug, Clone)]
pub struct BatchRows {
    /// Slot owning each occupied row.
    owners: Vec<u32>,
    table: BlockTable,
}

impl BatchRows {
    /// Bytes [`Self::new`] allocates for `max_rows` rows of `width` blocks.
    pub fn bytes_for(max_rows: usize, width: usize) -> u128 {
        BlockTable::bytes_for(max_rows, width)
            .saturating_add(max_rows as u128 * std::mem::size_of::<u32>() as u128)
    }

    /// Rows for up to `max_rows` running requests, `width` blocks each.
    pub fn new(max_rows: usize, width: usize) -> CoreResult<Self> {
        let table = BlockTable::new(max_rows, width)?;
        let mut owners = Vec::new();
        owners.try_reserve_exact(max_rows).map_err(|_| {
            CoreError::InvalidArgument(format!("cannot allocate {max_rows} block-table rows"))
        })?;
        Ok(Self { owners, table })
    }

    /// The block table.
    pub fn table(&self) -> &BlockTable {
        &self.table
    }

    /// The block table, to turn its journal on or trim it (rows stay this type's to change).
    pub fn table_journal_mut(&mut self) -> JournalControl<'_> {
        JournalControl(&mut self.table)
    }

    /// Occupied rows.
    pub fn len(&self) -> usize {
        self.owners.len()
    }

    /// Slot owning each occupied row, in row order.
    pub fn owners(&self) -> &[u32] {
        &self.owners
    }

    /// Gives `slot` the next free row, filled with `blocks`.
    pub fn add(&mut self, store: &mut RequestStore, slot: u32, blocks: &[u32]) {
        let row = self.owners.len();
        self.owners.push(slot);
        self.table.clear(row);
        self.table.append(row, blocks);
        store.set_row(slot, Some(row as u32));
    }

    /// Prefetches where the next [`Self::append`] to `row` writes.
    pub fn prefetch_append(&self, row: usize) {
        self.table.prefetch_append(row);
    }

    /// Appends newly allocated blocks to `row`.
    pub fn append(&mut self, row: usize, blocks: &[u32]) {
        self.table.append(row, blocks);
    }

    /// Frees `slot`'s row; the last row moves into the hole.
    pub fn remove(&mut self, store: &mut RequestStore, slot: u32) {
        let Some(row) = store.row(slot) else { return };
        let row = row as usize;
        let last = self.owners.len() - 1;
        if row == last {
            self.table.clear(row);
        } else {
            self.table.move_row(last, row);
        }
        self.owners.swap_remove(row);
        if row != last {
            store.set_row(self.owners[row], Some(row as u32));
        }
        store.set_row(slot, None);
    }

    /// Moves the rows whose owners satisfy `scheduled` to the front, keeping their order.
    pub fn partition_scheduled(
        &mut self,
        store: &mut RequestStore,
        scheduled: impl Fn(u32) -> bool,
    ) {
        let mut front = 0;
        for row in 0..self.owners.len() {
            if scheduled(self.owners[row]) {
                if row != front {
                    self.table.swap_rows(row, front);
                    self.owners.swap(row, front);
                    store.set_row(self.owners[row], Some(row as u32));
                    store.set_row(self.owners[front], Some(front as u32));
                }
                front += 1;
            }
        }
    }
}

/// Access to a block table's journal only: [`BlockTable::enable_journal`] and
/// [`BlockTable::trim_journal`].
pub struct JournalControl<'a>(&'a mut BlockTable);

impl JournalControl<'_> {
    /// Starts journaling the table's changes.
    pub fn enable(&mut self) {
        self.0.enable_journal();
    }

    /// Drops the journaled changes before `version`.
    pub fn trim(&mut self, version: u64) {
        self.0.trim_journal(version);
    }
}
