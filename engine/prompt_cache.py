"""Reuse of KV caches across requests in this process (longest common token prefix).

The caller takes a cache with ``acquire`` (which trims it to the part of the new prompt it
already covers) and gives it back with ``release`` once generation is done. KV is only ever
reused for the exact token prefix it was computed from.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import dataclass

from engine.kv_cache import make_cache
from engine.weight_policy import backend


@dataclass
class Reuse:
    cache: list
    cached_tokens: int
    source: str  # "ram" | "none"
    restore_ms: float = 0.0


def common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


class PromptCache:
    def __init__(self, model, profile, max_entries: int = 4):
        self.model = model
        self.profile = profile
        self.max_entries = max_entries
        self._entries: OrderedDict[str, tuple[list[int], list]] = OrderedDict()

    def new_cache(self) -> list:
        kv = self.profile.kv_cache
        # On the CPU backend live attention stays in float (quantized SDPA is far slower there);
        # quantized formats apply to stored checkpoints. GPUs run the profile's format live.
        bits = {"q8": 8, "q4": 4}.get(kv.format) if backend() != "cpu" else None
        return make_cache(self.model, kv_bits=bits, kv_group_size=kv.group_size)

    def acquire(self, prompt: list[int], session_id: str | None = None) -> Reuse:
        t0 = time.perf_counter()
        key, best = None, 0
        if session_id is not None and session_id in self._entries:
            key = session_id
            best = common_prefix(self._entries[key][0], prompt)
        else:
            for k, (tokens, _) in self._entries.items():
                p = common_prefix(tokens, prompt)
                if p > best:
                    key, best = k, p
        if key is None or best == 0:
            return Reuse(self.new_cache(), 0, "none")
        tokens, cache = self._entries.pop(key)
        covered = cache[0].offset
        use = min(best, covered, len(prompt) - 1)  # at least one token must be fed
        if use < covered:
            if not all(c.is_trimmable() for c in cache):
                return Reuse(self.new_cache(), 0, "none")
            for c in cache:
                c.trim(covered - use)
        if use == 0:
            return Reuse(self.new_cache(), 0, "none")
        return Reuse(cache, use, "ram", (time.perf_counter() - t0) * 1000)

    def release(self, tokens: list[int], cache: list, session_id: str | None = None) -> None:
        covered = cache[0].offset if cache else 0
        key = session_id or f"anon-{id(cache)}"
        self._entries[key] = (list(tokens[:covered]), cache)
        self._entries.move_to_end(key)
        while len(self._entries) > self.max_entries:
            self._entries.popitem(last=False)
