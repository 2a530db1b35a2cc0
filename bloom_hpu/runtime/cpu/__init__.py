"""CPU acceleration, applied to a finished model: capability detection (``capability.py``), our
kernels built per ISA (``kernels.py``, ``csrc/``), the layers they swap in (``layers.py``), and the
choice between them (``accelerate.py``)."""

from .accelerate import PATHS, CpuOptions, CpuPathError, CpuPlan, accelerate

__all__ = ["PATHS", "CpuOptions", "CpuPathError", "CpuPlan", "accelerate"]
