"""Bad configs (``SchedulerConfig`` and duck configs, their speculative part, sizes whose
tables cannot be allocated) raise a typed error with the exact message; the numpy integers and
block sizes that are accepted. The shared pieces are in bad_input.py."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any, Callable, Dict, Tuple, Type

import numpy as np
import pytest

from dflash_rs import (
    ArgumentTypeError,
    DFlashRsError,
    InvalidArgumentError,
    Request,
    Scheduler,
    SchedulerConfig,
    SpeculativeConfig,
)

from .bad_input import check_raises, duck_config
from .drivers import make_scheduler


def _duck_config_without(name: str) -> SimpleNamespace:
    fields = vars(duck_config())
    del fields[name]
    return SimpleNamespace(**fields)


_INT32_FIELDS = (
    "num_blocks",
    "block_size",
    "max_model_len",
    "max_num_seqs",
    "max_num_batched_tokens",
)


_PAST_RANGE = "is out of range: integers must lie in [-2**63, 2**63 - 1]"


#: Bad fields of a scheduler config: overrides of ``duck_config()``, the error and its exact
#: message. ``SchedulerConfig`` and a duck-typed config given to ``Scheduler`` are checked by one
#: validator, so both raise exactly this.
FIELD_CASES: Dict[str, Tuple[Dict[str, Any], Type[BaseException], str]] = {
    "num_blocks 1": (
        {"num_blocks": 1},
        InvalidArgumentError,
        "config.num_blocks must be >= 2, got 1",
    ),
    "num_blocks 0": (
        {"num_blocks": 0},
        InvalidArgumentError,
        "config.num_blocks must be >= 2, got 0",
    ),
    "num_blocks negative": (
        {"num_blocks": -3},
        InvalidArgumentError,
        "config.num_blocks must be >= 2, got -3",
    ),
    "num_blocks str": (
        {"num_blocks": "10"},
        ArgumentTypeError,
        "config.num_blocks must be an int, got str",
    ),
    "num_blocks bool": (
        {"num_blocks": True},
        ArgumentTypeError,
        "config.num_blocks must be an int, got the bool True",
    ),
    "num_blocks numpy bool": (
        {"num_blocks": np.True_},
        ArgumentTypeError,
        "config.num_blocks must be an int, got the bool True",
    ),
    "num_blocks huge": (
        {"num_blocks": 2**70},
        InvalidArgumentError,
        f"config.num_blocks = {2**70} {_PAST_RANGE}",
    ),
    "block_size 0": (
        {"block_size": 0},
        InvalidArgumentError,
        "config.block_size must be >= 1, got 0",
    ),
    "block_size negative": (
        {"block_size": -16},
        InvalidArgumentError,
        "config.block_size must be >= 1, got -16",
    ),
    "block_size float": (
        {"block_size": 16.0},
        ArgumentTypeError,
        "config.block_size must be an int, got float",
    ),
    "max_model_len 1": (
        {"max_model_len": 1},
        InvalidArgumentError,
        "config.max_model_len must be >= 2, got 1",
    ),
    "max_model_len huge": (
        {"max_model_len": 2**64},
        InvalidArgumentError,
        f"config.max_model_len = {2**64} {_PAST_RANGE}",
    ),
    "max_num_seqs 0": (
        {"max_num_seqs": 0},
        InvalidArgumentError,
        "config.max_num_seqs must be >= 1, got 0",
    ),
    "max_num_seqs negative": (
        {"max_num_seqs": -1},
        InvalidArgumentError,
        "config.max_num_seqs must be >= 1, got -1",
    ),
    "budget 0": (
        {"max_num_batched_tokens": 0},
        InvalidArgumentError,
        "config.max_num_batched_tokens must be >= 1, got 0",
    ),
    "no chunking and budget < max_model_len": (
        {"enable_chunked_prefill": False, "max_num_batched_tokens": 32},
        InvalidArgumentError,
        "without chunked prefill, max_num_batched_tokens (32) must be >= max_model_len (64)",
    ),
    "long_prefill_token_threshold negative": (
        {"long_prefill_token_threshold": -1},
        InvalidArgumentError,
        "config.long_prefill_token_threshold must be >= 0, got -1",
    ),
    "draft_slots_per_request bool": (
        {"draft_slots_per_request": True},
        ArgumentTypeError,
        "config.draft_slots_per_request must be an int, got the bool True",
    ),
    "draft slots fill the budget": (
        {"draft_slots_per_request": 64},
        InvalidArgumentError,
        "draft_slots_per_request (64) must be below max_num_batched_tokens (64): no request "
        "could be scheduled",
    ),
    "hash_lookahead_tokens 65": (
        {"hash_lookahead_tokens": 65},
        InvalidArgumentError,
        "hash_lookahead_tokens 65 is above 64",
    ),
    "hash lookahead with the block drop": (
        {"hash_lookahead_tokens": 1, "drop_last_hit_block": True},
        InvalidArgumentError,
        "hash_lookahead_tokens and drop_last_hit_block exclude each other: lookahead hashes "
        "make the last hit block reusable, the drop recomputes it",
    ),
    "max_loras negative": (
        {"max_loras": -1},
        InvalidArgumentError,
        "config.max_loras must be >= 0, got -1",
    ),
    "enable_prefix_caching str": (
        {"enable_prefix_caching": "no"},
        ArgumentTypeError,
        "config.enable_prefix_caching must be a bool, got str",
    ),
    "enable_chunked_prefill int": (
        {"enable_chunked_prefill": 1},
        ArgumentTypeError,
        "config.enable_chunked_prefill must be a bool, got int",
    ),
    "verify_prefix_hits str": (
        {"verify_prefix_hits": "yes"},
        ArgumentTypeError,
        "config.verify_prefix_hits must be a bool, got str",
    ),
    "async_scheduling int": (
        {"async_scheduling": 1},
        ArgumentTypeError,
        "config.async_scheduling must be a bool, got int",
    ),
    "policy": (
        {"policy": "lifo"},
        InvalidArgumentError,
        'unknown policy "lifo"; expected "fcfs" or "priority"',
    ),
    "policy None": (
        {"policy": None},
        ArgumentTypeError,
        "config.policy must be a str, got NoneType",
    ),
    "lookahead_policy": (
        {"lookahead_policy": "legacy"},
        InvalidArgumentError,
        'unknown lookahead_policy "legacy"; expected "correct", "legacy-first-prefill" or '
        '"legacy-k"',
    ),
    "hash_algo": (
        {"hash_algo": "md5"},
        InvalidArgumentError,
        'unknown hash_algo "md5"; expected one of "sha256", "blake3", "xxh3_128"',
    ),
    "hash_seed float": (
        {"hash_seed": 1.5},
        ArgumentTypeError,
        "hash_seed must be str, bytes, int or None, got float",
    ),
    "hash_seed bool": (
        {"hash_seed": True},
        ArgumentTypeError,
        "hash_seed must be str, bytes, int or None, got bool",
    ),
    "vllm_semantics float": (
        {"vllm_semantics": 0.33},
        ArgumentTypeError,
        "config.vllm_semantics must be a str, got float",
    ),
    "vllm_semantics unknown": (
        {"vllm_semantics": "0.31"},
        InvalidArgumentError,
        'unknown vLLM semantics "0.31"; expected "0.32" or "0.33"',
    ),
    "speculative a str": (
        {"speculative": "dflash"},
        ArgumentTypeError,
        "config.speculative must be a SpeculativeConfig or None, got str",
    ),
    # Every size field is int32 on the model side.
    **{
        f"{field} above int32": (
            {field: 2**31},
            InvalidArgumentError,
            f"{field} (2147483648) must be at most 2**31 - 1 = 2147483647: block ids, token "
            "positions and counts reach the model runner as int32",
        )
        for field in _INT32_FIELDS
    },
    "pool one block short of one max_model_len request": (
        {"num_blocks": 4},
        InvalidArgumentError,
        "num_blocks (4) cannot hold one request of max_model_len (64) tokens: that needs "
        "cdiv(64, block_size 16) = 4 blocks plus the null block, 5 in all; raise num_blocks or "
        "lower max_model_len",
    ),
}


def _error_of(make: Callable[[], Any]) -> BaseException:
    with pytest.raises(DFlashRsError) as info:
        make()
    return info.value


@pytest.mark.parametrize("name", list(FIELD_CASES))
def test_bad_config_field_raises_one_error_for_dataclass_and_duck_configs(name: str) -> None:
    overrides, error, message = FIELD_CASES[name]
    fields = {**vars(duck_config()), **overrides}
    from_dataclass = _error_of(lambda: SchedulerConfig(**fields))
    from_duck = _error_of(lambda: Scheduler(duck_config(**overrides)))
    for raised in (from_dataclass, from_duck):
        assert type(raised) is error
        assert str(raised) == message


#: Bad speculative configs: method, K, the error, and its message after "speculative." or
#: "config.speculative." (None: a message without that prefix).
SPECULATIVE_CASES: Dict[str, Tuple[Any, Any, Type[BaseException], str, bool]] = {
    "unknown method": (
        "medusa",
        3,
        InvalidArgumentError,
        'unknown speculative method "medusa"; expected one of dflash, eagle, eagle3, mtp, '
        "draft_model, ngram, suffix",
        False,
    ),
    "method in the wrong case": (
        "DFlash",
        2,
        InvalidArgumentError,
        'unknown speculative method "DFlash"; expected one of dflash, eagle, eagle3, mtp, '
        "draft_model, ngram, suffix",
        False,
    ),
    "method None": (None, 2, ArgumentTypeError, "method must be a str, got NoneType", True),
    "method an int": (3, 3, ArgumentTypeError, "method must be a str, got int", True),
    "K = 0": (
        "dflash",
        0,
        InvalidArgumentError,
        "num_speculative_tokens must be in [1, 64], got 0",
        True,
    ),
    "K negative": (
        "dflash",
        -1,
        InvalidArgumentError,
        "num_speculative_tokens must be in [1, 64], got -1",
        True,
    ),
    "K = 65": (
        "eagle",
        65,
        InvalidArgumentError,
        "num_speculative_tokens must be in [1, 64], got 65",
        True,
    ),
    "K bool": (
        "dflash",
        True,
        ArgumentTypeError,
        "num_speculative_tokens must be an int, got the bool True",
        True,
    ),
    "K numpy bool": (
        "dflash",
        np.True_,
        ArgumentTypeError,
        "num_speculative_tokens must be an int, got the bool True",
        True,
    ),
    "K float": (
        "eagle",
        2.0,
        ArgumentTypeError,
        "num_speculative_tokens must be an int, got float",
        True,
    ),
    "K str": (
        "dflash",
        "3",
        ArgumentTypeError,
        "num_speculative_tokens must be an int, got str",
        True,
    ),
    "K huge": (
        "dflash",
        2**70,
        InvalidArgumentError,
        f"num_speculative_tokens = {2**70} {_PAST_RANGE}",
        True,
    ),
}


@pytest.mark.parametrize("name", list(SPECULATIVE_CASES))
def test_bad_speculative_config_raises_one_error_alone_and_in_a_scheduler(name: str) -> None:
    method, k, error, message, prefixed = SPECULATIVE_CASES[name]
    alone = _error_of(lambda: SpeculativeConfig(method, k))
    duck = SimpleNamespace(method=method, num_speculative_tokens=k)
    in_scheduler = _error_of(lambda: Scheduler(duck_config(speculative=duck)))
    for raised, prefix in ((alone, "speculative."), (in_scheduler, "config.speculative.")):
        assert type(raised) is error
        assert str(raised) == (prefix + message if prefixed else message)


CONFIG_CASES: Dict[str, Tuple[Callable[[], Any], Type[BaseException], str]] = {
    "method none alone": (
        lambda: SpeculativeConfig("none", 0),
        InvalidArgumentError,
        'unknown speculative method "none": without speculation pass speculative=None',
    ),
    "K without a method (duck)": (
        lambda: Scheduler(
            duck_config(speculative=SimpleNamespace(method="none", num_speculative_tokens=2))
        ),
        InvalidArgumentError,
        "num_speculative_tokens must be 0 without a speculative method",
    ),
    "speculative without K (duck)": (
        lambda: Scheduler(duck_config(speculative=SimpleNamespace(method="dflash"))),
        InvalidArgumentError,
        'config.speculative has no attribute "num_speculative_tokens"',
    ),
    "not a config": (
        lambda: Scheduler(object()),
        InvalidArgumentError,
        'config has no attribute "num_blocks"',
    ),
    "no speculative attribute (duck)": (
        lambda: Scheduler(_duck_config_without("speculative")),
        InvalidArgumentError,
        'config has no attribute "speculative"',
    ),
    "pool short of the default max_model_len": (
        lambda: SchedulerConfig(10),
        InvalidArgumentError,
        "num_blocks (10) cannot hold one request of max_model_len (8192) tokens",
    ),
    "the issue's max_model_len 2**40": (
        lambda: SchedulerConfig(num_blocks=64, max_model_len=2**40, max_num_seqs=8),
        InvalidArgumentError,
        "max_model_len (1099511627776) must be at most 2**31 - 1",
    ),
}


@pytest.mark.parametrize("name", list(CONFIG_CASES))
def test_bad_config(name: str) -> None:
    check_raises(*CONFIG_CASES[name])


def test_numpy_integers_in_configs_are_stored_as_ints() -> None:
    config = SchedulerConfig(
        np.int64(64),
        block_size=np.int32(16),
        max_model_len=np.uint16(256),
        speculative=SpeculativeConfig("dflash", np.int8(3)),
    )
    assert type(config.num_blocks) is int and config.num_blocks == 64
    assert type(config.block_size) is int and type(config.max_model_len) is int
    assert speculative_k_is_int(config)


def speculative_k_is_int(config: SchedulerConfig) -> bool:
    assert config.speculative is not None
    return type(config.speculative.num_speculative_tokens) is int


def test_non_power_of_two_block_size_is_supported() -> None:
    """No entry point requires a power-of-two block size: 3-token blocks schedule and map
    positions like any other size."""
    sched = make_scheduler(12, block_size=3, max_model_len=30, method="dflash", k=2)
    sched.add_request(Request("a", list(range(7)), 4))
    out = sched.schedule()
    # 7 tokens + K + 1 = 3 lookahead slots -> 10 positions -> 4 blocks of 3.
    assert out.num_blocks_per_row.tolist() == [4]
    assert out.block_table[0, :4].tolist() == sched.block_ids("a")
    sched.check_invariants()


_OVERSIZED = """
import resource, sys, time
from dflash_rs import InvalidArgumentError, KVCacheManager, Scheduler, SchedulerConfig

