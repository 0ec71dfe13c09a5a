//! dflash-core: the pure-Rust core of dflash-rs.
//!
//! A KV-cache block pool with a prefix cache, a KV-cache manager with lookahead-aware,
//! all-or-nothing allocation, the per-method lookahead policy, and the request scheduler built
//! on them. No Python here: the `dflash-py` crate wraps these types for Python. The API is
//! re-exported at this root. The modules are crate-private and grouped by job, each standing
//! above what it imports (listed from the ground up):
//!
//! - `memory`: huge-page backing and software prefetch for the large tables.
//! - `error`; [`fault`]: the one error type; test-only fault points.
//! - `hashing`: chained block hashes (SHA-256, BLAKE3, XXH3) and the one-shot SHA-256.
//! - [`pool`]: the block pool: per-block records, free queue, prefix map, hit verification
//!   and the KV-cache event log.
//! - `requests`: request state, the slab of live requests, the waiting queue, and the view of
//!   a request that the KV-cache manager takes.
//! - [`batch`]: the block table handed to the model runner, its journal and snapshots, and
//!   which request owns which row.
//! - `limits`, `kv_manager`: the bounds of a configuration; the KV-cache manager.
//! - `config`, `lookahead`, `semantics`, `output`: the scheduler's settings, the lookahead
//!   policy, vLLM release semantics, and what a step produces.
//! - `scheduler`: the continuous-batching scheduler, on top of them all.
//!
//! [`fault`], [`pool`] and [`batch`] are public for what tests and benches drive directly and
//! for the types the API hands out from them.

#![warn(unnameable_types)]

pub mod batch;
mod config;
mod error;
pub mod fault;
mod hashing;
mod kv_manager;
mod limits;
mod lookahead;
mod memory;
mod output;
pub mod pool;
mod requests;
mod scheduler;
mod semantics;

pub use batch::block_table::BlockTable;
pub use batch::table_snapshot::{SnapshotPool, TableSnapshot};
pub use config::SchedulerConfig;
pub use error::{CoreError, CoreResult};
pub use hashing::{BlockHash, BlockHasher, ExtraKeys, HashAlgo};
pub use kv_manager::{cdiv, AllocateArgs, KvCacheManager, PrefixCacheStats};
pub use lookahead::{LookaheadPolicy, SpecMethod};
pub use memory::prefetch;
pub use output::{EndedRequest, EntryKind, RequestUpdate, StepOutput, UpdateOutput};
pub use pool::block_pool::{BlockPool, NULL_BLOCK};
pub use pool::kv_events::KvEvent;
pub use requests::kv_view::{RequestBlocks, SequenceView};
pub use requests::queue::Policy;
pub use requests::request::{
    token_capacity, FinishReason, Request, RequestSpec, RequestStatus, StopRules,
};
pub use requests::request_store::RequestStore;
pub use scheduler::{PauseState, Scheduler, SchedulerStats, PLACEHOLDER_TOKEN};
pub use semantics::VllmSemantics;
