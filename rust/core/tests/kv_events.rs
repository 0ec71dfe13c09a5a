//! KV-cache events (`SchedulerConfig::kv_events`): what a scheduler step records, and, over
//! random traces with preemption, aborts, abandoned steps and resets, that replaying the events
//! always rebuilds exactly the set of blocks registered in the prefix cache.

use std::collections::HashMap;

mod common;

use common::{add, apply, random_output, req, rng, schedule};
use dflash_core::{
    FinishReason, KvEvent, Scheduler, SchedulerConfig, SpecMethod, StepOutput, NULL_BLOCK,
};
use proptest::prelude::*;
use proptest::test_runner::TestRng;

const BS: usize = 16;

fn config(num_blocks: usize, kv_events: bool) -> SchedulerConfig {
    let mut c = SchedulerConfig::new(num_blocks, BS, 128.min((num_blocks - 1) * BS), 8, 128);
    c.kv_events = kv_events;
    c
}

/// Replays `events` onto `mirror` (block -> the request and logical index it was stored as),
/// checking each event against it: a stored block was not registered, a removed one was, a
/// stored run's parent is registered.
fn replay(mirror: &mut HashMap<u32, (String, usize)>, events: Vec<KvEvent>) -> [usize; 3] {
    let mut counts = [0; 3];
    for e in events {
        counts[match &e {
            KvEvent::Stored { .. } => 0,
            KvEvent::Removed { .. } => 1,
            KvEvent::Cleared => 2,
        }] += 1;
        match e {
            KvEvent::Stored {
                request_id,
                first,
                parent,
                blocks,
                tokens,
            } => {
                assert!(!request_id.is_empty(), "a Stored event names its request");
                assert_eq!(tokens.len(), blocks.len() * BS);
                assert_eq!(parent == NULL_BLOCK, first == 0);
                if parent != NULL_BLOCK {
                    assert!(
                        mirror.contains_key(&parent),
                        "parent {parent} is registered"
                    );
                }
                for (i, b) in blocks.into_iter().enumerate() {
                    let old = mirror.insert(b, (request_id.clone(), first + i));
                    assert!(old.is_none(), "block {b} stored twice");
                }
            }
            KvEvent::Removed { block } => {
                assert!(
                    mirror.remove(&block).is_some(),
                    "removed {block} was not stored"
                );
            }
            KvEvent::Cleared => mirror.clear(),
        }
    }
    counts
}

/// True with probability `p`.
fn chance(r: &mut TestRng, p: f64) -> bool {
    (r.next_u32() as f64) < p * u32::MAX as f64
}

/// Uniform in `lo..hi`.
fn below(r: &mut TestRng, lo: u32, hi: u32) -> u32 {
    lo + r.next_u32() % (hi - lo)
}

fn registered(s: &Scheduler) -> Vec<u32> {
    let pool = s.kv().pool();
    (1..pool.num_blocks() as u32)
        .filter(|&b| pool.block_hash(b).is_some())
        .collect()
}

fn mirrored(mirror: &HashMap<u32, (String, usize)>) -> Vec<u32> {
    let mut v: Vec<u32> = mirror.keys().copied().collect();
    v.sort_unstable();
    v
}

#[test]
fn off_by_default_and_records_nothing() {
    let mut s = Scheduler::new(config(16, false)).unwrap();
    add(&mut s, "a", 40, 4);
    let out = schedule(&mut s);
    apply(&mut s, &out, |_| vec![9]);
    assert!(!registered(&s).is_empty());
    assert!(s.take_kv_events().is_empty());
}

#[test]
fn stored_removed_and_cleared() {
    let mut s = Scheduler::new(config(8, true)).unwrap();
    add(&mut s, "a", 40, 20);
    let out = schedule(&mut s);
    let blocks = req(&s, "a").blocks.block_ids.clone();
    let prompt: Vec<u32> = req(&s, "a").tokens.clone();
    // The prefill's two full blocks, one event; the third block is partial.
    let events = s.take_kv_events();
    assert_eq!(
        events,
        [KvEvent::Stored {
            request_id: "a".into(),
            first: 0,
            parent: NULL_BLOCK,
            blocks: blocks[..2].to_vec(),
            tokens: prompt[..32].to_vec(),
        }]
    );
    // Decode until block 2 is full (token 48): its registration chains to block 1.
    let mut out = out;
    let mut stored = Vec::new();
    for t in 0..9 {
        apply(&mut s, &out, |_| vec![100 + t]);
        stored.extend(s.take_kv_events());
        out = schedule(&mut s);
        stored.extend(s.take_kv_events());
    }
    let tokens = req(&s, "a").tokens.clone();
    assert_eq!(
        stored,
        [KvEvent::Stored {
            request_id: "a".into(),
            first: 2,
            parent: blocks[1],
            blocks: vec![blocks[2]],
            tokens: tokens[32..48].to_vec(),
        }]
    );
    apply(&mut s, &out, |_| vec![7]);
    s.finish_requests(["a"], FinishReason::Abort).unwrap();
    assert!(
        s.take_kv_events().is_empty(),
        "freeing keeps the blocks cached"
    );
    // b needs every block: a's three cached blocks are evicted as they are popped.
    let spec = dflash_core::RequestSpec {
        request_id: "b".into(),
        prompt_token_ids: (0..7 * BS as u32 - 8).map(|t| 50_000 + t).collect(),
        max_tokens: 1,
        ..Default::default()
    };
    s.add_request(spec).unwrap();
    let _out = schedule(&mut s);
    let events = s.take_kv_events();
    let removed: Vec<u32> = events
        .iter()
        .filter_map(|e| match e {
            KvEvent::Removed { block } => Some(*block),
            _ => None,
        })
        .collect();
    let mut sorted = removed.clone();
    sorted.sort_unstable();
    let mut a_blocks = blocks[..3].to_vec();
    a_blocks.sort_unstable();
    assert_eq!(sorted, a_blocks);
    assert!(matches!(events.last(), Some(KvEvent::Stored { request_id, .. }) if request_id == "b"));
    s.finish_requests(["b"], FinishReason::Abort).unwrap();
    assert!(s.reset_prefix_cache());
    assert_eq!(s.take_kv_events(), [KvEvent::Cleared]);
    assert!(!s.reset_prefix_cache() || s.take_kv_events() == [KvEvent::Cleared]);
}

