"""The sweep: the Cartesian product of the options, one ``Config`` per point, each with a key.

The key names everything that changes what a configuration measures besides the machine and the
model (kept in results.json as one shape per folder), so a rerun finds what is done by key.
"""

from __future__ import annotations

import itertools
from dataclasses import asdict, dataclass

DTYPES = ("fp32", "bf16", "int8", "int4")
QUANTIZED = ("int8", "int4")
# The dtype of activations and KV cache: int8 and int4 are quantized weights, over bf16.
ACTIVATION_DTYPES = {"fp32": "float32", "bf16": "bfloat16", "int8": "bfloat16", "int4": "bfloat16"}
SCENARIOS = {"offline": ("offline",), "online": ("online",), "both": ("offline", "online")}


@dataclass(frozen=True)
class Config:
    scenario: str
    tp: int
    dtype: str
    max_batch: int
    input_len: int
    output_len: int
    speculate: str = "off"  # offline: "ngram:K" verifies up to K guesses a pass (prompt lookup)

    @property
    def key(self) -> str:
        key = f"{self.scenario} tp{self.tp} {self.dtype} batch{self.max_batch} in{self.input_len} out{self.output_len}"
        return key if self.speculate == "off" else f"{key} {self.speculate}"  # keys of earlier runs unchanged

    def to_dict(self) -> dict:
        return {"key": self.key, **asdict(self)}


def client_levels(max_batch: int) -> list[int]:
    """The online concurrency sweep of a server of ``max_batch`` rows: 1, 2, 4, ... up to max_batch
    (more clients than rows would only queue)."""
    levels, level = [], 1
    while level < max_batch:
        levels.append(level)
        level *= 2
    return levels + [max_batch]


def parse_lengths(text: str) -> tuple[int, int]:
    """'60,20' -> (60, 20): input tokens, output tokens."""
    parts = text.split(",")
    try:
        n_in, n_out = (int(p) for p in parts)
    except ValueError:
        raise ValueError(f"--input_output_lengths takes INPUT,OUTPUT pairs such as 60,20; got {text!r}") from None
    if n_in < 1 or n_out < 1:
        raise ValueError(f"input and output lengths must be >= 1, got {text!r}")
    return n_in, n_out


def product(scenario: str, tps: list[int], dtypes: list[str], batches: list[int],
            lengths: list[tuple[int, int]], speculate: list[str] = ("off",)) -> list[Config]:
    """Every configuration, grouped by tensor-parallel size then dtype (the order they run in: one
    launch per size, one set of weights per dtype), duplicates dropped. ``speculate`` is an axis of
    the offline configurations; online ones run without (serve_bench's engine takes no speculation)."""
    configs = [Config(s, tp, d, b, i, o, g)
               for tp, d, s, b, (i, o), g in itertools.product(tps, dtypes, SCENARIOS[scenario], batches, lengths,
                                                               speculate)
               if s == "offline" or g == "off"]
    return list(dict.fromkeys(configs))
