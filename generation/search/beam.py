"""Beam search (and beam sampling) entirely on the device, with transformers 4.57's semantics.

B prompts x N beams decode as one static batch of R = B*N rows (each prompt prefilled once, its
cache copied to its N rows: ``StepRunner.prefill_shared``). Per prompt, the device keeps:

* the N running beams: their scores [B, N] and token histories (``sequence`` [R, K]); the KV cache
  rows follow their parents through ``KVCache.reorder`` (in place, so captured graphs stay valid);
* the N best finished hypotheses: scores, full token rows, generated lengths, "is a real hypothesis"
  flags, all in fixed-size tensors merged with the new candidates by a top-k each step;
* ``open``: whether a running beam may still beat the worst finished hypothesis.

One step, as in ``GenerationMixin._beam_search``: log-softmax, processors, add each beam's score,
take the top 2N of the N*V continuations (or draw 2N without replacement when sampling),
candidates that hit EOS or the row's token budget go to the finished set (only those among the
first N, with score / new_tokens ** length_penalty), the best N others continue.

A prompt is done when no running beam can improve it (the early-stop heuristic), when its finished
set is full and ``early_stopping`` is true, or when it used its own budget. Done prompts stop
changing, which is exactly what a prompt run alone sees: transformers ends its loop there. The
host asks whether every prompt is done only every ``EOS_CHECK_EVERY`` steps.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from bloom_hpu.runtime.steps import StepRunner, step_input

from ..run.batch import Batch
from .sampling import UniformKernel, gumbel
from .state import LoopState
from .token_loop import EOS_CHECK_EVERY

NEG = -1.0e9  # transformers' "impossible" score; kept identical so ties behave the same


@dataclass
class BeamOutput:
    sequences: torch.Tensor  # [B, N, K] finished hypotheses, best first: prompt + generated ids
    new_tokens: torch.Tensor  # [B, N] generated ids of each hypothesis
    scores: torch.Tensor  # [B, N] sum of log-probs / new_tokens ** length_penalty
    steps_run: int


class Hypotheses:
    """The N best finished hypotheses of each prompt, in fixed-size buffers updated in place."""

    def __init__(self, sequence: torch.Tensor, b: int, n: int):
        device = sequence.device
        self.scores = torch.full((b, n), NEG, device=device)  # NEG: an empty place
        self.sequences = sequence.view(b, n, -1).clone()  # [B, N, K]
        self.new_tokens = torch.zeros(b, n, dtype=torch.long, device=device)
        self.real = torch.zeros(b, n, dtype=torch.bool, device=device)  # a place holds a hypothesis

    def full(self) -> torch.Tensor:  # [B]
        return self.real.all(dim=1)

    def merge(self, scores, sequences, new_tokens: torch.Tensor, finished) -> None:
        """Keep the N best of the current places and the candidates (``scores`` [B, 2N], already
        pushed to NEG where a candidate may not enter), as transformers' top-k merge does."""
        n = self.scores.shape[1]
        best, keep = torch.topk(torch.cat((self.scores, scores), dim=1), n, dim=-1)  # of [B, 3N]
        cand_new = torch.zeros_like(finished, dtype=torch.long) + new_tokens  # new_tokens: [1] on the device
        self.sequences.copy_(torch.cat((self.sequences, sequences), dim=1).gather(
            1, keep[:, :, None].expand(-1, -1, self.sequences.shape[2])))
        self.new_tokens.copy_(torch.cat((self.new_tokens, cand_new), dim=1).gather(1, keep))
        self.real.copy_(torch.cat((self.real, finished), dim=1).gather(1, keep))
        self.scores.copy_(best)


