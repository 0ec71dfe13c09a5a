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
//!
//! The rooms, in the order a step runs:
//! 1. `admission.rs`: `add_request` validates and enqueues a request.
//! 2. `drafts.rs`: the runner installs draft tokens for the next step.
//! 3. `schedule()` (here) plans the step in three phases, within the step's token budget
//!    (`budget.rs`) and prefill cadence (`cadence.rs`), on per-slot scratch records
//!    (`scratch.rs`):
//!    - A, `running.rs`: running requests get their next tokens; a short pool preempts;
//!    - B, `admission.rs`: waiting requests are admitted (`hold.rs`: those held back);
//!    - C, `layout.rs`: the batch goes into the block table and the step output.
//! 4. `in_flight.rs`: the step awaits its output; `in_flight_limit.rs`: an idle step planned
//!    while as many await theirs as the engine keeps in flight is refused.
//! 5. `update.rs`: the output is applied; `finish.rs` ends stopped, aborted and unservable
//!    requests.
//! 6. `abandon.rs`: or the step is abandoned, its output lost.
//!
//! Around the step: `pause.rs` (pause states, preempting every running request), `stats.rs`
//! (counters), `invariants.rs` (the invariant check).

mod abandon;
mod admission;
mod budget;
mod cadence;
mod drafts;
mod finish;
mod hold;
mod in_flight;
mod in_flight_limit;
mod invariants;
mod layout;
mod pause;
mod running;
mod scratch;
mod stats;
mod update;

pub use pause::PauseState;
pub use stats::SchedulerStats;

use std::collections::VecDeque;
use std::sync::atomic::{AtomicU64, Ordering};

use budget::StepBudget;
use cadence::{PrefillCadence, StepPrefills};
use in_flight::InFlightStep;
use scratch::StepScratch;

use crate::batch::batch_rows::BatchRows;
use crate::batch::block_table::BlockTable;
use crate::config::SchedulerConfig;
use crate::error::CoreResult;
use crate::hashing::BlockHasher;
use crate::kv_manager::{KvCacheManager, PrefixCacheStats};
use crate::lookahead::{lookahead_tokens, AllocationKind};
use crate::output::{EndedRequest, StepOutput};
use crate::requests::queue::WaitingQueue;
use crate::requests::request_store::RequestStore;

/// A placeholder draft token (vLLM's `-1`): scheduled for a padded admission, never accepted,
/// or (async scheduling) standing for a draft the runner proposes after this step is planned.
pub const PLACEHOLDER_TOKEN: u32 = u32::MAX;

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
    /// be made later (`batch::table_snapshot`); the caller trims the journal.
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
        let lookups_before = self.lookups_if_at_limit();
        self.scratch.ensure(self.store_capacity());
        let mut budget = self.step_budget();
        let mut scheduled_order: Vec<u32> = Vec::with_capacity(self.running.len());
        let mut preempted_any = false;
        let mut prefills = StepPrefills {
            hold: self
                .cadence
                .holds_back(throttle_prefills, || self.any_running_decode()),
            ..Default::default()
        };

        // Phase A (`running.rs`).
        prefills.scheduled = self.schedule_running(
            &mut budget,
            &mut scheduled_order,
            &mut preempted_any,
            prefills.hold,
            out,
        )?;
        crate::fault::hit("schedule.after_running")?;
        // Phase B (`admission.rs`): none after a preemption, nor while paused.
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
        self.refuse_idle_step(lookups_before, &scheduled_order, out)?;
        self.cadence.end_step(prefills, !scheduled_order.is_empty());
        // Phase C (`layout.rs`).
        self.finish_step(out, scheduled_order)?;
        out.preempted_req_ids
            .append(&mut self.preempted_between_steps);
        Ok(())
    }

    /// The step's token budget: none while `PausedAll`.
    fn step_budget(&self) -> StepBudget {
        let mut budget = StepBudget::new(
            self.config.max_num_batched_tokens,
            self.config.draft_slots_per_request,
        );
        if self.pause == PauseState::PausedAll {
            budget.tokens = 0; // vLLM: a step that schedules nothing but reports finished ids
        }
        budget
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

    fn store_capacity(&self) -> usize {
        self.store.capacity()
    }

    /// Empties the prefix cache; false while any block is held.
    pub fn reset_prefix_cache(&mut self) -> bool {
        self.kv.reset_prefix_cache()
    }

    /// Takes the KV-cache events recorded since the last call, oldest first (none unless
    /// [`SchedulerConfig::kv_events`] is on).
    pub fn take_kv_events(&mut self) -> Vec<crate::pool::kv_events::KvEvent> {
        self.kv.take_kv_events()
    }
}
