//! Reading the Python-side `SchedulerConfig` and `Request` objects into core types.

use dflash_core::{
    token_capacity, BlockHash, ExtraKeys, FinishReason, HashAlgo, LookaheadPolicy, Policy,
    RequestSpec, SchedulerConfig, SpecMethod, VllmSemantics,
};
use pyo3::intern;
use pyo3::prelude::*;
use pyo3::types::{PyBool, PyString};

use crate::convert::{
    int_named, non_negative, opt_str_named, positive, str_named, token_ids,
    token_ids_with_capacity, Int,
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

/// `config.<name>` as a str (the name of a policy, an algorithm, a series).
fn name_attr(config: &Bound<'_, PyAny>, name: &str) -> PyResult<String> {
    let value = get_attr(config, "config", name)?;
    Ok(str_named(value.as_borrowed(), &format!("config.{name}"))?.into_owned())
}

/// `config.<name>` as a bool: a Python bool (or numpy's), never an int or other truthy object.
fn flag(config: &Bound<'_, PyAny>, name: &str) -> PyResult<bool> {
    let value = get_attr(config, "config", name)?;
    bool_named(&value, &format!("config.{name}"))
}

/// An optional bool attribute of the config (absent: `default`), so configs written for
/// earlier versions keep working.
fn opt_flag(config: &Bound<'_, PyAny>, name: &str, default: bool) -> PyResult<bool> {
    match config.getattr(name) {
        Ok(value) => bool_named(&value, &format!("config.{name}")),
        Err(_) => Ok(default),
    }
}

/// `value` as a bool named `what`.
fn bool_named(value: &Bound<'_, PyAny>, what: &str) -> PyResult<bool> {
    let py = value.py();
    value.extract().map_err(|e| {
        unless_fatal(py, e, || {
            wrong_type(
                py,
                format!("{what} must be a bool, got {}", type_name(value)),
            )
        })
    })
}

/// `config.<name>` as a count of at least `minimum`.
fn count(config: &Bound<'_, PyAny>, name: &str, minimum: usize) -> PyResult<usize> {
    let py = config.py();
    let what = format!("config.{name}");
    let value = int_named(&get_attr(config, "config", name)?, &what)?;
    usize::try_from(value)
        .ok()
        .filter(|&v| v >= minimum)
        .ok_or_else(|| invalid(py, format!("{what} must be >= {minimum}, got {value}")))
}

/// An optional count of at least 0 (absent: `default`).
fn opt_count(config: &Bound<'_, PyAny>, name: &str, default: usize) -> PyResult<usize> {
    if config.hasattr(name).unwrap_or(false) {
        count(config, name, 0)
    } else {
        Ok(default)
    }
}

/// The most speculative tokens a method may propose per step.
const MAX_SPECULATIVE_TOKENS: i64 = 64;

/// A speculative config (`method`, `num_speculative_tokens`); `what` names it in messages
/// ("config.speculative" inside a scheduler config, "speculative" alone).
fn speculative_from_py(spec: &Bound<'_, PyAny>, what: &str) -> PyResult<(SpecMethod, usize)> {
    let py = spec.py();
    let has = |name: &str| spec.hasattr(name).unwrap_or(false);
    if !has("method") && !has("num_speculative_tokens") {
        return Err(wrong_type(
            py,
            format!(
                "{what} must be a SpeculativeConfig or None, got {}",
                type_name(spec)
            ),
        ));
    }
    let method = get_attr(spec, what, "method")?;
    let method =
        SpecMethod::from_name(&str_named(method.as_borrowed(), &format!("{what}.method"))?)
            .py(py)?;
    let k_what = format!("{what}.num_speculative_tokens");
    let k = int_named(&get_attr(spec, what, "num_speculative_tokens")?, &k_what)?;
    // Without a method K must be 0, which the core checks (with the method's name).
    if method != SpecMethod::None && !(1..=MAX_SPECULATIVE_TOKENS).contains(&k) {
        return Err(invalid(
            py,
            format!("{k_what} must be in [1, {MAX_SPECULATIVE_TOKENS}], got {k}"),
        ));
    }
    Ok((method, non_negative(py, &k_what, k)?))
}

/// Checks a `SpeculativeConfig` on its own (its constructor calls this): the same checks, and
/// messages, as when a scheduler reads it.
#[pyfunction]
#[pyo3(name = "_check_speculative_config")]
pub fn check_speculative_config(spec: &Bound<'_, PyAny>) -> PyResult<()> {
    let (method, _) = speculative_from_py(spec, "speculative")?;
    if method == SpecMethod::None {
        return Err(invalid(
            spec.py(),
            "unknown speculative method \"none\": without speculation pass speculative=None",
        ));
    }
    Ok(())
}

/// Checks a `SchedulerConfig` (its constructor calls this): every check a `Scheduler` makes of
/// its config, with the same messages, so a config is validated by one piece of code.
#[pyfunction]
#[pyo3(name = "_check_scheduler_config")]
pub fn check_scheduler_config(config: &Bound<'_, PyAny>) -> PyResult<()> {
    config_from_py(config).map(drop)
}

pub fn config_from_py(config: &Bound<'_, PyAny>) -> PyResult<SchedulerConfig> {
    let py = config.py();
    let mut c = SchedulerConfig::new(
        count(config, "num_blocks", 2)?,
        count(config, "block_size", 1)?,
        count(config, "max_model_len", 2)?,
        count(config, "max_num_seqs", 1)?,
        count(config, "max_num_batched_tokens", 1)?,
    );
    c.enable_prefix_caching = flag(config, "enable_prefix_caching")?;
    c.enable_chunked_prefill = flag(config, "enable_chunked_prefill")?;
    c.long_prefill_token_threshold = count(config, "long_prefill_token_threshold", 0)?;
    c.policy = Policy::from_name(&name_attr(config, "policy")?).py(py)?;
    c.hash_algo = HashAlgo::from_name(&name_attr(config, "hash_algo")?).py(py)?;
    c.verify_prefix_hits = opt_flag(config, "verify_prefix_hits", c.verify_prefix_hits)?;
    c.pad_admitted_decodes = opt_flag(config, "pad_admitted_decodes", c.pad_admitted_decodes)?;
    c.draft_slots_per_request =
        opt_count(config, "draft_slots_per_request", c.draft_slots_per_request)?;
    c.drop_last_hit_block = opt_flag(config, "drop_last_hit_block", c.drop_last_hit_block)?;
    c.hash_lookahead_tokens = opt_count(config, "hash_lookahead_tokens", c.hash_lookahead_tokens)?;
    c.kv_events = opt_flag(config, "kv_events", c.kv_events)?;
    if config.hasattr("vllm_semantics").unwrap_or(false) {
        c.vllm_semantics =
            VllmSemantics::from_name(&name_attr(config, "vllm_semantics")?).py(py)?;
    }
    c.refuse_idle_steps = opt_flag(config, "refuse_idle_steps", c.refuse_idle_steps)?;
    c.pool_must_hold_max_model_len = opt_flag(
        config,
        "pool_must_hold_max_model_len",
        c.pool_must_hold_max_model_len,
    )?;
    c.async_scheduling = opt_flag(config, "async_scheduling", c.async_scheduling)?;
    c.max_loras = opt_count(config, "max_loras", c.max_loras)?;
    c.local_prefill_interval =
        opt_count(config, "local_prefill_interval", c.local_prefill_interval)?;
    c.lookahead_policy =
        LookaheadPolicy::from_name(&name_attr(config, "lookahead_policy")?).py(py)?;
    let speculative = get_attr(config, "config", "speculative")?;
    if !speculative.is_none() {
        (c.spec_method, c.num_speculative_tokens) =
            speculative_from_py(&speculative, "config.speculative")?;
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
    let mut spec = request_fields(req)?;
    let prompt = req_attr(req, intern!(py, "prompt_token_ids"))?;
    spec.prompt_token_ids = token_ids_with_capacity(&prompt, "prompt_token_ids", |len| {
        token_capacity(len, spec.max_tokens, max_model_len)
    })?;
    Ok(spec)
}

/// Checks a request's fields, its prompt's tokens aside (`Request`'s constructor calls this;
/// the prompt is read, and checked, when the request is submitted): the checks, and messages,
/// of submission.
#[pyfunction]
#[pyo3(name = "_check_request")]
pub fn check_request(request: &Bound<'_, PyAny>) -> PyResult<()> {
    request_fields(request).map(drop)
}

/// `request.<name>`, or `InvalidArgumentError` naming the missing attribute.
fn req_attr<'py>(
    req: &Bound<'py, PyAny>,
    name: &Bound<'py, PyString>,
) -> PyResult<Bound<'py, PyAny>> {
    let py = req.py();
    req.getattr(name).map_err(|e| {
        unless_fatal(py, e, || {
            invalid(py, format!("request has no attribute \"{name}\""))
        })
    })
}

