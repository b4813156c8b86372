"""The engine's KV reuse: fresh caches for the model, checkpoints in and out.

``acquire`` returns a cache already holding the longest stored prefix of the new prompt
(session checkpoint first, then any checkpoint, RAM tier then SSD tier; see
engine.checkpoints); ``release`` checkpoints the cache after a turn. KV is only ever reused
for the exact token prefix it was computed from. A ``companion`` (the speculator, when a draft
model keeps its own KV) is told of every acquire and release, so its checkpoints follow the
session's.
"""

from __future__ import annotations

import time

from engine.checkpoints import (
    CheckpointStore,
    DurabilityReport,
    Restored,
    fingerprint_for_profile,
    open_store,
    snapshot,
)
from engine.checkpoints.fingerprint import live_kv_format
from engine.generation.kv_cache import live_kv_dtype, make_cache
from engine.model.weight_policy import backend

Reuse = Restored


class PromptCache:
    def __init__(self, model, profile, store: CheckpointStore | None = None):
        self.model = model
        self.profile = profile
        # One decision (fingerprint.live_kv_format) for the live caches and the checkpoints.
        self.kv_format = live_kv_format(profile.kv_cache, backend(), model)
        if store is None:
            store = open_store(profile, self.new_cache, fingerprint_for_profile(profile, model))
        self.store = store
        self.companion = None  # has acquire(prompt, session_id, cached) / release / flush / close

    def new_cache(self) -> list:
        kv = self.profile.kv_cache
        # GPUs run the profile's quantized formats live. On the CPU live attention stays in
        # float (quantized SDPA is far slower there; quantized formats apply to stored
        # checkpoints), float16 where the fused attention kernel reads it ("fp16"), or 8-bit
        # rows ("q8hrows-g<group>").
        bits = {"q8": 8, "q4": 4}.get(kv.format) if self.kv_format.startswith(("q8-", "q4-")) else None
        dtype = live_kv_dtype(self.kv_format)
        return make_cache(self.model, kv_bits=bits, kv_group_size=kv.group_size, kv_dtype=dtype)

    def acquire(self, prompt: list[int], session_id: str | None = None) -> Restored:
        found = self.store.acquire(prompt, session_id, hand_over=True)  # the request extends it
        if self.companion is not None:
            self.companion.acquire(prompt, session_id, found.cached_tokens)
        return found

    def fork(
        self, cache: list, prompt: list[int], session_id: str | None = None, use: int | None = None
    ) -> Restored:
        """A copy of the first ``use`` tokens (default: all) of ``cache``, a live cache another
        request of the same prompt computed, for a new request: its own buffers, so either may
        grow its cache without touching the other's. Source "twin"; the companion is told as
        by ``acquire``."""
        t0 = time.perf_counter()
        n = int(cache[0].offset) if cache else 0
        n = n if use is None else min(n, use)
        copy = snapshot.restore(snapshot.capture(cache), n, self.new_cache()) if n else self.new_cache()
        if self.companion is not None:
            self.companion.acquire(prompt, session_id, n)
        return Restored(copy, n, "twin", (time.perf_counter() - t0) * 1000)

    def release(self, tokens: list[int], cache: list, session_id: str | None = None) -> None:
        _fit(cache, len(tokens))
        self.store.release(tokens, cache, session_id)
        if self.companion is not None:
            self.companion.release(tokens, session_id)

    def flush(self, timeout: float | None = None) -> DurabilityReport:
        """Both stores' writes (the companion's first); one report for both."""
        theirs = self.companion.flush(timeout) if self.companion is not None else None
        return self.store.flush(timeout).joined(theirs)

    def close(self, timeout: float | None = None) -> DurabilityReport:
        theirs = self.companion.close(timeout) if self.companion is not None else None
        return self.store.close(timeout).joined(theirs)


def _fit(cache: list, n: int) -> None:
    """A cancelled reply's cache may have fed a token past the last one it streamed (the step
    after it was in flight): trim it to the ``n`` tokens the caller knows, so the checkpoint is
    stored (the store refuses a cache longer than its tokens) and the next turn restores it."""
    if not cache or n <= 0:
        return
    excess = int(cache[0].offset) - n
    if excess <= 0:
        return
    if all(c.is_trimmable() and getattr(c, "_pos", None) is None for c in cache):
        for c in cache:
            c.trim(excess)
