//! Requests: their state, the slab that holds the live ones, the waiting queue, and the view of
//! a request that the KV-cache manager takes.

pub(crate) mod kv_view;
pub(crate) mod queue;
pub(crate) mod request;
pub(crate) mod request_store;
