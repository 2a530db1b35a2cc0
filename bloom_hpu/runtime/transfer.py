"""Host values onto the device without waiting for the device.

``tensor.to("cuda")`` from ordinary (pageable) memory synchronizes with the card's queue before
it copies: the host waits until every step launched so far has run. A copy from pinned memory
with ``non_blocking=True`` is queued behind them instead, and PyTorch's pinned-memory allocator
keeps the source buffer until the copy has read it. The server uploads a few small tensors per
step (positions, row options, row indices); with this, the host prepares the next step while the
card still runs the last one.
"""

from __future__ import annotations

import torch


def host_to_device(host: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """``host`` (a CPU tensor) on ``device``; on CUDA without a host sync (pinned memory, a
    non-blocking copy). On
    a Gaudi a plain copy: pinned memory there has not been tried on a card."""
    device = torch.device(device)
    if device.type == "cpu":
        return host
    if device.type == "cuda":
        return host.pin_memory().to(device, non_blocking=True)
    return host.to(device)
