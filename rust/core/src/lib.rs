//! dflash-core: the pure-Rust core of dflash-rs.
//!
//! A KV-cache block pool with a prefix cache ([`block_pool`]), a KV-cache manager with
//! lookahead-aware, all-or-nothing allocation ([`kv_manager`]), the per-method lookahead policy
//! ([`lookahead`]), and the request scheduler built on them. No Python here: the `dflash-py`
//! crate wraps these types for Python.

pub mod batch_rows;
pub mod block_meta;
pub mod block_pool;
pub mod block_table;
pub mod config;
pub mod error;
pub mod fault;
pub mod free_queue;
pub mod hashing;
pub mod huge_pages;
pub mod kv_events;
pub mod kv_manager;
pub mod limits;
pub mod lookahead;
pub mod output;
pub mod prefetch;
pub mod prefix_map;
pub mod provenance;
pub mod queue;
pub mod request;
pub mod request_store;
pub mod scheduler;
pub mod semantics;
pub mod sha256;
pub mod table_journal;
pub mod table_snapshot;

pub use block_pool::{BlockPool, NULL_BLOCK};
pub use config::SchedulerConfig;
pub use error::{CoreError, CoreResult};
pub use hashing::{BlockHash, BlockHasher, ExtraKeys, HashAlgo};
pub use kv_manager::{AllocateArgs, KvCacheManager, PrefixCacheStats, RequestBlocks, SequenceView};
pub use lookahead::{LookaheadPolicy, SpecMethod};
pub use output::{EndedRequest, EntryKind, RequestUpdate, StepOutput, UpdateOutput};
pub use queue::Policy;
pub use request::{FinishReason, RequestSpec, RequestStatus};
pub use scheduler::{PauseState, Scheduler, SchedulerStats};
pub use semantics::VllmSemantics;
