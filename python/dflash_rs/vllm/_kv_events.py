"""KV-cache events (``--kv-events-config``): the core's prefix-cache log -> vLLM's own events.

With events on, the Rust core records every block registration (request, logical index,
parent block, tokens), every evicted registration and every reset (``SchedulerConfig.kv_events``).
After each call that may record some, ``KvEvents.collect`` turns them into vLLM's
``BlockStored``, ``BlockRemoved`` and ``AllBlocksCleared``, with the block hashes vLLM publishes
for the same tokens: its hash function and ``NONE_HASH``, its extra keys (cache salt), its
external form (``maybe_convert_block_hash``), and on vLLM 0.33 with lookahead block hashes (its
default for EAGLE-style drafters) the tokens after each block that its hash covers
(``lookahead_token_ids``). The core's own hashes are not vLLM's, so the hash
each block is registered under is kept here, by block id, while it stays registered.
``publish`` hands what was collected since the last one to vLLM's publisher in one
``KVEventBatch``, from ``update_from_output`` as vLLM's ``Scheduler`` does.
"""

from __future__ import annotations

import time
from typing import Any

from dflash_rs.vllm._requests import RequestBook

__all__ = ["KvEvents", "create_publisher"]


def create_publisher(vllm_config: Any) -> Any:
    """vLLM's event publisher, created as its ``Scheduler`` creates it (a no-op publisher
    without ``--kv-events-config``)."""
    from vllm.distributed.kv_events import EventPublisherFactory

    return EventPublisherFactory.create(
        vllm_config.kv_events_config, vllm_config.parallel_config.data_parallel_index
    )


class KvEvents:
    """Turns the core's KV-cache event log into vLLM's events and publishes them."""

    def __init__(
        self,
        core: Any,
        book: RequestBook,
        vllm_config: Any,
        kv_cache_config: Any,
        block_size: int,
    ) -> None:
        from vllm.distributed.kv_events import (
            MEDIUM_GPU,
            AllBlocksCleared,
            BlockRemoved,
            BlockStored,
            KVEventBatch,
        )
        from vllm.utils.hashing import get_hash_fn_by_name
        from vllm.v1.core.kv_cache_utils import (
            generate_block_hash_extra_keys,
            hash_block_tokens,
            maybe_convert_block_hash,
            to_event_extra_keys,
        )
        from vllm.v1.kv_cache_interface import (
            get_kv_cache_spec_kind,
            get_kv_cache_spec_sliding_window,
        )

        from dflash_rs.vllm._compat import installed

        self.core = core
        self.book = book
        self.block_size = block_size
        self.hash_fn = get_hash_fn_by_name(vllm_config.cache_config.prefix_caching_hash_algo)
        self.AllBlocksCleared = AllBlocksCleared
        self.BlockRemoved = BlockRemoved
        self.BlockStored = BlockStored
        self.KVEventBatch = KVEventBatch
        self.medium = MEDIUM_GPU  # what vLLM's KVCacheManager gives its block pool
        self.extra_keys = generate_block_hash_extra_keys
        #: Tokens after each block that its hash covers (vLLM 0.33's lookahead hashes; 0: none).
        self.lookahead = installed().num_hash_lookahead_tokens(vllm_config)
        if self.lookahead:
            from vllm.v1.core.kv_cache_utils import generate_lookahead_block_hash_extra_keys

            self.lookahead_extra_keys = generate_lookahead_block_hash_extra_keys
        self.hash_block_tokens = hash_block_tokens
        self.external = maybe_convert_block_hash
        self.to_event_extra_keys = to_event_extra_keys
        # The one KV-cache group (others are refused): what vLLM's KVCacheManager.take_events
        # adds to every BlockStored.
        spec = kv_cache_config.kv_cache_groups[0].kv_cache_spec
        self.spec_kind = get_kv_cache_spec_kind(spec).value
        self.spec_sliding_window = get_kv_cache_spec_sliding_window(spec)
        #: Block id -> the vLLM block hash it is registered under.
        self.hashes: dict[int, Any] = {}
        #: Events collected since the last publish.
        self.pending: list[Any] = []
        book.recently_finished = {}

    def collect(self) -> None:
        """Converts the events the core recorded since the last call."""
        for event in self.core.take_kv_events():
            kind = event[0]
            if kind == "stored":
                self.pending.append(self._stored(*event[1:]))
            elif kind == "removed":
                block_hash = self.hashes.pop(event[1])
                self.pending.append(
                    self.BlockRemoved(
                        block_hashes=[self.external(block_hash)], medium=self.medium, group_idx=0
                    )
                )
            else:
                self.hashes.clear()
                self.pending.append(self.AllBlocksCleared())
        finished = self.book.recently_finished
        if finished:
            finished.clear()

    def _stored(
        self, rid: str, first: int, parent: int, block_ids: list[int], token_ids: list[int]
    ) -> Any:
        """vLLM's ``BlockStored`` for blocks ``first..`` of request ``rid``, as its
        ``BlockPool.cache_full_blocks`` builds it."""
        book = self.book
        request = book.requests.get(rid)
        if request is None:
            # Registered in the call that finished it (its last accepted tokens).
            request = book.recently_finished[rid]  # type: ignore[index]
        bs = self.block_size
        known = request.block_hashes  # the prompt's, hashed by the engine
        parent_hash = None if first == 0 else self.hashes[parent]
        block_hash = parent_hash
        hashes: list[Any] = []
        extra_keys: list[Any] = []
        lookahead, lookahead_ids = self.lookahead, []
        for i, block in enumerate(block_ids):
            index = first + i
            start = index * bs
            tokens = token_ids[i * bs : (i + 1) * bs]
            if lookahead:
                # As vLLM's lookahead hasher: extra keys over the block and its next tokens,
                # hashed as (E, *next tokens).
                after = token_ids[(i + 1) * bs : (i + 1) * bs + lookahead]
                extra, _ = self.lookahead_extra_keys(
                    request, start, start + bs, start + bs + lookahead, 0
                )
                hash_extra: Any = (extra, *after)
                lookahead_ids.append(after)
            else:
                extra, _ = self.extra_keys(request, start, start + bs, 0)
                hash_extra = extra
            if index < len(known):
                block_hash = known[index]
            else:
                block_hash = self.hash_block_tokens(self.hash_fn, block_hash, tokens, hash_extra)
            self.hashes[block] = block_hash
            hashes.append(self.external(block_hash))
            extra_keys.append(extra)
        more = {"lookahead_token_ids": lookahead_ids} if lookahead else {}
        lora = request.lora_request
        event = self.BlockStored(
            block_hashes=hashes,
            parent_block_hash=None if parent_hash is None else self.external(parent_hash),
            token_ids=token_ids[: len(block_ids) * bs],
            block_size=bs,
            lora_id=lora.adapter_id if lora else None,
            medium=self.medium,
            lora_name=lora.name if lora else None,
            extra_keys=self.to_event_extra_keys(extra_keys),
            group_idx=0,
            session_id=request.session_id,
            **more,
        )
        event.kv_cache_spec_kind = self.spec_kind
        event.kv_cache_spec_sliding_window = self.spec_sliding_window
        return event

    def publish(self, publisher: Any) -> None:
        """Publishes through ``publisher`` what was collected since the last call, if
        anything, in one batch."""
        self.collect()
        if self.pending:
            batch = self.KVEventBatch(ts=time.time(), events=self.pending)
            self.pending = []
            publisher.publish(batch)
