"""Attention for mlx_lm's llama / qwen2 / gemma3 models on the CPU kernels.

MLX's CPU ``fast.scaled_dot_product_attention`` falls back to matmul -> softmax -> matmul: its
matmul against a transposed K runs far below sgemm speed, the softmax is a scalar,
single-threaded exp over a materialised L x S score matrix, and at decode the K/V stream
dominates. The default here is the extension's fused attention (``flash``, src/attention.cpp):
query tiles against K/V blocks read once per KV head, online softmax, float32 or float16 K/V,
for prefill, verify and decode alike. ``impl = "softmax"`` runs the previous round's path (MLX's
matmuls with GQA heads grouped + the fused masked softmax, prefill-sized calls only) and
``"mlx"`` mlx_lm's own function -- for A/B benchmarks (``IMPLS``; mlxterm bench resume).

Design notes, measurements and history: docs/engine-notes.md (attention.py).
"""

from __future__ import annotations

import threading
from contextlib import contextmanager

from engine import kernels, mlx_patches
from engine.kvrows import q8_group, q8_rotate, q8_unpack

import mlx.core as mx

_original = mlx_patches.ORIGINAL
# Set while a model routed by engine.kernels.hook runs its forward pass (or is traced by
# mx.compile): other models in the process keep mlx_lm's attention bit for bit.
_active = threading.local()
IMPLS = ("flash", "softmax", "mlx")
impl = "flash"


def reads_fp16_kv(model) -> bool:
    """True when ``model``'s attention runs here (a routed model of a patched mlx_lm module),
    so its caches may hold float16 K/V: the fused kernel widens them in registers."""
    base = type(model).__dict__.get("_routed_base")
    return base is not None and mlx_patches.routes(base.__module__) and kernels.available()


def routed(cls: type) -> type:
    """A subclass of model class ``cls`` whose forward pass uses this attention."""

    def __call__(self, *args, **kwargs):
        with routing():
            return cls.__call__(self, *args, **kwargs)

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


def _key_mask(mask: mx.array, B: int, L: int, S: int) -> mx.array | None:
    """``mask`` as an additive float32 (B or 1, 1, 1 or L, S) array, or None if it differs per
    head; a mask shared by every query stays one row (the fused kernel reads it per key)."""
    if mask.ndim > 4:
        return None
    m = mask.reshape((1,) * (4 - mask.ndim) + tuple(mask.shape))
    if m.shape[1] != 1 or m.shape[0] not in (1, B) or m.shape[2] not in (1, L) or m.shape[3] not in (1, S):
        return None
    m = mx.broadcast_to(m, (m.shape[0], 1, m.shape[2], S))
    if m.dtype == mx.bool_:
        return mx.where(m, mx.array(0.0, mx.float32), mx.array(-mx.inf, mx.float32))
    return m.astype(mx.float32)


def _mask_array(mask: mx.array, B: int, L: int, S: int) -> mx.array | None:
    """``mask`` as an additive float32 (B or 1, 1, L, S) array (the softmax path's layout)."""
    m = _key_mask(mask, B, L, S)
    return None if m is None else mx.broadcast_to(m, (m.shape[0], 1, L, S))


def q8_readable(D: int, k_width: int, v_width: int) -> bool:
    """True when the fused kernel reads q8 rows of these widths for head dim ``D`` (V rows
    as wide as K rows: Dv = D)."""
    group = q8_group(D, k_width)
    return group > 0 and group % 32 == 0 and v_width == k_width


def _widened(queries, keys, values):
    if keys.dtype == mx.uint8:  # q8 rows: their float values
        D = queries.shape[-1]
        return q8_unpack(keys, queries.dtype, D), q8_unpack(values, queries.dtype, D)
    if keys.dtype != queries.dtype:
        keys, values = keys.astype(queries.dtype), values.astype(queries.dtype)
    return keys, values


def scaled_dot_product_attention(queries, keys, values, cache, scale, mask, sinks=None):
    """Drop-in for ``mlx_lm.models.base.scaled_dot_product_attention``."""
    if (
        impl == "mlx"
        or not getattr(_active, "on", False)
        or sinks is not None
        or hasattr(cache, "bits")
        or not kernels.available()
        or queries.ndim != 4
        or queries.dtype != mx.float32
        or keys.dtype != values.dtype
        or keys.dtype not in (mx.float32, mx.float16, mx.uint8)
    ):
        return _fallback(queries, keys, values, cache, scale, mask, sinks)
    B, H, L, D = queries.shape
    Hk, S = keys.shape[1], keys.shape[2]
    if H % Hk:
        return _fallback(queries, keys, values, cache, scale, mask, sinks)
    q8 = keys.dtype == mx.uint8
    if q8 and (impl != "flash" or not q8_readable(D, keys.shape[-1], values.shape[-1])):
        return _fallback(queries, keys, values, cache, scale, mask, sinks)
    if impl == "flash" and D % 8 == 0 and (q8 or values.shape[-1] % 16 == 0):
        rot = {"rotate_q": True} if q8 else {}  # q8 K rows are rotated: the kernel rotates q
        if mask is None:
            return kernels.flash_attention(queries, keys, values, scale, **rot)
        if isinstance(mask, str):
            if mask == "causal":
                return kernels.flash_attention(queries, keys, values, scale, causal_offset=S - L, **rot)
        else:
            m = _key_mask(mask, B, L, S)
            if m is not None:
                return kernels.flash_attention(queries, keys, values, scale, mask=m, **rot)
        return _fallback(queries, keys, values, cache, scale, mask, sinks)
    return _softmax_path(queries, keys, values, cache, scale, mask, sinks)


def _fallback(queries, keys, values, cache, scale, mask, sinks):
    if isinstance(keys, mx.array) and keys.dtype == mx.uint8:  # q8 rows: K stored rotated
        queries = q8_rotate(queries)
    if not hasattr(cache, "bits"):
        keys, values = _widened(queries, keys, values)
    return _original(queries, keys, values, cache, scale, mask, sinks)


def _softmax_path(queries, keys, values, cache, scale, mask, sinks):
    """The previous round's path: MLX's matmuls (GQA heads grouped) + the fused softmax."""
    keys, values = _widened(queries, keys, values)
    B, H, L, D = queries.shape
    Hk, S = keys.shape[1], keys.shape[2]
    if (H // Hk) * L <= 8:
        # Decode-sized query counts stay on MLX's path here (see docs/kernels.md).
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
    """Point the mlx_lm model modules at this attention (engine.mlx_patches)."""
    mlx_patches.install_attention(scaled_dot_product_attention)


def uninstall() -> None:
    """Back to mlx_lm's own attention (for A/B benchmarks)."""
    mlx_patches.install_attention(_original)
