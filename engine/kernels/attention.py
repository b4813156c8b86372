"""Attention for mlx_lm's llama / qwen2 / gemma3 models on the CPU kernels.

MLX's CPU ``fast.scaled_dot_product_attention`` falls back to matmul -> softmax -> matmul with
a scalar, single-threaded exp (~85 M/s), which dominates long-context prefill and decode. Here
the two matmuls stay MLX's (OpenBLAS sgemm, GQA heads grouped so K/V are read once per KV
head) and the softmax is the extension's fused mask + exp + normalise over the pool.

``scaled_dot_product_attention`` takes exactly what mlx_lm's does and hands anything it does
not handle to the original: quantized KV caches, attention sinks, non-float32 tensors, masks
that differ per head, other devices. Masks handled: None, "causal" (queries at the end of the
keys, as during prefill/verify at an offset), and arrays broadcastable to (B or 1, 1, L, S),
boolean (True = attend) or additive -- which covers the static caches' key-validity masks in
the compiled decode step, sliding windows, and per-row masks of a batch.
"""

from __future__ import annotations

import threading
from contextlib import contextmanager

from engine import kernels

import mlx.core as mx
from mlx_lm.models import base

_original = base.scaled_dot_product_attention
_MODULES = ("llama", "qwen2", "gemma3_text")
# Set while a model routed by engine.kernels.hook runs its forward pass (or is traced by
# mx.compile): other models in the process keep mlx_lm's attention bit for bit.
_active = threading.local()


def routed(cls: type) -> type:
    """A subclass of model class ``cls`` whose forward pass uses this attention."""

    def __call__(self, *args, **kwargs):
        prev = getattr(_active, "on", False)
        _active.on = True
        try:
            return cls.__call__(self, *args, **kwargs)
        finally:
            _active.on = prev

    return type(cls.__name__, (cls,), {"__call__": __call__, "__module__": cls.__module__, "_routed_base": cls})


@contextmanager
def routing():
    """This attention for a routed model's parts called directly (e.g. its backbone alone)."""
    prev = getattr(_active, "on", False)
    _active.on = True
    try:
        yield
    finally:
        _active.on = prev


def _mask_array(mask: mx.array, B: int, L: int, S: int) -> mx.array | None:
    if mask.ndim > 4:
        return None
    m = mask.reshape((1,) * (4 - mask.ndim) + tuple(mask.shape))
    if m.shape[1] != 1 or m.shape[0] not in (1, B) or m.shape[2] not in (1, L) or m.shape[3] not in (1, S):
        return None
    m = mx.broadcast_to(m, (m.shape[0], 1, L, S))
    if m.dtype == mx.bool_:
        return mx.where(m, mx.array(0.0, mx.float32), mx.array(-mx.inf, mx.float32))
    return m.astype(mx.float32)


def scaled_dot_product_attention(queries, keys, values, cache, scale, mask, sinks=None):
    """Drop-in for ``mlx_lm.models.base.scaled_dot_product_attention``."""
    if (
        not getattr(_active, "on", False)
        or sinks is not None
        or hasattr(cache, "bits")
        or not kernels.available()
        or queries.ndim != 4
        or not (queries.dtype == keys.dtype == values.dtype == mx.float32)
    ):
        return _original(queries, keys, values, cache, scale, mask, sinks)
    B, H, L, D = queries.shape
    Hk, S = keys.shape[1], keys.shape[2]
    if H % Hk:
        return _original(queries, keys, values, cache, scale, mask, sinks)
    if (H // Hk) * L <= 8:
        # Decode-sized query counts stay on MLX's path: its matmul is slow against a transposed
        # K, and the K @ q^T rewrite that fixes that changed decode perplexity by 1.5% for a
        # reason not yet found (docs/kernels.md), while the path below is exact in-model.
        return _original(queries, keys, values, cache, scale, mask, sinks)
    mode, offset, marr = 0, 0, None
    if isinstance(mask, str):
        if mask != "causal":
            return _original(queries, keys, values, cache, scale, mask, sinks)
        mode, offset = 1, S - L
    elif mask is not None:
        marr = _mask_array(mask, B, L, S)
        if marr is None:
            return _original(queries, keys, values, cache, scale, mask, sinks)
        mode = 2
    r = H // Hk
    q = (queries * scale).reshape(B, Hk, r * L, D)
    scores = q @ keys.swapaxes(-1, -2)
    scores = scores.reshape(B, H, L, S)
    probs = kernels.masked_softmax(scores, offset if mode == 1 else None, marr)
    out = probs.reshape(B, Hk, r * L, S) @ values
    return out.reshape(B, H, L, values.shape[-1])


def install() -> None:
    """Point the mlx_lm model modules at this attention (they import it by name)."""
    import importlib

    for name in _MODULES:
        mod = importlib.import_module(f"mlx_lm.models.{name}")
        mod.scaled_dot_product_attention = scaled_dot_product_attention


def uninstall() -> None:
    """Back to mlx_lm's own attention (for A/B benchmarks)."""
    import importlib

    for name in _MODULES:
        mod = importlib.import_module(f"mlx_lm.models.{name}")
        mod.scaled_dot_product_attention = _original
