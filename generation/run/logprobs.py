"""Log-probabilities of tokens, their top-k alternatives, and where each token sits in the text.

Scores come from one teacher-forced pass over prompt + generated tokens (``score_rows``), not from
the search loop. That keeps every search (greedy, sampling, beams) untouched and gives the same
numbers for all of them: the model's own log-probabilities, ``log_softmax`` of the raw logits,
before repetition penalties, temperature, top-k or top-p reshape them (what OpenAI reports). The
pass has a static shape ([rows, length] with length fixed by the caller; on CPU and CUDA it
computes up to the longest row only) and reads the logits in slices of positions, so the full
[rows, length, vocab] tensor never exists at once, nor the fp32 log-softmax of a slice.

``token_pieces`` splits a decoded text into one piece per token, so that ``text_offset`` indexes
the text: byte-level BPE tokens may hold part of a UTF-8 character; a piece is the characters that
its token completes, hence ``"".join(pieces) == text``.
"""

from __future__ import annotations

import codecs
from dataclasses import dataclass

import torch

from bloom_hpu.runtime.prefixed import cacheable, copy_held, rest_bucket
from bloom_hpu.runtime.steps import step_input

POSITIONS_PER_SLICE = 64  # positions whose [rows, slice, vocab] logits exist at once
FP32_CHUNK_BYTES = 16 * 2**20  # fp32 logits converted at once: small enough to stay in the caches


@dataclass
class RowScores:
    """Scores of one row's tokens 1..n-1 (token 0 has no context to be predicted from)."""

    token_logprobs: list[float]  # [n-1] log p(token t | tokens < t), t = 1..n-1
    top_ids: list[list[int]]  # [n-1][k] the k most likely tokens at each of those positions
    top_logprobs: list[list[float]]  # [n-1][k] their log-probs
    greedy: list[bool]  # [n-1] the token is the most likely one (its argmax)
    first: int = 1  # the token the lists start at: later than 1 where a prefix cache served the start


