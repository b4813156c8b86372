"""A GGUF K-quant's scales back in their own compact form, for the decode matmul.

Q4_K/Q5_K store, per 256-value super-block, a float16 ``d`` and ``dmin`` and per group of 32 a
6-bit ``sc`` and ``m``: scale = d * sc, bias = -(dmin * m). The loader turns them into float32
arrays (exact: an 11-bit by 6-bit product), 8 bytes per 32 weights -- at 4 bits the weights
stream 24 bytes per 32 instead of the GGUF's 18. ``pack`` finds (d, sc) and (dmin, m) again
from those float32 arrays and checks that they give every value bit for bit; the kernels
(``QmmProblem::kscales``) then read 2.5 bytes per 32 weights (20 per super-block: d, dmin,
8 sc, 8 m) and compute the same float32 scales and biases. Arrays that do not factor so (other
formats, a fine-tuned update) return None and keep their float32 form.
"""

from __future__ import annotations

from typing import Any

import numpy as np

SUPER = 8  # groups of 32 per 256-value super-block
RECORD_BYTES = 20  # kKScaleBytes in src/qmm.h: d f16, dmin f16, sc 8 x u8, m 8 x u8
_QMAX = 63  # 6-bit sc and m


def _bits(a: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(a, dtype=np.float32).view(np.uint32)


def factor(v: np.ndarray) -> tuple[np.ndarray, np.ndarray] | None:
    """(d float32 (n,), q uint8 (n, 8)) with d a float16 value, q <= 63 and d * q == v bit for
    bit for every row of ``v`` (n, 8) float32; None when a row has no such factoring."""
    n = len(v)
    d = np.zeros(n, dtype=np.float32)
    q = np.zeros(v.shape, dtype=np.uint8)
    # The value of largest magnitude is d * (the largest q): d takes its sign. Rows of +0.0
    # only factor as d = 0; try the largest q first: a K-quant's biggest group scale is
    # usually 63, so nearly every row is done in the first pass.
    vmax = v[np.arange(n), np.abs(v).argmax(axis=1)]
    todo = np.nonzero(~np.all(_bits(v) == 0, axis=1))[0]
    for k in range(_QMAX, 0, -1):
        if len(todo) == 0:
            break
        dc = (vmax[todo] / np.float32(k)).astype(np.float16).astype(np.float32)
        with np.errstate(divide="ignore", invalid="ignore"):
            qq = np.rint(v[todo] / dc[:, None])
        ok = np.all((qq >= 0) & (qq <= _QMAX), axis=1) & (dc != 0)
        qq = np.where(ok[:, None], qq, 0).astype(np.uint8)
        ok &= np.all(_bits(dc[:, None] * qq.astype(np.float32)) == _bits(v[todo]), axis=1)
        done = todo[ok]
        d[done], q[done] = dc[ok], qq[ok]
        todo = todo[~ok]
    return None if len(todo) else (d, q)


def pack(scales: np.ndarray, biases: np.ndarray) -> np.ndarray | None:
    """float32 scales/biases (N, K / 32) -> uint8 (N, K / 256 * RECORD_BYTES) records whose
    d * sc and -(dmin * m) give them back bit for bit, or None (no such form, or K % 256)."""
    if scales.ndim != 2 or scales.shape != biases.shape or scales.shape[1] % SUPER:
        return None
    if scales.dtype != np.float32 or biases.dtype != np.float32:
        return None
    n, ng = scales.shape
    s = scales.reshape(-1, SUPER)
    fs = factor(s)
    if fs is None:
        return None
    fb = factor(-biases.reshape(-1, SUPER))  # -(-x) == x, bit for bit
    if fb is None:
        return None
    (d, sc), (dmin, m) = fs, fb
    if not np.all(_bits(-(dmin[:, None] * m.astype(np.float32))) == _bits(biases.reshape(-1, SUPER))):
        return None  # the sign of a zero bias (e.g. +0.0 where -(dmin * 0) gives -0.0)
    rec = np.empty((len(s), RECORD_BYTES), dtype=np.uint8)
    rec[:, 0:2] = d.astype("<f2")[:, None].view(np.uint8)
    rec[:, 2:4] = dmin.astype("<f2")[:, None].view(np.uint8)
    rec[:, 4:12] = sc
    rec[:, 12:20] = m
    return rec.reshape(n, ng // SUPER * RECORD_BYTES)


def unpack(rec: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The float32 (scales, biases) that records ``rec`` (from ``pack``) stand for: the scalar
    reference of the kernels' reading of them."""
    n = rec.shape[0]
    r = rec.reshape(-1, RECORD_BYTES)
    d = r[:, 0:2].copy().view("<f2").astype(np.float32)
    dmin = r[:, 2:4].copy().view("<f2").astype(np.float32)
    scales = d * r[:, 4:12].astype(np.float32)
    biases = -(dmin * r[:, 12:20].astype(np.float32))
    return scales.reshape(n, -1), biases.reshape(n, -1)


def unpack_mx(rec: Any) -> tuple[Any, Any]:
    """``unpack`` in MLX ops, lazily: the float32 (scales, biases) of records ``rec`` (uint8,
    (..., K / 256 * RECORD_BYTES)), bit for bit (d * sc and -(dmin * m) in float32, as ``pack``
    checked them)."""
    import mlx.core as mx

    lead, nsb = rec.shape[:-1], rec.shape[-1] // RECORD_BYTES
    r = rec.reshape(*lead, nsb, RECORD_BYTES)
    dd = mx.view(mx.contiguous(r[..., 0:4]), mx.float16).astype(mx.float32)  # (..., nsb, 2): d, dmin
    scales = dd[..., 0:1] * r[..., 4:12].astype(mx.float32)
    biases = -(dd[..., 1:2] * r[..., 12:20].astype(mx.float32))
    return scales.reshape(*lead, nsb * SUPER), biases.reshape(*lead, nsb * SUPER)
