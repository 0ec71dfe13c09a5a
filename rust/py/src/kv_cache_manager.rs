//! `dflash_rs.KVCacheManager`: the block pool and KV-cache manager for engines that keep their
//! own scheduler. Requests are registered by id with their tokens; block hashes are computed in
//! Rust, once per full block.

use dflash_core::{
    AllocateArgs, BlockHash, BlockHasher, CoreError, ExtraKeys, KvCacheManager, RequestBlocks,
    SequenceView,
};
use hashbrown::HashMap;
use pyo3::prelude::*;
use pyo3::types::PyBytes;
use std::borrow::Cow;

use crate::convert::{non_negative, opt_str_named, positive, Flag, Int, RequestId, Text};
use crate::errors::{invalid, to_py, IntoPyResult};
use crate::hash_config::make_hasher;

/// What the manager keeps per request.
struct ManagedRequest {
    tokens: Vec<u32>,
    hashes: Vec<BlockHash>,
    extra: ExtraKeys,
    blocks: RequestBlocks,
}

impl ManagedRequest {
    fn view(&self) -> SequenceView<'_> {
        SequenceView {
            tokens: &self.tokens,
            block_hashes: &self.hashes,
            extra: &self.extra,
        }
    }
}

/// Block pool + prefix cache + lookahead-aware allocation, keyed by request id.
#[pyclass(module = "dflash_rs._core", name = "KVCacheManager", weakref)]
pub struct PyKvCacheManager {
    inner: KvCacheManager,
    hasher: BlockHasher,
    requests: HashMap<String, ManagedRequest>,
    hit_buf: Vec<u32>,
    /// Set once a call panicked (a bug): later calls are refused.
    failure: Option<String>,
}

impl PyKvCacheManager {
    /// Runs a call's body so that a panic becomes `InvariantError` rather than crossing into
    /// Python; after one, every guarded call is refused (the state may be half updated).
    /// The manager never releases the GIL, so the GIL serialises callers.
    fn guarded<R>(
        &mut self,
        py: Python<'_>,
        body: impl FnOnce(&mut Self) -> PyResult<R>,
    ) -> PyResult<R> {
        if let Some(msg) = &self.failure {
            return Err(crate::guarded::stopped_error(py, "KVCacheManager", msg));
        }
        match std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| body(self))) {
            Ok(result) => result,
            Err(payload) => Err(crate::guarded::panic_to_error(
                py,
                "KVCacheManager",
                payload.as_ref(),
                &mut self.failure,
            )),
        }
    }

    fn get(&self, py: Python<'_>, id: &str) -> PyResult<&ManagedRequest> {
        self.requests
            .get(id)
            .ok_or_else(|| to_py(py, CoreError::UnknownRequest(id.to_owned())))
    }
}

