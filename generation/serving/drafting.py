"""The server's second source of guesses: a draft model (``--serve --speculate draft[:K] --draft_model DIR``),
a smaller BLOOM with the target's tokenizer, run a few greedy steps ahead of every row that guesses.

The draft keeps its own static KV cache in the engine's slot layout: one cache per batch bucket,
row i of it is the row in slot i, and whenever the engine moves a row between slots or buckets
(``DeviceRows.move``, ``resize``) the draft's row moves with it. What a slot of the draft's cache
holds is on the row itself (``RowDraft``, ``Row.draft``): a new row starts with none, so a row that
reuses a slot never reads an earlier row's keys and values.

Each engine step where rows guess (``draft_guesses``, called by ``speculating.propose``):

* **Roll back**: the guesses fed to the draft last time count as long as the row kept them (a
  slot's keys and values depend only on the tokens up to it); the rest of its cache is simply
  written again later, as the target's is.
* **Catch up** on what the row has that the draft has not fed: usually its last token (a decode
  row), after full acceptance its last two, and for a row that just started (its prompt, whether
  the target prefilled it, took it in segments or copied it from the prefix cache: the draft has
  no pool and always feeds it itself) or sat passes out (adaptive k at 0) many: those go in as
  prompt segments of the draft's mixed step (``StaticBloom.mixed``), as many as one step carries.
  A row whose catch-up does not fit offers no guess this step and goes on with it at the next.
* **Propose**: the logits at the row's last token give its first guess, ``most - 1`` decode steps
  the others (``most``: the most guesses any row may offer now). Its greedy choices: a point-mass
  draft, which the target's rejection rule (``speculation.choose_and_accept``) verifies exactly as
  it does prompt lookup's guesses.

The device side (``DraftRows``) is called with host values only, as ``DeviceRows`` is, so that a
tensor-parallel server's ranks make the same draft steps (``tp_serving.py``). Its shapes are the
target's decode and mixed shapes on the draft's own backend, all run by the warm-up. Host syncs:
the guesses come to the host once per step where some row guesses (the verify pass takes them as
host values; the target's logits wait on the draft's steps either way).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from bloom_hpu.runtime.transfer import host_to_device

from ..search.choose import argmax_rows


@dataclass
class RowDraft:
    """One row's state in the draft's cache (host values, kept on the ``Row``)."""

    fed: int = 0  # leading slots of the row in the draft's cache that hold its own tokens' keys and values
    proposed: list[int] = field(default_factory=list)  # the guesses fed after those at the last proposal

    def roll_back(self, history: list[int]) -> None:
        """Count the proposals fed last time that the row kept (its tokens now ``history``), and
        never the row's last token: its logits give the next first guess."""
        kept = 0
        for guess, token in zip(self.proposed, history[self.fed :]):
            if guess != token:
                break
            kept += 1
        self.fed = min(self.fed + kept, len(history) - 1)
        self.proposed = []


@dataclass
class DraftPlan:
    """One engine step's draft work for the b rows of a bucket, as host values (``DraftRows.step``).

    tokens, positions [b]: each row's decode token in the catch-up step (the last one of a row one
    token behind; elsewhere a filler at a slot its segment then writes, or that no row's count
    covers); segments: (slot, start, ids) pieces of catch-up; first [b]: where each guessing row's
    first guess comes from, an index into the step's logits (the b rows', then each segment's last
    token's); guessing [b]: the rows that guess this step; used [b]: their token counts (guess j is
    fed at slot used + j); idle [b]: the slot where the other rows write fillers in the decode
    steps (past what their counts cover); most: the most guesses a row offers."""

    tokens: list[int]
    positions: list[int]
    segments: list[tuple[int, int, list[int]]]
    first: list[int]
    guessing: list[bool]
    used: list[int]
    idle: list[int]
    most: int


