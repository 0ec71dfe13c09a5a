"""Bad input raises a typed error with a useful message and changes nothing.

Every case runs against the same populated manager (held blocks, cached free blocks, a request
with available hits) and compares a full snapshot -- free count and order, ref counts, block
ids, block hashes, cached counts, lookup stats -- before and after the failing call.
"""

from __future__ import annotations

import re
from typing import Any, Callable, NamedTuple, Type

import numpy as np
import pytest

import dflash_rs
from dflash_rs import (
    ArgumentTypeError,
    DFlashRsError,
    DuplicateRequestError,
    InvalidArgumentError,
    KVCacheManager,
    PromptTooLongError,
    UnknownRequestError,
)

from .kv_model import snapshot

BS = 4
MML = 64


def populated(enable_prefix_caching: bool = True) -> KVCacheManager:
    """11 blocks of 4 tokens, max_model_len 64.

    held  : 9 tokens, holds blocks [1, 2, 3] (blocks 1, 2 cached)
    gone  : allocated [4, 5] and freed: blocks 4, 5 are free but still cached
    fresh : 13 tokens sharing held's first 8; no blocks; hits [1, 2] available
    exact8: 8 tokens = held's 2 cached blocks; no blocks
    other : 6 unrelated tokens; no blocks
    """
    m = KVCacheManager(11, BS, MML, enable_prefix_caching=enable_prefix_caching)
    m.add_request("held", list(range(9)))
    assert m.allocate_slots("held", 9, num_computed_tokens=0) == [1, 2, 3]
    m.add_request("gone", list(range(20, 28)))
    assert m.allocate_slots("gone", 8, num_computed_tokens=0) == [4, 5]
    m.free("gone")
    m.add_request("fresh", [*range(8), 100, 101, 102, 103, 104])
    m.add_request("exact8", list(range(8)))
    m.add_request("other", [50, 51, 52, 53, 54, 55])
    m.check_invariants()
    return m


def alloc(rid: str, new: Any = 1, **kw: Any) -> Callable[[KVCacheManager], Any]:
    kw.setdefault("num_computed_tokens", 0)
    return lambda m: m.allocate_slots(rid, new, **kw)


def hits(rid: str, blocks: Any, tokens: Any = None, new: int = 1, **kw: Any) -> Callable:
    n = len(blocks) * BS if tokens is None else tokens
    return alloc(rid, new, num_new_computed_tokens=n, new_computed_blocks=blocks, **kw)


class Case(NamedTuple):
    call: Callable[[KVCacheManager], Any]
    exc: Type[BaseException]
    fragment: str
    caching: bool = True


