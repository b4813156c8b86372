"""The engine's public serving API: ``Engine``, ``GenerationRequest``, ``RequestHandle``.

The implementation lives in ``engine.serving``; callers outside the engine import from here.
"""

from engine.serving.engine import Engine, GenerationRequest, Priority
from engine.serving.worker import RequestHandle

__all__ = ["Engine", "GenerationRequest", "Priority", "RequestHandle"]
