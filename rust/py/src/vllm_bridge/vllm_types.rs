//! vLLM's classes the bridge builds, resolved once: the step dataclasses, the stats
//! dataclasses and `EngineCoreOutput`.

use pyo3::prelude::*;
use pyo3::types::{PyDict, PyList, PySet, PyTuple, PyType};

use crate::dataclass_build::DataclassBuilder;
use crate::struct_slots::StructBuilder;

/// The vLLM classes the bridge instantiates.
pub(super) struct VllmTypes {
    pub(super) scheduler_output: DataclassFields<10>,
    pub(super) cached_request_data: DataclassFields<7>,
    pub(super) engine_core_output: EngineCoreOutputType,
    pub(super) stats: StatsTypes,
    /// vLLM's `FinishReason` per core reason, in `FinishReason`'s order (stop, length, abort,
    /// error).
    pub(super) finish_reasons: [Py<PyAny>; 4],
}

/// vLLM's per-step stats dataclasses (`SchedulerStats`, `PrefixCacheStats`,
/// `SpecDecodingStats`) and the indices of the fields the bridge sets.
pub(super) struct StatsTypes {
    pub(super) scheduler: DataclassBuilder,
    pub(super) prefix: DataclassBuilder,
    pub(super) spec: DataclassBuilder,
    /// `SchedulerStats`: running, waiting, skipped, usage, prefix stats, spec stats.
    pub(super) scheduler_fields: [usize; 6],
    /// `PrefixCacheStats`: reset, then the six counters in `stats_counters`' order.
    pub(super) prefix_fields: [usize; 7],
    /// `SpecDecodingStats`: K, drafts, draft tokens, accepted, accepted and drafted per
    /// position.
    pub(super) spec_fields: [usize; 6],
}