#[pymethods]
impl PyKvCacheManager {
    #[new]
    #[pyo3(
        signature = (num_blocks, block_size, max_model_len, enable_prefix_caching=Flag(true), hash_algo=Text(Cow::Borrowed("sha256")), hash_seed=None, verify_prefix_hits=Flag(true)),
        text_signature = "(num_blocks, block_size, max_model_len, enable_prefix_caching=True, hash_algo='sha256', hash_seed=None, verify_prefix_hits=True)"
    )]
    #[allow(clippy::too_many_arguments)]
    fn new(
        py: Python<'_>,
        num_blocks: Int,
        block_size: Int,
        max_model_len: Int,
        enable_prefix_caching: Flag,
        hash_algo: Text<'_>,
        hash_seed: Option<&Bound<'_, PyAny>>,
        verify_prefix_hits: Flag,
    ) -> PyResult<Self> {
        let (Flag(enable_prefix_caching), Flag(verify_prefix_hits)) =
            (enable_prefix_caching, verify_prefix_hits);
        let num_blocks = non_negative(py, "num_blocks", num_blocks)?;
        let block_size = positive(py, "block_size", block_size)?;
        let max_model_len = positive(py, "max_model_len", max_model_len)?;
        let hasher = make_hasher(py, &hash_algo, hash_seed, block_size)?;
        let mut inner =
            KvCacheManager::new(num_blocks, block_size, max_model_len, enable_prefix_caching)
                .py(py)?;
        inner.set_verify_hits(verify_prefix_hits).py(py)?;
        Ok(Self {
            inner,
            hasher,
            requests: HashMap::new(),
            hit_buf: Vec::new(),
            failure: None,
        })
    }

    /// Registers a request and hashes its full blocks.
    #[pyo3(signature = (request_id, token_ids, lora_name=None, cache_salt=None))]
    fn add_request(
        &mut self,
        py: Python<'_>,
        request_id: RequestId<'_>,
        token_ids: &Bound<'_, PyAny>,
        lora_name: Option<&Bound<'_, PyAny>>,
        cache_salt: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<()> {
        let request_id: &str = &request_id;
        let lora_name = opt_str_named(lora_name, "lora_name")?;
        let cache_salt = opt_str_named(cache_salt, "cache_salt")?;
        self.guarded(py, |this| {
            crate::convert::request_id(py, request_id)?;
            if this.requests.contains_key(request_id) {
                return Err(to_py(
                    py,
                    CoreError::DuplicateRequest(request_id.to_owned()),
                ));
            }
            let tokens = crate::convert::token_ids(token_ids, "token_ids")?;
            if tokens.is_empty() {
                return Err(invalid(py, "token_ids must not be empty"));
            }
            if tokens.len() > this.inner.max_model_len() {
                return Err(to_py(
                    py,
                    CoreError::TooLong(format!(
                        "prompt of {} tokens exceeds max_model_len {}",
                        tokens.len(),
                        this.inner.max_model_len()
                    )),
                ));
            }
            let extra = ExtraKeys {
                lora_name,
                cache_salt,
                ..Default::default()
            };
            let mut hashes = Vec::new();
            if this.inner.pool().caching_enabled() {
                this.hasher.extend_hashes(&mut hashes, &tokens, &extra);
            }
            let req = ManagedRequest {
                tokens,
                hashes,
                extra,
                blocks: RequestBlocks::default(),
            };
            this.requests.insert(request_id.to_owned(), req);
            Ok(())
        })
    }

    /// Appends accepted tokens to a request (hashing any newly full block).
    fn append_token_ids(
        &mut self,
        py: Python<'_>,
        request_id: RequestId<'_>,
        token_ids: &Bound<'_, PyAny>,
    ) -> PyResult<()> {
        self.guarded(py, |this| {
            let new_tokens = crate::convert::token_ids(token_ids, "token_ids")?;
            let max_model_len = this.inner.max_model_len();
            let caching = this.inner.pool().caching_enabled();
            let req = this
                .requests
                .get_mut(&*request_id)
                .ok_or_else(|| to_py(py, CoreError::UnknownRequest(request_id.to_owned())))?;
            if req.tokens.len() + new_tokens.len() > max_model_len {
                return Err(to_py(
                    py,
                    CoreError::TooLong(format!(
                        "appending {} tokens to {} exceeds max_model_len {max_model_len}",
                        new_tokens.len(),
                        req.tokens.len()
                    )),
                ));
            }
            req.tokens.extend_from_slice(&new_tokens);
            if caching {
                this.hasher
                    .extend_hashes(&mut req.hashes, &req.tokens, &req.extra);
            }
            Ok(())
        })
    }

    /// Longest cached prefix: (hit block ids, hit tokens); capped at num_tokens - 1, whole blocks.
    fn get_computed_blocks(
        &mut self,
        py: Python<'_>,
        request_id: RequestId<'_>,
    ) -> PyResult<(Vec<u32>, usize)> {
        self.guarded(py, |this| {
            let req = this
                .requests
                .get(&*request_id)
                .ok_or_else(|| to_py(py, CoreError::UnknownRequest(request_id.to_owned())))?;
            let hit_tokens = this
                .inner
                .get_computed_blocks(req.view(), &mut this.hit_buf);
            Ok((this.hit_buf.clone(), hit_tokens))
        })
    }

    /// Allocates slots for `num_new_tokens` (+ lookahead); returns the new block ids, or None if
    /// the pool cannot serve it (then nothing changed).
    #[pyo3(signature = (request_id, num_new_tokens, *, num_computed_tokens, num_new_computed_tokens=Int(0), new_computed_blocks=BlockIds(Vec::new()), num_lookahead_tokens=Int(0), full_sequence_must_fit=Flag(false)), text_signature = "(self, request_id, num_new_tokens, *, num_computed_tokens, num_new_computed_tokens=0, new_computed_blocks=..., num_lookahead_tokens=0, full_sequence_must_fit=False)")]
    #[allow(clippy::too_many_arguments)]
    fn allocate_slots(
        &mut self,
        py: Python<'_>,
        request_id: RequestId<'_>,
        num_new_tokens: Int,
        num_computed_tokens: Int,
        num_new_computed_tokens: Int,
        new_computed_blocks: BlockIds,
        num_lookahead_tokens: Int,
        full_sequence_must_fit: Flag,
    ) -> PyResult<Option<Vec<u32>>> {
        let (BlockIds(hits), Flag(full_sequence_must_fit)) =
            (new_computed_blocks, full_sequence_must_fit);
        self.guarded(py, |this| {
            let args = AllocateArgs {
                num_new_tokens: non_negative(py, "num_new_tokens", num_new_tokens)?,
                num_computed_tokens: non_negative(py, "num_computed_tokens", num_computed_tokens)?,
                num_new_computed_tokens: non_negative(
                    py,
                    "num_new_computed_tokens",
                    num_new_computed_tokens,
                )?,
                new_computed_blocks: &hits,
                num_lookahead_tokens: non_negative(
                    py,
                    "num_lookahead_tokens",
                    num_lookahead_tokens,
                )?,
                full_sequence_must_fit,
            };
            let req = this
                .requests
                .get_mut(&*request_id)
                .ok_or_else(|| to_py(py, CoreError::UnknownRequest(request_id.to_owned())))?;
            let view = SequenceView {
                tokens: &req.tokens,
                block_hashes: &req.hashes,
                extra: &req.extra,
            };
            let first_new = this
                .inner
                .allocate_slots(&mut req.blocks, view, args)
                .py(py)?;
            Ok(first_new.map(|i| req.blocks.block_ids[i..].to_vec()))
        })
    }

    /// Releases every block of the request (tail first) and forgets it.
    fn free(&mut self, py: Python<'_>, request_id: RequestId<'_>) -> PyResult<()> {
        self.guarded(py, |this| {
            let mut req = this
                .requests
                .remove(&*request_id)
                .ok_or_else(|| to_py(py, CoreError::UnknownRequest(request_id.to_owned())))?;
            this.inner.free(&mut req.blocks);
            Ok(())
        })
    }

    /// Block ids the request holds, in logical order.
    fn block_ids(&self, py: Python<'_>, request_id: RequestId<'_>) -> PyResult<Vec<u32>> {
        Ok(self.get(py, &request_id)?.blocks.block_ids.clone())
    }

    /// Known tokens of the request.
    fn num_tokens(&self, py: Python<'_>, request_id: RequestId<'_>) -> PyResult<usize> {
        Ok(self.get(py, &request_id)?.tokens.len())
    }

    /// Chained hashes of the request's full blocks (empty when caching is off).
    fn block_hashes<'py>(
        &self,
        py: Python<'py>,
        request_id: RequestId<'_>,
    ) -> PyResult<Vec<Bound<'py, PyBytes>>> {
        Ok(self
            .get(py, &request_id)?
            .hashes
            .iter()
            .map(|h| PyBytes::new(py, h))
            .collect())
    }

    /// Leading blocks of the request registered in the prefix cache.
    fn num_cached_blocks(&self, py: Python<'_>, request_id: RequestId<'_>) -> PyResult<usize> {
        Ok(self.get(py, &request_id)?.blocks.num_cached_blocks)
    }

    /// Whether the id is registered.
    fn has_request(&self, request_id: RequestId<'_>) -> bool {
        self.requests.contains_key(&*request_id)
    }

    /// Registered request ids.
    fn request_ids(&self) -> Vec<String> {
        self.requests.keys().cloned().collect()
    }

    /// Empties the prefix cache; False (and no change) while any block is held.
    fn reset_prefix_cache(&mut self, py: Python<'_>) -> PyResult<bool> {
        self.guarded(py, |this| Ok(this.inner.reset_prefix_cache()))
    }

    /// Raises `InvariantError` if any pool or ownership invariant is broken.
    fn check_invariants(&mut self, py: Python<'_>) -> PyResult<()> {
        self.guarded(py, |this| {
            this.inner
                .check_invariants(this.requests.values().map(|r| &r.blocks))
                .py(py)
        })
    }

    /// Free block ids in eviction order (next reused first).
    fn free_block_ids(&self) -> Vec<u32> {
        self.inner.pool().free_block_ids()
    }

    /// Ref count of a block.
    fn ref_count(&self, py: Python<'_>, block_id: Int) -> PyResult<u32> {
        let b = self.checked_block(py, block_id.0)?;
        Ok(self.inner.pool().ref_count(b))
    }

    /// The hash a block is cached under, or None.
    fn block_hash<'py>(
        &self,
        py: Python<'py>,
        block_id: Int,
    ) -> PyResult<Option<Bound<'py, PyBytes>>> {
        let b = self.checked_block(py, block_id.0)?;
        Ok(self.inner.pool().block_hash(b).map(|h| PyBytes::new(py, h)))
    }

    /// Prefix-cache lookup counters: requests, queries and hits (tokens).
    fn prefix_cache_stats(&self) -> (u64, u64, u64) {
        let s = self.inner.prefix_cache_stats();
        (s.requests, s.queries, s.hits)
    }

    #[getter]
    fn num_free_blocks(&self) -> usize {
        self.inner.num_free_blocks()
    }

    #[getter]
    fn usage(&self) -> f64 {
        self.inner.usage()
    }

    #[getter]
    fn num_blocks(&self) -> usize {
        self.inner.pool().num_blocks()
    }

    #[getter]
    fn block_size(&self) -> usize {
        self.inner.block_size()
    }

    #[getter]
    fn max_model_len(&self) -> usize {
        self.inner.max_model_len()
    }

    #[getter]
    fn enable_prefix_caching(&self) -> bool {
        self.inner.pool().caching_enabled()
    }

    #[getter]
    fn hash_algo(&self) -> &'static str {
        self.hasher.algo().name()
    }

    #[getter]
    fn num_requests(&self) -> usize {
        self.requests.len()
    }

    /// Number of (hash, block) registrations in the prefix cache.
    #[getter]
    fn num_prefix_cached_blocks(&self) -> usize {
        self.inner.pool().num_cached_blocks()
    }

    fn __repr__(&self) -> String {
        format!(
            "KVCacheManager(num_blocks={}, block_size={}, max_model_len={}, free={}, requests={})",
            self.inner.pool().num_blocks(),
            self.inner.block_size(),
            self.inner.max_model_len(),
            self.inner.num_free_blocks(),
            self.requests.len()
        )
    }
}

/// The `new_computed_blocks` argument: a sequence (or 1-D integer array) of block ids.
struct BlockIds(Vec<u32>);

impl<'a, 'py> FromPyObject<'a, 'py> for BlockIds {
    type Error = PyErr;

    fn extract(obj: Borrowed<'a, 'py, PyAny>) -> PyResult<Self> {
        crate::convert::token_ids(&obj, "new_computed_blocks").map(BlockIds)
    }
}

impl PyKvCacheManager {
    fn checked_block(&self, py: Python<'_>, block_id: i64) -> PyResult<u32> {
        match u32::try_from(block_id) {
            Ok(b) if (b as usize) < self.inner.pool().num_blocks() => Ok(b),
            _ => Err(invalid(py, format!("block id {block_id} is out of range"))),
        }
    }
}