def static_length(longest: int, multiple: int = 64) -> int:
    """Pad scoring passes to a multiple of this, so passes over similar texts share one shape."""
    return -(-longest // multiple) * multiple


@torch.no_grad()
def score_rows(runner, rows: list[list[int]], top_k: int = 0, length: int | None = None,
               pad_token_id: int = 3, wanted_from: list[int] | None = None) -> list[RowScores]:
    """Score every token of every row given the tokens before it, in one batched pass.

    runner: the generator's StepRunner (its model and pooled caches). rows: token ids, each at
    least one token. length: the static padded length (>= the longest row); default: rounded up
    to a multiple of 64. ``wanted_from``: per row, the first token whose score is wanted; with a
    prefix cache, what the pool holds of the row before it is copied rather than computed, and
    the row's scores start later (``RowScores.first``).
    """
    model = runner.model
    device = model.ln_f.weight.device
    longest = max(len(r) for r in rows)
    length = length or static_length(longest)
    if length < longest:
        raise ValueError(f"scoring length {length} is shorter than a row of {longest} tokens")
    ids = torch.full((len(rows), length), pad_token_id, dtype=torch.long)
    for i, row in enumerate(rows):
        ids[i, : len(row)] = torch.tensor(row, dtype=torch.long)
    ids = ids.to(device)
    lengths = torch.tensor([len(r) for r in rows], dtype=torch.long, device=device)
    # The pooled cache of this shape: a scoring pass right after a generation of the same shape
    # reuses the generation's cache instead of allocating another one.
    cache = runner.cache(len(rows), length)
    if longest < 2:  # one token per row: nothing before it to score it by
        return [RowScores(token_logprobs=[], top_ids=[], top_logprobs=[], greedy=[]) for _ in rows]
    starts = _cached_starts(runner, rows, wanted_from, cache) if wanted_from is not None else None
    if starts is not None:  # the rows' rests, after the slots the pool filled
        rests = [row[start:] for row, start in zip(rows, starts)]
        rest_len = rest_bucket(max(len(r) for r in rests), length)
        ids = torch.full((len(rows), rest_len), pad_token_id, dtype=torch.long)
        for i, rest in enumerate(rests):
            ids[i, : len(rest)] = torch.tensor(rest, dtype=torch.long)
        ids = ids.to(device)
        hidden = runner.extend_hidden(ids, torch.tensor(starts, device=device),
                                      torch.tensor([len(r) for r in rests], device=device), cache)
    else:
        starts = [0] * len(rows)
        # On CPU and CUDA the pass stops at the longest row (steps.real_span): positions past it,
        # blocks and LM head alike, would only be thrown away.
        hidden = runner.hidden_states(ids, lengths, cache)  # [R, span, hidden]
    span = hidden.shape[1]

    target = ids[:, 1:]  # position t predicts token t+1
    chosen, is_top, top_vals, top_idx = [], [], [], []
    for start in range(0, span - 1, POSITIONS_PER_SLICE):
        end = min(start + POSITIONS_PER_SLICE, span - 1)
        # A slice of its own: a view at a new offset each time would be a new HPU graph per slice.
        logits = runner.logits(step_input(hidden[:, start:end]))  # [R, S, V] in the model's dtype
        picked, top, vals, idx = _scores_of(logits.flatten(0, 1), target[:, start:end].flatten(), top_k)
        shape = logits.shape[:2]  # [R, S]
        chosen.append(picked.view(shape))
        is_top.append(top.view(shape))
        if top_k:
            top_vals.append(vals.view(*shape, top_k))
            top_idx.append(idx.view(*shape, top_k))
    # One copy to the host for the whole pass.
    chosen_h = torch.cat(chosen, 1).cpu().tolist()
    top_h = torch.cat(is_top, 1).cpu().tolist()
    vals_h = torch.cat(top_vals, 1).cpu().tolist() if top_k else None
    idx_h = torch.cat(top_idx, 1).cpu().tolist() if top_k else None
    out = []
    for i, row in enumerate(rows):
        n = len(row) - 1 - starts[i]
        out.append(RowScores(
            token_logprobs=chosen_h[i][:n],
            top_ids=idx_h[i][:n] if top_k else [[] for _ in range(n)],
            top_logprobs=vals_h[i][:n] if top_k else [[] for _ in range(n)],
            greedy=top_h[i][:n],
            first=starts[i] + 1,
        ))
    return out


def _cached_starts(runner, rows: list[list[int]], wanted_from: list[int], cache) -> list[int] | None:
    """Copy into ``cache`` the blocks the prefix cache holds of each row before its first wanted
    token; the slots copied per row, or None when nothing was (or nothing would be saved)."""
    pool = runner.prefix
    if pool is None:
        return None
    # Token t is scored from the hidden state at t - 1, which must be computed.
    limits = [min(cacheable(len(row), pool.block), max(0, first - 1) // pool.block * pool.block)
              for row, first in zip(rows, wanted_from)]
    return copy_held(runner, cache, rows, limits, cache.length, runner.prefix_namespace, counted=0)


def _scores_of(logits: torch.Tensor, targets: torch.Tensor, top_k: int):
    """For logits [N, V] (any dtype) and targets [N]: log p(target) [N], whether the target is the
    argmax [N] (a tie counts: argmax cannot tell them apart), and the top_k log-probs and ids
    [N, top_k] (None without top_k), in fp32 as ``log_softmax(logits.float())`` gives them.

    log p = logit - logsumexp(logits), taken a few rows at a time: the [N, V] fp32 log-softmax
    would be written and read again for a handful of values per row (for a pass over a bloom-560m
    vocabulary, hundreds of MB per slice, which cost a third of a scoring pass)."""
    rows_at_once = max(1, FP32_CHUNK_BYTES // (4 * logits.shape[-1]))
    picked, is_top, vals, idx = [], [], [], []
    for a in range(0, logits.shape[0], rows_at_once):
        x = logits[a : a + rows_at_once].float()
        total = torch.logsumexp(x, dim=-1, keepdim=True)  # [n, 1]
        target_logit = x.gather(-1, targets[a : a + rows_at_once, None])
        picked.append((target_logit - total)[:, 0])
        is_top.append(target_logit[:, 0] >= x.max(dim=-1).values)
        if top_k:
            v, i = x.topk(top_k, dim=-1)
            vals.append(v - total)
            idx.append(i)
    return (torch.cat(picked), torch.cat(is_top), torch.cat(vals) if top_k else None,
            torch.cat(idx) if top_k else None)


# --- tokens as text -----------------------------------------------------------------------------


def _byte_decoder() -> dict[str, int]:
    """The byte-level BPE alphabet: each byte is written as one printable character (the GPT-2
    scheme that BLOOM's tokenizer uses); this maps those characters back to bytes."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100))
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[chr(b)] = b
        else:
            chars[chr(256 + extra)] = b
            extra += 1
    return chars


_BYTES_OF_CHAR = _byte_decoder()


class TokenText:
    """Per-token bytes of a tokenizer, cached; special tokens (EOS...) have none, as decoding skips
    them."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self._cache: dict[int, bytes] = {}

    def token_bytes(self, token_id: int) -> bytes:
        if token_id not in self._cache:
            if self.tokenizer.decode([token_id]) == "":
                raw = b""  # a special token: skipped by decode
            else:
                piece = self.tokenizer.id_to_token(token_id)
                if all(c in _BYTES_OF_CHAR for c in piece):
                    raw = bytes(_BYTES_OF_CHAR[c] for c in piece)
                else:  # not a byte-level token: trust the tokenizer's own decoding
                    raw = self.tokenizer.decode([token_id]).encode("utf-8")
            self._cache[token_id] = raw
        return self._cache[token_id]

    def label(self, token_id: int) -> str:
        """A token's own name in ``top_logprobs``: its text, or ``bytes:\\xNN...`` when it holds only
        part of a UTF-8 character (as OpenAI writes those), or ``</s>``-style for special tokens."""
        raw = self.token_bytes(token_id)
        if not raw:
            return self.tokenizer.id_to_token(token_id)
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            return "bytes:" + "".join(f"\\x{b:02x}" for b in raw)

    def pieces(self, ids: list[int]) -> list[str]:
        """One text piece per token; a piece holds the characters its token completes."""
        decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        pieces = [decoder.decode(self.token_bytes(t)) for t in ids]
        tail = decoder.decode(b"", final=True)  # an unfinished character at the very end
        if tail and pieces:
            pieces[-1] += tail
        return pieces


def offsets_of(pieces: list[str], start: int = 0) -> list[int]:
    """Character offset of each piece when the pieces are joined, starting at ``start``."""
    out, at = [], start
    for piece in pieces:
        out.append(at)
        at += len(piece)
    return out


def fill_token_logprobs(generator, batch, sequences) -> None:
    """Set ``token_logprobs`` of every generated sequence (in place) from one scoring pass over
    prompt + generated tokens; sequences[i] are prompt i's."""
    rows, where = [], []
    for prompt_ids, seqs in zip(batch.prompt_ids, sequences):
        for seq in seqs:
            rows.append(list(prompt_ids) + list(seq.token_ids))
            where.append((len(prompt_ids), seq))
    longest = max(len(r) for r in rows)
    length = batch.plan.cache_len if batch.plan.cache_len >= longest else static_length(longest)
    scored = score_rows(generator.runner, rows, 0, length, generator.tokenizer.pad_token_id,
                        wanted_from=[n_prompt for n_prompt, _ in where])
    for scores, (n_prompt, seq) in zip(scored, where):
        # Token t's score sits at index t - first; the generated tokens start at t = n_prompt.
        at = n_prompt - scores.first
        seq.token_logprobs = scores.token_logprobs[at : at + len(seq.token_ids)]


def clip_pieces(pieces: list[str], length: int) -> list[str]:
    """Pieces cut so that they join to at most ``length`` characters (a stop string may start
    inside the last kept token)."""
    out, at = [], 0
    for piece in pieces:
        out.append(piece[: max(0, length - at)])
        at += len(piece)
    return out
