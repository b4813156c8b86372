"""Batched decode: rows of different lengths share one forward pass per token.

``BatchKV`` holds per-layer ``mlx_lm`` ``BatchKVCache``s: each row's history is
right-aligned in a common buffer, and the left padding is masked out of attention while
RoPE runs at each row's own position, so a row's logits match its solo run. Rows join
(``add``: a prefilled per-request cache) and leave (``take`` then ``keep``) between steps;
the model sees standard mlx_lm attention inputs (array masks), nothing model-specific.

``prefill_together`` runs equal-length prompt chunks of several requests as one forward (their
caches merged for the call, then split back), so newcomers arriving together do not prefill
one after another.

Sliding-window layers (Gemma) join with the positions their ring still holds; in the batch
they keep every new position and the model's window mask (buffer distance = position
distance) hides what falls out of the window; ``take`` turns them back into rings.
"""

from __future__ import annotations

from engine.generation.kv_cache import StaticKVCache, WindowKVCache

import mlx.core as mx
from mlx_lm.models.cache import BatchKVCache, KVCache


def batchable(cache: list) -> bool:
    """True when a request's layer caches can join a batch (full or sliding-window float KV)."""
    return all(type(c) in (StaticKVCache, WindowKVCache) for c in cache)


def _plain(c, upto: int) -> KVCache:
    """The first ``upto`` positions of a layer cache (those it still holds) as a plain KVCache."""
    kv = KVCache()
    if isinstance(c, WindowKVCache):
        ordered = c.state  # time-ordered, ending at position c.offset - 1
        if ordered:
            keep = ordered[0].shape[2] - (c.offset - upto)
            kv.keys, kv.values = ordered[0][..., :keep, :], ordered[1][..., :keep, :]
            kv.offset = keep
        return kv
    kv.keys, kv.values, kv.offset = c.keys, c.values, upto
    return kv


class BatchKV:
    """Layer caches for the rows decoding together, in row order."""

    def __init__(self) -> None:
        self.layers: list[BatchKVCache] | None = None
        self.windows: list[int | None] = []  # per layer: sliding window size, or None
        self.rows = 0

    def add(self, cache: list, upto: int | None = None) -> None:
        """Append a row holding ``cache``'s first ``upto`` tokens (default: all it holds)."""
        upto = cache[0].offset if upto is None else upto
        one = []
        for c in cache:
            layer = BatchKVCache.merge([_plain(c, upto)])
            layer.offset = mx.array([upto])  # RoPE position, even where a window dropped the past
            one.append(layer)
        self.windows = [getattr(c, "window", None) for c in cache]
        if self.layers is None:
            self.layers = one
        else:
            for mine, theirs in zip(self.layers, one, strict=True):
                mine.extend(theirs)
        self.rows += 1

    def take(self, i: int) -> list:
        """Row ``i``'s history as fresh per-request caches (for checkpoints or the solo lane)."""
        out = []
        for layer, window in zip(self.layers or [], self.windows, strict=True):
            kv = layer.extract(i)
            if window is None:
                c = StaticKVCache()
                c.keys, c.values, c.offset = kv.keys, kv.values, kv.offset
            else:
                n = min(window, kv.offset)
                c = WindowKVCache(window)
                c.restore_ordered(kv.keys[..., -n:, :], kv.values[..., -n:, :], int(layer.offset[i].item()))
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


def fill(model, cache: list, tokens: list[int]) -> None:
    """Feed ``tokens`` into one request's ``cache`` without computing logits: only the caches
    are evaluated, so the output projection over every position (vocab x hidden per token,
    ~20-27% of a small model's prefill) and the last layer's MLP are never run. The KV values
    are the ones ``prefill`` computes (same forward); use it for prompt chunks whose logits
    nobody reads."""
    model(mx.array(tokens, dtype=mx.int32)[None], cache=cache)
    mx.eval([c.state for c in cache])


def prefill_together(model, caches: list[list], chunks: list[list[int]]) -> list[list]:
    """Feed equal-length ``chunks`` (one per request) after each request's ``caches`` in one
    forward; returns each request's caches holding its history plus its chunk.

    Every request's caches must hold the same number of tokens: the rows are then stacked
    without padding and the forward is the solo prefill's, batch dimension aside (scalar
    RoPE offset, "causal" mask), so each row rounds exactly as it would alone. Only the caches
    are evaluated: no logits are needed (the decode lanes feed the last prompt token), so the
    output projection over every position is never computed. Full-attention float caches
    only (see ``batchable``; sliding windows prefill one request at a time)."""
    offset = caches[0][0].offset
    if any(c[0].offset != offset for c in caches):
        raise ValueError("prefill_together needs caches of one length")
    layers = []
    for layer in zip(*caches, strict=True):
        kv = KVCache()
        if offset:
            kv.keys = mx.concatenate([c.keys[..., :offset, :] for c in layer])
            kv.values = mx.concatenate([c.values[..., :offset, :] for c in layer])
            kv.offset = offset
        layers.append(kv)
    model(mx.array(chunks, dtype=mx.int32), cache=layers)
    mx.eval([(kv.keys, kv.values) for kv in layers])
    out = []
    for i in range(len(chunks)):
        row = []
        for kv in layers:
            c = StaticKVCache()
            c.keys, c.values = kv.keys[i : i + 1, :, : kv.offset], kv.values[i : i + 1, :, : kv.offset]
            c.offset = kv.offset
            row.append(c)
        out.append(row)
    return out
