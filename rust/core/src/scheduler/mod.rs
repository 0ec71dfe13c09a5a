//! The continuous-batching scheduler (vLLM 0.33 semantics, one full-attention group).
//!
//! Each `schedule()` first tops up running requests (preempting when the pool is short), then,
//! if nothing was preempted, admits waiting requests (unless paused: `pause.rs`). Every
//! allocation reserves the lookahead the speculative method needs ([`crate::lookahead`]), so
//! every position the target or the drafter writes in the step lies in a block the request owns.
//!
//! With `async_scheduling` (vLLM's `AsyncScheduler`), a step may be scheduled before the
//! previous one's output is applied: each scheduled request that samples counts its coming
//! tokens as output placeholders (already in `num_computed_tokens`) and gets K placeholder
//! drafts, so the next step schedules 1 + K tokens for it; outputs resolve the placeholders.

mod abandon;
mod budget;
mod cadence;
mod hold;
mod invariants;
mod pause;
mod update;

pub use pause::PauseState;

use std::collections::VecDeque;
use std::sync::atomic::{AtomicU64, Ordering};

use budget::StepBudget;
use cadence::{PrefillCadence, StepPrefills};

use crate::batch_rows::BatchRows;
use crate::block_table::BlockTable;
use crate::config::SchedulerConfig;
use crate::error::{broken, invalid, CoreError, CoreResult};
use crate::hashing::BlockHasher;
use crate::kv_manager::{AllocateArgs, KvCacheManager, PrefixCacheStats};
use crate::lookahead::{lookahead_tokens, AllocationKind};
use crate::output::{EndedRequest, EntryKind, StepOutput};
use crate::queue::{Policy, PriorityKey, WaitingQueue};
use crate::request::{FinishReason, Request, RequestSpec, RequestStatus};
use crate::request_store::RequestStore;
use crate::semantics::VllmSemantics;

/// Counters since construction.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct SchedulerStats {
    /// Preemptions.
    pub num_preemptions: u64,
    /// Steps scheduled.
    pub num_steps: u64,
    /// Requests that received draft tokens to verify, summed over steps.
    pub num_drafts: u64,
    /// Draft tokens verified.
    pub num_draft_tokens: u64,
    /// Draft tokens accepted.
    pub num_accepted_tokens: u64,
    /// Accepted drafts per draft position.
    pub num_accepted_tokens_per_pos: Vec<u64>,
    /// Requests that verified `i` drafts, for `i` in `0..=K` (entry 0 unused).
    pub num_drafts_by_count: Vec<u64>,
    /// Requests finished.
    pub num_finished: u64,
    /// Prefix-cache lookups of first admissions, counted when the request is scheduled, as
    /// vLLM's `PrefixCacheStats` counts them (a lookup that did not lead to an admission is not).
    pub admitted_prefix: PrefixCacheStats,
    /// The same for re-admissions after a preemption (vLLM's `preempted_*` counters).
    pub resumed_prefix: PrefixCacheStats,
}

impl SchedulerStats {
    /// Verified drafts per draft position (position `p` counts requests with more than `p`).
    pub fn num_draft_tokens_per_pos(&self) -> Vec<u64> {
        let mut per_pos: Vec<u64> = self.num_drafts_by_count.iter().skip(1).copied().collect();
        for p in (1..per_pos.len()).rev() {
            per_pos[p - 1] += per_pos[p];
        }
        per_pos
    }
}

/// A scheduled entry awaiting its model output.
#[derive(Debug, Clone, Copy)]
struct InFlightEntry {
    slot: u32,
    generation: u32,
    /// Position in scheduling order (running requests first, then admissions), which is the
    /// order vLLM processes outputs in; batch order is block-table row order.
    rank: u32,
    num_spec_tokens: u32,
    is_prefill_chunk: bool,
    /// Tokens scheduled (taken off the request's in-flight count when the output arrives).
    num_scheduled: u32,
    /// The request's preemption count at scheduling: an output scheduled before a later
    /// preemption is stale (its tokens are delivered, its counters were reset).
    preemptions: u32,
    /// Stale output to drop rather than deliver (set by `preempt_all_running`; see `pause.rs`).
    drop_output: bool,
    /// The request's `is_prefill_chunk` before this step (restored if the step is abandoned).
    was_prefill_chunk: bool,
    /// Admitted by this step (a new or resumed entry): abandoning the step un-admits it.
    admitted: bool,
    /// The request's prefix-cached blocks before this step's allocation: abandoning the step
    /// withdraws the ones it registered (their KV is never computed).
    cached_before: u32,
}

#[derive(Debug, Clone)]
struct InFlightStep {
    step_id: u64,
    entries: Vec<InFlightEntry>,
}

/// A placeholder draft token (vLLM's `-1`): scheduled for a padded admission, never accepted,
/// or (async scheduling) standing for a draft the runner proposes after this step is planned.
pub const PLACEHOLDER_TOKEN: u32 = u32::MAX;

/// Per-step scratch state of `schedule()`.
#[derive(Debug, Default)]
struct StepScratch {
    /// Tokens scheduled per slot this step (0 = not scheduled).
    scheduled: Vec<u32>,
    /// Entry kind per slot.
    kind: Vec<Option<EntryKind>>,
    /// First new block index per slot.
    new_blocks_start: Vec<u32>,
    /// Computed tokens before this step per slot.
    computed_before: Vec<u32>,
    /// Prefix-cached blocks before this step's allocation, per slot.
    cached_before: Vec<u32>,
    /// Draft tokens scheduled per slot: the first ones of the request's `spec_token_ids`,
    /// which keep them until `finish_step` copies them out.
    num_spec: Vec<u32>,
    /// Position in this step's scheduling order, per scheduled slot.
    rank: Vec<u32>,
    hits: Vec<u32>,
    /// `update_from_output`'s second pass: (rank, slot, tokens done) of requests with blocks
    /// to cache.
    to_cache: Vec<(u32, u32, usize)>,
}

