"""What a token chooser and a logits processor may look at, at one step of a search.

Its own module so that the loops (``token_loop.py``, ``beam.py``), the processors and the token
choice (``choose.py``) can all name it without importing one another.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch


@dataclass
class LoopState:
    """Shapes: B rows, K cache slots."""

    sequence: torch.Tensor  # [B, K] prompt + generated ids so far (pad beyond each row's end)
    lengths: torch.Tensor  # [B] prompt tokens per row
    positions: torch.Tensor  # [B] slot of the token being chosen now = lengths + step (capped at the cache's end)
    step: int  # host int: how many tokens each row has generated so far
    step_tensor: torch.Tensor | None = None  # [1] the same on the device (what ops should use)
    # [B] each row's own step, where rows have generated different counts (speculation's verify
    # positions, ``speculation.py``); None: every row is at ``step``.
    row_steps: torch.Tensor | None = None


# (logits [B, V] float, state) -> next tokens [B] long
TokenChooser = Callable[[torch.Tensor, LoopState], torch.Tensor]
