"""A short demo of the KV-cache manager: admit requests that share a system prompt, allocate
their first prefill with DFlash's K+1 lookahead, and show block tables and pool usage."""

from __future__ import annotations

import argparse
import random

from dflash_rs import KVCacheManager


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--num-blocks", type=int, default=64)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--num-requests", type=int, default=4)
    parser.add_argument("--num-speculative-tokens", "-k", type=int, default=8)
    parser.add_argument("--seed", type=int, default=0)


def run(args: argparse.Namespace) -> int:
    rng = random.Random(args.seed)
    k = args.num_speculative_tokens
    lookahead = k + 1  # DFlash: bonus token + K mask tokens
    kv = KVCacheManager(args.num_blocks, args.block_size, max_model_len=4096, hash_seed=args.seed)
    system_prompt = [rng.randrange(3, 32000) for _ in range(3 * args.block_size)]
    print(
        f"pool: {args.num_blocks} blocks of {args.block_size} tokens "
        f"({kv.num_free_blocks} usable); DFlash K={k} -> lookahead {lookahead} slots"
    )
    for i in range(args.num_requests):
        prompt = system_prompt + [rng.randrange(3, 32000) for _ in range(rng.randrange(1, 40))]
        rid = f"req-{i}"
        kv.add_request(rid, prompt)
        hits, num_hit_tokens = kv.get_computed_blocks(rid)
        new_blocks = kv.allocate_slots(
            rid,
            len(prompt) - num_hit_tokens,
            num_computed_tokens=0,
            num_new_computed_tokens=num_hit_tokens,
            new_computed_blocks=hits,
            num_lookahead_tokens=lookahead,
        )
        if new_blocks is None:
            print(f"{rid}: does not fit ({kv.num_free_blocks} free)")
            continue
        table = kv.block_ids(rid)
        last_query = len(prompt) + k  # positions len(prompt) .. len(prompt)+K are DFlash queries
        owned = len(table) * args.block_size
        print(
            f"{rid}: prompt {len(prompt):3d} tokens, prefix hit {num_hit_tokens:3d}, "
            f"blocks {table} (new {new_blocks}); DFlash queries reach position {last_query} "
            f"< {owned} owned slots: {'ok' if last_query < owned else 'VIOLATION'}"
        )
    kv.check_invariants()
    print(f"pool usage {kv.usage:.1%}, {kv.num_free_blocks} free blocks")
    for rid in kv.request_ids():
        kv.free(rid)
    kv.check_invariants()
    print(f"after freeing every request: {kv.num_free_blocks} free, usage {kv.usage:.1%}")
    return 0
