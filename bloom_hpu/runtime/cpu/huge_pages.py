"""The model's weights moved into transparent huge pages (Linux), for the decode steps that
stream them from memory.

A batch-1 decode step reads every weight once: 1 GB a token for bloom-560m in bf16, in 4 KB pages
a quarter of a million pages, each a TLB entry to find. In 2 MB pages the same weights are ~500
entries, and the step reads them faster (on a Zen 5, bloom-560m's bf16 and fp32 decode took 3-4%
less time a token: docs/performance.md). Linux hands out such pages to anonymous memory that asks
for them (``madvise(MADV_HUGEPAGE)``) where ``/sys/kernel/mm/transparent_hugepage/enabled`` says
``madvise`` (the common default) or ``always``; the weights as loaded live where the allocator or
the checkpoint's file mapping put them, neither of which asks.

So the weights of each storage (2 MB or more of it) are copied, once, into an anonymous mapping
aligned to 2 MB and advised so, and the model's tensors are pointed at the copy (``Tensor.set_``:
every tensor object of the model keeps its identity, so a tied weight stays one). The values are
the same bits; only where they sit changes. Nothing is done where transparent huge pages are off (``never``), on
another OS, or for a storage already moved (a second ``accelerate`` of the same model).
"""

from __future__ import annotations

import ctypes
import mmap
import weakref
from pathlib import Path

import torch

HUGE_PAGE = 2 << 20
THP_ENABLED = Path("/sys/kernel/mm/transparent_hugepage/enabled")

# data pointer -> the mapping holding it, for the storages made here (the tensor keeps the mapping
# alive through ``torch.frombuffer``; the entry goes with it).
_moved: weakref.WeakValueDictionary = weakref.WeakValueDictionary()


def thp_mode() -> str:
    """'always', 'madvise' or 'never' (the bracketed word of the sysfs file), or 'unavailable'."""
    try:
        text = THP_ENABLED.read_text()
    except OSError:
        return "unavailable"
    start, end = text.find("["), text.find("]")
    return text[start + 1:end] if 0 <= start < end else "unavailable"


def huge_storage(nbytes: int) -> tuple[torch.UntypedStorage, mmap.mmap]:
    """An untyped storage of ``nbytes`` at a 2 MB boundary of an anonymous mapping advised to take
    huge pages (its pages not touched yet: the advice applies as they are first written)."""
    mapping = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    advise_huge_pages(mapping)
    address = ctypes.addressof(ctypes.c_char.from_buffer(mapping))
    skip = -address % HUGE_PAGE
    storage = torch.frombuffer(mapping, dtype=torch.uint8, count=nbytes, offset=skip).untyped_storage()
    return storage, mapping


def advise_huge_pages(mapping: mmap.mmap) -> None:
    """Asks Linux to back ``mapping`` with huge pages as its pages are first written."""
    mapping.madvise(mmap.MADV_HUGEPAGE)


def huge_zeros(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A tensor of zeros in huge-page memory, where Linux offers it (else ``torch.zeros``)."""
    if thp_mode() not in ("always", "madvise"):
        return torch.zeros(shape, dtype=dtype)
    storage, _ = huge_storage(torch.Size(shape).numel() * dtype.itemsize)
    return torch.empty(0, dtype=dtype).set_(storage, 0, shape).zero_()  # written: every page its own


def model_tensors(model: torch.nn.Module) -> list[torch.Tensor]:
    """Every parameter and buffer object of the model, each once (shared ones too)."""
    seen, out = set(), []
    for _, tensor in [*model.named_parameters(remove_duplicate=False), *model.named_buffers(remove_duplicate=False)]:
        if id(tensor) not in seen:
            seen.add(id(tensor))
            out.append(tensor)
    return out


def byte_span(tensor: torch.Tensor) -> tuple[int, int]:
    """The bytes [first, end) of its storage that ``tensor`` reaches."""
    size = tensor.element_size()
    extent = 1 + sum((n - 1) * stride for n, stride in zip(tensor.shape, tensor.stride())) if tensor.numel() else 0
    return tensor.storage_offset() * size, (tensor.storage_offset() + extent) * size


def move_weights(model: torch.nn.Module) -> int:
    """Moves the model's weights on the CPU into huge-page memory and returns the bytes moved: per
    storage, the span its tensors reach (a rank's slice of a bigger tensor, not the whole), where
    that span is 2 MB or more, once for all the tensors viewing it. Where transparent huge pages are
    off or unknown, moves nothing."""
    if thp_mode() not in ("always", "madvise"):
        return 0
    groups: dict[int, list[torch.Tensor]] = {}
    for tensor in model_tensors(model):
        storage = tensor.untyped_storage()
        if tensor.device.type == "cpu" and storage.data_ptr() not in _moved:
            groups.setdefault(storage.data_ptr(), []).append(tensor)
    moved = 0
    with torch.inference_mode():  # set_ of a model loaded in inference mode is allowed there alone
        for tensors in groups.values():
            spans = [byte_span(t) for t in tensors]
            first = min(start for start, _ in spans) // 64 * 64  # a multiple of every element size
            end = max(end for _, end in spans)
            if end - first < HUGE_PAGE:
                continue
            old = torch.empty(0, dtype=torch.uint8).set_(tensors[0].untyped_storage(), first, (end - first,))
            new, mapping = huge_storage(end - first)
            torch.empty(0, dtype=torch.uint8).set_(new, 0, (end - first,)).copy_(old)
            _moved[new.data_ptr()] = mapping
            for tensor in tensors:
                offset = tensor.storage_offset() - first // tensor.element_size()
                tensor.set_(new, offset, tensor.shape, tensor.stride())
            moved += end - first
    return moved


def huge_bytes(tensors: list[torch.Tensor]) -> int:
    """Bytes of huge pages (``AnonHugePages`` of /proc/self/smaps) in the mappings holding these
    tensors' storages: what the kernel really gave; 0 where it cannot be read."""
    starts = {t.untyped_storage().data_ptr() for t in tensors}
    total, inside = 0, False
    try:
        lines = Path("/proc/self/smaps").read_text().splitlines()
    except OSError:
        return 0
    for line in lines:
        head = line.split(maxsplit=1)[0] if line else ""
        if "-" in head and not head.endswith(":"):
            low, _, high = head.partition("-")
            low, high = int(low, 16), int(high, 16)
            inside = any(low <= s < high for s in starts)
        elif inside and head == "AnonHugePages:":
            total += int(line.split()[1]) * 1024
    return total
