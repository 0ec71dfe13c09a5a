//! Reading the Python-side `SchedulerConfig` and `Request` objects into core types.

use dflash_core::lookahead::{LookaheadPolicy, SpecMethod};
use dflash_core::request::token_capacity;
use dflash_core::{
    ExtraKeys, FinishReason, HashAlgo, Policy, RequestSpec, SchedulerConfig, VllmSemantics,
};
use pyo3::intern;
use pyo3::prelude::*;
use pyo3::types::PyString;

use crate::convert::{int_named, non_negative, token_ids, token_ids_with_capacity, Int};
use crate::errors::{invalid, unless_fatal, IntoPyResult};

fn attr<'py, T: FromPyObjectOwned<'py>>(obj: &Bound<'py, PyAny>, name: &str) -> PyResult<T> {
    let py = obj.py();
    obj.getattr(name)
        .map_err(|e| {
            unless_fatal(py, e, || {
                invalid(py, format!("config has no attribute {name:?}"))
            })
        })?
        .extract::<T>()
        .map_err(|_| invalid(py, format!("config.{name} has the wrong type")))
}

pub fn config_from_py(config: &Bound<'_, PyAny>) -> PyResult<SchedulerConfig> {
    let py = config.py();
    let count = |name: &str| -> PyResult<usize> {
        let value = config.getattr(name).map_err(|e| {
            unless_fatal(py, e, || {
                invalid(py, format!("config has no attribute {name:?}"))
            })
        })?;
        let value = int_named(&value, &format!("config.{name}")).map_err(|e| {
            if e.is_instance_of::<pyo3::exceptions::PyTypeError>(py) {
                invalid(py, format!("config.{name} has the wrong type"))
            } else {
                e
            }
        })?;
        non_negative(py, name, value)
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
    if let Ok(v) = config.getattr("verify_prefix_hits") {
        c.verify_prefix_hits = v.extract().map_err(|e| {
            unless_fatal(py, e, || {
                invalid(py, "config.verify_prefix_hits must be a bool")
            })
        })?;
    }
    if let Ok(v) = config.getattr("pad_admitted_decodes") {
        c.pad_admitted_decodes = v.extract().map_err(|e| {
            unless_fatal(py, e, || {
                invalid(py, "config.pad_admitted_decodes must be a bool")
            })
        })?;
    }
    if let Ok(v) = config.getattr("draft_slots_per_request") {
        c.draft_slots_per_request = v.extract().map_err(|e| {
            unless_fatal(py, e, || {
                invalid(
                    py,
                    "config.draft_slots_per_request must be a non-negative int",
                )
            })
        })?;
    }
    if let Ok(v) = config.getattr("drop_last_hit_block") {
        c.drop_last_hit_block = v.extract().map_err(|e| {
            unless_fatal(py, e, || {
                invalid(py, "config.drop_last_hit_block must be a bool")
            })
        })?;
    }
    if let Ok(v) = config.getattr("vllm_semantics") {
        let name: String = v.extract().map_err(|e| {
            unless_fatal(py, e, || invalid(py, "config.vllm_semantics must be a str"))
        })?;
        c.vllm_semantics = VllmSemantics::from_name(&name).py(py)?;
    }
    if let Ok(v) = config.getattr("pool_must_hold_max_model_len") {
        c.pool_must_hold_max_model_len = v.extract().map_err(|e| {
            unless_fatal(py, e, || {
                invalid(py, "config.pool_must_hold_max_model_len must be a bool")
            })
        })?;
    }
    if let Ok(v) = config.getattr("async_scheduling") {
        c.async_scheduling = v.extract().map_err(|e| {
            unless_fatal(py, e, || {
                invalid(py, "config.async_scheduling must be a bool")
            })
        })?;
    }
    c.lookahead_policy =
        LookaheadPolicy::from_name(&attr::<String>(config, "lookahead_policy")?).py(py)?;
    let speculative = config.getattr("speculative")?;
    if !speculative.is_none() {
        c.spec_method = SpecMethod::from_name(&attr::<String>(&speculative, "method")?).py(py)?;
        c.num_speculative_tokens = non_negative(
            py,
            "num_speculative_tokens",
            attr::<Int>(&speculative, "num_speculative_tokens")?,
        )?;
    }
    let seed: Option<Bound<'_, PyAny>> = config.getattr("hash_seed").ok().filter(|s| !s.is_none());
    c.hash_seed = crate::hash_config::seed_bytes(py, seed.as_ref())?;
    c.validate().py(py)?;
    Ok(c)
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
    let request_id: String = get(intern!(py, "request_id"))?
        .extract()
        .map_err(|e| unless_fatal(py, e, || invalid(py, "request_id must be a str")))?;
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
    let arrival_time: f64 = if arrival.is_none() {
        0.0
    } else {
        arrival.extract()?
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
        ignore_eos: get(intern!(py, "ignore_eos"))?.extract()?,
        min_tokens: non_negative(py, "min_tokens", min_tokens)?,
        priority: int_named(&get(intern!(py, "priority"))?, "priority")?,
        arrival_time,
        extra: ExtraKeys {
            lora_name: get(intern!(py, "lora_name"))?.extract()?,
            cache_salt: get(intern!(py, "cache_salt"))?.extract()?,
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
