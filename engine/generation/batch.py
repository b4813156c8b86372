"""Batched decode: rows of different lengths share one forward pass per token.

``BatchKV`` holds per-layer ``mlx_lm`` ``BatchKVCache``s: each row's history is
right-aligned in a common buffer, and the left padding is masked out of attention while
RoPE runs at each row's own position, so a row's logits match its solo run. Rows join
(``add``: a prefilled per-request cache) and leave (``take`` then ``keep``) between steps;
the model sees standard mlx_lm attention inputs (array masks), nothing model-specific.
"""

from __future__ import annotations

from engine.generation.kv_cache import StaticKVCache

import mlx.core as mx
from mlx_lm.models.cache import BatchKVCache


def batchable(cache: list) -> bool:
    """True when a request's layer caches can join a batch (plain full-attention KV)."""
    return all(type(c) is StaticKVCache for c in cache)


class BatchKV:
    """Layer caches for the rows decoding together, in row order."""

    def __init__(self) -> None:
        self.layers: list[BatchKVCache] | None = None
        self.rows = 0

    def add(self, cache: list) -> None:
        """Append a row holding exactly ``cache``'s tokens (one per-request layer list)."""
        one = [BatchKVCache.merge([c]) for c in cache]
        if self.layers is None:
            self.layers = one
        else:
            for mine, theirs in zip(self.layers, one, strict=True):
                mine.extend(theirs)
        self.rows += 1

    def take(self, i: int) -> list:
        """Row ``i``'s history as fresh per-request caches (for checkpoints or the solo lane)."""
        out = []
        for layer in self.layers or []:
            kv = layer.extract(i)
            c = StaticKVCache()
            c.keys, c.values, c.offset = kv.keys, kv.values, kv.offset
            out.append(c)
        return out

    def keep(self, rows: list[int]) -> None:
        """Drop every row not listed (list order becomes the new row order)."""
        if not rows:
            self.layers, self.rows = None, 0
            return
        if len(rows) == self.rows and rows == list(range(self.rows)):
            return
        idx = mx.array(rows, dtype=mx.int32)
        for layer in self.layers or []:
            layer.filter(idx)
        self.rows = len(rows)

    @property
    def nbytes(self) -> int:
        return sum(layer.nbytes for layer in self.layers or [])


def batched_logits(model, tokens: list[int], kv: BatchKV) -> mx.array:
    """Feed one token per row; (rows, vocab) logits of the next position."""
    x = mx.array(tokens, dtype=mx.int32)[:, None]
    return model(x, cache=kv.layers)[:, -1, :]
