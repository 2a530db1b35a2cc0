"""Generation on top of the static-shape BLOOM: options, search loops, the public Generator."""

from .generator import Generator
from .request.options import GenerationOptions
from .run.results import GenerationResult, Sequence

__all__ = ["Generator", "GenerationOptions", "GenerationResult", "Sequence"]
