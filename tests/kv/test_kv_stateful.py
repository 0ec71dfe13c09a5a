"""Model-based test: random call sequences on a small pool, real manager vs. ``kv_model.KVModel``.

Every call goes to both; return values (or the exception class) must agree, and after every
step the full observable state must agree: free count and free order (eviction order), ref
count of every block, every request's block ids / token count / cached-block count, the number
of prefix-cache registrations, which blocks are registered and under which hash, lookup stats,
usage -- and ``check_invariants()`` must pass.

The model keys the prefix cache by ``(lora, salt, token prefix)``; the machine learns the real
hash of each key from ``block_hashes()`` and checks that the key <-> hash correspondence is a
bijection (equal prefixes hash equally, different ones differently) and that every registered
block carries exactly the hash of the key the model registered it under.
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Tuple

import numpy as np
import pytest
from hypothesis import HealthCheck, Phase, event, note, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from dflash_rs import DFlashRsError, KVCacheManager

from .kv_model import KVModel, observe

TOKENS = st.integers(0, 2)  # a tiny alphabet: prefixes (and therefore hits) are common
LORAS = st.sampled_from([None] * 5 + ["lora-a"])
SALTS = st.sampled_from([None] * 5 + ["salt-a"])


class KVMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.real: Any = None
        self.model: Any = None
        self.counter = 0
        self.history: List[List[int]] = []  # allocated token sequences, to share prefixes
        self.freed: List[List[int]] = []  # sequences of freed requests (cached but evictable)
        self.pending: Dict[str, Tuple[List[int], int]] = {}  # lookups not yet adopted
        self.key_to_hash: Dict[Any, bytes] = {}
        self.hash_to_key: Dict[bytes, Any] = {}

    # ------------------------------------------------------------------ plumbing
    @initialize(
        block_size=st.sampled_from([1, 2, 4, 16]),
        num_blocks=st.integers(8, 24),
        caching=st.sampled_from([True, True, True, False]),
        hash_algo=st.sampled_from(["sha256", "blake3", "xxh3_128"]),
        data=st.data(),
    )
    def setup(
        self, block_size: int, num_blocks: int, caching: bool, hash_algo: str, data: Any
    ) -> None:
        self.bs = block_size
        self.mml = data.draw(st.integers(max(8, 2 * block_size), max(24, 6 * block_size)))
        self.real = KVCacheManager(
            num_blocks,
            block_size,
            self.mml,
            enable_prefix_caching=caching,
            hash_algo=hash_algo,
            hash_seed=0,
        )
        self.model = KVModel(num_blocks, block_size, self.mml, enable_prefix_caching=caching)
        note(
            f"KVCacheManager({num_blocks}, {block_size}, {self.mml}, "
            f"enable_prefix_caching={caching}, hash_algo={hash_algo!r}, hash_seed=0)"
        )

    def both(self, name: str, *args: Any, **kwargs: Any) -> Any:
        """Calls model and manager; they must both succeed with equal results or both raise the
        same error class. Returns the result (None after an error)."""
        exp_exc: Optional[type] = None
        got_exc: Optional[type] = None
        expected = got = None
        try:
            expected = getattr(self.model, name)(*args, **kwargs)
        except DFlashRsError as e:
            exp_exc = type(e)
        try:
            got = getattr(self.real, name)(*args, **kwargs)
        except DFlashRsError as e:
            got_exc = type(e)
            got_msg = str(e)
        assert exp_exc is got_exc, f"{name}{args}{kwargs}: model raised {exp_exc}, manager " + (
            f"raised {got_exc}: {got_msg}" if got_exc else f"returned {got!r}"
        )
        assert got == expected, f"{name}{args}{kwargs}: manager {got!r} != model {expected!r}"
        note(f"{name}{args}{kwargs} -> {got_exc.__name__ if got_exc else repr(got)}")
        if name == "allocate_slots":
            hit = "with hits" if kwargs.get("new_computed_blocks") else "no hits"
            outcome = got_exc.__name__ if got_exc else ("None" if got is None else "ok")
            event(f"allocate_slots {hit}: {outcome}")
        elif name == "get_computed_blocks" and got:
            event("get_computed_blocks: hit" if got[1] else "get_computed_blocks: miss")
        elif name == "reset_prefix_cache":
            event(f"reset_prefix_cache: {got}")
        return got

    def rids(self) -> List[str]:
        return sorted(self.model.requests)

    def rids_without_blocks(self) -> List[str]:
        return [r for r in self.rids() if not self.model.requests[r].blocks]

    def rids_with_blocks(self) -> List[str]:
        return [r for r in self.rids() if self.model.requests[r].blocks]

    def remember(self, tokens: List[int]) -> None:
        self.history.append(list(tokens))
        del self.history[:-24]

    def tokens_arg(self, tokens: List[int], data: Any) -> Any:
        kind = data.draw(st.sampled_from(["list", "list", "tuple", "int32", "int64"]))
        if kind == "list":
            return list(tokens)
        if kind == "tuple":
            return tuple(tokens)
        return np.asarray(tokens, dtype=np.int32 if kind == "int32" else np.int64)

    def both_tokens(self, name: str, rid: str, tokens: List[int], data: Any, **kw: Any) -> Any:
        """Like both(), passing the tokens to the manager as a list, tuple or numpy array."""
        try:
            getattr(self.model, name)(rid, tokens, **kw)
            exp_exc = None
        except DFlashRsError as e:
            exp_exc = type(e)
        try:
            getattr(self.real, name)(rid, self.tokens_arg(tokens, data), **kw)
            got_exc = None
        except DFlashRsError as e:
            got_exc = type(e)
        assert exp_exc is got_exc, f"{name}({rid!r}, {tokens}, {kw}): {exp_exc} vs {got_exc}"
        note(f"{name}({rid!r}, {tokens}, {kw}) -> {got_exc.__name__ if got_exc else 'ok'}")
        return exp_exc is None

    def draw_prompt(self, data: Any) -> List[int]:
        max_len = min(self.mml, 2 * self.bs + 3)
        prefix: List[int] = []
        if self.history and data.draw(st.integers(0, 3)) > 0:
            base = data.draw(st.sampled_from(self.history))
            cut = data.draw(st.one_of(st.just(len(base)), st.integers(0, len(base))))
            prefix = base[: min(cut, max_len)]
        tail_len = data.draw(st.integers(0 if prefix else 1, max_len - len(prefix)))
        return prefix + data.draw(st.lists(TOKENS, min_size=tail_len, max_size=tail_len))

    def allocate(self, rid: str, new: int, data: Any, **kw: Any) -> Any:
        kw.setdefault("num_lookahead_tokens", data.draw(st.integers(0, 6)))
        kw.setdefault("full_sequence_must_fit", data.draw(st.booleans()))
        got = self.both("allocate_slots", rid, new, **kw)
        if got is not None and rid in self.model.requests:
            self.remember(self.model.requests[rid].tokens)
        return got

    # ------------------------------------------------------------------ rules
    @rule(data=st.data())
    def add_request(self, data: Any) -> None:
        rid = self.new_request(data)
        if rid is not None and data.draw(st.booleans()):
            self.admit_request(rid, data)

    def new_request(self, data: Any) -> Optional[str]:
        self.counter += 1
        rid = f"r{self.counter}"
        prompt = self.draw_prompt(data)
        lora, salt = data.draw(LORAS), data.draw(SALTS)
        if self.both_tokens("add_request", rid, prompt, data, lora_name=lora, cache_salt=salt):
            return rid
        return None

    @rule(data=st.data(), n=st.integers(1, 20))
    def append_token_ids(self, data: Any, n: int) -> None:
        if not self.model.requests:
            return
        rid = data.draw(st.sampled_from(self.rids()))
        tokens = data.draw(st.lists(TOKENS, min_size=n, max_size=n))
        if self.both_tokens("append_token_ids", rid, tokens, data):
            self.remember(self.model.requests[rid].tokens)

    @rule(data=st.data())
    def lookup(self, data: Any) -> None:
        """get_computed_blocks alone; the result may be adopted later (possibly stale by then)."""
        if not self.model.requests:
            return
        rid = data.draw(st.sampled_from(self.rids()))
        self.pending[rid] = self.both("get_computed_blocks", rid)

    @rule(data=st.data())
    def admit(self, data: Any) -> None:
        if self.rids_without_blocks() and data.draw(st.booleans()):
            rid: Optional[str] = data.draw(st.sampled_from(self.rids_without_blocks()))
        else:
            rid = self.new_request(data)
        if rid is not None:
            self.admit_request(rid, data)

    def admit_request(self, rid: str, data: Any, how: Optional[str] = None) -> None:
        """A scheduler admission: lookup, then allocate the rest (or a chunk, or + drafts)."""
        hits, num_hit = self.both("get_computed_blocks", rid)
        if how is None:
            how = data.draw(st.sampled_from(["all", "all", "all", "prefix", "none"]))
        if how == "prefix":
            hits = hits[: data.draw(st.integers(0, len(hits)))]
        elif how == "none":
            hits = []
        num_hit = len(hits) * self.bs
        rest = self.model.num_tokens(rid) - num_hit
        new = data.draw(
            st.one_of(
                st.just(rest),
                st.integers(1, rest),  # a chunk
                st.integers(rest + 1, rest + 4),  # + unverified draft tokens
            )
        )
        self.allocate(
            rid,
            new,
            data,
            num_computed_tokens=0,
            num_new_computed_tokens=num_hit,
            new_computed_blocks=hits,
        )

    @rule(data=st.data())
    def follow_up(self, data: Any) -> None:
        """A follow-up turn: a new request extending an earlier allocated sequence (whose cached
        blocks may be free, i.e. evictable, by now), admitted with all its hits."""
        sources = [h for h in (self.history, self.freed) if h]
        if not sources:
            return
        base = data.draw(st.sampled_from(data.draw(st.sampled_from(sources))))
        tail = data.draw(st.lists(TOKENS, min_size=1, max_size=self.bs + 1))
        prompt = (base + tail)[: self.mml]
        self.counter += 1
        rid = f"r{self.counter}"
        lora, salt = data.draw(LORAS), data.draw(SALTS)
        if self.both_tokens("add_request", rid, prompt, data, lora_name=lora, cache_salt=salt):
            if data.draw(st.booleans()):  # under capacity pressure
                self.squeeze_to(data.draw(st.integers(0, 4)))
            self.admit_request(rid, data, how="all")

    @rule(data=st.data())
    def admit_at_capacity_edge(self, data: Any) -> None:
        """Re-admit a freed sequence whose cached blocks are free (evictable), with the pool
        squeezed to exactly the capacity the admission needs, or one block less: the edge where
        counting evictable hits as consumed capacity, and the full-sequence gate (for a chunk),
        decide between blocks and None."""
        if not self.freed:
            holders = [r for r in self.rids_with_blocks() if not r.startswith("fill")]
            if not holders:
                return
            self.free_request(data.draw(st.sampled_from(holders)))
        prompt = data.draw(st.sampled_from(self.freed))[: self.mml]
        self.counter += 1
        rid = f"r{self.counter}"
        if not self.both_tokens("add_request", rid, prompt, data):
            return
        hits = self.model.longest_cache_hit(rid)
        rest = len(prompt) - len(hits) * self.bs
        new = data.draw(st.sampled_from([rest, data.draw(st.integers(1, rest))]))
        lookahead = data.draw(st.integers(0, 6))
        gate = data.draw(st.booleans())
        evictable = sum(1 for b in hits if self.model.ref[b] == 0)
        need_slot = min(len(hits) * self.bs + new + lookahead, self.mml)
        need = max(-(-need_slot // self.bs) - len(hits), 0) + evictable
        if gate:
            need_full = max(-(-len(prompt) // self.bs) - len(hits), 0) + evictable
            need = max(need, need_full)
        self.squeeze_to(need - data.draw(st.integers(0, 1)))
        hits, num_hit = self.both("get_computed_blocks", rid)
        self.allocate(
            rid,
            new,
            data,
            num_computed_tokens=0,
            num_new_computed_tokens=num_hit,
            new_computed_blocks=hits,
            num_lookahead_tokens=lookahead,
            full_sequence_must_fit=gate,
        )

    @rule(data=st.data())
    def admit_pending(self, data: Any) -> None:
        """Adopt hits from an earlier lookup: other allocations may have evicted them since."""
        if not any(r in self.model.requests for r in self.pending):
            return
        rid = data.draw(
            st.sampled_from(sorted(r for r in self.pending if r in self.model.requests))
        )
        hits, num_hit = self.pending.pop(rid)
        rest = max(self.model.num_tokens(rid) - num_hit, 1)
        self.allocate(
            rid,
            data.draw(st.integers(1, rest)),
            data,
            num_computed_tokens=0,
            num_new_computed_tokens=num_hit,
            new_computed_blocks=hits,
        )

    @rule(data=st.data())
    def step(self, data: Any) -> None:
        """A running request's next step: decode (1 + drafts), next prefill chunk, or anything
        up to the slots it owns."""
        if not self.rids_with_blocks():
            self.admit(data)
            return
        rid = data.draw(st.sampled_from(self.rids_with_blocks()))
        r = self.model.requests[rid]
        owned = len(r.blocks) * self.bs
        nt = len(r.tokens)
        comp = data.draw(
            st.one_of(
                st.just(min(nt - 1, owned)),
                st.just(min(nt, owned)),
                st.integers(0, owned),
            )
        )
        new = data.draw(st.integers(1, self.bs + 4))
        if comp + new > self.mml and self.mml > comp and data.draw(st.booleans()):
            new = self.mml - comp
        self.allocate(rid, new, data, num_computed_tokens=comp)

    @rule(data=st.data())
    def squeeze(self, data: Any) -> None:
        """Fill the pool until only a few blocks are free, with 1-token requests whose lookahead
        slots take whole blocks (nothing to hit, nothing cached). Fresh blocks go first, so the
        blocks left free are mostly cached ones: the next admission adopts evictable hits under
        capacity pressure, and chunked admissions meet the full-sequence gate."""
        self.squeeze_to(data.draw(st.integers(0, 3)))

    def squeeze_to(self, target: int) -> None:
        for _ in range(4):
            excess = self.model.num_free_blocks - target
            if excess <= 0:
                break
            self.counter += 1
            rid = f"fill{self.counter}"
            self.both("add_request", rid, [3])
            slots = min(excess * self.bs, self.mml)
            self.both(
                "allocate_slots", rid, 1, num_computed_tokens=0, num_lookahead_tokens=slots - 1
            )

    @rule(data=st.data())
    def free(self, data: Any) -> None:
        if not self.model.requests:
            return
        for _ in range(data.draw(st.integers(1, 2))):
            if self.model.requests:
                self.free_request(data.draw(st.sampled_from(self.rids())))

    def free_request(self, rid: str) -> None:
        if self.model.requests[rid].blocks and not rid.startswith("fill"):
            self.freed.append(list(self.model.requests[rid].tokens))
            del self.freed[:-8]
        self.both("free", rid)
        self.pending.pop(rid, None)

    @rule(data=st.data())
    def reset_prefix_cache(self, data: Any) -> None:
        if data.draw(st.integers(0, 3)) == 0:  # rarely: it empties the cache whenever it can
            self.both("reset_prefix_cache")

    @rule(data=st.data())
    def bad_call(self, data: Any) -> None:
        """Invalid input: both must raise the same class (the invariant then checks that the
        manager's state did not move)."""
        kind = data.draw(
            st.sampled_from(
                [
                    "unknown-free",
                    "unknown-lookup",
                    "unknown-allocate",
                    "unknown-append",
                    "bad-token",
                    "duplicate",
                    "zero",
                    "negative",
                    "hits-count",
                    "random-hits",
                    "comp",
                    "too-long",
                ]
            )
        )
        if kind.startswith("unknown"):
            {
                "unknown-free": lambda: self.both("free", "nope"),
                "unknown-lookup": lambda: self.both("get_computed_blocks", "nope"),
                "unknown-allocate": lambda: self.both(
                    "allocate_slots", "nope", 1, num_computed_tokens=0
                ),
                "unknown-append": lambda: self.both("append_token_ids", "nope", [1]),
            }[kind]()
            return
        if not self.model.requests:
            return
        # Only one thing is wrong in each call below (the order in which a manager checks its
        # arguments is not part of the contract).
        rid = data.draw(st.sampled_from(self.rids()))
        if kind == "duplicate":
            self.both_tokens("add_request", rid, [1], data)
        elif kind == "bad-token":
            self.both("append_token_ids", rid, [1, 2**31])  # nothing may be appended
        elif kind == "zero":
            self.both("allocate_slots", rid, 0, num_computed_tokens=0)
        elif kind == "negative":
            field = data.draw(
                st.sampled_from(
                    ["num_computed_tokens", "num_new_computed_tokens", "num_lookahead_tokens"]
                )
            )
            kw = {"num_computed_tokens": 0, field: -1}
            self.both("allocate_slots", rid, 1, **kw)
        elif kind == "hits-count":
            self.both(
                "allocate_slots",
                rid,
                1,
                num_computed_tokens=0,
                num_new_computed_tokens=self.bs + 1,
                new_computed_blocks=[1],
            )
        elif kind == "random-hits":
            # Arbitrary block ids as hits: mostly invalid, occasionally a genuine prefix.
            blocks = data.draw(st.lists(st.integers(-1, self.model.num_blocks), max_size=3))
            num_hit = len(blocks) * self.bs
            if num_hit < self.mml:
                self.both(
                    "allocate_slots",
                    rid,
                    min(data.draw(st.integers(1, 3)), self.mml - num_hit),
                    num_computed_tokens=0,
                    num_new_computed_tokens=num_hit,
                    new_computed_blocks=blocks,
                )
        elif kind == "comp":
            owned = len(self.model.requests[rid].blocks) * self.bs
            if owned + 2 <= self.mml:
                self.both("allocate_slots", rid, 1, num_computed_tokens=owned + 1)
        else:
            self.both("allocate_slots", rid, self.mml + 1, num_computed_tokens=0)

    # ------------------------------------------------------------------ invariants
    @invariant()
    def same_state(self) -> None:
        if self.real is None:
            return
        self.real.check_invariants()
        real, model = observe(self.real), observe(self.model)
        for k in real:
            assert real[k] == model[k], f"{k}: manager {real[k]} != model {model[k]}"
        assert self.real.num_requests == len(self.model.requests)
        assert self.real.prefix_cache_stats() == self.model.prefix_cache_stats()
        assert self.real.usage == pytest.approx(self.model.usage)
        # Key <-> hash bijection, learned from every live request's block hashes.
        for rid in self.model.requests:
            keys = self.model.keys(rid)
            hashes = self.real.block_hashes(rid)
            assert len(hashes) == len(keys)
            for k, h in zip(keys, hashes):
                assert self.key_to_hash.setdefault(k, h) == h, "same prefix, different hash"
                assert self.hash_to_key.setdefault(h, k) == k, "different prefixes, same hash"
        # Every block is registered under exactly the hash of the model's key (or nothing).
        for b in range(self.model.num_blocks):
            k = self.model.key_of_block(b)
            assert self.real.block_hash(b) == (None if k is None else self.key_to_hash[k])


# No explain phase: on a failure it costs ~1 min and adds nothing the notes don't already show.
PHASES = [Phase.explicit, Phase.reuse, Phase.generate, Phase.target, Phase.shrink]

TestKVStateful = KVMachine.TestCase
TestKVStateful.settings = settings(
    max_examples=400,
    stateful_step_count=50,
    deadline=None,
    phases=PHASES,
    report_multiple_bugs=False,
    suppress_health_check=[HealthCheck.too_slow],
)


class SlowKVMachine(KVMachine):
    pass


SlowKVMachine.TestCase.settings = settings(
    max_examples=1500,
    stateful_step_count=100,
    deadline=None,
    phases=PHASES,
    report_multiple_bugs=False,
    suppress_health_check=[HealthCheck.too_slow],
)
TestKVStatefulSlow = pytest.mark.slow(SlowKVMachine.TestCase)