/// One random trace: arrivals, steps with random outputs (DFlash drafts accepted at random),
/// aborts, abandoned steps, resets with running requests preempted; after every call the
/// replayed events equal the registered blocks. Returns how many events of each kind it saw.
fn trace(seed: u64, policy_priority: bool, async_scheduling: bool) -> [usize; 3] {
    let mut seen = [0; 3];
    let mut note = |c: [usize; 3]| {
        for (s, c) in seen.iter_mut().zip(c) {
            *s += c;
        }
    };
    let mut c = config(24, true);
    c.spec_method = SpecMethod::DFlash;
    c.num_speculative_tokens = 3;
    c.async_scheduling = async_scheduling;
    c.refuse_idle_steps = false;
    if policy_priority {
        c.policy = dflash_core::Policy::Priority;
    }
    let mut s = Scheduler::new(c).unwrap();
    let mut r = rng(seed);
    let mut mirror = HashMap::new();
    let mut in_flight: Vec<StepOutput> = Vec::new();
    let shared: Vec<u32> = (0..40).map(|t| 500 + t).collect();
    for step in 0..200u32 {
        if chance(&mut r, 0.3) {
            let n = below(&mut r, 8, 100) as usize;
            let mut prompt: Vec<u32> = (0..n as u32).map(|t| 10_000 * (step + 1) + t).collect();
            if chance(&mut r, 0.5) {
                prompt.splice(0..0, shared.iter().copied());
                prompt.truncate(127);
            }
            let spec = dflash_core::RequestSpec {
                request_id: format!("r{step}"),
                prompt_token_ids: prompt,
                max_tokens: below(&mut r, 1, 40) as usize,
                priority: below(&mut r, 0, 3) as i64,
                arrival_time: step as f64,
                ..Default::default()
            };
            s.add_request(spec).unwrap();
        }
        let out = schedule(&mut s);
        note(replay(&mut mirror, s.take_kv_events()));
        assert_eq!(mirrored(&mirror), registered(&s), "seed {seed} step {step}");
        if out.num_reqs() > 0 {
            in_flight.push(out);
        }
        let depth = if async_scheduling { 2 } else { 1 };
        while in_flight.len() >= depth || (!in_flight.is_empty() && chance(&mut r, 0.2)) {
            let out = in_flight.remove(0);
            if chance(&mut r, 0.05) {
                s.abandon_step(out.step_id).unwrap();
                in_flight.clear();
            } else {
                let (tokens, counts) = random_output(&out, &mut r, |r| below(r, 16, 4000));
                let mut upd = dflash_core::UpdateOutput::default();
                s.update_from_output(out.step_id, &tokens, &counts, &mut upd)
                    .unwrap();
            }
            s.check_invariants().unwrap();
            note(replay(&mut mirror, s.take_kv_events()));
            assert_eq!(mirrored(&mirror), registered(&s), "seed {seed} step {step}");
        }
        if chance(&mut r, 0.03) {
            let live: Vec<String> = s
                .running()
                .iter()
                .map(|&slot| s.requests().get(slot).unwrap().spec.request_id.clone())
                .collect();
            if let Some(id) = live.first() {
                s.finish_requests([id.as_str()], FinishReason::Abort)
                    .unwrap();
            }
        }
        if chance(&mut r, 0.03) && in_flight.is_empty() {
            s.reset_prefix_cache_preempting_running().unwrap();
            let events = s.take_kv_events();
            assert_eq!(events.last(), Some(&KvEvent::Cleared));
            note(replay(&mut mirror, events));
            assert!(mirror.is_empty());
        }
        note(replay(&mut mirror, s.take_kv_events()));
        assert_eq!(mirrored(&mirror), registered(&s), "seed {seed} step {step}");
    }
    seen
}

#[test]
fn random_traces_store_evict_and_clear() {
    let mut seen = [0; 3];
    for seed in 0..8 {
        for (s, c) in seen
            .iter_mut()
            .zip(trace(seed, seed % 2 == 1, seed % 4 >= 2))
        {
            *s += c;
        }
    }
    assert!(
        seen.iter().all(|&n| n > 0),
        "stored, removed, cleared: {seen:?}"
    );
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(24))]
    #[test]
    fn replayed_events_equal_the_registered_blocks(
        seed in any::<u64>(),
        priority in any::<bool>(),
        async_scheduling in any::<bool>(),
    ) {
        trace(seed, priority, async_scheduling);
    }
}