CASES = {
    # ---- unknown ids (KeyError subclass), every entry point
    "alloc-unknown-id": Case(alloc("nope"), UnknownRequestError, 'unknown request id "nope"'),
    "free-unknown-id": Case(lambda m: m.free("nope"), UnknownRequestError, "unknown request id"),
    "free-twice": Case(lambda m: m.free("gone"), UnknownRequestError, 'unknown request id "gone"'),
    "append-unknown-id": Case(
        lambda m: m.append_token_ids("nope", [1]), UnknownRequestError, "unknown request id"
    ),
    "get-computed-unknown-id": Case(
        lambda m: m.get_computed_blocks("nope"), UnknownRequestError, "unknown request id"
    ),
    "block-ids-unknown-id": Case(
        lambda m: m.block_ids("nope"), UnknownRequestError, "unknown request id"
    ),
    "num-tokens-unknown-id": Case(
        lambda m: m.num_tokens("nope"), UnknownRequestError, "unknown request id"
    ),
    "block-hashes-unknown-id": Case(
        lambda m: m.block_hashes("nope"), UnknownRequestError, "unknown request id"
    ),
    "num-cached-unknown-id": Case(
        lambda m: m.num_cached_blocks("nope"), UnknownRequestError, "unknown request id"
    ),
    "free-empty-id": Case(lambda m: m.free(""), UnknownRequestError, 'unknown request id ""'),
    "get-computed-empty-id": Case(
        lambda m: m.get_computed_blocks(""), UnknownRequestError, 'unknown request id ""'
    ),
    "alloc-empty-id": Case(alloc(""), UnknownRequestError, 'unknown request id ""'),
    # ---- add_request
    "duplicate-id": Case(
        lambda m: m.add_request("held", [1]), DuplicateRequestError, 'request id "held"'
    ),
    "duplicate-id-no-blocks": Case(
        lambda m: m.add_request("fresh", [1]), DuplicateRequestError, "already in use"
    ),
    "empty-id": Case(lambda m: m.add_request("", [1]), InvalidArgumentError, "non-empty"),
    "empty-prompt": Case(lambda m: m.add_request("x", []), InvalidArgumentError, "empty"),
    "empty-prompt-numpy": Case(
        lambda m: m.add_request("x", np.array([], dtype=np.int64)), InvalidArgumentError, "empty"
    ),
    "prompt-too-long": Case(
        lambda m: m.add_request("x", [1] * (MML + 1)), PromptTooLongError, "max_model_len"
    ),
    "tokens-str": Case(lambda m: m.add_request("x", "abc"), InvalidArgumentError, "string"),
    "tokens-float": Case(
        lambda m: m.add_request("x", [1.0, 2.0]), InvalidArgumentError, "sequence of ints"
    ),
    "tokens-none": Case(lambda m: m.add_request("x", None), InvalidArgumentError, "token_ids"),
    "tokens-nested": Case(lambda m: m.add_request("x", [[1]]), InvalidArgumentError, "token_ids"),
    "tokens-numpy-float": Case(
        lambda m: m.add_request("x", np.array([1.0])),
        ArgumentTypeError,
        "token_ids must be a 1-D integer array, got ndim=1 dtype=float64",
    ),
    "tokens-numpy-bool": Case(
        lambda m: m.add_request("x", np.array([True, False])),
        ArgumentTypeError,
        "token_ids must be a 1-D integer array, got ndim=1 dtype=bool",
    ),
    "tokens-bools": Case(
        lambda m: m.add_request("x", [True, False]),
        ArgumentTypeError,
        "token_ids[0] must be an int, got the bool True",
    ),
    "tokens-numpy-bool-scalar": Case(
        lambda m: m.add_request("x", [3, np.False_]),
        ArgumentTypeError,
        "token_ids[1] must be an int, got the bool False",
    ),
    "append-bools": Case(
        lambda m: m.append_token_ids("held", (1, True)),
        ArgumentTypeError,
        "token_ids[1] must be an int, got the bool True",
    ),
    "tokens-numpy-uint64-beyond-int32": Case(
        lambda m: m.add_request("x", np.array([2**63 + 1], dtype=np.uint64)),
        InvalidArgumentError,
        "token_ids[0] = 9223372036854775809 is outside [0, 2**31 - 1]",
    ),
    "tokens-numpy-int8-negative": Case(
        lambda m: m.add_request("x", np.array([1, -128], dtype=np.int8)),
        InvalidArgumentError,
        "token_ids[1] = -128 is outside",
    ),
    # A big-endian array must be rejected, not reinterpreted (256 would silently read as 65536).
    "tokens-numpy-big-endian": Case(
        lambda m: m.add_request("x", np.array([256, 1], dtype=">i4")),
        InvalidArgumentError,
        "token_ids must be an integer array in native byte order, got dtype=>i4",
    ),
    "append-numpy-big-endian": Case(
        lambda m: m.append_token_ids("held", np.array([1], dtype=">u2")),
        InvalidArgumentError,
        "native byte order",
    ),
    "tokens-numpy-2d": Case(
        lambda m: m.add_request("x", np.array([[1, 2]], dtype=np.int64)),
        InvalidArgumentError,
        "1-D",
    ),
    "token-negative": Case(lambda m: m.add_request("x", [1, -1]), InvalidArgumentError, "-1"),
    "token-2**31": Case(lambda m: m.add_request("x", [2**31]), InvalidArgumentError, "2147483648"),
    "token-huge": Case(lambda m: m.add_request("x", [2**70]), InvalidArgumentError, "token_ids"),
    "token-numpy-negative": Case(
        lambda m: m.add_request("x", np.array([3, -5], dtype=np.int32)),
        InvalidArgumentError,
        "-5",
    ),
    "token-numpy-2**40": Case(
        lambda m: m.add_request("x", np.array([2**40], dtype=np.int64)),
        InvalidArgumentError,
        "1099511627776",
    ),
    "request-id-int": Case(
        lambda m: m.add_request(5, [1]), ArgumentTypeError, "request_id must be a str, got int"
    ),
    "request-id-none": Case(
        lambda m: m.add_request(None, [1]),
        ArgumentTypeError,
        "request_id must be a str, got NoneType",
    ),
    "cache-salt-int": Case(
        lambda m: m.add_request("x", [1], cache_salt=5),
        ArgumentTypeError,
        "cache_salt must be a str, got int",
    ),
    "lora-name-int": Case(
        lambda m: m.add_request("x", [1], lora_name=5),
        ArgumentTypeError,
        "lora_name must be a str, got int",
    ),
    "request-id-surrogate": Case(
        lambda m: m.add_request("\udc80", [1]), InvalidArgumentError, "lone surrogate"
    ),
    # ---- wrong id types at every entry point taking a request id
    "append-id-int": Case(
        lambda m: m.append_token_ids(1, [1]), ArgumentTypeError, "request_id must be a str"
    ),
    "get-computed-id-none": Case(
        lambda m: m.get_computed_blocks(None), ArgumentTypeError, "got NoneType"
    ),
    "alloc-id-bytes": Case(
        lambda m: m.allocate_slots(b"fresh", 1, num_computed_tokens=0),
        ArgumentTypeError,
        "request_id must be a str, got bytes",
    ),
    "free-id-list": Case(lambda m: m.free(["held"]), ArgumentTypeError, "got list"),
    "block-ids-id-int": Case(lambda m: m.block_ids(3), ArgumentTypeError, "got int"),
    "num-tokens-id-float": Case(lambda m: m.num_tokens(1.0), ArgumentTypeError, "got float"),
    "block-hashes-id-none": Case(lambda m: m.block_hashes(None), ArgumentTypeError, "NoneType"),
    "num-cached-id-dict": Case(lambda m: m.num_cached_blocks({}), ArgumentTypeError, "got dict"),
    "has-request-id-int": Case(lambda m: m.has_request(1), ArgumentTypeError, "got int"),
    # ---- append_token_ids (all-or-nothing: a bad token later in the list appends nothing)
    "append-beyond-max-model-len": Case(
        lambda m: m.append_token_ids("held", [1] * (MML - 9 + 1)),
        PromptTooLongError,
        "max_model_len",
    ),
    "append-negative-after-good": Case(
        lambda m: m.append_token_ids("held", [1, 2, -1]), InvalidArgumentError, "-1"
    ),
    "append-str": Case(lambda m: m.append_token_ids("held", "abc"), InvalidArgumentError, "string"),
    "append-float": Case(
        lambda m: m.append_token_ids("held", [1.5]), InvalidArgumentError, "token_ids"
    ),
    "append-token-2**31": Case(
        lambda m: m.append_token_ids("held", [1, 2**31]), InvalidArgumentError, "2147483648"
    ),
    "append-numpy-2-d": Case(
        lambda m: m.append_token_ids("held", np.array([[1]], dtype=np.int32)),
        InvalidArgumentError,
        "1-D",
    ),
    # ---- allocate_slots: counts
    "negative-new-tokens": Case(alloc("fresh", -1), InvalidArgumentError, "num_new_tokens"),
    "zero-new-tokens": Case(alloc("fresh", 0), InvalidArgumentError, "positive"),
    "zero-new-tokens-running": Case(
        alloc("held", 0, num_computed_tokens=9), InvalidArgumentError, "positive"
    ),
    "negative-computed": Case(
        alloc("fresh", num_computed_tokens=-1), InvalidArgumentError, "num_computed_tokens"
    ),
    "negative-new-computed": Case(
        alloc("fresh", num_new_computed_tokens=-4), InvalidArgumentError, "num_new_computed"
    ),
    "negative-lookahead": Case(
        alloc("fresh", num_lookahead_tokens=-1), InvalidArgumentError, "num_lookahead_tokens"
    ),
    "over-max-model-len-new": Case(alloc("fresh", MML + 1), PromptTooLongError, "max_model_len"),
    "huge-new-tokens": Case(alloc("fresh", 2**40), PromptTooLongError, "1099511627776"),
    "huge-computed": Case(
        alloc("held", num_computed_tokens=2**63 - 1), InvalidArgumentError, "9223372036854775807"
    ),
    "huge-new-tokens-beyond-int64": Case(
        alloc("fresh", 2**70), InvalidArgumentError, "1180591620717411303424 is out of range"
    ),
    "huge-lookahead-beyond-int64": Case(
        alloc("fresh", num_lookahead_tokens=2**70), InvalidArgumentError, "[-2**63, 2**63 - 1]"
    ),
    "negative-new-computed-beyond-int64": Case(
        alloc("fresh", num_new_computed_tokens=-(2**70)),
        InvalidArgumentError,
        "-1180591620717411303424 is out of range",
    ),
    "over-max-model-len-running": Case(
        alloc("held", MML - 9 + 1, num_computed_tokens=9), PromptTooLongError, "max_model_len"
    ),
    "over-max-model-len-with-hits": Case(
        hits("fresh", [1, 2], new=MML - 8 + 1), PromptTooLongError, "max_model_len"
    ),
    "computed-beyond-owned-slots": Case(
        alloc("held", num_computed_tokens=13), InvalidArgumentError, "13"
    ),
    "computed-without-blocks": Case(
        alloc("fresh", num_computed_tokens=1), InvalidArgumentError, "num_computed_tokens"
    ),
    # ---- allocate_slots: hits
    "hits-tokens-without-blocks": Case(
        hits("fresh", [], tokens=4), InvalidArgumentError, "num_new_computed_tokens"
    ),
    "hits-blocks-without-tokens": Case(
        hits("fresh", [1], tokens=0), InvalidArgumentError, "num_new_computed_tokens"
    ),
    "hits-partial-block-tokens": Case(
        hits("fresh", [1], tokens=3), InvalidArgumentError, "num_new_computed_tokens"
    ),
    "hits-wrong-id": Case(hits("fresh", [2]), InvalidArgumentError, "new_computed_blocks[0]"),
    "hits-wrong-order": Case(hits("fresh", [2, 1]), InvalidArgumentError, "new_computed_blocks"),
    "hits-duplicate": Case(hits("fresh", [1, 1]), InvalidArgumentError, "new_computed_blocks[1]"),
    "hits-beyond-cached-prefix": Case(
        hits("fresh", [1, 2, 3]), InvalidArgumentError, "new_computed_blocks[2]"
    ),
    "hits-other-prefix-cached-free-block": Case(
        hits("fresh", [4]), InvalidArgumentError, "new_computed_blocks[0]"
    ),
    "hits-null-block": Case(hits("fresh", [0]), InvalidArgumentError, "new_computed_blocks"),
    "hits-out-of-range": Case(hits("fresh", [99]), InvalidArgumentError, "new_computed_blocks"),
    "hits-negative-id": Case(hits("fresh", [-1]), InvalidArgumentError, "new_computed_blocks"),
    "hits-not-this-requests-prefix": Case(
        hits("other", [1]), InvalidArgumentError, "new_computed_blocks[0]"
    ),
    "hits-for-request-holding-blocks": Case(
        hits("held", [1], num_computed_tokens=0), InvalidArgumentError, "holds no blocks"
    ),
    "hits-with-computed-tokens": Case(
        hits("fresh", [1], num_computed_tokens=4), InvalidArgumentError, "no computed tokens"
    ),
    "hits-cover-whole-sequence": Case(hits("exact8", [1, 2]), InvalidArgumentError, "not below"),
    "hits-with-caching-disabled": Case(
        hits("fresh", [1]), InvalidArgumentError, "new_computed_blocks[0]", caching=False
    ),
    # ---- allocate_slots: Python types
    "new-tokens-float": Case(
        alloc("fresh", 1.0), ArgumentTypeError, "an int argument must be an int, got float"
    ),
    "new-tokens-str": Case(alloc("fresh", "1"), ArgumentTypeError, "must be an int, got str"),
    "lookahead-float": Case(
        alloc("fresh", num_lookahead_tokens=2.0), ArgumentTypeError, "must be an int, got float"
    ),
    "computed-none": Case(
        alloc("fresh", num_computed_tokens=None), ArgumentTypeError, "got NoneType"
    ),
    "new-tokens-numpy-bool": Case(
        alloc("fresh", np.True_), ArgumentTypeError, "must be an int, got the bool True"
    ),
    "full-sequence-flag-int": Case(
        alloc("fresh", full_sequence_must_fit=1),
        ArgumentTypeError,
        "a bool argument must be a bool, got int",
    ),
    "hits-bools": Case(
        hits("fresh", [True]),
        ArgumentTypeError,
        "new_computed_blocks[0] must be an int, got the bool True",
    ),
    "hits-float-array": Case(
        hits("fresh", np.array([1.0])),
        ArgumentTypeError,
        "new_computed_blocks must be a 1-D integer array, got ndim=1 dtype=float64",
    ),
    "computed-missing": Case(
        lambda m: m.allocate_slots("fresh", 1), TypeError, "num_computed_tokens"
    ),
    "hits-none": Case(
        lambda m: m.allocate_slots("fresh", 1, num_computed_tokens=0, new_computed_blocks=None),
        ArgumentTypeError,
        "new_computed_blocks must be a sequence of ints or a 1-D integer array, got NoneType",
    ),
    "hits-float-ids": Case(
        hits("fresh", [1.0]), ArgumentTypeError, "new_computed_blocks[0] is a float"
    ),
    "new-tokens-bool": Case(alloc("fresh", True), InvalidArgumentError, "got the bool True"),
    # ---- debug helpers
    "ref-count-out-of-range": Case(lambda m: m.ref_count(11), InvalidArgumentError, "range"),
    "ref-count-negative": Case(lambda m: m.ref_count(-1), InvalidArgumentError, "range"),
    "block-hash-out-of-range": Case(lambda m: m.block_hash(11), InvalidArgumentError, "range"),
    "block-hash-negative": Case(lambda m: m.block_hash(-1), InvalidArgumentError, "range"),
    "ref-count-huge": Case(lambda m: m.ref_count(2**40), InvalidArgumentError, "range"),
    "ref-count-str": Case(lambda m: m.ref_count("1"), ArgumentTypeError, "got str"),
    "ref-count-bool": Case(lambda m: m.ref_count(True), ArgumentTypeError, "the bool True"),
    "block-hash-none": Case(lambda m: m.block_hash(None), ArgumentTypeError, "got NoneType"),
    "block-hash-numpy-bool": Case(
        lambda m: m.block_hash(np.False_), ArgumentTypeError, "the bool False"
    ),
}


