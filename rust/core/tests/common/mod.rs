//! Helpers shared by the scheduler's integration tests (each test file includes this module,
//! so a helper one file does not use is not dead code there).
#![allow(dead_code)]

use dflash_core::{Request, RequestSpec, Scheduler, SpecMethod, StepOutput, UpdateOutput};
use proptest::prelude::*;

/// Submits `id` with a prompt of `prompt_len` tokens distinct from other requests' (EOS is 2;
/// prompts never contain it), arriving after the requests already live.
pub fn add(s: &mut Scheduler, id: &str, prompt_len: usize, max_tokens: usize) {
    let base = 1000 * (s.num_unfinished() as u32 + 1);
    let spec = RequestSpec {
        request_id: id.to_owned(),
        prompt_token_ids: (0..prompt_len as u32).map(|t| base + t).collect(),
        max_tokens,
        eos_token_id: Some(2),
        arrival_time: s.num_unfinished() as f64,
        ..Default::default()
    };
    s.add_request(spec).unwrap();
}

/// The live request `id`.
pub fn req<'a>(s: &'a Scheduler, id: &str) -> &'a Request {
    s.requests().get(s.slot_of(id).unwrap()).unwrap()
}

/// The ids of the requests in `slots`.
pub fn ids(s: &Scheduler, slots: &[u32]) -> Vec<String> {
    slots
        .iter()
        .map(|&slot| s.requests().get(slot).unwrap().spec.request_id.clone())
        .collect()
}

/// One `schedule()`, with the invariants checked after it.
pub fn schedule(s: &mut Scheduler) -> StepOutput {
    let mut out = StepOutput::default();
    s.schedule(&mut out).unwrap();
    s.check_invariants().unwrap();
    out
}

/// Applies `out`'s output: entry `i` samples `sampled(i)` tokens (none for prefill chunks);
/// the invariants are checked after it.
pub fn apply(
    s: &mut Scheduler,
    out: &StepOutput,
    sampled: impl Fn(usize) -> Vec<u32>,
) -> UpdateOutput {
    let (mut tokens, mut counts) = (Vec::new(), Vec::new());
    for i in 0..out.num_reqs() {
        let t = if out.is_prefill_chunk[i] {
            Vec::new()
        } else {
            sampled(i)
        };
        counts.push(t.len() as u32);
        tokens.extend(t);
    }
    let mut upd = UpdateOutput::default();
    s.update_from_output(out.step_id, &tokens, &counts, &mut upd)
        .unwrap();
    s.check_invariants().unwrap();
    upd
}

/// The ownership contract for one step: every position the step writes (its tokens plus the
/// method's lookahead, capped at `max_model_len`) lies in a block of the request's row, and
/// every block of the row is the request's own.
pub fn check_ownership(s: &Scheduler, out: &StepOutput) -> Result<(), String> {
    let required = s.config().required_lookahead();
    let bs = s.config().block_size;
    let table = s.block_table();
    for i in 0..out.num_reqs() {
        let r = s.requests().get(out.slots[i]).map_err(|e| e.to_string())?;
        let end =
            (out.num_computed_tokens[i] as usize + out.num_scheduled_tokens[i] as usize + required)
                .min(s.config().max_model_len);
        let count = table.counts()[i] as usize;
        if end.div_ceil(bs) > count {
            return Err(format!(
                "{} writes up to position {end} but owns only {count} blocks",
                r.spec.request_id
            ));
        }
        for &b in &table.full_row(i)[..count] {
            if b == 0 || !r.blocks.block_ids.contains(&(b as u32)) {
                return Err(format!(
                    "{} maps to block {b} it does not own",
                    r.spec.request_id
                ));
            }
        }
    }
    Ok(())
}

/// A deterministic random stream for a property test case's `seed`.
pub fn rng(seed: u64) -> proptest::test_runner::TestRng {
    let mut bytes = [0u8; 32];
    bytes[..8].copy_from_slice(&seed.to_le_bytes());
    proptest::test_runner::TestRng::from_seed(proptest::test_runner::RngAlgorithm::ChaCha, &bytes)
}

/// A model output for `out` with uniform acceptance: every entry that samples accepts 0..=its
/// drafts plus the bonus token, each token drawn by `token`; prefill chunks sample nothing.
/// Returns (flat tokens, per-entry counts).
pub fn random_output(
    out: &StepOutput,
    rng: &mut proptest::test_runner::TestRng,
    mut token: impl FnMut(&mut proptest::test_runner::TestRng) -> u32,
) -> (Vec<u32>, Vec<u32>) {
    use proptest::prelude::*;
    let (mut tokens, mut counts) = (Vec::new(), Vec::new());
    for i in 0..out.num_reqs() {
        if out.is_prefill_chunk[i] {
            counts.push(0);
            continue;
        }
        let accepted = rng.next_u32() as usize % (out.num_spec_tokens[i] as usize + 1);
        counts.push(accepted as u32 + 1);
        for _ in 0..=accepted {
            tokens.push(token(rng));
        }
    }
    (tokens, counts)
}

/// A random serving run for the scheduler's property tests: the method and K, the pool, how
/// many steps may be in flight, the requests (prompt length, max tokens) and the seed of the
/// outputs.
#[derive(Debug, Clone)]
pub struct Workload {
    pub async_scheduling: bool,
    pub method: SpecMethod,
    pub k: usize,
    pub num_blocks: usize,
    pub in_flight: usize,
    pub prompts: Vec<(usize, usize)>,
    pub seed: u64,
}

/// Workloads with K in `1..=max_k` (0 without speculation), fewer than `max_requests`
/// requests, and async scheduling with probability `async_share`.
pub fn workload(
    max_k: usize,
    max_requests: usize,
    async_share: f64,
) -> impl Strategy<Value = Workload> {
    (
        prop::sample::select(vec![
            SpecMethod::DFlash,
            SpecMethod::Eagle,
            SpecMethod::Ngram,
            SpecMethod::None,
        ]),
        1usize..=max_k,
        12usize..40,
        1usize..=3,
        prop::collection::vec((1usize..120, 1usize..60), 1..max_requests),
        any::<u64>(),
        prop::bool::weighted(async_share),
    )
        .prop_map(
            |(method, k, num_blocks, in_flight, prompts, seed, async_scheduling)| Workload {
                async_scheduling,
                method,
                k: if method == SpecMethod::None { 0 } else { k },
                num_blocks,
                in_flight,
                prompts,
                seed,
            },
        )
}
