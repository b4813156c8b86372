"""Batched decode: rows of different lengths share one compiled forward pass per token.

``BatchKV`` holds one ``RowsKVCache`` per layer: every row's history sits at the buffer
positions of its own token positions (row ``i``'s key for position ``p`` at index ``p``,
rows left-aligned, the buffer a multiple of ``StaticKVCache.step`` long), exactly where its
solo ``StaticKVCache`` holds it. A step writes each row's new key/value at that row's position
and attends under a per-row key mask (``index <= position``), with RoPE at each row's own
position -- the solo compiled step's layout with a batch dimension, so every row's logits are
its solo run's bits (the CPU kernels' matmul and attention results do not depend on the other
rows). Buffers keep the rows' KV dtype (float16 KV stays float16).

Design notes, measurements and history: docs/engine-notes.md (batch.py).
"""

from __future__ import annotations

from engine import kernels
from engine.generation.generate import last_logits, per_model
from engine.generation.kv_cache import StaticKVCache, WindowKVCache, _stored
from engine.kernels.hook import fused_active

import mlx.core as mx


def batchable(cache: list) -> bool:
    """True when a request's layer caches can join a batch (full or sliding-window float KV)."""
    return all(type(c) in (StaticKVCache, WindowKVCache) for c in cache)


def _held(c, upto: int) -> tuple[mx.array | None, mx.array | None, int]:
    """(keys, values, first position) of the positions < ``upto`` a layer cache still holds."""
    if isinstance(c, WindowKVCache):
        ordered = c.state  # time-ordered, ending at position c.offset - 1
        if not ordered:
            return None, None, upto
        n = ordered[0].shape[2] - (c.offset - upto)
        return ordered[0][..., :n, :], ordered[1][..., :n, :], upto - n
    if c.keys is None or upto == 0:
        return None, None, upto
    return c.keys[..., :upto, :], c.values[..., :upto, :], 0


