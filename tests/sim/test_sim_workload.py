"""Pieces the verifier relies on: content tags and the workload's shared prefixes."""

from __future__ import annotations

import numpy as np

from dflash_rs.sim.ledger import Ledger
from dflash_rs.sim.tags import is_query_tag, query_tags
from dflash_rs.sim.workload import Workload, WorkloadConfig


def test_content_tags_depend_on_prefix_and_salt_only() -> None:
    ledger = Ledger()
    a = ledger.add("a", [5, 6, 7, 8], None, 0)
    b = ledger.add("b", [5, 6, 9], None, 0)
    c = ledger.add("c", [5, 6, 7, 8], "tenant", 0)
    assert a.tags[:2].tolist() == b.tags[:2].tolist()
    assert a.tags[2] != b.tags[2]
    assert not set(a.tags.tolist()) & set(c.tags.tolist())
    b.append([7])
    assert b.speculative_tags([1, 2]).tolist() != a.tags[3:5].tolist()
    assert (
        a.speculative_tags([3]).tolist()
        == ledger.add("d", [5, 6, 7, 8, 3], None, 0).tags[4:].tolist()
    )


def test_query_tags_are_private() -> None:
    tags = query_tags(np.array([0, 1, 0]), np.array([7, 7, 7]), step=3)
    assert is_query_tag(tags).all()
    assert tags[0] != tags[1] and tags[0] == tags[2]
    assert query_tags(np.array([0]), np.array([7]), step=4)[0] != tags[0]


def test_workload_shares_prefixes_and_continues_conversations() -> None:
    workload = Workload(WorkloadConfig(num_requests=30, seed=1))
    first = workload.due(0)
    assert 0 < len(first) <= 30
    prompts = [np.asarray(r.prompt_token_ids) for r in first]
    shared = sum(1 for i, p in enumerate(prompts) for q in prompts[:i] if (p[:16] == q[:16]).all())
    assert shared > 0  # system prompts
    done = first[0]
    history = [*done.prompt_token_ids, 11, 12, 13]
    workload.on_finished(done.request_id, history, step=5)
    later = [r for step in range(6, 20) for r in workload.due(step)]
    continuation = [r for r in later if r.request_id.startswith(done.request_id.split("-")[0])]
    if continuation:
        assert list(continuation[0].prompt_token_ids[: len(history)]) == history
