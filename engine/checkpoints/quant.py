"""Storage encodings of float K/V for checkpoint files, in numpy (the writer thread never runs MLX).

q8/q4 are MLX's affine layout along head_dim: per group of ``group_size`` values a float16
scale and bias, codes packed little-endian into uint32 words, so restore is one
``mx.dequantize``. A value comes back within half a quantization step
((max - min) / (2**bits - 1) / 2 of its group) plus float16 rounding of scale and bias.
"""

from __future__ import annotations

import numpy as np

MLX_GROUP_SIZES = (128, 64, 32)


def pick_group_size(head_dim: int, wanted: int) -> int | None:
    """``wanted`` if it divides ``head_dim``, else the largest MLX group size that does."""
    for g in (wanted, *MLX_GROUP_SIZES):
        if head_dim % g == 0:
            return g
    return None


def to_float32(x: np.ndarray, dtype: str) -> np.ndarray:
    if dtype == "bfloat16":  # stored as its uint16 bits
        return (x.astype(np.uint32) << 16).view(np.float32)
    return x.astype(np.float32, copy=False)


def encode_fp16(x: np.ndarray, dtype: str) -> np.ndarray | None:
    """float16 copy of ``x``, or None when a finite value would overflow to inf."""
    if dtype == "float16":
        return x
    f = to_float32(x, dtype)
    h = f.astype(np.float16)
    if not np.isfinite(h).all() and np.isfinite(f).all():
        return None
    return h


def quantize(x: np.ndarray, dtype: str, group: int, bits: int):
    """(packed uint32, scales f16, biases f16) of ``x`` along its last axis, or None on overflow."""
    f = to_float32(x, dtype)
    *lead, d = f.shape
    g = f.reshape(*lead, d // group, group)
    lo, hi = g.min(axis=-1), g.max(axis=-1)
    levels = (1 << bits) - 1
    scale = ((hi - lo) / levels).astype(np.float16)
    bias = lo.astype(np.float16)
    if not (np.isfinite(scale).all() and np.isfinite(bias).all()):
        return None
    scale = np.where(scale == 0, np.float16(1), scale)  # constant group: every code is 0
    s32, b32 = scale.astype(np.float32)[..., None], bias.astype(np.float32)[..., None]
    codes = np.clip(np.rint((g - b32) / s32), 0, levels).astype(np.uint8).reshape(*lead, d)
    return pack(codes, bits), scale, bias


def pack(codes: np.ndarray, bits: int) -> np.ndarray:
    """uint8 codes -> uint32 words, value j of a word at bits [bits*j, bits*(j+1)) (MLX layout)."""
    if bits == 4:
        codes = codes[..., 0::2] | (codes[..., 1::2] << 4)
    return np.ascontiguousarray(codes).view("<u4")


def unpack(words: np.ndarray, bits: int) -> np.ndarray:
    """Inverse of ``pack`` (for tests and numpy-side checks)."""
    b = words.view(np.uint8)
    if bits == 8:
        return b
    out = np.empty((*b.shape[:-1], b.shape[-1] * 2), np.uint8)
    out[..., 0::2], out[..., 1::2] = b & 0x0F, b >> 4
    return out