impl StepScratch {
    fn ensure(&mut self, num_slots: usize) {
        if self.scheduled.len() < num_slots {
            self.scheduled.resize(num_slots, 0);
            self.kind.resize(num_slots, None);
            self.new_blocks_start.resize(num_slots, 0);
            self.computed_before.resize(num_slots, 0);
            self.cached_before.resize(num_slots, 0);
            self.num_spec.resize(num_slots, 0);
            self.rank.resize(num_slots, 0);
        }
    }

    fn unschedule(&mut self, slot: u32) {
        let s = slot as usize;
        if s < self.scheduled.len() {
            self.scheduled[s] = 0;
            self.kind[s] = None;
            self.num_spec[s] = 0;
        }
    }
}

/// The scheduler.
#[derive(Debug)]
pub struct Scheduler {
    config: SchedulerConfig,
    kv: KvCacheManager,
    hasher: Option<BlockHasher>,
    store: RequestStore,
    waiting: WaitingQueue,
    running: Vec<u32>,
    rows: BatchRows,
    finished_ids: Vec<String>,
    in_flight: VecDeque<InFlightStep>,
    next_step_id: u64,
    next_arrival_seq: u64,
    stats: SchedulerStats,
    scratch: StepScratch,
    uid: u64,
    /// What `schedule()` may schedule (vLLM's pause states).
    pause: PauseState,
    /// In-flight entries marked `drop_output`.
    num_dropped_in_flight: usize,
    /// Requests preempted outside `schedule()`, reported with the next step.
    preempted_between_steps: Vec<String>,
    /// Ids of the steps abandoned with `abandon_step` (their output is refused).
    abandoned_steps: Vec<u64>,
    /// Requests the scheduler ended on its own, reported by the next `update_from_output`.
    ended_unreported: Vec<EndedRequest>,
    /// Waiting requests marked `deferred`.
    num_deferred: usize,
    /// Held requests (`set_admission_hold`) the last `schedule()` passed over, in order.
    held_passed_over: Vec<u32>,
    /// When steps hold prefills back (`cadence.rs`).
    cadence: PrefillCadence,
}

/// Source of scheduler identities, so an output is never applied to another scheduler.
static NEXT_SCHEDULER_UID: AtomicU64 = AtomicU64::new(1);

impl Scheduler {
    /// A scheduler with an empty pool.
    pub fn new(config: SchedulerConfig) -> CoreResult<Self> {
        config.validate()?;
        let mut kv = KvCacheManager::new(
            config.num_blocks,
            config.block_size,
            config.max_model_len,
            config.enable_prefix_caching,
        )?;
        kv.set_verify_hits(config.verify_prefix_hits)?;
        kv.set_drop_last_hit_block(config.drop_last_hit_block);
        kv.set_hash_lookahead_tokens(config.hash_lookahead_tokens);
        let hasher = config.enable_prefix_caching.then(|| {
            BlockHasher::new(config.hash_algo, config.block_size, &config.hash_seed)
                .with_lookahead(config.hash_lookahead_tokens)
        });
        kv.set_kv_events(config.kv_events);
        let rows = BatchRows::new(config.max_num_seqs, config.block_table_width())?;
        let stats = SchedulerStats {
            num_accepted_tokens_per_pos: vec![0; config.num_speculative_tokens],
            num_drafts_by_count: vec![0; config.num_speculative_tokens + 1],
            ..Default::default()
        };
        let cadence = PrefillCadence::new(config.local_prefill_interval);
        Ok(Self {
            waiting: WaitingQueue::new(config.policy),
            config,
            kv,
            hasher,
            store: RequestStore::default(),
            running: Vec::new(),
            rows,
            finished_ids: Vec::new(),
            in_flight: VecDeque::new(),
            next_step_id: 0,
            next_arrival_seq: 0,
            stats,
            scratch: StepScratch::default(),
            uid: NEXT_SCHEDULER_UID.fetch_add(1, Ordering::Relaxed),
            pause: PauseState::Unpaused,
            num_dropped_in_flight: 0,
            preempted_between_steps: Vec::new(),
            abandoned_steps: Vec::new(),
            ended_unreported: Vec::new(),
            num_deferred: 0,
            held_passed_over: Vec::new(),
            cadence,
        })
    }

    /// Identity of this scheduler (unique in the process); carried by its step outputs.
    pub fn uid(&self) -> u64 {
        self.uid
    }

    /// The configuration.
    pub fn config(&self) -> &SchedulerConfig {
        &self.config
    }

    /// The KV-cache manager (read-only).
    pub fn kv(&self) -> &KvCacheManager {
        &self.kv
    }

    /// The persistent block table; rows `[0, n)` are the last step's batch.
    pub fn block_table(&self) -> &BlockTable {
        self.rows.table()
    }

    /// Starts journaling the block table's changes, so a snapshot of any journaled version can
    /// be made later ([`crate::table_snapshot`]); the caller trims the journal.
    pub fn enable_block_table_journal(&mut self) {
        self.rows.table_journal_mut().enable();
    }

    /// Drops the block table's journaled changes before `version`.
    pub fn trim_block_table_journal(&mut self, version: u64) {
        self.rows.table_journal_mut().trim(version);
    }

    /// Counters.
    pub fn stats(&self) -> &SchedulerStats {
        &self.stats
    }

    /// Prefix-cache lookup counters.
    pub fn prefix_cache_stats(&self) -> PrefixCacheStats {
        self.kv.prefix_cache_stats()
    }

    /// The lookahead the policy in use gives a running request.
    pub fn lookahead_tokens(&self) -> usize {
        self.lookahead_for(AllocationKind::Running)
    }

    fn lookahead_for(&self, kind: AllocationKind) -> usize {
        lookahead_tokens(
            self.config.spec_method,
            self.config.num_speculative_tokens,
            self.config.lookahead_policy,
            kind,
        )
    }