@pytest.mark.parametrize("name", list(CASES))
def test_bad_input_raises_and_changes_nothing(name: str) -> None:
    case = CASES[name]
    m = populated(case.caching)
    before = snapshot(m)
    with pytest.raises(case.exc, match=re.escape(case.fragment)) as info:
        case.call(m)
    # Only a call that does not match the signature (a missing argument) raises the builtin
    # TypeError, as any Python function does; a wrong type raises ArgumentTypeError.
    if case.exc is not TypeError:
        assert isinstance(info.value, DFlashRsError)
    assert snapshot(m) == before
    m.check_invariants()
    # The manager still works after the error: the pending request can be admitted normally.
    hit_blocks, num_hit = m.get_computed_blocks("fresh")
    assert (hit_blocks, num_hit) == (([1, 2], 8) if case.caching else ([], 0))
    new = m.allocate_slots(
        "fresh",
        m.num_tokens("fresh") - num_hit,
        num_computed_tokens=0,
        num_new_computed_tokens=num_hit,
        new_computed_blocks=hit_blocks,
    )
    assert new is not None
    m.check_invariants()


@pytest.mark.parametrize(
    ("args", "kwargs", "exc", "fragment"),
    [
        pytest.param((1, 4, 64), {}, InvalidArgumentError, "num_blocks", id="num-blocks-1"),
        pytest.param((0, 4, 64), {}, InvalidArgumentError, "num_blocks", id="num-blocks-0"),
        pytest.param((-1, 4, 64), {}, InvalidArgumentError, "num_blocks", id="num-blocks-neg"),
        pytest.param(
            (2**32, 4, 64), {}, InvalidArgumentError, "at most 2**31 - 1", id="num-blocks-2**32"
        ),
        pytest.param(
            (11, 2**31, 64), {}, InvalidArgumentError, "block_size (2147483648)", id="bs-2**31"
        ),
        pytest.param(
            (11, 4, 2**31), {}, InvalidArgumentError, "max_model_len (2147483648)", id="mml-2**31"
        ),
        pytest.param(
            (2**31 - 1, 2**20, 64),
            {},
            InvalidArgumentError,
            "the config needs 8.0 PiB up front",
            id="pool-beyond-memory",
        ),
        pytest.param((11, 0, 64), {}, InvalidArgumentError, "block_size", id="block-size-0"),
        pytest.param((11, -4, 64), {}, InvalidArgumentError, "block_size", id="block-size-neg"),
        pytest.param((11, 4, 0), {}, InvalidArgumentError, "max_model_len", id="mml-0"),
        pytest.param(
            (11, 4, 64), {"hash_algo": "md5"}, InvalidArgumentError, "hash_algo", id="algo-md5"
        ),
        pytest.param(
            (11, 4, 64), {"hash_algo": "SHA256"}, InvalidArgumentError, "hash_algo", id="algo-case"
        ),
        pytest.param(
            (11, 4, 64), {"hash_algo": ""}, InvalidArgumentError, "hash_algo", id="algo-empty"
        ),
        pytest.param((11.0, 4, 64), {}, ArgumentTypeError, "got float", id="num-blocks-float"),
        pytest.param((11, "4", 64), {}, ArgumentTypeError, "got str", id="block-size-str"),
        pytest.param((None, 4, 64), {}, ArgumentTypeError, "NoneType", id="num-blocks-none"),
        pytest.param(
            (11, np.True_, 64), {}, ArgumentTypeError, "the bool True", id="block-size-np-bool"
        ),
        pytest.param((11, 4, 64), {"hash_algo": 1}, ArgumentTypeError, "got int", id="algo-int"),
        pytest.param(
            (11, 4, 64), {"hash_seed": True}, ArgumentTypeError, "got bool", id="seed-bool"
        ),
        pytest.param(
            (11, 4, 64),
            {"verify_prefix_hits": None},
            ArgumentTypeError,
            "a bool argument must be a bool, got NoneType",
            id="verify-none",
        ),
        pytest.param((11, 4, -1), {}, InvalidArgumentError, "max_model_len", id="mml-neg"),
        pytest.param(
            (11, 4, 64), {"hash_seed": 1.5}, InvalidArgumentError, "hash_seed", id="seed-float"
        ),
        pytest.param(
            (11, 4, 64),
            {"enable_prefix_caching": "no"},
            ArgumentTypeError,
            "a bool argument must be a bool, got str",
            id="caching-str",
        ),
        pytest.param(
            (2**70, 4, 64), {}, InvalidArgumentError, "out of range", id="num-blocks-2**70"
        ),
        pytest.param((11, 4, 2**70), {}, InvalidArgumentError, "out of range", id="mml-2**70"),
        pytest.param(
            (11, True, 64), {}, InvalidArgumentError, "got the bool True", id="block-size-bool"
        ),
    ],
)
def test_bad_constructor_arguments(
    args: tuple, kwargs: dict, exc: Type[BaseException], fragment: str
) -> None:
    with pytest.raises(exc, match=re.escape(fragment)) as info:
        KVCacheManager(*args, **kwargs)
    assert isinstance(info.value, DFlashRsError)


