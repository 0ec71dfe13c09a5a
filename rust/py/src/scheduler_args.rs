//! Reading the Python-side `SchedulerConfig` and `Request` objects into core types.

use dflash_core::lookahead::{LookaheadPolicy, SpecMethod};
use dflash_core::request::token_capacity;
use dflash_core::{
    BlockHash, ExtraKeys, FinishReason, HashAlgo, Policy, RequestSpec, SchedulerConfig,
    VllmSemantics,
};
use pyo3::intern;
use pyo3::prelude::*;
use pyo3::types::{PyBool, PyString};

use crate::convert::{
    int_named, non_negative, opt_str_named, str_named, token_ids, token_ids_with_capacity, Int,
};
use crate::errors::{invalid, type_name, unless_fatal, wrong_type, IntoPyResult};

/// `obj.name`, or `InvalidArgumentError` naming what lacks it (`owner`: "config").
fn get_attr<'py>(obj: &Bound<'py, PyAny>, owner: &str, name: &str) -> PyResult<Bound<'py, PyAny>> {
    let py = obj.py();
    obj.getattr(name).map_err(|e| {
        unless_fatal(py, e, || {
            invalid(py, format!("{owner} has no attribute {name:?}"))
        })
    })
}

fn attr<'py, T: FromPyObjectOwned<'py, Error = PyErr>>(
    obj: &Bound<'py, PyAny>,
    name: &str,
) -> PyResult<T> {
    let py = obj.py();
    let value = get_attr(obj, "config", name)?;
    value.extract::<T>().map_err(|e| {
        unless_fatal(py, e, || {
            wrong_type(
                py,
                format!("config.{name} has the wrong type ({})", type_name(&value)),
            )
        })
    })
}

/// An optional bool attribute of the config (absent: `default`).
fn opt_flag(config: &Bound<'_, PyAny>, name: &str, default: bool) -> PyResult<bool> {
    let py = config.py();
    match config.getattr(name) {
        Ok(v) => v.extract().map_err(|e| {
            unless_fatal(py, e, || {
                wrong_type(
                    py,
                    format!("config.{name} must be a bool, got {}", type_name(&v)),
                )
            })
        }),
        Err(_) => Ok(default),
    }
}

pub fn config_from_py(config: &Bound<'_, PyAny>) -> PyResult<SchedulerConfig> {
    let py = config.py();
    let count = |name: &str| -> PyResult<usize> {
        let value = get_attr(config, "config", name)?;
        non_negative(py, name, int_named(&value, &format!("config.{name}"))?)
    };
    let mut c = SchedulerConfig::new(
        count("num_blocks")?,
        count("block_size")?,
        count("max_model_len")?,
        count("max_num_seqs")?,
        count("max_num_batched_tokens")?,
    );
    c.enable_prefix_caching = attr(config, "enable_prefix_caching")?;
    c.enable_chunked_prefill = attr(config, "enable_chunked_prefill")?;
    c.long_prefill_token_threshold = count("long_prefill_token_threshold")?;
    c.policy = Policy::from_name(&attr::<String>(config, "policy")?).py(py)?;
    c.hash_algo = HashAlgo::from_name(&attr::<String>(config, "hash_algo")?).py(py)?;
    // Optional, so configs written for earlier versions keep working.
    c.verify_prefix_hits = opt_flag(config, "verify_prefix_hits", c.verify_prefix_hits)?;
    c.pad_admitted_decodes = opt_flag(config, "pad_admitted_decodes", c.pad_admitted_decodes)?;
    if config.hasattr("draft_slots_per_request").unwrap_or(false) {
        c.draft_slots_per_request = count("draft_slots_per_request")?;
    }
    c.drop_last_hit_block = opt_flag(config, "drop_last_hit_block", c.drop_last_hit_block)?;
    if config.hasattr("hash_lookahead_tokens").unwrap_or(false) {
        c.hash_lookahead_tokens = count("hash_lookahead_tokens")?;
    }
    c.kv_events = opt_flag(config, "kv_events", c.kv_events)?;
    if let Ok(v) = config.getattr("vllm_semantics") {
        let name = str_named(v.as_borrowed(), "config.vllm_semantics")?;
        c.vllm_semantics = VllmSemantics::from_name(&name).py(py)?;
    }
    c.refuse_idle_steps = opt_flag(config, "refuse_idle_steps", c.refuse_idle_steps)?;
    c.pool_must_hold_max_model_len = opt_flag(
        config,
        "pool_must_hold_max_model_len",
        c.pool_must_hold_max_model_len,
    )?;
    c.async_scheduling = opt_flag(config, "async_scheduling", c.async_scheduling)?;
    if config.hasattr("max_loras").unwrap_or(false) {
        c.max_loras = count("max_loras")?;
    }
    if config.hasattr("local_prefill_interval").unwrap_or(false) {
        c.local_prefill_interval = count("local_prefill_interval")?;
    }
    c.lookahead_policy =
        LookaheadPolicy::from_name(&attr::<String>(config, "lookahead_policy")?).py(py)?;
    let speculative = get_attr(config, "config", "speculative")?;
    if !speculative.is_none() {
        let method = get_attr(&speculative, "config.speculative", "method")?;
        let method = str_named(method.as_borrowed(), "config.speculative.method")?;
        c.spec_method = SpecMethod::from_name(&method).py(py)?;
        let k = get_attr(&speculative, "config.speculative", "num_speculative_tokens")?;
        c.num_speculative_tokens = non_negative(
            py,
            "num_speculative_tokens",
            int_named(&k, "config.speculative.num_speculative_tokens")?,
        )?;
    }
    let seed: Option<Bound<'_, PyAny>> = config.getattr("hash_seed").ok().filter(|s| !s.is_none());
    c.hash_seed = crate::hash_config::seed_bytes(py, seed.as_ref())?;
    c.validate().py(py)?;
    Ok(c)
}

