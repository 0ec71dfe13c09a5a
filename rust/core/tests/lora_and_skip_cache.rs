//! vLLM's per-request admission rules: `max_loras` (a waiting request whose adapter would make
//! one adapter too many in the step is passed over and keeps its place) and
//! `skip_reading_prefix_cache` (no hit is read for the request, its blocks are still cached).

mod common;

use common::{apply, ids, schedule};
use dflash_core::{RequestSpec, Scheduler, SchedulerConfig, StepOutput};

const BS: usize = 16;

fn scheduler(max_loras: usize) -> Scheduler {
    let mut c = SchedulerConfig::new(200, BS, 512, 8, 1024);
    c.max_loras = max_loras;
    Scheduler::new(c).unwrap()
}

fn add(s: &mut Scheduler, id: &str, prompt: Vec<u32>, lora_id: u32, skip_reading: bool) {
    s.add_request(RequestSpec {
        request_id: id.to_owned(),
        prompt_token_ids: prompt,
        max_tokens: 4,
        lora_id,
        skip_reading_prefix_cache: skip_reading,
        extra: dflash_core::ExtraKeys {
            lora_name: (lora_id != 0).then(|| format!("lora{lora_id}")),
            ..Default::default()
        },
        ..Default::default()
    })
    .unwrap();
}

fn prompt(base: u32, len: usize) -> Vec<u32> {
    (0..len as u32).map(|t| base + t).collect()
}

fn step_ids(s: &Scheduler, out: &StepOutput) -> Vec<String> {
    ids(s, &out.slots)
}

/// Requests (id, lora) submitted in order; returns the ids the first step admits, in
/// scheduling order (rows follow admission order here: nothing ran before).
fn first_step(max_loras: usize, reqs: &[(&str, u32)]) -> (Scheduler, Vec<String>) {
    let mut s = scheduler(max_loras);
    for (i, &(id, lora)) in reqs.iter().enumerate() {
        add(&mut s, id, prompt(1000 * (i as u32 + 1), 20), lora, false);
    }
    let out = schedule(&mut s);
    let admitted = step_ids(&s, &out);
    (s, admitted)
}

#[test]
fn max_loras_passes_over_a_third_adapter_and_keeps_its_place() {
    let reqs = [("a", 1), ("b", 2), ("c", 3), ("d", 0), ("e", 1), ("f", 3)];
    let (s, admitted) = first_step(2, &reqs);
    assert_eq!(admitted, ["a", "b", "d", "e"]);
    // The passed-over requests wait at the front, in their order, counted as deferred.
    assert_eq!(ids(&s, &s.waiting_in_order()), ["c", "f"]);
    assert_eq!(s.num_deferred_waiting(), 2);
}

#[test]
fn deferred_requests_are_counted_until_admitted_or_finished() {
    let (mut s, _) = first_step(1, &[("a", 1), ("b", 2), ("c", 3), ("d", 2)]);
    assert_eq!(s.num_deferred_waiting(), 3);
    s.finish_requests(["c"], dflash_core::FinishReason::Abort)
        .unwrap();
    assert_eq!(s.num_deferred_waiting(), 2);
    s.finish_requests(["a"], dflash_core::FinishReason::Abort)
        .unwrap();
    // a's adapter is gone: b and d (adapter 2) are admitted, nothing is deferred any more.
    let out = schedule(&mut s);
    assert_eq!(step_ids(&s, &out), ["b", "d"]);
    assert_eq!(s.num_deferred_waiting(), 0);
}

#[test]
fn no_limit_without_max_loras() {
    let reqs = [("a", 1), ("b", 2), ("c", 3)];
    let (_, admitted) = first_step(0, &reqs);
    assert_eq!(admitted, ["a", "b", "c"]);
}

#[test]
fn running_requests_adapters_count() {
    let mut s = scheduler(1);
    add(&mut s, "a", prompt(1000, 20), 1, false);
    let out = schedule(&mut s);
    apply(&mut s, &out, |_| vec![100]);
    add(&mut s, "b", prompt(2000, 20), 2, false);
    add(&mut s, "c", prompt(3000, 20), 1, false);
    let out = schedule(&mut s);
    // a runs with adapter 1: b (adapter 2) waits, c (adapter 1) joins.
    assert_eq!(step_ids(&s, &out), ["a", "c"]);
    assert_eq!(ids(&s, &s.waiting_in_order()), ["b"]);
    apply(&mut s, &out, |_| vec![100]);
    // Until a and c finish (max_tokens 4), b keeps waiting; then it runs.
    let mut admitted_b = false;
    for _ in 0..8 {
        let out = schedule(&mut s);
        let step = step_ids(&s, &out);
        if step.contains(&"b".to_owned()) {
            assert_eq!(step, ["b"], "b ran beside another adapter");
            admitted_b = true;
            break;
        }
        apply(&mut s, &out, |_| vec![100]);
    }
    assert!(admitted_b);
}

