//! Builds a block hasher from the Python-side `hash_algo` / `hash_seed` arguments.

use dflash_core::{BlockHasher, HashAlgo};
use pyo3::prelude::*;
use pyo3::types::{PyBool, PyBytes, PyInt, PyString};

use crate::errors::{invalid, type_name, wrong_type, IntoPyResult};

/// The root seed: the given `hash_seed` (str, bytes or int), else `PYTHONHASHSEED` as vLLM does,
/// else 32 random bytes from the OS (hashes then differ between processes).
pub fn seed_bytes(py: Python<'_>, hash_seed: Option<&Bound<'_, PyAny>>) -> PyResult<Vec<u8>> {
    if let Some(seed) = hash_seed {
        if let Ok(s) = seed.cast::<PyString>() {
            return Ok(s.to_cow()?.as_bytes().to_vec());
        }
        if let Ok(b) = seed.cast::<PyBytes>() {
            return Ok(b.as_bytes().to_vec());
        }
        if !seed.is_instance_of::<PyBool>() {
            // An int, or a numpy integer (its `__index__`): the seed is its decimal digits.
            let int = if seed.is_exact_instance_of::<PyInt>() {
                Some(seed.clone())
            } else if seed.hasattr("__index__")? {
                Some(seed.call_method0("__index__")?)
            } else {
                None
            };
            if let Some(int) = int.filter(|i| i.is_instance_of::<PyInt>()) {
                return Ok(int.str()?.to_cow()?.as_bytes().to_vec());
            }
        }
        return Err(wrong_type(
            py,
            format!(
                "hash_seed must be str, bytes, int or None, got {}",
                type_name(seed)
            ),
        ));
    }
    if let Ok(env) = std::env::var("PYTHONHASHSEED") {
        if !env.is_empty() && env != "random" {
            return Ok(env.into_bytes());
        }
    }
    let mut buf = vec![0u8; 32];
    getrandom::fill(&mut buf)
        .map_err(|e| invalid(py, format!("no OS randomness for hash_seed: {e}")))?;
    Ok(buf)
}

/// A hasher for `block_size`-token blocks.
pub fn make_hasher(
    py: Python<'_>,
    hash_algo: &str,
    hash_seed: Option<&Bound<'_, PyAny>>,
    block_size: usize,
) -> PyResult<BlockHasher> {
    let algo = HashAlgo::from_name(hash_algo).py(py)?;
    Ok(BlockHasher::new(
        algo,
        block_size,
        &seed_bytes(py, hash_seed)?,
    ))
}