def _capacity(n: int) -> int:
    step = StaticKVCache.step
    return max(step, ((n + step - 1) // step) * step)


class RowsKVCache:
    """One layer's K/V for the rows of a batch, (rows, heads, capacity, dim), row-aligned by
    position. ``offset`` is the (rows,) position array the next token is written at (RoPE
    offsets); mlx_lm's attention reads it through ``update_and_fetch`` and ``make_mask``."""

    def __init__(self, window: int | None = None, dtype: mx.Dtype | None = None) -> None:
        self.window = window
        self.dtype = dtype  # the rows' cache dtype setting (None: as computed)
        self.keys: mx.array | None = None
        self.values: mx.array | None = None
        self.offset: mx.array | None = None

    def update_and_fetch(self, keys: mx.array, values: mx.array):
        """Write each row's one new key/value at that row's position: on the CPU kernels one
        in-place primitive for both (``kernels.kv_write_rows``, casting float32 rows to a
        float16 buffer itself), else ``put_along_axis``."""
        kernel = fused_active()  # else put_along_axis (hook.FUSED off, not on the CPU)
        casts = kernel and self.keys is not None and self.keys.dtype in (mx.float16, mx.bfloat16)
        if not (casts and keys.dtype == values.dtype == mx.float32):
            keys, values = _stored(self.dtype, keys, values)  # the rows' storage (float16, q8 rows)
        B, H, _, Dk = keys.shape
        if self.keys is None:  # every row joined with an empty history: first step allocates
            self.keys = mx.zeros((B, H, StaticKVCache.step, Dk), keys.dtype)
            self.values = mx.zeros((B, H, StaticKVCache.step, values.shape[3]), keys.dtype)
        if kernel and keys.dtype == values.dtype and keys.dtype in (self.keys.dtype, mx.float32):
            self.keys = kernels.kv_write_rows(self.keys, keys, self.offset)
            self.values = kernels.kv_write_rows(self.values, values, self.offset)
            return self.keys, self.values
        keys, values = keys.astype(self.keys.dtype), values.astype(self.values.dtype)
        at = self.offset.reshape(B, 1, 1, 1)
        self.keys = mx.put_along_axis(self.keys, mx.broadcast_to(at, keys.shape), keys, axis=2)
        self.values = mx.put_along_axis(self.values, mx.broadcast_to(at, values.shape), values, axis=2)
        return self.keys, self.values

    def make_mask(self, N: int, return_array: bool = False, window_size: int | None = None) -> mx.array:
        """(rows, 1, 1, capacity): key index <= the row's position (and inside its window)."""
        k = mx.arange(self.keys.shape[2] if self.keys is not None else StaticKVCache.step)[None]
        p = self.offset[:, None]
        mask = k <= p
        window = window_size or self.window
        if window:
            mask = mask & (k > p - window)
        return mask[:, None, None, :]


class BatchKV:
    """Layer caches for the rows decoding together, in row order.

    Joining rows are assembled into the batch buffers in one pass per layer, when the layers
    are next read (``layers``): a burst of N rows joining one after another then copies each
    row's history once, not the whole batch again per join (N(N+1)/2 row copies: ~130 ms of
    copies before the first step of 8 SmolLM2 rows at ~300 tokens)."""

    def __init__(self) -> None:
        self._layers: list[RowsKVCache] | None = None
        self._joining: list[list[tuple[mx.array | None, mx.array | None, int]]] = []
        self.positions: list[int] = []  # per row: the position its pending token goes to

    @property
    def rows(self) -> int:
        return len(self.positions)

    @property
    def layers(self) -> list[RowsKVCache] | None:
        """The rows' layer caches, joiners included."""
        if self._joining:
            self._assemble()
        return self._layers

    @layers.setter
    def layers(self, layers: list[RowsKVCache] | None) -> None:
        self._layers = layers

    def add(self, cache: list, upto: int | None = None) -> None:
        """Append a row holding ``cache``'s first ``upto`` tokens (default: all it holds)."""
        upto = cache[0].offset if upto is None else upto
        if self._layers is None:
            self._layers = [RowsKVCache(getattr(c, "window", None), getattr(c, "dtype", None)) for c in cache]
        self._joining.append([_held(c, upto) for c in cache])
        self.positions.append(upto)
        self._sync()

    def _assemble(self) -> None:
        """Write the joiners' histories into the batch buffers: one zeroed (rows, heads,
        capacity, dim) buffer per layer and K/V, each row's history copied in at its own
        positions (the buffer is donated from one write to the next, so nothing else is
        copied). Layers no row has history in stay empty (the first step allocates them)."""
        joining, self._joining = self._joining, []
        old = self.rows - len(joining)
        cap = _capacity(max(self.positions) + 1)
        for li, layer in enumerate(self._layers):
            held = [parts[li] for parts in joining]
            some = next((h for h in held if h[0] is not None), None)
            if layer.keys is None and some is None:
                continue
            like_k, like_v = (layer.keys, layer.values) if layer.keys is not None else some[:2]
            layer.keys = _rows_buffer(layer.keys, old, [(k, f) for k, _, f in held], like_k, cap)
            layer.values = _rows_buffer(layer.values, old, [(v, f) for _, v, f in held], like_v, cap)

    def take(self, i: int) -> list:
        """Row ``i``'s history as fresh per-request caches (for checkpoints or the solo lane);
        they store K/V in the dtype the row came with."""
        pos = self.positions[i]
        out = []
        for layer in self.layers or []:
            if layer.window is None:
                c = StaticKVCache(layer.dtype)
                if layer.keys is not None and pos:
                    c.keys = mx.contiguous(layer.keys[i : i + 1, :, :pos])
                    c.values = mx.contiguous(layer.values[i : i + 1, :, :pos])
                    c.offset = pos
            else:
                c = WindowKVCache(layer.window, layer.dtype)
                n = min(layer.window, pos)
                if layer.keys is not None and n:
                    c.restore_ordered(layer.keys[i : i + 1, :, pos - n : pos], layer.values[i : i + 1, :, pos - n : pos], pos)
            out.append(c)
        return out

    def keep(self, rows: list[int]) -> None:
        """Drop every row not listed (list order becomes the new row order)."""
        if not rows:
            self.layers, self.positions, self._joining = None, [], []
            return
        if rows == list(range(self.rows)):
            return
        layers = self.layers or []  # joiners assembled under the old row order
        idx = mx.array(rows, dtype=mx.int32)
        self.positions = [self.positions[i] for i in rows]
        cap = _capacity(max(self.positions) + 1)
        for layer in layers:
            if layer.keys is not None:
                layer.keys = _resized(layer.keys[idx], cap)
                layer.values = _resized(layer.values[idx], cap)
        self._sync()

    def advance(self) -> None:
        """Every row's token was fed: next positions, buffers grown when a row reaches the end."""
        layers = self.layers or []
        self.positions = [p + 1 for p in self.positions]
        cap = _capacity(max(self.positions) + 1)
        for layer in layers:
            if layer.keys is not None and layer.keys.shape[2] < cap:
                layer.keys, layer.values = _resized(layer.keys, cap), _resized(layer.values, cap)
        self._sync()

    def _sync(self) -> None:
        offset = mx.array(self.positions, dtype=mx.int32)
        for layer in self._layers or []:
            layer.offset = offset

    @property
    def nbytes(self) -> int:
        return sum(layer.keys.nbytes + layer.values.nbytes for layer in self.layers or [] if layer.keys is not None)


def _resized(a: mx.array, cap: int) -> mx.array:
    """``a`` with its position axis cut or zero-padded to ``cap``."""
    n = a.shape[2]
    if n == cap:
        return a
    if n > cap:
        return a[:, :, :cap]
    return mx.pad(a, [(0, 0), (0, 0), (0, cap - n), (0, 0)])


def _rows_buffer(
    current: mx.array | None, old: int, joining: list[tuple[mx.array | None, int]], like: mx.array, cap: int
) -> mx.array:
    """(old + len(joining), heads, cap, dim) buffer: ``current``'s ``old`` rows (zeros when
    None), then each joiner's history (an array from position ``first`` on, or None: zeros)."""
    buf = mx.zeros((old + len(joining), like.shape[1], cap, like.shape[3]), like.dtype)
    if current is not None and old:
        n = min(cap, current.shape[2])
        buf[:old, :, :n] = current[:, :, :n]
    for r, (a, first) in enumerate(joining, start=old):
        if a is not None:
            buf[r : r + 1, :, first : first + a.shape[2]] = a.astype(like.dtype)
    return buf


class _Forward:
    """The batched forward ``(tokens, positions, kv) -> (logits, kv)`` of one model and layer
    layout, compiled: ``mx.compile`` traces it once per input shape (rows, capacity) and keeps
    every trace, so rows joining and leaving reuse earlier traces. ``traces`` counts them."""

    def __init__(self, model, layers: list[RowsKVCache]):
        self.model = model
        self.scratch = [RowsKVCache(c.window, c.dtype) for c in layers]
        self.traces = 0
        self.compiled = mx.compile(self._traced)

    def _traced(self, tokens, offset, kv):
        self.traces += 1  # runs only while tracing
        for c, (k, v) in zip(self.scratch, kv, strict=True):
            c.keys, c.values, c.offset = k, v, offset
        logits = self.model(tokens[:, None], cache=self.scratch)[:, -1, :]
        out = [(c.keys, c.values) for c in self.scratch]
        for c in self.scratch:
            c.keys = c.values = c.offset = None  # drop tracer arrays
        return logits, out


_forwards: dict[int, dict] = {}


def forward_for(model, layers: list[RowsKVCache]) -> _Forward:
    """The (cached) compiled batched forward for ``model`` and this layer layout."""
    forwards = per_model(_forwards, model)
    key = tuple((c.window, c.dtype) for c in layers)
    fwd = forwards.get(key)
    if fwd is None:
        fwd = forwards[key] = _Forward(model, layers)
    return fwd


def traces() -> int:
    """How many times batched forwards were traced (compiled) in this process, all models."""
    return sum(f.traces for per_model in _forwards.values() for f in per_model.values())


def batched_logits(model, tokens: list[int | mx.array] | mx.array, kv: BatchKV) -> mx.array:
    """Feed one token per row (at each row's position); (rows, vocab) logits of the next
    position. The rows' positions advance by one. A token may be a one-element array not yet
    evaluated (the token a step in flight draws), so the next step is built before it is read;
    ``tokens`` may also be one (rows,) array."""
    if isinstance(tokens, mx.array):
        x = tokens.astype(mx.int32)
    elif not any(isinstance(t, mx.array) for t in tokens):
        x = mx.array(tokens, dtype=mx.int32)
    else:
        x = mx.concatenate(
            [t.reshape(1).astype(mx.int32) if isinstance(t, mx.array) else mx.array([int(t)], mx.int32) for t in tokens]
        )
    layers = kv.layers or []
    if any(c.keys is None for c in layers):  # no history in any row yet: shapes unknown
        logits = model(x[:, None], cache=layers)[:, -1, :]
    else:
        fwd = forward_for(model, layers)
        logits, out = fwd.compiled(x, layers[0].offset, [(c.keys, c.values) for c in layers])
        for c, (k, v) in zip(layers, out, strict=True):
            c.keys, c.values = k, v
    kv.advance()
    return logits


def prefill_together(
    model, caches: list[list], chunks: list[list[int]], logits: bool = False
) -> tuple[list[list], mx.array | None]:
    """Feed equal-length ``chunks`` (one per request) after each request's ``caches`` in one
    forward; returns each request's caches holding its history plus its chunk.

    Every request's caches must hold the same number of tokens: the rows are then stacked
    without padding and the forward is the solo prefill's, batch dimension aside (scalar
    RoPE offset, "causal" mask), so each row rounds exactly as it would alone. ``logits``:
    also each row's last-position logits (B, vocab), as ``prefill`` computes them alone
    (``last_logits``); else only the caches are evaluated and the output head never runs.
    Returns (caches per request, logits or None). Full-attention float caches only (see
    ``batchable``; sliding windows prefill one request at a time)."""
    offset = caches[0][0].offset
    if any(c[0].offset != offset for c in caches):
        raise ValueError("prefill_together needs caches of one length")
    layers = []
    for layer in zip(*caches, strict=True):
        kv = StaticKVCache(layer[0].dtype)  # the rows' KV storage, as their solo prefill writes it
        if offset:
            kv.keys = mx.concatenate([c.keys[..., :offset, :] for c in layer])
            kv.values = mx.concatenate([c.values[..., :offset, :] for c in layer])
            kv.offset = offset
        layers.append(kv)
    out_logits = last_logits(model, mx.array(chunks, dtype=mx.int32), layers)
    mx.eval([(kv.keys, kv.values) for kv in layers], *([out_logits] if logits else []))
    out = []
    for i in range(len(chunks)):
        row = []
        for kv in layers:
            c = StaticKVCache(kv.dtype)
            c.keys, c.values = kv.keys[i : i + 1, :, : kv.offset], kv.values[i : i + 1, :, : kv.offset]
            c.offset = kv.offset
            row.append(c)
        out.append(row)
    return out, (out_logits if logits else None)
