"""A small pure-Python reference model of the KV-cache manager rules.

Written from vLLM 0.33's behaviour for one full-attention KV group (its block pool, KV-cache
manager and their invariants) and this project's ownership rules -- not from the Rust sources.
It is deliberately naive (plain lists and dicts, O(n) everywhere) so that it is easy to check by
eye.

Differences from vLLM that our API has on purpose: no EAGLE "drop the last hit block" rule, block
hashes are our own, and bad input raises (the model raises the same exception classes).

Prefix-cache keys: instead of re-implementing the hash chain, a full block ``i`` of a request is
keyed by ``(lora_name, cache_salt, tuple(tokens[: (i + 1) * block_size]))``.  A chained hash of
block ``i`` depends on exactly these inputs (every earlier token, the LoRA name on every block and
the cache salt on block 0, which the chain carries forward), so two blocks share a key iff they
share a hash.  The stateful test checks that correspondence against the real hashes.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, Hashable, List, Optional, Sequence, Tuple

from dflash_rs.errors import (
    DuplicateRequestError,
    InvalidArgumentError,
    PromptTooLongError,
    UnknownRequestError,
)
from support.arithmetic import cdiv

NULL_BLOCK = 0
MAX_TOKEN_ID = 2**31 - 1

Key = Tuple[Optional[str], Optional[str], Tuple[int, ...]]


@dataclass
class ModelRequest:
    tokens: List[int]
    lora_name: Optional[str]
    cache_salt: Optional[str]
    blocks: List[int] = field(default_factory=list)
    num_cached: int = 0


class KVModel:
    """Reference model of one full-attention KV-cache group with a shared block pool."""

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        max_model_len: int,
        enable_prefix_caching: bool = True,
    ) -> None:
        assert num_blocks >= 2 and block_size >= 1 and max_model_len >= 1
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.enable_prefix_caching = enable_prefix_caching
        # Free queue, head (index 0) is reused/evicted first. Block 0 is the null block and is
        # never in it.
        self.free_queue: List[int] = list(range(1, num_blocks))
        self.ref: List[int] = [0] * num_blocks
        # block id -> key it is registered under in the prefix cache
        self.block_key: Dict[int, Key] = {}
        # key -> block ids registered under it, in insertion order (first one is served)
        self.cache: Dict[Key, List[int]] = {}
        self.requests: Dict[str, ModelRequest] = {}
        self.stats = [0, 0, 0]  # lookups, queried tokens, hit tokens

    # ------------------------------------------------------------------ helpers
    def key(self, request_id: str, i: int) -> Key:
        """Prefix-cache key of full block ``i`` of a request."""
        r = self.requests[request_id]
        end = (i + 1) * self.block_size
        assert end <= len(r.tokens)
        return (r.lora_name, r.cache_salt, tuple(r.tokens[:end]))

    def keys(self, request_id: str) -> List[Key]:
        """Keys of every full block of the request (what its block hashes stand for)."""
        if not self.enable_prefix_caching:
            return []
        n = len(self.requests[request_id].tokens) // self.block_size
        return [self.key(request_id, i) for i in range(n)]

    def _req(self, request_id: str) -> ModelRequest:
        if request_id not in self.requests:
            raise UnknownRequestError(f'unknown request id "{request_id}"')
        return self.requests[request_id]

    @staticmethod
    def _check_tokens(token_ids: Sequence[int]) -> List[int]:
        out = list(token_ids)
        for t in out:
            if not 0 <= t <= MAX_TOKEN_ID:
                raise InvalidArgumentError(f"token id {t} out of range")
        return out

    def _pop_free(self, n: int) -> List[int]:
        assert n <= len(self.free_queue)
        popped, self.free_queue = self.free_queue[:n], self.free_queue[n:]
        for b in popped:
            # Reusing a block evicts whatever it was cached as.
            k = self.block_key.pop(b, None)
            if k is not None:
                self.cache[k].remove(b)
                if not self.cache[k]:
                    del self.cache[k]
            assert self.ref[b] == 0
            self.ref[b] = 1
        return popped

    # ------------------------------------------------------------------ API
    @property
    def num_free_blocks(self) -> int:
        return len(self.free_queue)

    @property
    def usage(self) -> float:
        return 1.0 - len(self.free_queue) / (self.num_blocks - 1)

    @property
    def num_prefix_cached_blocks(self) -> int:
        return sum(len(v) for v in self.cache.values())

    def add_request(
        self,
        request_id: str,
        token_ids: Sequence[int],
        lora_name: Optional[str] = None,
        cache_salt: Optional[str] = None,
    ) -> None:
        if not request_id:
            raise InvalidArgumentError("request_id must be a non-empty string")
        if request_id in self.requests:
            raise DuplicateRequestError(f'request id "{request_id}" is already in use')
        tokens = self._check_tokens(token_ids)
        if not tokens:
            raise InvalidArgumentError("token_ids must not be empty")
        if len(tokens) > self.max_model_len:
            raise PromptTooLongError("prompt exceeds max_model_len")
        self.requests[request_id] = ModelRequest(tokens, lora_name, cache_salt)

    def append_token_ids(self, request_id: str, token_ids: Sequence[int]) -> None:
        r = self._req(request_id)
        tokens = self._check_tokens(token_ids)
        if len(r.tokens) + len(tokens) > self.max_model_len:
            raise PromptTooLongError("sequence exceeds max_model_len")
        r.tokens.extend(tokens)

    def get_computed_blocks(self, request_id: str) -> Tuple[List[int], int]:
        r = self._req(request_id)
        if not self.enable_prefix_caching:
            return [], 0
        hits = self.longest_cache_hit(request_id)
        num_hit = len(hits) * self.block_size
        self.stats[0] += 1
        self.stats[1] += len(r.tokens)
        self.stats[2] += num_hit
        return hits, num_hit

    def longest_cache_hit(self, request_id: str) -> List[int]:
        """The hit blocks ``get_computed_blocks`` would report, without recording a lookup."""
        r = self._req(request_id)
        if not self.enable_prefix_caching:
            return []
        # Cap at num_tokens - 1: the last token is always recomputed (logits are needed).
        max_hit_blocks = (len(r.tokens) - 1) // self.block_size
        hits: List[int] = []
        for i in range(max_hit_blocks):
            blocks = self.cache.get(self.key(request_id, i))
            if not blocks:
                break
            hits.append(blocks[0])
        return hits

    def allocate_slots(
        self,
        request_id: str,
        num_new_tokens: int,
        *,
        num_computed_tokens: int,
        num_new_computed_tokens: int = 0,
        new_computed_blocks: Sequence[int] = (),
        num_lookahead_tokens: int = 0,
        full_sequence_must_fit: bool = False,
    ) -> Optional[List[int]]:
        bs = self.block_size
        r = self._req(request_id)
        hits = list(new_computed_blocks)
        # ---- validation (raises, changes nothing)
        for name, v in (
            ("num_new_tokens", num_new_tokens),
            ("num_computed_tokens", num_computed_tokens),
            ("num_new_computed_tokens", num_new_computed_tokens),
            ("num_lookahead_tokens", num_lookahead_tokens),
        ):
            if v < 0:
                raise InvalidArgumentError(f"{name} must be >= 0")
        if num_new_tokens == 0:
            raise InvalidArgumentError("num_new_tokens must be positive")
        if num_new_computed_tokens != len(hits) * bs:
            raise InvalidArgumentError("num_new_computed_tokens != len(new_computed_blocks) * bs")
        if hits and (r.blocks or num_computed_tokens > 0):
            raise InvalidArgumentError("hits only for a request that holds no blocks")
        if hits and num_new_computed_tokens >= len(r.tokens):
            raise InvalidArgumentError("a prefix hit must be below the sequence length")
        for i, b in enumerate(hits):
            if not (0 <= b < self.num_blocks) or self.block_key.get(b) != self.key(request_id, i):
                raise InvalidArgumentError("not the cached block of this request's prefix")
        main = num_computed_tokens + num_new_computed_tokens + num_new_tokens
        if main > self.max_model_len:
            raise PromptTooLongError("exceeds max_model_len")
        if num_computed_tokens > len(r.blocks) * bs:
            raise InvalidArgumentError("num_computed_tokens exceeds the owned slots")

        # ---- capacity (all-or-nothing: a None changes nothing)
        held = len(r.blocks) + len(hits)
        evictable_hits = sum(1 for b in hits if self.ref[b] == 0)
        if full_sequence_must_fit:
            full_len = min(len(r.tokens), self.max_model_len)
            need_full = max(cdiv(full_len, bs) - held, 0) + evictable_hits
            if need_full > len(self.free_queue):
                return None
        need_slot = min(main + num_lookahead_tokens, self.max_model_len)
        num_new_blocks = max(cdiv(need_slot, bs) - held, 0)
        if num_new_blocks + evictable_hits > len(self.free_queue):
            return None

        # ---- adopt hits first (touch: leave the free queue), then pop fresh blocks
        for b in hits:
            if self.ref[b] == 0:
                self.free_queue.remove(b)
            self.ref[b] += 1
        if hits:
            r.blocks = list(hits)
            r.num_cached = len(hits)
        new_blocks = self._pop_free(num_new_blocks)
        r.blocks.extend(new_blocks)

        # ---- cache full blocks of known tokens (never drafts, never lookahead slots)
        if self.enable_prefix_caching:
            num_known = min(main, len(r.tokens))
            num_full = num_known // bs
            for i in range(r.num_cached, num_full):
                b = r.blocks[i]
                assert b not in self.block_key
                k = self.key(request_id, i)
                self.block_key[b] = k
                self.cache.setdefault(k, []).append(b)
            r.num_cached = max(r.num_cached, num_full)
        return new_blocks

    def free(self, request_id: str) -> None:
        """Release every block of the request, tail first (a chain's tail is evicted before its
        parents).  Blocks whose count reaches 0 go back to the free queue in two groups, each in
        that tail-first order (vLLM 0.33 ``BlockPool.free_blocks``):

        * blocks registered in the prefix cache are appended at the tail -- they stay cached as
          long as possible (LRU by free time);
        * blocks without a hash (partial blocks, everything when caching is off) can never be
          hit, so they are prepended at the head and reused first.

        (vLLM 0.23 appended both groups; 0.33's reference tests expect e.g. the free order
        ``[5, 4, 6, 7, 8, 9, 10, 3, 2, 1]`` in test_prefill.)
        """
        r = self._req(request_id)
        reuse_first: List[int] = []
        evict_last: List[int] = []
        for b in reversed(r.blocks):
            self.ref[b] -= 1
            assert self.ref[b] >= 0
            if self.ref[b] == 0:
                (evict_last if b in self.block_key else reuse_first).append(b)
        self.free_queue = reuse_first + self.free_queue + evict_last
        del self.requests[request_id]

    def reset_prefix_cache(self) -> bool:
        if any(self.ref[b] > 0 for b in range(1, self.num_blocks)):
            return False
        self.cache.clear()
        self.block_key.clear()
        return True

    # ------------------------------------------------------------------ views
    def block_ids(self, request_id: str) -> List[int]:
        return list(self._req(request_id).blocks)

    def num_tokens(self, request_id: str) -> int:
        return len(self._req(request_id).tokens)

    def num_cached_blocks(self, request_id: str) -> int:
        return self._req(request_id).num_cached

    def free_block_ids(self) -> List[int]:
        return list(self.free_queue)

    def ref_count(self, block_id: int) -> int:
        return self.ref[block_id]

    def key_of_block(self, block_id: int) -> Optional[Hashable]:
        return self.block_key.get(block_id)

    def prefix_cache_stats(self) -> Tuple[int, int, int]:
        return (self.stats[0], self.stats[1], self.stats[2])


def observe(kv: Any) -> Dict[str, Any]:
    """Everything observable about a pool, read through the API surface both objects share.

    Works on the real ``dflash_rs.KVCacheManager`` and on :class:`KVModel` alike, so a test can
    compare the two, or one object before and after a call (block hashes are compared separately:
    the model has keys, the manager has bytes).
    """
    rids = sorted(kv.requests) if isinstance(kv, KVModel) else sorted(kv.request_ids())
    return {
        "num_free_blocks": kv.num_free_blocks,
        "free_block_ids": kv.free_block_ids(),
        "ref_counts": [kv.ref_count(b) for b in range(1, kv.num_blocks)],
        "num_prefix_cached_blocks": kv.num_prefix_cached_blocks,
        "requests": {
            rid: (kv.block_ids(rid), kv.num_tokens(rid), kv.num_cached_blocks(rid)) for rid in rids
        },
    }


def snapshot(manager: Any) -> Dict[str, Any]:
    """:func:`observe` plus what only the real manager has: block hashes and lookup stats."""
    state = observe(manager)
    state["block_hash"] = [manager.block_hash(b) for b in range(manager.num_blocks)]
    state["block_hashes"] = {rid: manager.block_hashes(rid) for rid in state["requests"]}
    state["prefix_cache_stats"] = manager.prefix_cache_stats()
    state["usage"] = manager.usage
    state["num_requests"] = manager.num_requests
    return state
