"""Moving KV caches back to the accepted length after a verification forward.

A verification forward writes ``k + 1`` positions; only the pending token and the accepted
drafts stay. Full-attention caches (static, growing, quantized) keep their buffers and just
move ``offset``: positions past it are never read (the compiled step masks them, the
prefill path slices them off) and the next forward overwrites them. A sliding-window ring
overwrote the slots of the oldest positions, so ``Round`` keeps the ring from before the
forward (MLX arrays are immutable: a reference, not a copy) and takes each slot from the
new ring only for positions that were kept -- an exact rollback, also after wrapping.
"""

from __future__ import annotations

from engine.generation.kv_cache import WindowKVCache

import mlx.core as mx
from mlx_lm.models.cache import KVCache, QuantizedKVCache


def unsupported(cache: list) -> str | None:
    """Why these caches cannot be rolled back (speculation then stays off), or None."""
    for c in cache:
        if not isinstance(c, (WindowKVCache, KVCache, QuantizedKVCache)):
            return f"{type(c).__name__} layers cannot be rolled back"
    return None


def max_rows(cache: list) -> int | None:
    """The most positions one forward may add so a window ring still holds all of them."""
    windows = [c.window for c in cache if isinstance(c, WindowKVCache)]
    return min(windows) if windows else None


class Round:
    """One verification forward's effect on the caches; ``keep(n)`` leaves ``n`` of its positions."""

    def __init__(self, cache: list):
        self.cache = cache
        self.base = cache[0].offset
        self.before = [(c.keys, c.values) if isinstance(c, WindowKVCache) else None for c in cache]
        self.after: list | None = None

    def written(self) -> None:
        """Call after the forward: remember what it wrote."""
        self.after = [(c.keys, c.values) if isinstance(c, WindowKVCache) else None for c in self.cache]

    def keep(self, n: int) -> None:
        assert self.after is not None, "keep() before written()"
        for c, before, after in zip(self.cache, self.before, self.after, strict=True):
            if after is None:
                c.offset = self.base + n
                continue
            W = c.window
            slots = mx.arange(W)
            # slot of position p is p % W; kept positions are base .. base + n - 1
            rel = (slots - self.base) % W
            take_new = (rel < n).reshape(1, 1, W, 1)
            c.keys = mx.where(take_new, after[0], before[0])
            c.values = mx.where(take_new, after[1], before[1])
            c.offset = self.base + n