@pytest.mark.parametrize(
    "dtype", ["int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64"]
)
def test_integer_arrays_of_every_dtype(dtype: str) -> None:
    """Token ids (and hit block ids) come in every integer dtype and read as from a list."""
    by_array = KVCacheManager(11, BS, MML, hash_seed=np.int64(0))
    by_list = KVCacheManager(11, BS, MML, hash_seed=0)
    by_array.add_request("a", np.arange(9, dtype=dtype))
    by_list.add_request("a", list(range(9)))
    by_array.append_token_ids("a", np.array([9, 10], dtype=dtype))
    by_list.append_token_ids("a", [9, 10])
    assert by_array.block_hashes("a") == by_list.block_hashes("a")
    assert by_array.allocate_slots("a", 11, num_computed_tokens=0) == [1, 2, 3]
    by_array.free("a")
    by_array.add_request("b", np.arange(9, dtype=dtype))
    assert by_array.allocate_slots(
        "b",
        1,
        num_computed_tokens=0,
        num_new_computed_tokens=np.int32(8),
        new_computed_blocks=np.array([1, 2], dtype=dtype),
    ) == [3]
    by_array.check_invariants()


def test_numpy_integer_scalars_are_ints() -> None:
    m = KVCacheManager(np.int64(11), np.uint8(BS), np.int32(MML))
    assert (m.num_blocks, m.block_size, m.max_model_len) == (11, BS, MML)
    m.add_request("a", [np.int32(1), np.uint64(2), 3, 4, 5])
    new = m.allocate_slots(
        "a", np.int16(5), num_computed_tokens=np.uint32(0), num_lookahead_tokens=np.int8(3)
    )
    assert new == [1, 2]
    assert m.ref_count(np.uint16(1)) == 1 and m.block_hash(np.int64(2)) is None
    m.check_invariants()