def peak_mib():
    # This process's peak RSS: VmHWM restarts at exec, unlike ru_maxrss (the parent's counts).
    try:
        with open("/proc/self/status") as status:
            return next(int(l.split()[1]) for l in status if l.startswith("VmHWM:")) // 1024
    except OSError:
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024

def bypass(**fields):
    # Past the Python wrapper's own checks, to the core's.
    config = SchedulerConfig(num_blocks=64, max_model_len=1008)
    for name, value in fields.items():
        object.__setattr__(config, name, value)
    return config

start = time.perf_counter()
try:
    {call}
except InvalidArgumentError as exc:
    print("InvalidArgumentError:", exc)
    print("seconds", time.perf_counter() - start)
    print("peak_mib", peak_mib())
    sys.exit(0)
print("accepted after", time.perf_counter() - start, "s with a peak of", peak_mib(), "MiB")
sys.exit(3)
"""


_I32 = 2**31 - 1


#: Configs whose tables cannot (or may not) be allocated: the call, and what the error says.
OVERSIZED: Dict[str, Tuple[str, str]] = {
    "the issue's repro": (
        "Scheduler(SchedulerConfig(num_blocks=64, max_model_len=2**40, max_num_seqs=8))",
        "max_model_len (1099511627776) must be at most 2**31 - 1",
    ),
    **{
        f"{field} above int32 (core)": (
            f"Scheduler(bypass({field}=2**40))",
            f"{field} (1099511627776) must be at most 2**31 - 1",
        )
        for field in _INT32_FIELDS
    },
    # A 2 GiB table that the old code zero-filled for a pool that holds 1008 tokens.
    "max_model_len beyond the pool (core)": (
        f"Scheduler(bypass(max_model_len={_I32}, max_num_seqs=4))",
        f"num_blocks (64) cannot hold one request of max_model_len ({_I32}) tokens",
    ),
    "block table beyond memory": (
        f"Scheduler(SchedulerConfig(num_blocks=2**21 + 1, block_size=1024, "
        f"max_model_len={_I32}, max_num_seqs={_I32}))",
        f"the block table (max_num_seqs = {_I32} rows of cdiv(max_model_len = {_I32}, "
        "block_size = 1024) = 2097152 int32 entries) takes 16.0 PiB",
    ),
    "pool beyond memory": (
        f"Scheduler(SchedulerConfig(num_blocks={_I32}, block_size=2**20, max_model_len=2**20, "
        "max_num_seqs=1))",
        f"the pool's per-block tables (num_blocks = {_I32} blocks, each with a copy of its "
        "block_size = 1048576 tokens) take 8.0 PiB",
    ),
    "KVCacheManager pool beyond memory": (
        f"KVCacheManager({_I32}, 2**20, 2**20)",
        "the config needs 8.0 PiB up front, more than the",
    ),
    "KVCacheManager num_blocks above int32": (
        "KVCacheManager(2**31, 16, 1024)",
        "num_blocks (2147483648) must be at most 2**31 - 1",
    ),
}


@pytest.mark.parametrize("name", list(OVERSIZED))
def test_oversized_config_raises_before_allocating(name: str) -> None:
    """A config whose up-front tables are out of bounds raises InvalidArgumentError naming the
    fields and the size, at once and without touching the memory (peak RSS of the child). Run
    in a child process with an 8 GiB address-space limit, so that a regression cannot take the
    session down."""
    import resource
    import subprocess
    import sys

    def limit_memory() -> None:
        resource.setrlimit(resource.RLIMIT_AS, (8 << 30, 8 << 30))

    call, fragment = OVERSIZED[name]
    done = subprocess.run(
        [sys.executable, "-c", _OVERSIZED.format(call=call)],
        capture_output=True,
        text=True,
        timeout=120,
        preexec_fn=limit_memory,
        check=False,
    )
    if "Traceback" in done.stderr:  # a Python error in the child is not the failure expected
        raise RuntimeError(done.stderr)
    assert done.returncode == 0, (done.returncode, done.stdout, done.stderr[-300:])
    assert fragment in done.stdout
    lines = dict(line.split(" ", 1) for line in done.stdout.splitlines()[1:])
    assert float(lines["seconds"]) < 1.0, done.stdout
    assert int(lines["peak_mib"]) < 300, done.stdout