/// Every field of a request but its prompt (left empty), checked.
fn request_fields(req: &Bound<'_, PyAny>) -> PyResult<RequestSpec> {
    let py = req.py();
    let get = |name| req_attr(req, name);
    let request_id =
        str_named(get(intern!(py, "request_id"))?.as_borrowed(), "request_id")?.into_owned();
    crate::convert::request_id(py, &request_id)?;
    let max_tokens = int_named(&get(intern!(py, "max_tokens"))?, "max_tokens")?;
    let min_tokens = int_named(&get(intern!(py, "min_tokens"))?, "min_tokens")?;
    let stop = token_ids(&get(intern!(py, "stop_token_ids"))?, "stop_token_ids")?;
    let arrival = get(intern!(py, "arrival_time"))?;
    let arrival_time = if arrival.is_none() {
        0.0
    } else {
        let time = number_named(&arrival, "arrival_time")?;
        if !time.is_finite() {
            return Err(invalid(
                py,
                format!("arrival_time must be finite, got {time}"),
            ));
        }
        time
    };
    let spec = RequestSpec {
        request_id,
        prompt_token_ids: Vec::new(),
        max_tokens: positive(py, "max_tokens", max_tokens)?,
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
        skip_reading_prefix_cache: match req.getattr(intern!(py, "skip_reading_prefix_cache")) {
            Ok(flag) => bool_named(&flag, "skip_reading_prefix_cache")?,
            Err(_) => false,
        },
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