def test_non_contiguous_token_arrays_are_read_by_value() -> None:
    """Strided numpy views (every other element) are read element by element, not as the raw
    buffer: the request sees the same tokens and hashes as with a list."""
    tokens = np.arange(40, dtype=np.int64)[::2]
    assert not tokens.flags.c_contiguous
    strided = KVCacheManager(11, BS, MML, hash_seed=0)
    listed = KVCacheManager(11, BS, MML, hash_seed=0)
    strided.add_request("a", tokens)
    listed.add_request("a", tokens.tolist())
    strided.append_token_ids("a", np.arange(6, dtype=np.int32)[::-2])
    listed.append_token_ids("a", [5, 3, 1])
    assert strided.num_tokens("a") == listed.num_tokens("a") == 23
    assert strided.block_hashes("a") == listed.block_hashes("a")


def test_non_power_of_two_block_size_is_supported() -> None:
    """No power-of-two requirement: 3-token blocks allocate cdiv(n, 3) blocks."""
    m = KVCacheManager(11, 3, MML)
    m.add_request("a", list(range(7)))
    assert m.allocate_slots("a", 7, num_computed_tokens=0, num_lookahead_tokens=3) == [1, 2, 3, 4]
    m.check_invariants()


def test_error_hierarchy() -> None:
    assert dflash_rs.errors.UnknownRequestError is UnknownRequestError
    for cls, builtin in [
        (InvalidArgumentError, ValueError),
        (UnknownRequestError, KeyError),
        (DuplicateRequestError, ValueError),
        (PromptTooLongError, ValueError),
        (dflash_rs.OutOfBlocksError, RuntimeError),
        (dflash_rs.SchedulerStateError, RuntimeError),
        (dflash_rs.InvariantError, AssertionError),
    ]:
        assert issubclass(cls, DFlashRsError) and issubclass(cls, builtin)
    # Callers catching the builtin keep working.
    m = KVCacheManager(4, 4, 64)
    with pytest.raises(KeyError):
        m.free("nope")
    with pytest.raises(ValueError):
        m.add_request("x", [])