def plan_step(rows: list, wants: list[int], segment_length: int, max_segments: int, pad: int) -> DraftPlan:
    """The draft's work for one step: rows (the bucket's Rows or None) whose ``wants`` > 0 catch
    up and guess; their catch-up pieces first come first served up to ``max_segments``."""
    b = len(rows)
    tokens, positions, first = [pad] * b, [0] * b, list(range(b))
    guessing, used, idle, segments = [False] * b, [0] * b, [0] * b, []
    for i, row in enumerate(rows):
        if row is None or not row.running:
            continue  # its draft row is empty: the filler at slot 0 is harmless
        if row.draft is None:
            row.draft = RowDraft()
        history = row.handle.prompt_ids + row.ids
        row.draft.roll_back(history)
        fed = row.draft.fed
        positions[i] = fed  # a filler's slot unless the row feeds its last token below
        if not wants[i]:
            continue
        missing = history[fed:]  # at least the last token
        if len(missing) == 1:  # the usual case: its last token as the decode row's
            tokens[i], guessing[i], used[i] = missing[0], True, len(history)
            continue
        pieces = [missing[s : s + segment_length] for s in range(0, len(missing), segment_length)]
        room = max_segments - len(segments)
        for n, piece in enumerate(pieces[:room]):
            segments.append((i, fed + n * segment_length, piece))
        if len(pieces) <= room:  # caught up: the last piece's last token's logits give the first guess
            first[i] = b + len(segments) - 1
            guessing[i], used[i] = True, len(history)
        else:  # the rest at the next step (the filler at ``fed`` is overwritten by the segment)
            row.draft.fed = fed + room * segment_length
    for i, row in enumerate(rows):
        if row is not None and row.draft is not None and not guessing[i]:
            idle[i] = row.draft.fed  # (after its catch-up pieces, if any: those slots count now)
    most = max((w for w, g in zip(wants, guessing) if g), default=0)
    return DraftPlan(tokens, positions, segments, first, guessing, used, idle, most)


def draft_guesses(device_rows, rows: list, wants: list[int], k: int) -> tuple[list[list[int]], list[int]]:
    """Each slot's guesses (``k`` ids, padded with 0) and how many are real, for ``rows`` (the
    bucket's Rows or None) that may offer ``wants`` [b] guesses now (0: none)."""
    b = len(rows)
    guesses, counts = [[0] * k for _ in range(b)], [0] * b
    if not any(wants):
        return guesses, counts
    draft = device_rows.draft
    plan = plan_step(rows, wants, draft.segment_length, draft.segment_counts[-1], device_rows.pad)
    if not plan.segments and not plan.most:
        return guesses, counts
    proposed = device_rows.draft_step(b, plan.tokens, plan.positions, plan.segments, plan.first, plan.guessing,
                                      plan.used, plan.idle, plan.most)  # [b][k], host
    for i, row in enumerate(rows):
        if plan.guessing[i]:
            row.draft.fed = plan.used[i]
            # Fed at slots used.. by the decode steps: guess j - 1 by step j < most, within the
            # row's room (a row offering fewer than ``most`` had its later ones written clamped).
            row.draft.proposed = proposed[i][: min(plan.most - 1, wants[i])]
            counts[i] = wants[i]
            guesses[i][: wants[i]] = proposed[i][: wants[i]]
    return guesses, counts


