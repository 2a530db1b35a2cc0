"""What generation returns: per prompt, one or more sequences with their text and ids."""

from __future__ import annotations

from dataclasses import dataclass, field

from ..search.text_ends import text_end


@dataclass
class Sequence:
    text: str  # the generated continuation only (special tokens removed)
    token_ids: list[int]  # generated ids, up to and including an EOS that ended the row
    finish_reason: str  # "length", "eos" or "stop"
    score: float | None = None  # beam search: the hypothesis score transformers reports
    token_logprobs: list[float] | None = None  # log-prob of each generated token, when asked


@dataclass
class GenerationResult:
    prompt: str
    prompt_token_ids: list[int]
    sequences: list[Sequence] = field(default_factory=list)
    cached_tokens: int = 0  # prompt tokens whose keys and values came from the prefix cache

    # The first (best) sequence, which is all there is unless num_return_sequences > 1.
    @property
    def text(self) -> str:
        return self.sequences[0].text

    @property
    def token_ids(self) -> list[int]:
        return self.sequences[0].token_ids

    @property
    def finish_reason(self) -> str:
        return self.sequences[0].finish_reason

    def to_dict(self) -> dict:
        out = {
            "prompt": self.prompt,
            "completion": self.text,
            "token_ids": self.token_ids,
            "finish_reason": self.finish_reason,
        }
        if len(self.sequences) > 1 or self.sequences[0].score is not None:
            out["sequences"] = [
                {"completion": s.text, "token_ids": s.token_ids, "finish_reason": s.finish_reason, "score": s.score}
                for s in self.sequences
            ]
        return out


@dataclass
class BatchStats:
    seconds: float
    new_tokens: int
    graph_count: int
    cached_tokens: int = 0  # prompt tokens served by the prefix cache
    speculation: object | None = None  # search/speculation.SpeculationStats of a call that speculated

    @property
    def tokens_per_second(self) -> float:
        return self.new_tokens / self.seconds if self.seconds > 0 else 0.0


def make_sequence(tokenizer, ids: list[int], finish_reason: str, score: float | None = None,
                  stops: list[str] = (), eos_ends: bool = True) -> Sequence:
    """A row's generated ids -> its sequence, ended at its first EOS (kept in the ids, not in the
    text; ``eos_ends=False``, vLLM's ignore_eos: EOS ends nothing) or just before its first stop
    string; ``finish_reason`` says why the search stopped it otherwise."""
    end = text_end(ids, list(stops), tokenizer, eos_ends)
    return Sequence(end.text, end.token_ids, end.reason or finish_reason, score)
