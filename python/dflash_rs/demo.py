"""A short demo of the KV-cache manager: admit requests that share a system prompt, allocate
their first prefill with DFlash's K+1 lookahead, and show block tables and pool usage."""

from __future__ import annotations

import argparse
import random

from dflash_rs import KVCacheManager
from dflash_rs._cli_types import int_at_least, positive_int, seed, speculative_tokens

#: Context limit of the demo's pool.
MAX_MODEL_LEN = 4096
#: The shared system prompt is this many blocks long.
SYSTEM_PROMPT_BLOCKS = 3
#: Each request adds 1 to this many tokens of its own.
MAX_USER_TOKENS = 39


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add = parser.add_argument
    add("--num-blocks", type=int_at_least(2), default=64, help="KV blocks (block 0 is reserved)")
    add("--block-size", type=positive_int, default=16, help="tokens per KV block")
    add("--num-requests", type=positive_int, default=4, help="requests to admit")
    add("--num-speculative-tokens", "-k", type=speculative_tokens, default=8, help="DFlash K")
    add("--seed", type=seed, default=0, help="prompt and block-hash seed")


def check_args(args: argparse.Namespace) -> None:
    """The longest prompt must fit the demo's max_model_len."""
    longest = SYSTEM_PROMPT_BLOCKS * args.block_size + MAX_USER_TOKENS
    if longest > MAX_MODEL_LEN:
        raise ValueError(
            f"--block-size {args.block_size} makes prompts of up to {longest} tokens, more than "
            f"the demo's max_model_len {MAX_MODEL_LEN}"
        )


def run(args: argparse.Namespace) -> int:
    rng = random.Random(args.seed)
    k = args.num_speculative_tokens
    lookahead = k + 1  # DFlash: bonus token + K mask tokens
    kv = KVCacheManager(
        args.num_blocks, args.block_size, max_model_len=MAX_MODEL_LEN, hash_seed=args.seed
    )
    system_prompt = [rng.randrange(3, 32000) for _ in range(SYSTEM_PROMPT_BLOCKS * args.block_size)]
    print(
        f"pool: {args.num_blocks} blocks of {args.block_size} tokens "
        f"({kv.num_free_blocks} usable); DFlash K={k} -> lookahead {lookahead} slots"
    )
    for i in range(args.num_requests):
        user = [rng.randrange(3, 32000) for _ in range(rng.randrange(1, MAX_USER_TOKENS + 1))]
        prompt = system_prompt + user
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
