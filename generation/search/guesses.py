"""Where speculative decoding's guesses come from, and how a user names the source.

*Prompt lookup* (n-gram): a row's last n tokens are looked up in its own prompt and output; the
tokens that followed their latest earlier occurrence are the guesses. No second model: it pays
where the text copies its context (few-shot answers, quotes, code, text that repeats itself).

The lookup runs on the device over the loop's static ``sequence`` buffer, for every row at once:
a comparison of the sequence, shifted by m, with each of the row's last tokens (m = 0, 1, 2) and one
maximum ([B, L] work, a dozen ops, nothing read back to the host), so it adds no host round-trip
to the loop.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

KINDS = ("ngram", "draft")  # prompt lookup; a draft model's guesses (draft.py)
# The verify pass's guess count is rounded up to one of these (one captured shape each); rows
# with fewer guesses pad.
K_SHAPES = (2, 4, 8)
MAX_K = K_SHAPES[-1]
DEFAULT_K = 4
LONGEST_NGRAM = 3  # the suffix lengths tried: 3, 2, 1, the longest that matches first (it predicts better)
# On a CPU a verify pass's cost grows with its rows x positions (the products turn compute-bound):
# past about 16 it costs more than the ~2 tokens a row that prompt lookup's guesses save on text that
# repeats (the crossover measured in docs/performance.md), so the server's passes and greedy
# ``generate`` batches larger than that decode without guesses. Not measured on cards.
CPU_VERIFY_ROWS = 16


def worth_verifying(rows: int, positions: int, device: torch.device) -> bool:
    """Whether a verify pass of ``rows`` x ``positions`` pays where a plain decode step would do."""
    return device.type != "cpu" or rows * positions <= CPU_VERIFY_ROWS


class SpeculationError(ValueError):
    """A malformed ``speculate`` value or a search it cannot serve; the message is meant for the user."""


@dataclass(frozen=True)
class Speculation:
    kind: str  # "ngram" or "draft"
    k: int  # at most this many guesses a row per verify pass

    @property
    def shape_k(self) -> int:
        """The guesses the verify pass is shaped for: ``k`` rounded up to ``K_SHAPES``."""
        return next(s for s in K_SHAPES if s >= self.k)

    def __str__(self) -> str:
        return f"{self.kind}:{self.k}"


def parse_speculation(value) -> Speculation | None:
    """``None``/"" /"off" -> None; "ngram", "draft", "ngram:K" or "draft:K" (1 <= K <= 8) -> Speculation; a
    ``Speculation`` as it is. Anything else: ``SpeculationError``."""
    if value is None or isinstance(value, Speculation):
        return value
    if not isinstance(value, str):
        raise SpeculationError(f"speculate must be a string such as 'ngram:4', got {type(value).__name__}")
    text = value.strip().lower()
    if text in ("", "off", "none"):
        return None
    kind, _, k = text.partition(":")
    if kind not in KINDS:
        raise SpeculationError(f"unknown speculation {value!r}: use ngram[:K] (prompt lookup) or draft[:K] (a draft "
                               f"model's guesses, with --draft_model), at most K guesses a pass, 1..{MAX_K}")
    if not k:
        return Speculation(kind, DEFAULT_K)
    if not k.isdigit() or not 1 <= int(k) <= MAX_K:
        raise SpeculationError(f"speculation {value!r}: K must be a whole number from 1 to {MAX_K}")
    return Speculation(kind, int(k))


def ngram_guesses(sequence: torch.Tensor, used: torch.Tensor, k: int,
                  longest: int = LONGEST_NGRAM) -> tuple[torch.Tensor, torch.Tensor]:
    """Prompt lookup for every row: guesses [B, k] long and how many of them are real, counts [B].

    sequence [B, L]: each row's prompt + output in its first ``used[b]`` slots (anything after).
    For the longest n <= ``longest`` whose suffix (the row's last n tokens) occurs earlier in the
    row, the latest such occurrence followed by k real tokens (else the latest one) is taken and the
    (up to k) tokens after it are the guesses; counts is how many of those lie in real tokens
    (0: no match, the row guesses nothing).

    An occurrence is found by where it ends: comparing the sequence, shifted by m, with the row's
    m-th last token (m < ``longest``) counts, per slot p, how many of the row's last tokens end at
    p; one maximum over a key (that count, then whether k real tokens follow, then p) picks the
    occurrence."""
    rows, length = sequence.shape
    device = sequence.device
    back = torch.arange(longest, device=device)
    suffix = sequence.gather(1, (used[:, None] - 1 - back[None, :]).clamp(min=0))  # [B, n]: column m the m-th last token
    # Slot p's m-th token back, sequence[p - m], is padded[p + n - 1 - m]; the pad (-1) equals no token.
    padded = torch.nn.functional.pad(sequence, (longest - 1, 0), value=-1)
    run = torch.zeros(rows, length, dtype=torch.long, device=device)  # [B, L]: how many of the last tokens end at p
    alive = torch.ones(rows, length, dtype=torch.bool, device=device)
    for m in range(longest):
        alive = alive & (padded[:, longest - 1 - m: longest - 1 - m + length] == suffix[:, m: m + 1])
        run = run + alive
    # An occurrence ends before the row's last token and is followed by one real token at least
    # (p <= used - 2); its count is then at most p + 1 < used, the suffix never the whole row.
    slots = torch.arange(length, device=device)
    valid = (run > 0) & (slots[None, :] <= used[:, None] - 2)
    full = slots[None, :] + 1 + k <= used[:, None]  # followed by k real tokens
    key = torch.where(valid, run * (2 * length) + full * length + slots[None, :], -1).amax(dim=1)  # [B]
    hit = key >= 0
    follow = key % length + 1  # [B] the first guessed slot
    ahead = torch.arange(k, device=device)
    picked = sequence.gather(1, (follow[:, None] + ahead[None, :]).clamp(0, length - 1))  # [B, k]
    guesses = torch.where(hit[:, None], picked, 0)
    counts = torch.where(hit, (used - follow).clamp(max=k), 0)
    return guesses, counts