def top_candidates(log_probs: torch.Tensor, running: torch.Tensor, k: int, step: torch.Tensor,
                   sample_keys: torch.Tensor | None, noise_kernel: UniformKernel | None = None):
    """The k best continuations of the beams (``log_probs`` [B, N, V] plus each beam's ``running``
    score [B, N]), or k drawn without replacement from their softmax when sampling (Gumbel-top-k):
    (their scores [B, k], flat indices parent * V + token [B, k])."""
    b, n, vocab = log_probs.shape
    if sample_keys is not None:
        total = (log_probs + running[:, :, None]).view(b, n * vocab)
        flat = torch.topk(gumbel(sample_keys, step, total.shape[-1], noise_kernel).add_(total), k, dim=-1).indices
        return total.gather(1, flat), flat
    # The k best of all N*V continuations are among each beam's own k best (adding the beam's
    # score keeps a beam's order): N top-ks over V and one over N*k, instead of one over N*V,
    # a top-k over a million values per prompt at every step for 4 beams of BLOOM's vocabulary.
    best, token = torch.topk(log_probs, k, dim=-1)  # [B, N, k]
    scores, pick = torch.topk((best + running[:, :, None]).view(b, n * k), k, dim=-1)
    return scores, (pick // k) * vocab + token.view(b, n * k).gather(1, pick)


def beam_search(
    runner: StepRunner,
    batch: Batch,
    processors,
    *,
    num_beams: int,
    length_penalty: float,
    early_stopping: bool | str,
    eos_token_id: int | None,
    pad_token_id: int,
    use_kv_cache: bool = True,
    sample_keys: torch.Tensor | None = None,
    tick=None,
    noise_kernel: UniformKernel | None = None,
) -> BeamOutput:
    """``eos_token_id=None``: EOS ends nothing (ignore_eos). ``sample_keys`` [B]: beam sampling,
    its noise computed by ``noise_kernel`` where the runtime has one (``sampling.uniform``).
    ``tick()``: called on the host after each step (progress)."""
    b, n, plan = batch.size, num_beams, batch.plan
    rows, k_len, device = b * n, plan.cache_len, batch.input_ids.device
    limits = batch.new_limits  # [B] each prompt's own token budget
    lengths = batch.lengths.repeat_interleave(n)  # [R]
    input_ids = batch.input_ids.repeat_interleave(n, dim=0)  # [R, P]

    sequence = torch.full((rows, k_len), pad_token_id, dtype=torch.long, device=device)
    sequence[:, : plan.prompt_len] = input_ids
    # Only beam 0 starts alive, so the first step does not pick the same token N times.
    running = torch.zeros(b, n, device=device)
    running[:, 1:] = NEG
    finished = Hypotheses(sequence, b, n)
    open_ = torch.ones(b, 1, dtype=torch.bool, device=device)  # a running beam may still win
    done = torch.zeros(b, dtype=torch.bool, device=device)  # [B] (every prompt has a budget >= 1)
    first_n = torch.arange(2 * n, device=device) < n  # only these candidates may finish
    row_base = torch.arange(b, device=device)[:, None] * n
    never = early_stopping == "never" and length_penalty > 0
    stop_when_full = early_stopping is True

    cache = runner.cache(rows, k_len)
    logits = runner.prefill_shared(step_input(batch.input_ids), step_input(batch.lengths), cache, n,
                                   batch.prompt_ids)  # each prompt once
    # The step as a device tensor for every op that uses it: a Python int in an op is a new lazy
    # graph per token on a Gaudi (token_loop.py says more).
    step_t = torch.zeros(1, dtype=torch.long, device=device)  # [1]
    steps_run = 0
    for step in range(batch.steps):
        positions = lengths + step_t  # [R] slot of the token chosen now
        log_probs = torch.log_softmax(logits.float(), dim=-1)
        log_probs = processors(log_probs, LoopState(sequence, lengths, positions, step, step_t))
        vocab = log_probs.shape[-1]
        # 2N candidates: enough to keep N running beams even if N of them end here.
        cand_scores, flat = top_candidates(log_probs.view(b, n, vocab), running, 2 * n, step_t, sample_keys,
                                           noise_kernel)
        parent, token = flat // vocab, flat % vocab  # [B, 2N]
        slot = (batch.lengths + step_t).clamp(max=k_len - 1)  # [B] where this token goes
        cand_seq = sequence.view(b, n, k_len).gather(1, parent[:, :, None].expand(b, 2 * n, k_len))
        cand_seq.scatter_(2, slot[:, None, None].expand(b, 2 * n, 1), token[:, :, None])
        ends = (step_t + 1 >= limits)[:, None].expand(b, 2 * n)
        if eos_token_id is not None:
            ends = ends | (token == eos_token_id)

        # The best N candidates that did not end continue.
        running, pick = torch.topk(cand_scores + ends.float() * NEG, n, dim=-1)
        next_parent, next_token = parent.gather(1, pick), token.gather(1, pick)

        # Ended candidates among the first N enter the finished set if they beat its worst member;
        # nothing enters a done prompt (nor a full one with early_stopping=true).
        just_finished = ends & first_n[None, :]
        closed = ~open_ | done[:, None]
        if stop_when_full:
            closed = closed | finished.full()[:, None]
        scored = cand_scores / (step_t + 1).float() ** length_penalty
        scored = scored + closed.float() * NEG + (~just_finished).float() * NEG
        finished.merge(scored, cand_seq, step_t + 1, just_finished)

        # Running beams: histories and cache rows follow their parents (in place).
        sequence.copy_(cand_seq.gather(1, pick[:, :, None].expand(b, n, k_len)).view(rows, k_len))
        if use_kv_cache:
            cache.reorder((row_base + next_parent).view(rows), upto=plan.window(step))

        # transformers' heuristic: can the best running beam still beat the worst finished one?
        # ("never" with a positive penalty assumes the beam could still grow to the full budget.)
        best_length = limits[:, None].float() if never else (step_t + 1).float()
        best_running = running[:, :1] / best_length**length_penalty
        worst = torch.where(finished.real, finished.scores.min(dim=1, keepdim=True).values, NEG)
        open_ = open_ & (best_running > worst).any(dim=1, keepdim=True)
        done = done | ~open_[:, 0] | (step_t + 1 >= limits)
        if stop_when_full:
            done = done | finished.full()

        steps_run = step + 1
        if tick is not None:
            tick()
        if step + 1 == batch.steps:
            break
        if (step + 1) % EOS_CHECK_EVERY == 0 and bool(done.all()):  # the only host read
            break
        step_t += 1
        slots = positions.clamp(max=k_len - 1)  # done prompts may run past their end
        if use_kv_cache:
            # Step inputs of one layout every step (steps.step_input): graph keys stay the same.
            logits = runner.decode(step_input(next_token.view(rows, 1)), step_input(slots), cache, plan.window(step))
        else:
            logits = runner.prefill(sequence, (positions + 1).clamp(max=k_len), cache)
    return BeamOutput(finished.sequences, finished.new_tokens, finished.scores, steps_run)
