"""The README's serving loop as a typed program: ``make lint`` checks it under ``mypy --strict``
and ``test_readme_loop.py`` runs it, so the README's first API stays both typed and true."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import dflash_rs as d
from dflash_rs.types import FinishReason, SchedulerStats


def serve(prompts: Mapping[str, Sequence[int]], k: int = 8) -> dict[str, FinishReason]:
    """Serves ``prompts`` to the end with a stand-in model; returns each request's finish reason."""
    sched = d.Scheduler(
        d.SchedulerConfig(
            num_blocks=256,
            block_size=16,
            max_model_len=1024,
            max_num_seqs=8,
            max_num_batched_tokens=512,
            speculative=d.SpeculativeConfig("dflash", k),
        )
    )
    for rid, prompt in prompts.items():
        sched.add_request(d.Request(rid, list(prompt), max_tokens=20))
    reasons: dict[str, FinishReason] = {}
    while sched.has_unfinished_requests():
        out = sched.schedule()
        # A stand-in model: a prefill chunk samples one token once it reaches the prompt's end,
        # a decode step accepts its first draft token plus the bonus token.
        sampled: list[list[int]] = []
        for rid in out.req_ids:
            drafts = out.scheduled_spec_decode_tokens.get(rid, [])
            sampled.append([7, *drafts[:1]])
        for r in sched.update_from_output(out, d.ModelRunnerOutput(out.req_ids, sampled)):
            if r.finish_reason is not None:
                reasons[r.request_id] = r.finish_reason
        next_drafts: dict[str, list[int]] = {rid: [5] * k for rid in sched.running_request_ids()}
        sched.update_draft_token_ids(next_drafts)
        sched.check_invariants()
    stats: SchedulerStats = sched.stats()
    assert stats["num_finished"] == len(prompts)
    return reasons


if __name__ == "__main__":
    print(serve({"r1": range(40), "r2": range(100, 117)}))