    /// Live requests.
    pub fn requests(&self) -> &RequestStore {
        &self.store
    }

    /// Slot of a live request.
    pub fn slot_of(&self, request_id: &str) -> Option<u32> {
        self.store.slot_of(request_id)
    }

    /// Running requests (slots) in running order.
    pub fn running(&self) -> &[u32] {
        &self.running
    }

    /// Number of waiting (incl. preempted) requests.
    pub fn num_waiting(&self) -> usize {
        self.waiting.len()
    }

    /// Waiting requests passed over at admission since they last ran or arrived (vLLM's
    /// `num_skipped_waiting_reqs`): held back by `max_loras`, or by their stale output.
    pub fn num_deferred_waiting(&self) -> usize {
        self.num_deferred
    }

    /// Waiting slots in admission order.
    pub fn waiting_in_order(&self) -> Vec<u32> {
        self.waiting.handles_in_order()
    }

    /// Requests not yet finished.
    pub fn num_unfinished(&self) -> usize {
        self.store.len()
    }

    /// Validates and enqueues a request; returns its slot.
    pub fn add_request(&mut self, spec: RequestSpec) -> CoreResult<u32> {
        crate::fault::hit("add_request.begin")?;
        if spec.request_id.is_empty() {
            return Err(invalid!("request_id must be a non-empty string"));
        }
        if self.store.slot_of(&spec.request_id).is_some() {
            return Err(CoreError::DuplicateRequest(spec.request_id));
        }
        if spec.prompt_token_ids.is_empty() {
            return Err(invalid!(
                "request {:?}: prompt_token_ids must not be empty",
                spec.request_id
            ));
        }
        if spec.prompt_token_ids.len() > self.config.max_model_len {
            return Err(CoreError::TooLong(format!(
                "request {:?}: prompt of {} tokens exceeds max_model_len {}",
                spec.request_id,
                spec.prompt_token_ids.len(),
                self.config.max_model_len
            )));
        }
        // Its last prefill step writes the whole prompt plus the method's lookahead; a request
        // the whole pool cannot hold would wait at the queue head forever.
        let lookahead = self.lookahead_for(AllocationKind::Admission {
            num_computed_tokens: 0,
        });
        let slots = (spec.prompt_token_ids.len() + lookahead).min(self.config.max_model_len);
        let prompt_blocks = slots.div_ceil(self.config.block_size);
        if prompt_blocks > self.kv.pool().num_usable_blocks() {
            return Err(CoreError::OutOfBlocks(format!(
                "request {:?}: its prompt ({} tokens) plus {lookahead} lookahead slots needs \
                 {prompt_blocks} KV blocks but the pool has only {}",
                spec.request_id,
                spec.prompt_token_ids.len(),
                self.kv.pool().num_usable_blocks()
            )));
        }
        if spec.max_tokens == 0 {
            return Err(invalid!(
                "request {:?}: max_tokens must be >= 1",
                spec.request_id
            ));
        }
        if !spec.arrival_time.is_finite() {
            return Err(invalid!(
                "request {:?}: arrival_time must be finite",
                spec.request_id
            ));
        }
        let seq = self.next_arrival_seq;
        self.next_arrival_seq += 1;
        let request = Request::new(spec, seq, self.hasher.as_ref(), self.config.max_model_len);
        let key = priority_key(&request);
        let slot = self.store.insert(request)?;
        self.waiting.push_back(slot, key);
        Ok(slot)
    }

    /// Installs draft tokens for the next step; ignores unknown, finished, waiting and
    /// prefill-chunk requests. Returns how many requests took drafts. More than K drafts for any
    /// request is refused (`InvalidArgument`) and installs nothing.
    pub fn update_draft_token_ids<'a, I>(&mut self, drafts: I) -> CoreResult<usize>
    where
        I: IntoIterator<Item = (&'a str, &'a [u32])>,
        I::IntoIter: Clone,
    {
        let drafts = drafts.into_iter();
        let k = self.config.num_speculative_tokens;
        if let Some((id, tokens)) = drafts.clone().find(|(_, t)| t.len() > k) {
            return Err(invalid!(
                "request {id:?} got {} draft tokens but at most K = {k} can be verified",
                tokens.len()
            ));
        }
        let mut applied = 0;
        for (id, tokens) in drafts {
            let Some(slot) = self.store.slot_of(id) else {
                continue;
            };
            if let Ok(r) = self.store.get_mut(slot) {
                if r.status == RequestStatus::Running && !r.is_prefill_chunk {
                    r.spec_token_ids.clear();
                    r.spec_token_ids.extend_from_slice(tokens);
                    applied += 1;
                }
            }
        }
        Ok(applied)
    }

    /// Draft tokens for a step's batch, given as (slot, generation) per entry, in batch order;
    /// entry `i` gets the next `counts[i]` tokens. Same filtering as
    /// [`Self::update_draft_token_ids`]; entries whose request is gone are skipped.
    pub fn update_draft_token_ids_for_slots(
        &mut self,
        slots: &[(u32, u32)],
        tokens: &[u32],
        counts: &[u32],
    ) -> CoreResult<usize> {
        if slots.len() != counts.len() {
            return Err(invalid!(
                "{} requests but {} draft counts",
                slots.len(),
                counts.len()
            ));
        }
        let total: usize = counts.iter().map(|&c| c as usize).sum();
        if total != tokens.len() {
            return Err(invalid!(
                "draft counts sum to {total} but {} draft tokens were given",
                tokens.len()
            ));
        }
        let k = self.config.num_speculative_tokens;
        if let Some(i) = counts.iter().position(|&c| c as usize > k) {
            return Err(invalid!(
                "the request at batch index {i} got {} draft tokens but at most K = {k} can be \
                 verified",
                counts[i]
            ));
        }
        let mut applied = 0;
        let mut start = 0;
        for (i, (&(slot, generation), &count)) in slots.iter().zip(counts).enumerate() {
            if let Some(&(ahead, _)) = slots.get(i + crate::prefetch::RECORD_DISTANCE) {
                self.store.prefetch_for_drafts(ahead);
            }
            let end = start + count as usize;
            if let Some(r) = self.store.get_mut_if_current(slot, generation) {
                if r.status == RequestStatus::Running && !r.is_prefill_chunk {
                    r.spec_token_ids.clear();
                    r.spec_token_ids.extend_from_slice(&tokens[start..end]);
                    applied += 1;
                }
            }
            start = end;
        }
        Ok(applied)
    }

