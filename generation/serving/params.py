"""What one request asks of the engine: ``SamplingParams`` (per-row options, host values) and the
events the engine sends back while it runs."""

from __future__ import annotations

from dataclasses import dataclass, field

from ..request.parse import Request


@dataclass
class SamplingParams:
    """Options of one request; each of its rows gets them as entries of the engine's row tensors."""

    max_tokens: int = 16
    temperature: float = 0.0  # 0: greedy (argmax); > 0: sampling at this temperature
    top_p: float = 1.0
    top_k: int = 0  # 0: off
    repetition_penalty: float = 1.0  # transformers' (prompt and generated tokens; 1: off)
    presence_penalty: float = 0.0  # OpenAI's: over generated tokens only (as vLLM)
    frequency_penalty: float = 0.0
    seed: int | None = None  # None: one drawn at admission
    stop: list[str] = field(default_factory=list)
    logprobs: int | None = None  # None: none; k: the chosen token's log-prob and k alternatives
    n: int = 1  # choices
    adapter: int = 0  # the LoRA adapter its rows use (the engine's generator.lora; 0: the base model)
    ignore_eos: bool = False  # vLLM's: the row does not stop at EOS (it runs to max_tokens)
    grammar: object = None  # structured output (structured.Grammar): what each choice must match

    @classmethod
    def of(cls, request: Request, adapter: int = 0) -> "SamplingParams":
        """A checked request (greedy search or sampling: what the engine runs row by row) as its
        rows' options."""
        o = request.options  # (checked when the request was read)
        return cls(max_tokens=request.max_tokens, temperature=o.temperature if o.do_sample else 0.0,
                   top_p=o.top_p, top_k=o.top_k, repetition_penalty=o.repetition_penalty,
                   presence_penalty=request.presence_penalty, frequency_penalty=request.frequency_penalty,
                   seed=o.seed, stop=request.stop,
                   logprobs=request.logprobs, n=request.n, adapter=adapter, ignore_eos=request.ignore_eos,
                   grammar=request.grammar)

    @property
    def sampling(self) -> bool:
        return self.temperature > 0

    @property
    def rows(self) -> int:
        """Rows the request occupies: greedy choices are all the same, so one row serves them."""
        return self.n if self.sampling else 1


@dataclass
class TokenLogprob:
    token_id: int
    logprob: float
    top: list[tuple[int, float]]  # the most likely tokens and their log-probs, best first


@dataclass
class Event:
    """One message from the engine to a request's consumer.

    kind: "delta" (new text and token ids of choice ``index``), "finish" (choice ``index`` ended:
    ``sequence`` is the whole result, ``finish_reason`` why), "done" (every choice ended; ``usage``),
    "record" (an offline-path answer: ``record`` as the batch runner writes it), "error"."""

    kind: str
    index: int = 0
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] | None = None
    finish_reason: str | None = None
    sequence: object = None
    usage: dict | None = None
    record: dict | None = None
    message: str = ""
