"""Structured output in the speculative loop (``speculation.py``): the grammar mask at every
verified position, as the plain loop (``choose.GrammarSteps``) applies it at every step.

Before a pass's tokens are chosen, each constrained row's matcher is advanced over the row's
guesses and rolled back (``RowGrammar.masks_ahead``): position j gets the mask the plain loop
would use had the row chosen guesses 0..j-1, and a flag when its grammar had ended before j (the
row ends there, finish reason "stop", the token chosen there not kept in its text). After the
pass, the tokens each row kept go into its matcher, in order.

The host reads the pass's guesses and the tokens kept: two reads per pass, where the plain loop
with a grammar reads every token. The masks are computed on the host, as in the plain loop.
"""

from __future__ import annotations

import torch

from ..request.grammar import GrammarRows


class VerifiedGrammars:
    """The grammars (``GrammarRows``) of a batch that speculates."""

    def __init__(self, rows: GrammarRows):
        self.rows = rows

    def masks(self, guesses: torch.Tensor, counts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """guesses [B, S - 1], counts [B] -> the allowed tokens [B * S, words] int32 of every
        position (row-major, for ``grammar.allow``) and whether a row's grammar had ended before
        it [B, S] bool, on the device."""
        masks, ended = self.rows.masks_ahead(guesses.tolist(), counts.tolist())
        device = self.rows.device
        return masks.to(device), torch.tensor(ended, dtype=torch.bool, device=device)

    def take(self, token: torch.Tensor, kept: torch.Tensor) -> None:
        """The first ``kept[b]`` tokens of ``token[b]`` ([B, S]) into row b's grammar, until it ends
        (the token chosen where it ended is the end the grammar forced: not taken)."""
        for grammar, row, n in zip(self.rows.rows, token.tolist(), kept.tolist()):
            for t in row[:n] if grammar is not None else ():
                if grammar.ended:
                    break
                grammar.consume(t)