#[test]
fn skip_reading_prefix_cache_reads_no_hit_but_caches_its_blocks() {
    let mut s = scheduler(0);
    let shared = prompt(5000, 3 * BS + 4);
    // The first to compute the prefix skips reading the cache: its blocks are still cached...
    add(&mut s, "skip", shared.clone(), 0, true);
    let out = schedule(&mut s);
    apply(&mut s, &out, |_| vec![100]);
    let mut other = shared[..3 * BS].to_vec();
    other.extend(prompt(9000, 5));
    add(&mut s, "later", other, 0, false);
    let out = schedule(&mut s);
    let i = step_ids(&s, &out)
        .iter()
        .position(|r| r == "later")
        .unwrap();
    assert_eq!(out.num_computed_tokens[i] as usize, 3 * BS);
    apply(&mut s, &out, |_| vec![100]);
    // ...but a request skipping it gets no hit although its whole prefix is cached, and its
    // lookup is not counted (vLLM counts only the lookups it makes).
    let lookups = s.stats().admitted_prefix;
    add(&mut s, "skip2", shared.clone(), 0, true);
    let out = schedule(&mut s);
    let i = step_ids(&s, &out)
        .iter()
        .position(|r| r == "skip2")
        .unwrap();
    assert_eq!(out.num_computed_tokens[i], 0);
    assert_eq!(out.num_scheduled_tokens[i] as usize, shared.len());
    assert_eq!(s.stats().admitted_prefix, lookups);
}

/// A prompt of embeddings: placeholder tokens (all 0), one digest per prompt block.
fn add_embeds(s: &mut Scheduler, id: &str, digests: &[u8], len: usize) {
    s.add_request(RequestSpec {
        request_id: id.to_owned(),
        prompt_token_ids: vec![0; len],
        max_tokens: 4,
        extra: dflash_core::ExtraKeys {
            prompt_embed_hashes: digests.iter().map(|&d| [d; 32]).collect(),
            ..Default::default()
        },
        ..Default::default()
    })
    .unwrap();
}

/// The prefix hit (tokens) `id` got when the next step admitted it after `first` ran.
fn hit_after(s: &mut Scheduler, first: (&str, &[u8]), then: (&str, &[u8])) -> usize {
    add_embeds(s, first.0, first.1, 3 * BS + 4);
    let out = schedule(s);
    apply(s, &out, |_| vec![100]);
    add_embeds(s, then.0, then.1, 3 * BS + 4);
    let out = schedule(s);
    let i = step_ids(s, &out).iter().position(|r| r == then.0).unwrap();
    out.num_computed_tokens[i] as usize
}

#[test]
fn prompt_embeds_share_exactly_the_blocks_whose_embeddings_agree() {
    let mut s = scheduler(0);
    // Same placeholder tokens: blocks 0 and 1 agree, block 2 differs.
    assert_eq!(
        hit_after(&mut s, ("a", &[1, 2, 3, 4]), ("b", &[1, 2, 9, 4])),
        2 * BS
    );
    let mut s = scheduler(0);
    assert_eq!(
        hit_after(&mut s, ("a", &[1, 2, 3, 4]), ("b", &[7, 2, 3, 4])),
        0
    );
    let mut s = scheduler(0);
    assert_eq!(
        hit_after(&mut s, ("a", &[1, 2, 3, 4]), ("b", &[1, 2, 3, 4])),
        3 * BS
    );
}

/// Under a forced collision of every block hash, verified hits still keep embeddings apart
/// (the prefix fingerprint carries the digests).
#[cfg(feature = "fault-injection")]
#[test]
fn prompt_embeds_never_share_kv_under_a_hash_collision() {
    let mut c = SchedulerConfig::new(200, BS, 512, 8, 1024);
    c.hash_algo = dflash_core::HashAlgo::TestCollide;
    let mut s = Scheduler::new(c).unwrap();
    assert_eq!(
        hit_after(&mut s, ("a", &[1, 2, 3, 4]), ("b", &[5, 6, 7, 8])),
        0
    );
}