    /// Plans one step into `out`.
    ///
    /// Refused (`State`, nothing changed; unless `refuse_idle_steps` is off) when the step
    /// would be idle (no request scheduled, no finished or preempted id to report) while as
    /// many steps await their output as the mode's engine keeps in flight ([`Self::max_steps_in_flight`]): everything runnable waits
    /// for those outputs, which the engine must apply with `update_from_output` or give up
    /// with [`Self::abandon_step`]. An idle step with fewer steps in flight is legal (vLLM's
    /// batch queue asks for one while a step runs), and so is a step that schedules something
    /// beyond the limit (vLLM's scheduler plans a step while others run, as with pipelining).
    pub fn schedule(&mut self, out: &mut StepOutput) -> CoreResult<()> {
        self.schedule_throttled(out, false)
    }

    /// [`Self::schedule`], holding prefills back if `throttle_prefills` (vLLM's
    /// `schedule(throttle_prefills=True)`, set by its data-parallel engine core between
    /// cadence-aligned steps): running requests keep decoding, prefill chunks and admissions
    /// that need a prefill wait, unless nothing is decoding or the last release left the queue
    /// backed up (`cadence.rs`). The local cadence
    /// ([`SchedulerConfig::local_prefill_interval`]) holds prefills back the same way.
    pub fn schedule_throttled(
        &mut self,
        out: &mut StepOutput,
        throttle_prefills: bool,
    ) -> CoreResult<()> {
        crate::fault::hit("schedule.begin")?;
        out.clear();
        self.held_passed_over.clear();
        let at_limit =
            self.config.refuse_idle_steps && self.in_flight.len() >= self.max_steps_in_flight();
        let lookups_before = at_limit.then(|| self.kv.prefix_cache_stats());
        self.scratch.ensure(self.store_capacity());
        let mut budget = StepBudget::new(
            self.config.max_num_batched_tokens,
            self.config.draft_slots_per_request,
        );
        if self.pause == PauseState::PausedAll {
            budget.tokens = 0; // vLLM: a step that schedules nothing but reports finished ids
        }
        let mut scheduled_order: Vec<u32> = Vec::with_capacity(self.running.len());
        let mut preempted_any = false;
        let mut prefills = StepPrefills {
            hold: self
                .cadence
                .holds_back(throttle_prefills, || self.any_running_decode()),
            ..Default::default()
        };

        prefills.scheduled = self.schedule_running(
            &mut budget,
            &mut scheduled_order,
            &mut preempted_any,
            prefills.hold,
            out,
        )?;
        crate::fault::hit("schedule.after_running")?;
        if !preempted_any && self.pause != PauseState::PausedAll {
            if self.pause == PauseState::Unpaused {
                prefills.admitted =
                    self.schedule_waiting(&mut budget, &mut scheduled_order, prefills)?;
            }
            if !prefills.hold {
                // vLLM records whether this release left admissible requests waiting (under
                // PAUSED_NEW too, where it admits nobody).
                prefills.capacity_bound = Some(self.waiting.len() > self.num_deferred);
            }
        }
        if let Some(lookups) = lookups_before {
            let idle = scheduled_order.is_empty()
                && out.preempted_req_ids.is_empty()
                && self.finished_ids.is_empty()
                && self.preempted_between_steps.is_empty();
            if idle {
                // Admission lookups that led nowhere are all this planning changed.
                self.kv.set_prefix_cache_stats(lookups);
                return Err(self.idle_step_error());
            }
        }
        self.cadence.end_step(prefills, !scheduled_order.is_empty());
        self.finish_step(out, scheduled_order)?;
        out.preempted_req_ids
            .append(&mut self.preempted_between_steps);
        Ok(())
    }

    /// Whether some running request is past its prefill (vLLM's `any(not r.is_prefill_chunk
    /// for r in running)`): only then may a step hold prefills back.
    fn any_running_decode(&self) -> bool {
        self.running
            .iter()
            .any(|&slot| self.store.get(slot).is_ok_and(|r| !r.is_prefill_chunk))
    }

    /// vLLM's `prefill_capacity_bound`: the last step that did not hold prefills back left
    /// requests waiting that it could have admitted, so no step holds back until one drains
    /// the queue (`cadence.rs`).
    pub fn prefill_capacity_bound(&self) -> bool {
        self.cadence.capacity_bound()
    }

    /// Steps awaiting output from which an idle `schedule()` is refused: vLLM's engine keeps
    /// one step in flight in sync mode, and two (its batch queue) with async scheduling.
    pub fn max_steps_in_flight(&self) -> usize {
        if self.config.async_scheduling {
            2
        } else {
            1
        }
    }

    /// The error of an idle step planned at the in-flight limit: what is pending.
    fn idle_step_error(&self) -> CoreError {
        let pending: Vec<String> = self
            .in_flight
            .iter()
            .map(|s| format!("step {} ({} requests)", s.step_id, s.entries.len()))
            .collect();
        CoreError::State(format!(
            "nothing to schedule until an output arrives: {} {} awaiting output ({} allows {} \
             in flight); apply the oldest with update_from_output, or abandon it with \
             abandon_step if it is lost",
            pending.join(", "),
            if pending.len() == 1 { "is" } else { "are" },
            if self.config.async_scheduling {
                "async scheduling"
            } else {
                "sync scheduling"
            },
            self.max_steps_in_flight(),
        ))
    }

