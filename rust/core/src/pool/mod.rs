//! The block pool and its parts: per-block records, the free queue, the prefix map, hit
//! verification (provenance) and the KV-cache event log. Public here: the parts that the API
//! hands out or that tests and benches drive directly.

pub(crate) mod block_meta;
pub(crate) mod block_pool;
pub(crate) mod free_queue;
pub(crate) mod kv_events;
pub(crate) mod prefix_map;
pub(crate) mod provenance;

pub use block_pool::BlockSource;
pub use free_queue::FreeQueue;
pub use kv_events::KvEventLog;