impl StatsTypes {
    pub(super) fn new(classes: &Bound<'_, PyTuple>) -> PyResult<Self> {
        let py = classes.py();
        let (scheduler, prefix, spec): (Bound<'_, PyType>, Bound<'_, PyType>, Bound<'_, PyType>) =
            classes.extract()?;
        let zero = || 0_i64.into_pyobject(py).map(|z| z.into_any());
        let prefix_names = [
            "reset",
            "requests",
            "queries",
            "hits",
            "preempted_requests",
            "preempted_queries",
            "preempted_hits",
        ];
        let prefix = DataclassBuilder::new(&prefix, &[("requests", zero()?)])?;
        let spec_names = [
            "num_spec_tokens",
            "num_drafts",
            "num_draft_tokens",
            "num_accepted_tokens",
            "num_accepted_tokens_per_pos",
            "num_draft_tokens_per_pos",
        ];
        let spec = DataclassBuilder::new(&spec, &[("num_spec_tokens", zero()?)])?;
        let scheduler_names = [
            "num_running_reqs",
            "num_waiting_reqs",
            "num_skipped_waiting_reqs",
            "kv_cache_usage",
            "prefix_cache_stats",
            "spec_decoding_stats",
        ];
        let scheduler = DataclassBuilder::new(&scheduler, &[("num_running_reqs", zero()?)])?;
        let fields = |b: &DataclassBuilder, names: &[&str]| -> PyResult<Vec<usize>> {
            names.iter().map(|n| b.field(py, n)).collect()
        };
        Ok(Self {
            scheduler_fields: fields(&scheduler, &scheduler_names)?.try_into().unwrap(),
            prefix_fields: fields(&prefix, &prefix_names)?.try_into().unwrap(),
            spec_fields: fields(&spec, &spec_names)?.try_into().unwrap(),
            scheduler,
            prefix,
            spec,
        })
    }
}

/// The fields of vLLM's `SchedulerOutput` the bridge sets, in the order it gives them.
const STEP_OUTPUT_FIELDS: [&str; 10] = [
    "scheduled_new_reqs",
    "scheduled_cached_reqs",
    "num_scheduled_tokens",
    "total_num_scheduled_tokens",
    "scheduled_spec_decode_tokens",
    "scheduled_encoder_inputs",
    "finished_req_ids",
    "free_encoder_mm_hashes",
    "preempted_req_ids",
    "num_spec_tokens_to_schedule",
];

/// The fields of vLLM's `CachedRequestData`, in the order the bridge gives them.
const CACHED_REQUEST_DATA_FIELDS: [&str; 7] = [
    "req_ids",
    "resumed_req_ids",
    "new_token_ids",
    "all_token_ids",
    "new_block_ids",
    "num_computed_tokens",
    "num_output_tokens",
];

/// A vLLM dataclass the bridge builds from the same `N` fields each time, given in the order
/// of the names it was made with.
pub(super) struct DataclassFields<const N: usize> {
    pub(super) builder: DataclassBuilder,
    fields: [usize; N],
}

impl<const N: usize> DataclassFields<N> {
    /// `example` holds valid values of the `names` fields (the direct build is checked on it).
    pub(super) fn new(
        cls: &Bound<'_, PyType>,
        names: &[&str; N],
        example: [Bound<'_, PyAny>; N],
    ) -> PyResult<Self> {
        let py = cls.py();
        let pairs: Vec<(&str, Bound<'_, PyAny>)> = names.iter().copied().zip(example).collect();
        let builder = DataclassBuilder::new(cls, &pairs)?;
        let mut fields = [0; N];
        for (slot, name) in fields.iter_mut().zip(names) {
            *slot = builder.field(py, name)?;
        }
        Ok(Self { builder, fields })
    }

    pub(super) fn build<'py>(
        &self,
        py: Python<'py>,
        values: [Bound<'py, PyAny>; N],
    ) -> PyResult<Bound<'py, PyAny>> {
        let given: Vec<(usize, &Bound<'py, PyAny>)> =
            self.fields.iter().copied().zip(values.iter()).collect();
        self.builder.build(py, &given)
    }
}

/// `SchedulerOutput` and `CachedRequestData`, checked on a valid empty step.
pub(super) fn step_output_types(
    scheduler_output: &Bound<'_, PyType>,
    cached_request_data: &Bound<'_, PyType>,
) -> PyResult<(DataclassFields<10>, DataclassFields<7>)> {
    let py = scheduler_output.py();
    let list = || PyList::empty(py).into_any();
    let dict = || PyDict::new(py).into_any();
    let set = || PySet::empty(py).map(|s| s.into_any());
    let zero = || 0_i64.into_pyobject(py).map(|z| z.into_any());
    let cached = DataclassFields::new(
        cached_request_data,
        &CACHED_REQUEST_DATA_FIELDS,
        [list(), set()?, list(), dict(), list(), list(), list()],
    )?;
    let empty_cached = cached.build(py, std::array::from_fn(|_| list()))?;
    let step = DataclassFields::new(
        scheduler_output,
        &STEP_OUTPUT_FIELDS,
        [
            list(),
            empty_cached,
            dict(),
            zero()?,
            dict(),
            dict(),
            set()?,
            list(),
            set()?,
            zero()?,
        ],
    )?;
    Ok((step, cached))
}

/// vLLM's `EngineCoreOutput` (a msgspec struct) and the indices of the fields the bridge sets.
pub(super) struct EngineCoreOutputType {
    pub(super) builder: StructBuilder,
    request_id: usize,
    new_token_ids: usize,
    finish_reason: usize,
    stop_reason: usize,
}

impl EngineCoreOutputType {
    pub(super) fn new(ty: &Bound<'_, PyAny>) -> PyResult<Self> {
        let py = ty.py();
        let builder = StructBuilder::new(ty)?;
        Ok(Self {
            request_id: builder.field(py, "request_id")?,
            new_token_ids: builder.field(py, "new_token_ids")?,
            finish_reason: builder.field(py, "finish_reason")?,
            stop_reason: builder.field(py, "stop_reason")?,
            builder,
        })
    }

    /// An output that carries new tokens only (the references are moved into it).
    pub(super) fn tokens<'py>(
        &self,
        rid: Bound<'py, PyAny>,
        tokens: Bound<'py, PyAny>,
    ) -> PyResult<Bound<'py, PyAny>> {
        self.builder.build(
            rid.py(),
            [(self.request_id, rid), (self.new_token_ids, tokens)],
        )
    }

    /// A final output: new tokens, the finish reason and the stop reason.
    pub(super) fn finished<'py>(
        &self,
        rid: Bound<'py, PyAny>,
        tokens: Bound<'py, PyAny>,
        reason: Bound<'py, PyAny>,
        stop: Bound<'py, PyAny>,
    ) -> PyResult<Bound<'py, PyAny>> {
        self.builder.build(
            rid.py(),
            [
                (self.request_id, rid),
                (self.new_token_ids, tokens),
                (self.finish_reason, reason),
                (self.stop_reason, stop),
            ],
        )
    }
}