    fn store_capacity(&self) -> usize {
        self.store.capacity()
    }

    /// Phase A: running requests, in running order. Returns whether a request in the middle of
    /// its prefill was scheduled.
    fn schedule_running(
        &mut self,
        budget: &mut StepBudget,
        scheduled_order: &mut Vec<u32>,
        preempted_any: &mut bool,
        hold_prefills: bool,
        out: &mut StepOutput,
    ) -> CoreResult<bool> {
        let mut prefill_scheduled = false;
        let lookahead = self.lookahead_for(AllocationKind::Running);
        let threshold = self.config.long_prefill_token_threshold;
        let max_model_len = self.config.max_model_len;
        let mut index = 0;
        while index < self.running.len() && budget.can_schedule() {
            // Running order mostly follows row order: the row a few requests ahead is where a
            // new block of theirs will be written (a hint; a wrong row costs nothing).
            self.rows.prefetch_append(index + crate::prefetch::DISTANCE);
            let slot = self.running[index];
            let r = self.store.get(slot)?;
            if r.in_flight_reaches_max_tokens() || (hold_prefills && r.is_prefill_chunk) {
                // Held back: its next prefill chunk waits for a step that carries prefills.
                index += 1;
                continue;
            }
            let computed = r.num_computed_tokens;
            let placeholders = r.num_output_placeholders;
            let mut num_new =
                (r.num_tokens() + r.spec_token_ids.len() + placeholders).saturating_sub(computed);
            if threshold > 0 && num_new > threshold {
                num_new = threshold;
            }
            // Every input position stays <= max_model_len - 2 (room for the sampled token), but
            // the known tokens may always be computed: a prompt of exactly max_model_len must
            // finish its prefill instead of waiting forever for its last token.
            let length_cap = max_model_len
                .saturating_sub(1 + computed)
                .max(r.num_tokens().saturating_sub(computed));
            num_new = num_new.min(budget.cap()).min(length_cap);
            if num_new == 0 {
                index += 1;
                continue;
            }
            let mut allocated = None;
            self.scratch.cached_before[slot as usize] = r.blocks.num_cached_blocks as u32;
            loop {
                let r = self.store.get_mut(slot)?;
                let args = AllocateArgs {
                    num_new_tokens: num_new,
                    num_computed_tokens: computed,
                    num_lookahead_tokens: lookahead,
                    ..Default::default()
                };
                let seq = crate::kv_manager::SequenceView {
                    tokens: &r.tokens,
                    block_hashes: &r.block_hashes,
                    extra: &r.spec.extra,
                };
                if let Some(first_new) = self.kv.allocate_slots(&mut r.blocks, seq, args)? {
                    if self.kv.kv_events_on() {
                        self.kv.attribute_kv_events(&r.spec.request_id);
                    }
                    allocated = Some(first_new);
                    break;
                }
                if self.running.len() == 1 {
                    // Alone and still short: the pool can never hold this request. End it
                    // instead of letting it preempt itself forever.
                    self.end_unservable(slot)?;
                    break;
                }
                let victim_index = self.pick_victim()?;
                let victim = self.running.remove(victim_index);
                *preempted_any = true;
                if victim_index < index {
                    // Priority policy: the victim was already scheduled this step; undo it, and
                    // take back the prefix-cache entries it registered for KV never computed.
                    budget.give_back(self.scratch.scheduled[victim as usize] as usize);
                    let cached_before = self.scratch.cached_before[victim as usize] as usize;
                    self.scratch.unschedule(victim);
                    scheduled_order.retain(|&s| s != victim);
                    index -= 1;
                    let v = self.store.get_mut(victim)?;
                    self.kv.uncache_blocks(&mut v.blocks, cached_before);
                }
                self.preempt(victim, out)?;
                if victim == slot {
                    break;
                }
            }
            let Some(first_new) = allocated else {
                if self.store.slot_of_generation(slot).is_none() {
                    // Ended above: the pool can never hold it; `running` is empty now.
                    break;
                }
                if self.config.policy == Policy::Priority
                    && self.config.vllm_semantics == VllmSemantics::V0_33
                {
                    // The current request preempted itself; try the next one (vLLM 0.33; 0.32
                    // ends the running phase here).
                    continue;
                }
                break;
            };
            if let Some(row) = self.store.row(slot) {
                let r = self.store.get(slot)?;
                self.rows
                    .append(row as usize, &r.blocks.block_ids[first_new..]);
            }
            let r = self.store.get_mut(slot)?;
            let s = slot as usize;
            self.scratch.scheduled[s] = num_new as u32;
            self.scratch.kind[s] = Some(EntryKind::Running);
            self.scratch.new_blocks_start[s] = first_new as u32;
            self.scratch.computed_before[s] = computed as u32;
            let num_spec = (num_new + computed).saturating_sub(r.num_tokens() + placeholders);
            r.spec_token_ids.truncate(num_spec);
            self.scratch.num_spec[s] = r.spec_token_ids.len() as u32;
            prefill_scheduled |= r.is_prefill_chunk;
            scheduled_order.push(slot);
            budget.take(num_new);
            index += 1;
        }
        Ok(prefill_scheduled)
    }

    /// Index in `running` of the request to preempt.
    fn pick_victim(&self) -> CoreResult<usize> {
        if self.running.is_empty() {
            return Err(broken!(
                "allocation failed with no running request to preempt"
            ));
        }
        match self.config.policy {
            Policy::Fcfs => Ok(self.running.len() - 1),
            Policy::Priority => {
                let mut best = 0;
                let mut best_key = priority_key(self.store.get(self.running[0])?);
                for (i, &slot) in self.running.iter().enumerate().skip(1) {
                    let key = priority_key(self.store.get(slot)?);
                    // Largest key = lowest priority, latest arrival.
                    if key.cmp_key(&best_key).is_ge() {
                        best = i;
                        best_key = key;
                    }
                }
                Ok(best)
            }
        }
    }