/// A real number (an int, a float, a numpy scalar; not a bool) named `what`.
fn number_named(obj: &Bound<'_, PyAny>, what: &str) -> PyResult<f64> {
    let py = obj.py();
    let not_a_number = || {
        wrong_type(
            py,
            format!("{what} must be a number or None, got {}", type_name(obj)),
        )
    };
    if obj.is_instance_of::<PyBool>() {
        return Err(not_a_number());
    }
    obj.extract().map_err(|e| unless_fatal(py, e, not_a_number))
}

/// `runner_output.<name>`, or `InvalidArgumentError` naming the missing attribute.
pub fn runner_attr<'py>(
    runner: &Bound<'py, PyAny>,
    name: &Bound<'py, PyString>,
) -> PyResult<Bound<'py, PyAny>> {
    let py = runner.py();
    runner.getattr(name).map_err(|e| {
        unless_fatal(py, e, || {
            invalid(
                py,
                format!("runner_output must be a ModelRunnerOutput (it has no {name})"),
            )
        })
    })
}

pub fn finish_reason_from_name(py: Python<'_>, name: &str) -> PyResult<FinishReason> {
    match name {
        "abort" | "aborted" | "FINISHED_ABORTED" => Ok(FinishReason::Abort),
        "stop" | "stopped" | "FINISHED_STOPPED" => Ok(FinishReason::Stop),
        "length" | "FINISHED_LENGTH_CAPPED" => Ok(FinishReason::Length),
        "error" | "FINISHED_ERROR" => Ok(FinishReason::Error),
        other => Err(invalid(
            py,
            format!("unknown finish status {other:?}; expected abort, stop, length or error"),
        )),
    }
}

fn opt_token(py: Python<'_>, what: &str, v: Option<Int>) -> PyResult<Option<u32>> {
    v.map(|Int(t)| {
        u32::try_from(t)
            .ok()
            .filter(|&t| t <= i32::MAX as u32)
            .ok_or_else(|| invalid(py, format!("{what} = {t} is outside [0, 2**31 - 1]")))
    })
    .transpose()
}

/// `request.lora_id` (absent or None: 0, no adapter), in `[1, 2**31 - 1]` when given.
fn lora_id(req: &Bound<'_, PyAny>) -> PyResult<u32> {
    let py = req.py();
    let Ok(v) = req.getattr(intern!(py, "lora_id")) else {
        return Ok(0);
    };
    if v.is_none() {
        return Ok(0);
    }
    let id = int_named(&v, "lora_id")?;
    u32::try_from(id)
        .ok()
        .filter(|&id| id >= 1 && id <= i32::MAX as u32)
        .ok_or_else(|| invalid(py, format!("lora_id = {id} is outside [1, 2**31 - 1]")))
}

