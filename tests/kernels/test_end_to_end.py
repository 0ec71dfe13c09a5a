"""Scheduler -> SchedulerOutput -> glue -> DFlash kernel (strict mode): the loop closed.

The bug this project grew from: vLLM's scheduler did not allocate DFlash's ``K + 1`` lookahead
slots on a request's first prefill (and later allocated ``K`` instead of ``K + 1``), while the
drafter's kernel maps all ``K + 1`` query lanes through the block table anyway, so their KV landed
in the null block or in blocks of other requests (reference sections 4.4-4.5, invariants 20 and
27). Here the real scheduler drives the real kernel in strict mode, step after step, and every
lane the kernel maps is checked against ``Scheduler.block_ids`` of the row's request:

* with the correct lookahead policy there is no violation at any step, for every prompt length
  1..3 * block_size and K in {1, 3, 8, 15}, with chunked prefill, prefix-cache hits, preemption
  and resumption, and decode steps that accept 0..K drafts (the rejected ones passed to the
  kernel, the sampled tokens fed back through ``update_from_output``);
* with the two legacy policies the same loop finds violations, exactly the lanes a hand
  computation predicts, and vLLM's default (non-strict) mode silently maps them into the null
  block.

The big sweeps use the pure-torch reference; a representative subset also runs the Triton kernel
(the interpreter on CPU) and must agree with it bit for bit.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Sequence

import numpy as np
import pytest
import torch
from dflash_expand_oracle import OUTPUT_FIELDS

from dflash_rs import ModelRunnerOutput, Request, Scheduler, SchedulerConfig, SpeculativeConfig
from dflash_rs.kernels import (
    PAD_SLOT_ID,
    DeviceBlockTable,
    DFlashInputs,
    expand_dflash_inputs,
    expand_from_output,
    kernel_inputs_from_output,
)
from support.arithmetic import cdiv

BLOCK = 16
MASK_TOKEN_ID = 3
KS = (1, 3, 8, 15)
PROMPT_LENS = tuple(range(1, 3 * BLOCK + 1))
LEGACY_POLICIES = ("legacy-first-prefill", "legacy-k")


def make_scheduler(k: int, lookahead: str = "correct", **kwargs) -> Scheduler:
    settings = dict(
        num_blocks=2048,
        block_size=BLOCK,
        max_model_len=256,
        max_num_seqs=64,
        max_num_batched_tokens=4096,
    )
    settings.update(kwargs)
    return Scheduler(
        SchedulerConfig(
            speculative=SpeculativeConfig("dflash", k), lookahead_policy=lookahead, **settings
        )
    )


def prompt(length: int, seed: int, offset: int = 1000) -> List[int]:
    """A prompt of ``length`` tokens that no other seed's prompt shares a block with."""
    return [offset + (seed * 7919 + i * 104729) % 50000 for i in range(length)]


# ---------------------------------------------------------------------------------------------
# the independent check of one step


@dataclass
class StepCheck:
    """One step's lanes as an independent computation from ``block_ids`` sees them."""

    num_reqs: int
    unowned_query: np.ndarray  # int64 [n]: query lanes below max_model_len without a slot
    unowned_context: np.ndarray  # int64 [n]: same for context lanes
    beyond_max_len: int  # lanes at positions >= max_model_len (no slot by design)
    query_positions: np.ndarray

    @property
    def unowned(self) -> int:
        return int(self.unowned_query.sum() + self.unowned_context.sum())


def _owned_matrix(ids: Sequence[Sequence[int]], width: int) -> np.ndarray:
    """[n, width + 1] int64: row i holds block_ids of request i, then -1 (never a block)."""
    owned = np.full((len(ids), width + 1), -1, dtype=np.int64)
    for i, blocks in enumerate(ids):
        owned[i, : len(blocks)] = blocks
    return owned