    /// Recompute preemption: free the blocks (full ones stay cached), reset progress, back to
    /// the front of the waiting queue. The caller already removed it from `running`.
    fn preempt(&mut self, slot: u32, out: &mut StepOutput) -> CoreResult<()> {
        self.keep_dropping_stale_output(slot);
        self.rows.remove(&mut self.store, slot);
        let r = self.store.get_mut(slot)?;
        self.kv.free(&mut r.blocks);
        r.status = RequestStatus::Preempted;
        r.num_computed_tokens = 0;
        r.num_output_placeholders = 0;
        r.spec_token_ids.clear();
        r.is_prefill_chunk = false;
        r.num_preemptions += 1;
        out.preempted_req_ids.push(r.spec.request_id.clone());
        let key = priority_key(r);
        self.waiting.push_front(slot, key);
        self.stats.num_preemptions += 1;
        Ok(())
    }

    /// Phase B: waiting requests, strict FCFS (or priority) admission. A preempted request
    /// whose stale output is still in flight is passed over and keeps its place. Returns
    /// whether a request was admitted with more than one token left to compute (a prefill).
    fn schedule_waiting(
        &mut self,
        budget: &mut StepBudget,
        scheduled_order: &mut Vec<u32>,
        prefills: StepPrefills,
    ) -> CoreResult<bool> {
        let mut passed_over = Vec::new();
        let result = self.admit_waiting(budget, scheduled_order, prefills, &mut passed_over);
        for &slot in passed_over.iter().rev() {
            let key = priority_key(self.store.get(slot)?);
            self.waiting.push_front(slot, key);
        }
        result
    }

    fn admit_waiting(
        &mut self,
        budget: &mut StepBudget,
        scheduled_order: &mut Vec<u32>,
        prefills: StepPrefills,
        passed_over: &mut Vec<u32>,
    ) -> CoreResult<bool> {
        let prefill_scheduled = prefills.scheduled;
        let mut prefill_admitted = false;
        let threshold = self.config.long_prefill_token_threshold;
        let k = self.config.num_speculative_tokens;
        let num_running_scheduled = scheduled_order.len();
        // The LoRA adapters of the step's requests, built at the first waiting LoRA request.
        let mut scheduled_loras: Option<Vec<u32>> = None;
        while budget.can_schedule() && self.running.len() < self.config.max_num_seqs {
            let Some(slot) = self.waiting.peek() else {
                break;
            };
            let r = self.store.get(slot)?;
            if r.admission_hold {
                // As vLLM's blocked statuses (a grammar still compiling): checked first.
                self.held_passed_over.push(slot);
                self.pass_over(slot, passed_over)?;
                continue;
            }
            if r.status == RequestStatus::Preempted
                && r.num_in_flight_tokens > 0
                && !self.drops_stale_output(slot)
            {
                // As vLLM 0.33: output of a step scheduled before its preemption is still to
                // come; resuming now could recompute positions that output delivers later.
                // (Output to be dropped delivers nothing: such a request resumes at once.)
                self.pass_over(slot, passed_over)?;
                continue;
            }
            let lora_id = if self.config.max_loras > 0 {
                r.spec.lora_id
            } else {
                0
            };
            if lora_id != 0 {
                if scheduled_loras.is_none() {
                    // vLLM 0.33 counts every running request's adapter (an unscheduled one may
                    // join a later batch); 0.32 those of the running requests it scheduled.
                    let counted = match self.config.vllm_semantics {
                        VllmSemantics::V0_32 => scheduled_order.as_slice(),
                        VllmSemantics::V0_33 => self.running.as_slice(),
                    };
                    scheduled_loras = Some(self.loras_of(counted)?);
                }
                let max_loras = self.config.max_loras;
                let at_limit = scheduled_loras
                    .as_ref()
                    .is_some_and(|l| l.len() >= max_loras && !l.contains(&lora_id));
                if at_limit {
                    // As vLLM: admitting it would exceed max_loras; it keeps its place.
                    self.pass_over(slot, passed_over)?;
                    continue;
                }
            }
            let r = self.store.get(slot)?;
            let computed_before_hits = r.num_computed_tokens;
            let reads_cache = !r.spec.skip_reading_prefix_cache;
            let hit_tokens = if reads_cache {
                self.kv
                    .get_computed_blocks(r.sequence(), &mut self.scratch.hits)
            } else {
                self.scratch.hits.clear();
                0
            };
            // vLLM's rule for a prefill: more than one token left after the hit.
            let needs_prefill = hit_tokens + 1 < r.num_tokens();
            if prefills.hold && needs_prefill {
                break; // held back until a step that carries prefills (`cadence.rs`)
            }
            let mut num_new = r.num_tokens() - hit_tokens;
            // vLLM 0.33 (opt-in here): an admission with one token left to compute (a resume, a
            // full prefix hit) joins a decode batch as a uniform 1 + K decode with K placeholder
            // drafts, so the batch keeps one shape (CUDA graphs).
            let pad = self.config.pad_admitted_decodes
                && k > 0
                && num_new == 1
                && !prefill_scheduled
                && (num_running_scheduled > 0 || hit_tokens > 0)
                && hit_tokens + 1 + k < self.config.max_model_len // room for the sampled token
                && (threshold == 0 || threshold > k);
            let cap = budget.cap();
            let pad = pad && {
                if 1 + k > cap && num_running_scheduled > 0 {
                    break; // vLLM: rather not schedule it than schedule it unpadded
                }
                // Alone, a budget below 1 + K would block it forever: schedule it unpadded.
                k < cap
            };
            if pad {
                num_new = 1 + k;
            }
            if threshold > 0 && num_new > threshold {
                num_new = threshold;
            }
            if !self.config.enable_chunked_prefill && num_new > cap {
                break;
            }
            num_new = num_new.min(cap);
            let lookahead = self.lookahead_for(AllocationKind::Admission {
                num_computed_tokens: computed_before_hits,
            });
            let r = self.store.get_mut(slot)?;
            let seq = crate::kv_manager::SequenceView {
                tokens: &r.tokens,
                block_hashes: &r.block_hashes,
                extra: &r.spec.extra,
            };
            let args = AllocateArgs {
                num_new_tokens: num_new,
                num_computed_tokens: 0,
                num_new_computed_tokens: hit_tokens,
                new_computed_blocks: &self.scratch.hits,
                num_lookahead_tokens: lookahead,
                full_sequence_must_fit: true,
            };
            // The hits come from `get_computed_blocks` on this sequence above, and nothing has
            // changed the pool since.
            if self
                .kv
                .allocate_slots_after_lookup(&mut r.blocks, seq, args)?
                .is_none()
            {
                if self.running.is_empty() {
                    // Nothing holds a block, yet it does not fit (a resumed request that grew
                    // past the pool): it never will. End it rather than block the queue.
                    self.end_unservable(slot)?;
                    continue;
                }
                break;
            }
            if self.kv.kv_events_on() {
                self.kv.attribute_kv_events(&r.spec.request_id);
            }
            self.waiting.pop();
            if r.deferred {
                r.deferred = false;
                self.num_deferred -= 1;
            }
            let kind = if r.status == RequestStatus::Preempted {
                EntryKind::Resumed
            } else {
                EntryKind::New
            };
            if let Some(loras) = scheduled_loras.as_mut().filter(|_| lora_id != 0) {
                if !loras.contains(&lora_id) {
                    loras.push(lora_id);
                }
            }
            if self.config.enable_prefix_caching && reads_cache {
                let stats = if r.num_preemptions > 0 {
                    &mut self.stats.resumed_prefix
                } else {
                    &mut self.stats.admitted_prefix
                };
                stats.requests += 1;
                stats.queries += r.num_tokens() as u64;
                stats.hits += hit_tokens as u64;
            }
            r.status = RequestStatus::Running;
            r.num_computed_tokens = hit_tokens;
            let blocks = std::mem::take(&mut r.blocks.block_ids);
            self.rows.add(&mut self.store, slot, &blocks);
            self.store.get_mut(slot)?.blocks.block_ids = blocks;
            self.running.push(slot);
            let s = slot as usize;
            self.scratch.scheduled[s] = num_new as u32;
            self.scratch.kind[s] = Some(kind);
            self.scratch.new_blocks_start[s] = 0;
            self.scratch.computed_before[s] = hit_tokens as u32;
            self.scratch.cached_before[s] = (hit_tokens / self.config.block_size) as u32;
            let r = self.store.get_mut(slot)?;
            r.spec_token_ids.clear();
            if pad {
                r.spec_token_ids.resize(k, PLACEHOLDER_TOKEN);
            }
            self.scratch.num_spec[s] = r.spec_token_ids.len() as u32;
            scheduled_order.push(slot);
            budget.take(num_new);
            prefill_admitted |= needs_prefill;
        }
        Ok(prefill_admitted)
    }

