"""Softmax and exact GELU that stay fast on MLX's CPU backend.

MLX's CPU kernels for ``exp``/``erf`` are scalar on x86 (measured ~30 ns per element,
about 8x numpy's vectorised ``exp``), and Whisper's encoder spends most of its time in
them: 4 x 13.5 M softmax exponentials and 4 x 9.2 M GELUs per 30-s window. On the CPU
they run in the engine's kernels (vectorised, on the kernel pool) when those are built;
without them large arrays take a numpy detour (evaluated in cache-sized blocks), and
small ones (the decoder's per-token steps) and GPU arrays stay in MLX.
"""

from __future__ import annotations

from engine import kernels

import mlx.core as mx
import numpy as np

_NUMPY_MIN_SIZE = 1 << 16
_BLOCK = 1 << 16
_INV_SQRT2 = np.float32(1.0 / np.sqrt(2.0))
# Numerical Recipes' Chebyshev fit of erfc (fractional error < 1.2e-7 everywhere),
# highest order first.
_ERFC = tuple(np.float32(c) for c in (
    0.17087277, -0.82215223, 1.48851587, -1.13520398, 0.27886807,
    -0.18628806, 0.09678418, 0.37409196, 1.00002368, -1.26551223,
))


def _numpy_path(x: mx.array) -> bool:
    return x.size >= _NUMPY_MIN_SIZE and x.dtype == mx.float32 and mx.default_device() == mx.cpu


def softmax(x: mx.array) -> mx.array:
    """Softmax over the last axis (large inputs: the engine's CPU kernel when present,
    vectorised exp on the kernel pool, no numpy round trip; the decoder's per-token steps stay
    in MLX, where a pool job costs more than the few thousand exponentials)."""
    if _numpy_path(x) and x.ndim == 4 and kernels.available():
        return kernels.masked_softmax(x)
    if not _numpy_path(x):
        return mx.softmax(x, axis=-1, precise=True)
    a = np.asarray(x).reshape(-1, x.shape[-1])  # evaluates x; a read-only view, no copy
    out = np.empty(a.shape, np.float32)
    rows = max(1, _BLOCK // a.shape[1])
    for i in range(0, a.shape[0], rows):
        src, dst = a[i:i + rows], out[i:i + rows]
        np.subtract(src, src.max(axis=1, keepdims=True), out=dst)
        np.exp(dst, out=dst)
        dst /= dst.sum(axis=1, keepdims=True)
    return mx.array(out.reshape(x.shape))


def gelu(x: mx.array) -> mx.array:
    """Exact (erf) GELU: ``x * Phi(x)`` (on the CPU: the engine's vectorised kernel when
    present, at every size, so a decoder step's and an encoder window's values take one path)."""
    if x.dtype == mx.float32 and kernels.available() and kernels.has("gelu_erf"):
        return kernels.gelu_erf(x)
    if not _numpy_path(x):
        return x * (1.0 + mx.erf(x * float(_INV_SQRT2))) * 0.5
    a = np.asarray(x).reshape(-1)
    out = np.empty(a.shape, np.float32)
    for i in range(0, a.size, _BLOCK):
        v = a[i:i + _BLOCK]
        half_erfc = 0.5 * _erfc(np.abs(v) * _INV_SQRT2)  # = Phi(-|v|)
        out[i:i + _BLOCK] = v * np.where(v >= 0, 1.0 - half_erfc, half_erfc)
    return mx.array(out.reshape(x.shape))


def _erfc(z: np.ndarray) -> np.ndarray:
    """erfc for z >= 0 in float32."""
    t = 1.0 / (1.0 + 0.5 * z)
    poly = np.full_like(z, _ERFC[0])
    for c in _ERFC[1:]:
        poly *= t
        poly += c
    return t * np.exp(poly - z * z)
