"""The engine's public sampling API; the implementation is ``engine.generation.sampling``."""

from engine.generation.sampling import SamplingParams

__all__ = ["SamplingParams"]
