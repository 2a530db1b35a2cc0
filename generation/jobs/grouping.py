"""A request file's requests in batches: grouped by the search options they share, then cut
under a token budget."""

from __future__ import annotations

from ..run.request_batch import RequestBatch
from ..request.parse import Request, batch_length


def plan_batches(requests: list[Request], prompt_lengths: dict[int, list[int]], budget: int) -> list[RequestBatch]:
    """Group requests by search options, then fill batches in order of prompt length while
    rows x static length stays within ``budget`` tokens (a request never splits; one that exceeds
    the budget alone gets a batch of its own)."""
    groups: dict[tuple, list[Request]] = {}
    for r in requests:
        groups.setdefault(r.group, []).append(r)
    batches = []
    for members in groups.values():
        members = sorted(members, key=lambda r: max(prompt_lengths[r.line]))  # stable
        current: list[Request] = []
        for r in members:
            trial = current + [r]
            longest = max(max(prompt_lengths[q.line]) for q in trial)
            rows = sum(len(q.prompts) * q.rows_per_prompt for q in trial)
            if current and rows * batch_length(longest, max(q.max_tokens for q in trial)) > budget:
                batches.append(_batch(current, prompt_lengths, budget))
                trial = [r]
            current = trial
        if current:
            batches.append(_batch(current, prompt_lengths, budget))
    return batches


def _batch(requests: list[Request], prompt_lengths: dict[int, list[int]], budget: int) -> RequestBatch:
    lengths = [prompt_lengths[r.line] for r in requests]
    longest = max(max(x) for x in lengths)
    return RequestBatch(requests, lengths, batch_length(longest, max(r.max_tokens for r in requests)), budget)