def check_step(
    sched: Scheduler,
    out,
    result: DFlashInputs,
    anchors: np.ndarray,
    rejected: np.ndarray,
) -> StepCheck:
    """Check the strict kernel's result against ``block_ids`` of each row's request.

    Every lane at a position below ``max_model_len`` whose logical block the request owns must
    map to exactly ``block_ids[pos // B] * B + pos % B``; every other lane must be
    ``PAD_SLOT_ID`` and counted in ``num_violations``. Positions and input ids follow the
    kernel's contract (invariant 29). Returns what it saw; the caller decides what is allowed.
    """
    cfg = sched.config
    bs, k, max_len = cfg.block_size, cfg.num_speculative_tokens, cfg.max_model_len
    req_ids = list(out.req_ids)
    n = len(req_ids)
    table = out.block_table
    counts = out.num_blocks_per_row
    ids = [sched.block_ids(rid) for rid in req_ids]
    for i, blocks in enumerate(ids):
        assert counts[i] == len(blocks), f"row {i} ({req_ids[i]}): count != len(block_ids)"
        assert table[i, : len(blocks)].tolist() == blocks, f"row {i}: table != block_ids"
        assert not table[i, len(blocks) :].any(), f"row {i}: stale ids past the row's count"
    width = table.shape[1]
    owned = _owned_matrix(ids, width)

    computed = out.num_computed_tokens.astype(np.int64)
    scheduled = out.num_scheduled_tokens_array.astype(np.int64)
    # Context positions by a plain per-request loop (the glue's vectorised form is under test).
    ctx_pos = np.concatenate(
        [np.arange(c, c + s, dtype=np.int64) for c, s in zip(computed, scheduled)]
    )
    ctx_rows = np.repeat(np.arange(n), scheduled)
    last = computed + scheduled - 1 - rejected
    q_rows = np.repeat(np.arange(n), k + 1)
    q_pos = last[q_rows] + 1 + np.tile(np.arange(k + 1), n)

    def expected(rows: np.ndarray, pos: np.ndarray) -> np.ndarray:
        block = owned[rows, np.minimum(pos // bs, width)]
        ok = (block > 0) & (pos < max_len)
        return np.where(ok, block * bs + pos % bs, PAD_SLOT_ID)

    got = {f: getattr(result, f).cpu().numpy().astype(np.int64) for f in OUTPUT_FIELDS}
    assert got["context_positions"].tolist() == ctx_pos.tolist()
    assert got["query_positions"].tolist() == q_pos.tolist()
    ids_expected = np.where(np.tile(np.arange(k + 1), n) == 0, anchors[q_rows], MASK_TOKEN_ID)
    assert got["input_ids"].tolist() == ids_expected.tolist()

    exp_ctx, exp_q = expected(ctx_rows, ctx_pos), expected(q_rows, q_pos)
    for name, rows, pos, exp in (
        ("context", ctx_rows, ctx_pos, exp_ctx),
        ("query", q_rows, q_pos, exp_q),
    ):
        slots = got[f"{name}_slot_mapping"]
        bad = np.flatnonzero(slots != exp)
        assert not bad.size, (
            f"{name} lanes {bad[:8].tolist()} (rows {rows[bad[:8]].tolist()}, positions "
            f"{pos[bad[:8]].tolist()}): kernel slots {slots[bad[:8]].tolist()}, expected "
            f"{exp[bad[:8]].tolist()}"
        )
        # Ownership, stated directly: every mapped lane's block is one of its row's blocks.
        mapped = slots != PAD_SLOT_ID
        member = (owned[rows, :width] == (slots // bs)[:, None]).any(axis=1)
        assert member[mapped].all()
    num_pad = int((exp_ctx == PAD_SLOT_ID).sum() + (exp_q == PAD_SLOT_ID).sum())
    assert int(got["num_violations"][0]) == num_pad

    def unowned(rows: np.ndarray, pos: np.ndarray, exp: np.ndarray) -> np.ndarray:
        lanes = (exp == PAD_SLOT_ID) & (pos < max_len)
        return np.bincount(rows[lanes], minlength=n)

    beyond = int((ctx_pos >= max_len).sum() + (q_pos >= max_len).sum())
    return StepCheck(
        n, unowned(q_rows, q_pos, exp_q), unowned(ctx_rows, ctx_pos, exp_ctx), beyond, q_pos
    )


def assert_same(a: DFlashInputs, b: DFlashInputs, what: str) -> None:
    for name in OUTPUT_FIELDS:
        x, y = getattr(a, name).cpu(), getattr(b, name).cpu()
        assert torch.equal(x, y), f"{what}: {name} differs: {x.tolist()} vs {y.tolist()}"


# ---------------------------------------------------------------------------------------------
# the engine loop


@dataclass
class RunLog:
    steps: int = 0
    kernel_steps: int = 0
    violations: List[int] = field(default_factory=list)  # strict num_violations per step
    unowned: List[int] = field(default_factory=list)  # lanes below max_model_len without slot
    beyond_max_len: int = 0
    accepted: Dict[int, int] = field(default_factory=dict)  # accepted drafts -> rows with drafts
    chunk_rows: int = 0
    preemptions: int = 0
    resumed: int = 0
    prefix_hit_admissions: int = 0
    triton_steps: int = 0
    first_step: Optional[StepCheck] = None


def drive(
    sched: Scheduler,
    arrivals: Dict[int, List[Request]],
    rng: np.random.Generator,
    *,
    backend: str = "reference",
    triton_every: int = 0,
    max_steps: int = 400,
    expect_clean: bool = True,
    on_step: Optional[Callable[[int, object, StepCheck], None]] = None,
    device_table: bool = False,
) -> RunLog:
    """Run the serving loop until every request finished; check every step's kernel result.

    Per step: ``schedule()``; sample (each row accepts 0..len(drafts) drafts at random, the
    extremes favoured, plus a bonus token; prefill chunks sample nothing and anchor on their
    next prompt token); run the strict kernel through the glue with the rejected drafts; check
    it (``check_step``); feed the sampled tokens back and propose K new drafts per decoding
    row. ``expect_clean`` fails at the first step with a lane below ``max_model_len`` that has
    no owned slot, and runs the scheduler's own ``check_invariants()`` after every step.
    ``triton_every=m`` also runs the Triton kernel every m-th kernel step and requires it
    to equal the reference. ``device_table=True`` feeds the kernel through a
    ``DeviceBlockTable`` (CPU mirror, incremental copies) instead of the zero-copy view.
    """
    cfg = sched.config
    k = cfg.num_speculative_tokens
    log = RunLog()
    table = None
    if device_table:
        # A real GPU mirror where the compiled kernel runs; a CPU stand-in elsewhere.
        mirror_device = "cuda" if backend == "triton" and torch.cuda.is_available() else "cpu"
        table = DeviceBlockTable.from_config(cfg, mirror_device, mirror=True, max_ranges=2)
    pending = dict(arrivals)
    for step in range(max_steps):
        for request in pending.pop(step, []):
            sched.add_request(request)
        if not pending and not sched.has_unfinished_requests():
            break
        out = sched.schedule()
        log.steps += 1
        log.preemptions += len(out.preempted_req_ids)
        log.resumed += len(out.scheduled_cached_reqs.resumed_req_ids)
        for new in out.scheduled_new_reqs:
            log.prefix_hit_admissions += int(not new.resumed and new.num_computed_tokens > 0)
        req_ids = list(out.req_ids)
        n = len(req_ids)
        if n == 0:
            sched.update_from_output(out, ModelRunnerOutput([], []))
            continue

        drafts = [out.scheduled_spec_decode_tokens.get(rid, []) for rid in req_ids]
        num_drafts = np.array([len(d) for d in drafts], dtype=np.int64)
        chunk = np.asarray(out.is_prefill_chunk, dtype=bool)
        # Acceptance: none, all, or a uniform count, a third of the rows each.
        mode = rng.integers(0, 3, size=n)
        uniform = rng.integers(0, num_drafts + 1)
        accepted = np.select([mode == 0, mode == 1], [0, num_drafts], uniform)
        accepted = np.where(chunk, 0, accepted)
        rejected = num_drafts - accepted
        end = out.num_computed_tokens.astype(np.int64) + out.num_scheduled_tokens_array
        bonus = rng.integers(100, 30000, size=n)
        anchors = bonus.copy()
        for i in np.flatnonzero(chunk):
            anchors[i] = sched.all_token_ids(req_ids[i])[int(end[i])]  # vLLM's backup token
        log.chunk_rows += int(chunk.sum())
        for a in accepted[num_drafts > 0]:
            log.accepted[int(a)] = log.accepted.get(int(a), 0) + 1

        common = dict(
            next_token_ids=anchors,
            num_rejected_tokens=rejected,
            mask_token_id=MASK_TOKEN_ID,
            strict=True,
        )
        result = expand_from_output(out, cfg, backend=backend, block_table=table, **common)
        check = check_step(sched, out, result, anchors, rejected)
        if expect_clean and check.unowned:
            rows = np.flatnonzero(check.unowned_query + check.unowned_context)
            pytest.fail(
                f"step {step}: {check.unowned} lanes without an owned slot (strict "
                f"num_violations={int(result.num_violations[0])}) in rows {rows.tolist()} = "
                f"requests {[req_ids[r] for r in rows]}, blocks per row "
                f"{out.num_blocks_per_row[rows].tolist()}, computed "
                f"{out.num_computed_tokens[rows].tolist()}, scheduled "
                f"{out.num_scheduled_tokens_array[rows].tolist()}, rejected "
                f"{rejected[rows].tolist()}"
            )
        if triton_every and log.kernel_steps % triton_every == 0:
            other = "triton" if backend == "reference" else "reference"
            assert_same(result, expand_from_output(out, cfg, backend=other, **common), other)
            log.triton_steps += 1
        log.kernel_steps += 1
        log.violations.append(int(result.num_violations[0]))
        log.unowned.append(check.unowned)
        log.beyond_max_len += check.beyond_max_len
        if log.first_step is None:
            log.first_step = check
        if on_step is not None:
            on_step(step, out, check)

        sampled = [[] if chunk[i] else [*drafts[i][: accepted[i]], int(bonus[i])] for i in range(n)]
        finished = {
            o.request_id
            for o in sched.update_from_output(out, ModelRunnerOutput(req_ids, sampled))
            if o.finished
        }
        proposals = {
            rid: rng.integers(100, 30000, size=k).tolist()
            for i, rid in enumerate(req_ids)
            if not chunk[i] and rid not in finished
        }
        if proposals:
            sched.update_draft_token_ids(proposals)
        if expect_clean:  # the scheduler's own checks (legacy policies break its ownership one)
            sched.check_invariants()
    else:
        pytest.fail(f"requests still unfinished after {max_steps} steps")
    return log


def assert_clean(log: RunLog) -> None:
    bad = [(i, v) for i, v in enumerate(log.violations) if v]
    assert not bad, f"strict-mode violations at (kernel step, lanes): {bad[:10]}"
    assert not any(log.unowned)
    assert log.kernel_steps > 0


# ---------------------------------------------------------------------------------------------
# correct policy: no violation, ever


@pytest.mark.parametrize("k", KS)
def test_every_prompt_length_every_step_is_owned(k, seeded_rng):
    """Prompts of 1..3*B tokens admitted together, then decoded with random acceptance."""
    _, rng = seeded_rng
    sched = make_scheduler(k)
    requests = [
        Request(f"p{length}", prompt(length, length), int(rng.integers(1, 3 * k + 6)))
        for length in PROMPT_LENS
    ]
    log = drive(sched, {0: requests}, rng, triton_every=1 if k == 8 else 0)
    assert_clean(log)
    first = log.first_step
    assert first is not None and first.num_reqs == len(PROMPT_LENS)  # one admission step
    assert log.beyond_max_len == 0
    assert 0 in log.accepted and k in log.accepted  # both extremes of acceptance were seen


@pytest.mark.parametrize("k", KS)
def test_every_prompt_length_alone_is_owned(k, seeded_rng):
    """One request per scheduler, so its row is row 0 and nothing else shapes the pool."""
    _, rng = seeded_rng
    for length in PROMPT_LENS:
        sched = make_scheduler(k, num_blocks=64)
        log = drive(sched, {0: [Request("a", prompt(length, length), 2 * k + 3)]}, rng)
        assert_clean(log)
        first = log.first_step
        assert first is not None
        assert first.query_positions.tolist() == list(range(length, length + k + 1))


@pytest.mark.parametrize("k", (3, 8))
def test_chunked_prefill_is_owned(k, seeded_rng):
    """A small token budget splits prompts into chunks; each chunk's queries are owned."""
    _, rng = seeded_rng
    sched = make_scheduler(k, max_num_batched_tokens=24)
    lengths = [1, 15, 16, 17, 31, 32, 33, 47, 48, 70, 100]
    arrivals = {
        2 * i: [Request(f"c{i}", prompt(length, 100 + i), int(rng.integers(1, 2 * k + 4)))]
        for i, length in enumerate(lengths)
    }
    log = drive(sched, arrivals, rng, triton_every=1 if k == 3 else 0)
    assert_clean(log)
    assert log.chunk_rows >= 10


def test_prefix_cache_hits_are_owned(seeded_rng):
    """Requests sharing prompt prefixes (hits capped at num_tokens - 1, block aligned)."""
    _, rng = seeded_rng
    k = 3
    sched = make_scheduler(k)
    base = prompt(64, 7)
    tails = {length: prompt(20, 300 + length, offset=60000) for length in range(1, 49)}
    arrivals: Dict[int, List[Request]] = {0: [Request("base", base, 4)]}
    # Identical prompts (hit capped at num_tokens - 1), block multiples, and suffixes.
    waves = [
        [base[:16], base[:32], base[:48], base[:64]],
        [base[:17], base[:31], base[:33], base[:47] + tails[1][:1]],
        [base[:32] + tails[length][: length % 20] for length in range(5, 45, 4)],
    ]
    for w, prompts in enumerate(waves):
        arrivals[3 * (w + 1)] = [
            Request(f"h{w}.{i}", p, int(rng.integers(1, 10))) for i, p in enumerate(prompts)
        ]
    log = drive(sched, arrivals, rng, triton_every=1)
    assert_clean(log)
    assert log.prefix_hit_admissions >= 10
    assert sched.stats()["prefix_cache_hits"] > 0


@pytest.mark.parametrize("k", (3, 15))
def test_preemption_and_resume_are_owned(k, seeded_rng):
    """A tiny pool forces preemptions; resumed requests get their lookahead again."""
    _, rng = seeded_rng
    sched = make_scheduler(k, num_blocks=10, max_model_len=128)
    arrivals = {
        i: [Request(f"r{i}", prompt(10 + 5 * i, 500 + i), 24 + (i % 3) * 8)] for i in range(8)
    }
    log = drive(sched, arrivals, rng, triton_every=1 if k == 3 else 0)
    assert_clean(log)
    assert log.preemptions > 0 and log.resumed > 0


@pytest.mark.parametrize("policy", ("fcfs", "priority"))
@pytest.mark.parametrize("k", KS)
def test_mixed_serving_is_owned(k, policy, seeded_rng):
    """Everything at once: staggered arrivals, shared prefixes, chunked prefill (budget 32),
    a tight pool (preemption), priorities, random acceptance."""
    _, rng = seeded_rng
    sched = make_scheduler(
        k, num_blocks=14, max_model_len=208, max_num_batched_tokens=32, policy=policy
    )
    bases = [prompt(48, 40 + b) for b in range(3)]
    # Two first arrivals that share a 48-token prefix: the second is admitted in the next
    # step, onto the first's cached blocks, whatever the random arrivals below do.
    arrivals: Dict[int, List[Request]] = {
        0: [
            Request(name, bases[0] + prompt(4, 900 + j, offset=60000), 30, arrival_time=j - 2.0)
            for j, name in enumerate(("a0", "a1"))
        ]
    }
    for i in range(20):
        shared = int(rng.integers(0, 49))
        tail = prompt(int(rng.integers(0 if shared else 1, 33)), 1000 + i, offset=60000)
        request = Request(
            f"x{i}",
            bases[i % 3][:shared] + tail,
            int(rng.integers(1, 31)),
            priority=int(rng.integers(0, 3)),
            arrival_time=float(i),
        )
        arrivals.setdefault(int(rng.integers(0, 12)), []).append(request)
    device_table = policy == "fcfs"  # half the runs read the table through the device mirror
    log = drive(sched, arrivals, rng, triton_every=5 if k == 8 else 0, device_table=device_table)
    assert_clean(log)
    assert log.chunk_rows > 0 and log.prefix_hit_admissions > 0


def test_context_limit_lanes_are_the_only_unmapped_ones(seeded_rng):
    """Near max_model_len the lookahead is capped: lanes at positions >= max_model_len get no
    slot (vLLM skips drafting there); every lane below the limit is still owned."""
    _, rng = seeded_rng
    sched = make_scheduler(8, max_model_len=64)
    arrivals = {0: [Request(f"m{i}", prompt(30 + 6 * i, 900 + i), 64) for i in range(4)]}
    log = drive(sched, arrivals, rng)
    assert not any(log.unowned)
    assert log.beyond_max_len > 0
    assert sum(log.violations) == log.beyond_max_len


def test_a_glue_that_drops_the_lookahead_is_caught():
    """Sensitivity of the check: strict mode with one block fewer per row finds violations."""
    k = 3
    sched = make_scheduler(k)
    for length in PROMPT_LENS:
        sched.add_request(Request(f"p{length}", prompt(length, length), 4))
    out = sched.schedule()
    n = out.num_reqs
    inputs = kernel_inputs_from_output(out, next_token_ids=np.full(n, 5))
    result = expand_dflash_inputs(
        inputs.next_token_ids,
        inputs.target_positions,
        inputs.query_start_loc,
        inputs.block_table,
        block_size=BLOCK,
        num_speculative_tokens=k,
        mask_token_id=MASK_TOKEN_ID,
        num_blocks_per_row=inputs.num_blocks_per_row - 1,
        backend="reference",
    )
    # Every row's last owned block holds query lanes (the lookahead block) or context lanes.
    assert int(result.num_violations[0]) >= n
    unmapped = result.query_slot_mapping.view(n, k + 1) == PAD_SLOT_ID
    assert bool(unmapped.any(dim=1).all())


# ---------------------------------------------------------------------------------------------
# legacy policies: the bug, found and pinned down


def _legacy_expected_unowned(policy: str, length: int, k: int) -> int:
    """Query lanes (positions length .. length+K) without a block on the admission step."""
    lookahead = 0 if policy == "legacy-first-prefill" else k
    owned_tokens = cdiv(length + lookahead, BLOCK) * BLOCK
    return sum(1 for pos in range(length, length + k + 1) if pos >= owned_tokens)


@pytest.mark.parametrize("policy", LEGACY_POLICIES)
@pytest.mark.parametrize("k", KS)
def test_legacy_policy_violations_are_exactly_the_predicted_lanes(policy, k, seeded_rng):
    """Admission of every prompt length: per row, the unmapped query lanes are exactly those
    past the blocks the legacy policy allocated; then the loop finds violations (the suite's
    proof that the end-to-end check fails on the bug)."""
    _, rng = seeded_rng
    sched = make_scheduler(k, policy)
    requests = [Request(f"p{length}", prompt(length, length), 2 * k + 2) for length in PROMPT_LENS]
    log = drive(sched, {0: requests}, rng, expect_clean=False)
    first = log.first_step
    assert first is not None and first.num_reqs == len(PROMPT_LENS)
    expected = [_legacy_expected_unowned(policy, length, k) for length in PROMPT_LENS]
    assert first.unowned_query.tolist() == expected
    assert not first.unowned_context.any()
    assert log.violations[0] == sum(expected) > 0
    assert any(v > 0 for v in log.violations)
    if policy == "legacy-first-prefill":
        # Its running path allocates K + 1: once admitted, later steps are clean.
        assert not any(log.unowned[1:])


def test_legacy_k_also_breaks_decode_steps(seeded_rng):
    """K instead of K+1 on every allocation: decode windows that cross a block boundary with
    every draft accepted lose their last query lane."""
    _, rng = seeded_rng
    k = 3
    sched = make_scheduler(k, "legacy-k")
    requests = [Request(f"d{i}", prompt(5 + i, 700 + i), 40) for i in range(16)]
    decode_violations = []

    def record(step: int, out, check: StepCheck) -> None:
        if step > 0:
            decode_violations.append(check.unowned)

    drive(sched, {0: requests}, rng, expect_clean=False, on_step=record)
    assert sum(decode_violations) > 0


def _single_request_step(policy: str, k: int, length: int):
    sched = make_scheduler(k, policy)
    sched.add_request(Request("a", prompt(length, 1), 8))
    out = sched.schedule()
    return sched, out


# Hand-checked cases, block 16, K=3: (policy, prompt length, owned blocks, unmapped query lanes).
HAND_CASES = [
    ("legacy-first-prefill", 16, 1, [0, 1, 2, 3]),  # queries 16..19 all in block 1
    ("legacy-k", 13, 1, [3]),  # queries 13..16: 16 is in block 1, not allocated by K=3
    ("correct", 16, 2, []),
    ("correct", 13, 2, []),
]


@pytest.mark.parametrize("backend", ("triton", "reference"))
@pytest.mark.parametrize(("policy", "length", "num_blocks", "unmapped"), HAND_CASES)
def test_hand_checked_first_prefill(policy, length, num_blocks, unmapped, backend):
    k = 3
    sched, out = _single_request_step(policy, k, length)
    blocks = sched.block_ids("a")
    assert out.num_blocks_per_row.tolist() == [num_blocks] == [len(blocks)]
    common = dict(
        next_token_ids=[42], mask_token_id=MASK_TOKEN_ID, backend=backend, config=sched.config
    )
    strict = expand_from_output(out, strict=True, **common)
    positions = list(range(length, length + k + 1))
    assert strict.query_positions.tolist() == positions
    expected = [
        PAD_SLOT_ID if q in unmapped else blocks[p // BLOCK] * BLOCK + p % BLOCK
        for q, p in enumerate(positions)
    ]
    assert strict.query_slot_mapping.tolist() == expected
    assert strict.num_violations.tolist() == [len(unmapped)]
    assert strict.context_slot_mapping.tolist() == [
        blocks[p // BLOCK] * BLOCK + p % BLOCK for p in range(length)
    ]
    assert strict.input_ids.tolist() == [42] + [MASK_TOKEN_ID] * k

    # vLLM's default mode on the same table: the unowned lanes silently hit the null block.
    default = expand_from_output(out, strict=False, **common)
    slots = default.query_slot_mapping.tolist()
    for q, p in enumerate(positions):
        if q in unmapped:
            assert slots[q] // BLOCK == 0 and slots[q] == p % BLOCK  # null block 0
        else:
            assert slots[q] == expected[q]
    assert default.num_violations.tolist() == [0]  # nothing reported: silent corruption


@pytest.mark.parametrize("policy", LEGACY_POLICIES)
def test_default_mode_maps_legacy_lanes_to_the_null_block(policy, seeded_rng):
    """Over a whole admission sweep: every lane strict mode rejects is, in default mode, a
    write into block 0 that no request owns; all other lanes agree between the modes."""
    _, rng = seeded_rng
    k = 8
    sched = make_scheduler(k, policy)
    for length in PROMPT_LENS:
        sched.add_request(Request(f"p{length}", prompt(length, length), 4))
    out = sched.schedule()
    n = out.num_reqs
    anchors = rng.integers(100, 30000, size=n)
    common = dict(
        next_token_ids=anchors,
        mask_token_id=MASK_TOKEN_ID,
        config=sched.config,
        backend="reference",
    )
    strict = expand_from_output(out, strict=True, **common)
    default = expand_from_output(out, **common)
    bad = strict.query_slot_mapping == PAD_SLOT_ID
    assert int(bad.sum()) == int(strict.num_violations[0]) > 0
    assert bool((default.query_slot_mapping[bad] // BLOCK == 0).all())
    assert torch.equal(default.query_slot_mapping[~bad], strict.query_slot_mapping[~bad])
    assert torch.equal(default.context_slot_mapping, strict.context_slot_mapping)