class DraftRows:
    """The draft's caches (one per batch bucket, the engine's slot layout) and its steps, called
    with host values only. ``lengths``: the engine's length buckets (its windows);
    ``segment_length``, ``segment_counts``: its mixed step's segments (``device_rows.chunk_shape``);
    ``k``: the most guesses a row offers (the verify pass's)."""

    def __init__(self, draft, batch_sizes: list[int], max_length: int, lengths: list[int], segment_length: int,
                 segment_counts: list[int], pad: int, k: int):
        self.runner = draft.runner
        self.device = self.runner.backend.device
        self.max_length = max_length
        self.batch_sizes = batch_sizes
        self.lengths = lengths
        self.segment_length = segment_length
        self.segment_counts = segment_counts
        self.pad = pad
        self.k = k
        model, per_layer = self.runner.model, self.runner.backend.per_layer_cache
        self.caches = {b: model.allocate_cache(b, max_length, per_layer) for b in batch_sizes}

    def window(self, needed: int) -> int:
        return next(n for n in self.lengths if n >= min(needed, self.max_length))

    @torch.no_grad()
    def warm_up(self) -> int:
        """Every draft shape once, through ``step`` (its eager ops too): per (batch bucket, window)
        a catch-up decode and ``k - 1`` guess decodes, and a catch-up mixed step per segment count;
        pad tokens from slot 0 (nothing counts them). Returns how many step shapes."""
        for b in reversed(self.batch_sizes):
            for window in reversed(self.lengths):
                pads, zeros, every = [self.pad] * b, [0] * b, [True] * b
                self.step(b, pads, zeros, [], list(range(b)), every, zeros, zeros, self.k, window)
                for count in reversed(self.segment_counts):
                    segments = [(0, 0, [self.pad] * self.segment_length)] * count
                    self.step(b, pads, zeros, segments, list(range(b)), every, zeros, zeros, 1, window)
        self.runner.backend.synchronize()
        return len(self.batch_sizes) * len(self.lengths) * (1 + len(self.segment_counts))

    @torch.no_grad()
    def step(self, bucket: int, tokens: list[int], positions: list[int], segments: list[tuple[int, int, list[int]]],
             first: list[int], guessing: list[bool], used: list[int], idle: list[int], most: int,
             window: int | None = None) -> list[list[int]]:
        """One engine step's draft work (``DraftPlan``'s fields) in ``caches[bucket]``: the
        catch-up step (a decode, or a mixed step with the segments), then ``most - 1`` decodes
        of the guesses. Returns each row's ``k`` greedy guesses (host; the first ``most`` are
        real for the rows that guess, the rest anything).

        Every unit of eager work between two ``mark_step``s is the same ops on the same shapes
        whatever ``most`` (a lazy runtime compiles each distinct unit once)."""
        if window is None:  # every slot attended: up to the furthest guess fed (used + most - 2), segment end
            ends = [start + len(ids) for _, start, ids in segments]
            window = self.window(max([p + 1 for p in positions + idle] + ends + [u + most - 1 for u in used]))
        if segments:
            logits = self._mixed(bucket, tokens, positions, segments, window)  # [b + G, V]
        else:
            logits = self._decode(bucket, self._upload(tokens), positions, window)  # [b, V]
        token = argmax_rows(logits.index_select(0, self._upload(first)))  # [b]: the first guesses
        mask = host_to_device(torch.tensor(guessing), self.device)
        filler = torch.full_like(token, self.pad)
        self.runner.backend.mark_step()
        chosen = [token]
        for j in range(1, most):  # guess j - 1 fed at slot used + j - 1 (clamped: past a row's room)
            at = [min(u + j - 1, self.max_length - 1) if g else q for u, g, q in zip(used, guessing, idle)]
            token = argmax_rows(self._decode(bucket, torch.where(mask, token, filler), at, window))
            self.runner.backend.mark_step()
            chosen.append(token)
        return torch.stack(chosen + [filler] * (self.k - most), dim=1).tolist()  # the step's one read: [b, k]

    def _decode(self, bucket: int, tokens: torch.Tensor, positions: list[int], window: int) -> torch.Tensor:
        return self.runner.decode(tokens[:, None], self._upload(positions), self.caches[bucket], window)

    def _mixed(self, bucket: int, tokens: list[int], positions: list[int], segments: list[tuple[int, int, list[int]]],
               window: int) -> torch.Tensor:
        """As ``DeviceRows.mixed`` (segments padded to a count by repeating the last): logits [b + G, V]."""
        count = next(n for n in self.segment_counts if n >= len(segments))
        padded = segments + segments[-1:] * (count - len(segments))
        c = self.segment_length
        chunk = self._upload([ids + [self.pad] * (c - len(ids)) for _, _, ids in padded])
        rows, starts, lengths = (self._upload(column) for column in zip(*[(r, s, len(ids)) for r, s, ids in padded]))
        logits = self.runner.mixed(self._upload(tokens)[:, None], self._upload(positions), chunk, rows, starts,
                                   lengths, self.caches[bucket], window)
        return logits[: bucket + len(segments)]

    def move(self, bucket: int, src: int, dst: int, extent: int) -> None:
        cache = self.caches[bucket]
        cache.copy_rows(cache, [src], [dst], extent)

    def resize(self, old: int, new: int, extent: int) -> None:
        rows = list(range(min(old, new)))
        self.caches[new].copy_rows(self.caches[old], rows, rows, extent)

    def _upload(self, values) -> torch.Tensor:
        return host_to_device(torch.tensor(list(values), dtype=torch.long), self.device)