    /// Takes the queue head `slot` out for this step (it goes back to the front after it),
    /// marking it deferred.
    fn pass_over(&mut self, slot: u32, passed_over: &mut Vec<u32>) -> CoreResult<()> {
        self.waiting.pop();
        passed_over.push(slot);
        let r = self.store.get_mut(slot)?;
        if !r.deferred {
            r.deferred = true;
            self.num_deferred += 1;
        }
        Ok(())
    }

    /// The distinct LoRA adapters (ids) of the requests in `slots`.
    fn loras_of(&self, scheduled: &[u32]) -> CoreResult<Vec<u32>> {
        let mut loras = Vec::new();
        for &slot in scheduled {
            let id = self.store.get(slot)?.spec.lora_id;
            if id != 0 && !loras.contains(&id) {
                loras.push(id);
            }
        }
        Ok(loras)
    }

    /// Phase C: lay the batch out in the block table, fill `out`, advance computed tokens.
    fn finish_step(&mut self, out: &mut StepOutput, scheduled_order: Vec<u32>) -> CoreResult<()> {
        let scheduled = &self.scratch.scheduled;
        self.rows.partition_scheduled(&mut self.store, |slot| {
            scheduled.get(slot as usize).is_some_and(|&n| n > 0)
        });
        debug_assert_eq!(
            self.rows
                .owners()
                .iter()
                .take_while(|&&s| self.scratch.scheduled[s as usize] > 0)
                .count(),
            scheduled_order.len()
        );
        let step_id = self.next_step_id;
        self.next_step_id += 1;
        out.step_id = step_id;
        out.num_lookahead_tokens = self.lookahead_tokens();
        for (rank, &slot) in scheduled_order.iter().enumerate() {
            self.scratch.rank[slot as usize] = rank as u32;
        }
        let n = scheduled_order.len();
        let StepOutput {
            slots,
            kinds,
            num_scheduled_tokens,
            num_computed_tokens,
            num_output_placeholders,
            query_start_loc,
            is_prefill_chunk,
            new_block_ids,
            num_new_blocks,
            generations,
            spec_token_ids,
            num_spec_tokens,
            ..
        } = out;
        // Columns that come from the step's scratch arrays, one tight pass each; then one pass
        // over the requests for what their records hold.
        slots.extend_from_slice(&self.rows.owners()[..n]);
        let scratch = &self.scratch;
        for &slot in slots.iter() {
            kinds.push(
                scratch.kind[slot as usize]
                    .ok_or_else(|| broken!("scheduled slot {slot} without kind"))?,
            );
        }
        num_scheduled_tokens.extend(slots.iter().map(|&s| scratch.scheduled[s as usize] as i32));
        num_computed_tokens.extend(
            slots
                .iter()
                .map(|&s| scratch.computed_before[s as usize] as i32),
        );
        num_spec_tokens.extend(slots.iter().map(|&s| scratch.num_spec[s as usize]));
        query_start_loc.push(0);
        let mut total = 0i32;
        query_start_loc.extend(num_scheduled_tokens.iter().map(|&t| {
            total += t;
            total
        }));
        let mut entries = Vec::with_capacity(n);
        for &slot in slots.iter() {
            let s = slot as usize;
            let num_new = self.scratch.scheduled[s] as usize;
            let num_spec = self.scratch.num_spec[s] as usize;
            let generation = self.store.generation(slot);
            let r = self.store.get_mut(slot)?;
            r.num_computed_tokens += num_new;
            r.num_in_flight_tokens += num_new;
            let was_prefill_chunk = r.is_prefill_chunk;
            r.is_prefill_chunk = r.num_computed_tokens < r.num_tokens() + r.num_output_placeholders;
            num_output_placeholders.push(r.num_output_placeholders as u32);
            is_prefill_chunk.push(r.is_prefill_chunk);
            let new_blocks = &r.blocks.block_ids[self.scratch.new_blocks_start[s] as usize..];
            new_block_ids.extend_from_slice(new_blocks);
            num_new_blocks.push(new_blocks.len() as u32);
            generations.push(generation);
            let spec = r
                .spec_token_ids
                .get(..num_spec)
                .ok_or_else(|| broken!("scheduled drafts of slot {slot} went missing"))?;
            spec_token_ids.extend_from_slice(spec);
            r.spec_token_ids.clear();
            entries.push(InFlightEntry {
                slot,
                generation,
                rank: self.scratch.rank[s],
                num_spec_tokens: num_spec as u32,
                is_prefill_chunk: r.is_prefill_chunk,
                num_scheduled: num_new as u32,
                preemptions: r.num_preemptions,
                drop_output: false,
                was_prefill_chunk,
                admitted: self.scratch.kind[s] != Some(EntryKind::Running),
                cached_before: self.scratch.cached_before[s],
            });
            if self.config.async_scheduling && !r.is_prefill_chunk {
                add_output_placeholders(r, num_spec, self.config.num_speculative_tokens);
            }
        }
        for &slot in slots.iter() {
            self.scratch.scheduled[slot as usize] = 0;
            self.scratch.kind[slot as usize] = None;
        }
        out.total_num_scheduled_tokens = total as usize;
        out.finished_req_ids.append(&mut self.finished_ids);
        out.scheduler_uid = self.uid;
        if !entries.is_empty() {
            self.in_flight.push_back(InFlightStep { step_id, entries });
        }
        self.stats.num_steps += 1;
        Ok(())
    }