/// `request.prompt_embed_hashes` (absent or None: none): one 32-byte digest per prompt block.
fn prompt_embed_hashes(req: &Bound<'_, PyAny>) -> PyResult<Vec<BlockHash>> {
    let py = req.py();
    let Ok(v) = req.getattr(intern!(py, "prompt_embed_hashes")) else {
        return Ok(Vec::new());
    };
    if v.is_none() {
        return Ok(Vec::new());
    }
    let not_digests = || {
        wrong_type(
            py,
            format!(
                "prompt_embed_hashes must be a sequence of 32-byte bytes, got {}",
                type_name(&v)
            ),
        )
    };
    let items: Vec<Vec<u8>> = v.extract().map_err(|e| unless_fatal(py, e, not_digests))?;
    items
        .into_iter()
        .map(|d| {
            BlockHash::try_from(d.as_slice()).map_err(|_| {
                invalid(
                    py,
                    format!("prompt_embed_hashes: a digest of {} bytes, not 32", d.len()),
                )
            })
        })
        .collect()
}

/// The engine's request as the core's spec. The prompt vector is given room for the request's
/// outputs up to `max_model_len` ([`token_capacity`]), so submitting it copies nothing.
pub fn request_spec<'py>(req: &Bound<'py, PyAny>, max_model_len: usize) -> PyResult<RequestSpec> {
    let py = req.py();
    let get = |name: &Bound<'py, PyString>| -> PyResult<Bound<'py, PyAny>> {
        req.getattr(name).map_err(|e| {
            unless_fatal(py, e, || {
                invalid(py, format!("request has no attribute \"{name}\""))
            })
        })
    };
    let request_id =
        str_named(get(intern!(py, "request_id"))?.as_borrowed(), "request_id")?.into_owned();
    let max_tokens = int_named(&get(intern!(py, "max_tokens"))?, "max_tokens")?;
    let room_for = usize::try_from(max_tokens).unwrap_or(0);
    let prompt = token_ids_with_capacity(
        &get(intern!(py, "prompt_token_ids"))?,
        "prompt_token_ids",
        |len| token_capacity(len, room_for, max_model_len),
    )?;
    let min_tokens = int_named(&get(intern!(py, "min_tokens"))?, "min_tokens")?;
    let stop = token_ids(&get(intern!(py, "stop_token_ids"))?, "stop_token_ids")?;
    let arrival = get(intern!(py, "arrival_time"))?;
    let arrival_time = if arrival.is_none() {
        0.0
    } else {
        number_named(&arrival, "arrival_time")?
    };
    let spec = RequestSpec {
        request_id,
        prompt_token_ids: prompt,
        max_tokens: non_negative(py, "max_tokens", max_tokens)?,
        eos_token_id: {
            let eos = get(intern!(py, "eos_token_id"))?;
            let eos = (!eos.is_none())
                .then(|| int_named(&eos, "eos_token_id").map(Int))
                .transpose()?;
            opt_token(py, "eos_token_id", eos)?
        },
        stop_token_ids: stop,
        ignore_eos: {
            let flag = get(intern!(py, "ignore_eos"))?;
            flag.extract().map_err(|e| {
                unless_fatal(py, e, || {
                    wrong_type(
                        py,
                        format!("ignore_eos must be a bool, got {}", type_name(&flag)),
                    )
                })
            })?
        },
        min_tokens: non_negative(py, "min_tokens", min_tokens)?,
        priority: int_named(&get(intern!(py, "priority"))?, "priority")?,
        arrival_time,
        lora_id: lora_id(req)?,
        skip_reading_prefix_cache: opt_flag(req, "skip_reading_prefix_cache", false)?,
        extra: ExtraKeys {
            lora_name: opt_str_named(Some(&get(intern!(py, "lora_name"))?), "lora_name")?,
            cache_salt: opt_str_named(Some(&get(intern!(py, "cache_salt"))?), "cache_salt")?,
            prompt_embed_hashes: prompt_embed_hashes(req)?,
        },
    };
    if spec.min_tokens > spec.max_tokens {
        // vLLM refuses it too (SamplingParams): the request could never stop before max_tokens.
        return Err(invalid(
            py,
            format!(
                "min_tokens ({}) must be <= max_tokens ({})",
                spec.min_tokens, spec.max_tokens
            ),
        ));
    }
    Ok(spec)
}
