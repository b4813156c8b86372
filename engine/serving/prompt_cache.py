"""The engine's KV reuse: fresh caches for the model, checkpoints in and out.

``acquire`` returns a cache already holding the longest stored prefix of the new prompt
(session checkpoint first, then any checkpoint, RAM tier then SSD tier; see
engine.checkpoints); ``release`` checkpoints the cache after a turn. KV is only ever reused
for the exact token prefix it was computed from. A ``companion`` (the speculator, when a draft
model keeps its own KV) is told of every acquire and release, so its checkpoints follow the
session's.
"""

from __future__ import annotations

from engine.checkpoints import CheckpointStore, DurabilityReport, Restored, open_store
from engine.generation.kv_cache import make_cache
from engine.model.weight_policy import backend

Reuse = Restored


class PromptCache:
    def __init__(self, model, profile, store: CheckpointStore | None = None):
        self.model = model
        self.profile = profile
        self.store = store or open_store(profile, self.new_cache)
        self.companion = None  # has acquire(prompt, session_id, cached) / release / flush / close

    def new_cache(self) -> list:
        kv = self.profile.kv_cache
        # On the CPU backend live attention stays in float (quantized SDPA is far slower there);
        # quantized formats apply to stored checkpoints. GPUs run the profile's format live.
        bits = {"q8": 8, "q4": 4}.get(kv.format) if backend() != "cpu" else None
        return make_cache(self.model, kv_bits=bits, kv_group_size=kv.group_size)

    def acquire(self, prompt: list[int], session_id: str | None = None) -> Restored:
        found = self.store.acquire(prompt, session_id)
        if self.companion is not None:
            self.companion.acquire(prompt, session_id, found.cached_tokens)
        return found

    def release(self, tokens: list[int], cache: list, session_id: str | None = None) -> None:
        self.store.release(tokens, cache, session_id)
        if self.companion is not None:
            self.companion.release(tokens, session_id)

    def flush(self, timeout: float | None = None) -> DurabilityReport:
        if self.companion is not None:
            self.companion.flush(timeout)
        return self.store.flush(timeout)

    def close(self, timeout: float | None = None) -> DurabilityReport:
        if self.companion is not None:
            self.companion.close(timeout)
        return self.store.close(timeout)
