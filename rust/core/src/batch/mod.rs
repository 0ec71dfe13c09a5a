//! The batch's block table: the persistent int32 table handed to the model runner, its
//! journal, the frozen snapshots handed out with steps, and which request owns which row.
//! Public here: the journal's records, which [`crate::BlockTable::journal`] hands out.

pub(crate) mod batch_rows;
pub(crate) mod block_table;
pub(crate) mod table_journal;
pub(crate) mod table_snapshot;

pub use table_journal::{Op, RowChange, TableJournal};
