//! The memory layer: how the large tables are backed (transparent huge pages) and read ahead
//! (software prefetch). No dependencies inside the crate.

pub(crate) mod huge_pages;
pub mod prefetch;