    /// Finishes a live request: out of the queues, blocks freed, id reported once.
    fn finish(&mut self, slot: u32, reason: FinishReason) -> CoreResult<()> {
        let status = self.store.get(slot)?.status;
        match status {
            RequestStatus::Running => {
                if let Some(i) = self.running.iter().position(|&s| s == slot) {
                    self.running.remove(i);
                }
                self.rows.remove(&mut self.store, slot);
            }
            RequestStatus::Waiting | RequestStatus::Preempted => {
                self.waiting.remove(slot);
            }
            RequestStatus::Finished(_) => return Ok(()),
        }
        let mut r = self.store.remove(slot)?;
        if r.deferred {
            self.num_deferred -= 1;
        }
        self.kv.free(&mut r.blocks);
        r.status = RequestStatus::Finished(reason);
        self.finished_ids.push(r.spec.request_id);
        self.stats.num_finished += 1;
        Ok(())
    }

    /// Ends a request the pool can never hold (reason `Error`), reported by the next
    /// `update_from_output`. Only a pool smaller than one `max_model_len` request
    /// (`pool_must_hold_max_model_len` off, the vLLM drop-in) leads here: a pool that holds one
    /// holds any request alone, lookahead included, since allocations stop at `max_model_len`.
    fn end_unservable(&mut self, slot: u32) -> CoreResult<()> {
        let request_id = self.store.get(slot)?.spec.request_id.clone();
        self.finish(slot, FinishReason::Error)?;
        self.ended_unreported.push(EndedRequest {
            request_id,
            finish_reason: FinishReason::Error,
        });
        Ok(())
    }

    /// Finishes the given requests (e.g. aborts); unknown ids are ignored. Returns the ids
    /// actually finished.
    pub fn finish_requests<'a>(
        &mut self,
        ids: impl IntoIterator<Item = &'a str>,
        reason: FinishReason,
    ) -> CoreResult<Vec<String>> {
        let mut done = Vec::new();
        for id in ids {
            if let Some(slot) = self.store.slot_of(id) {
                self.finish(slot, reason)?;
                done.push(id.to_owned());
            }
        }
        Ok(done)
    }

    /// Empties the prefix cache; false while any block is held.
    pub fn reset_prefix_cache(&mut self) -> bool {
        self.kv.reset_prefix_cache()
    }

    /// Takes the KV-cache events recorded since the last call, oldest first (none unless
    /// [`SchedulerConfig::kv_events`] is on).
    pub fn take_kv_events(&mut self) -> Vec<crate::kv_events::KvEvent> {
        self.kv.take_kv_events()
    }
}

/// Async scheduling, after `r` was scheduled in a step that samples: the step's sampled token
/// and its `num_spec` drafts become output placeholders, and the next step gets `k`
/// placeholder drafts (the runner proposes the real ones after this step is planned).
fn add_output_placeholders(r: &mut Request, num_spec: usize, k: usize) {
    r.num_output_placeholders += 1 + num_spec;
    r.spec_token_ids.clear();
    r.spec_token_ids.resize(k, PLACEHOLDER_TOKEN);
}

fn priority_key(r: &Request) -> PriorityKey {
    PriorityKey {
        priority: r.spec.priority,
        arrival_time: r.spec.arrival_time,
        arrival_seq: r.arrival_seq,
    }
}
