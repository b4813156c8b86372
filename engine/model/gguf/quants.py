"""Vectorised numpy decoding of ggml block formats, and lossless MLX affine triples.

Every type whose blocks are "scale*q + bias over 32 consecutive values" maps exactly onto
MLX's affine quantization (``mx.quantize`` with group_size 32): ``to_affine`` returns
the packed uint32 weights with float32 scales/biases, and ``mx.dequantize`` of that triple
reproduces ``dequantize`` bit for bit. Q6_K (groups of 16) only dequantizes.

Block layouts (Q4_0 ... Q6_K, from ggml-common.h) and notes: docs/engine-notes.md (quants.py).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from engine.errors import ModelLoadError
from engine.model.gguf.ggml_types import BY_NAME, GGMLType

import numpy as np

GROUP_SIZE = 32
# Values decoded per step: bounds the float32 temporaries for big tensors (embeddings).
_CHUNK_VALUES = 1 << 22

Parts = tuple[np.ndarray, np.ndarray, np.ndarray]  # q (groups, 32) uint8, scales, biases


@dataclass
class AffineWeights:
    """An MLX affine-quantized tensor: ``w = scales*q + biases`` per group of 32."""

    weight: np.ndarray  # uint32, (..., cols * bits // 32)
    scales: np.ndarray  # float32, (..., cols // 32)
    biases: np.ndarray  # float32, (..., cols // 32)
    bits: int
    group_size: int = GROUP_SIZE


def _f16(blocks: np.ndarray, start: int) -> np.ndarray:
    """Column of float16 fields at byte ``start`` of each block, as float32 (n, 1)."""
    return blocks[:, start : start + 2].copy().view("<f2").astype(np.float32)


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """Q4_0-style 16 bytes -> 32 values: low nibbles first, then high nibbles."""
    return np.concatenate([qs & 0x0F, qs >> 4], axis=-1)


def _high_bits32(qh: np.ndarray) -> np.ndarray:
    """Q5_0/Q5_1: 4 bytes (a little-endian u32) -> bit j for value j, moved to bit 4."""
    return np.unpackbits(qh, axis=1, bitorder="little") << 4


def _q4_0(b: np.ndarray) -> Parts:
    d = _f16(b, 0)
    return _nibbles(b[:, 2:18]), d, -8.0 * d


def _q4_1(b: np.ndarray) -> Parts:
    return _nibbles(b[:, 4:20]), _f16(b, 0), _f16(b, 2)


def _q5_0(b: np.ndarray) -> Parts:
    d = _f16(b, 0)
    return _nibbles(b[:, 6:22]) | _high_bits32(b[:, 2:6]), d, -16.0 * d


def _q5_1(b: np.ndarray) -> Parts:
    return _nibbles(b[:, 8:24]) | _high_bits32(b[:, 4:8]), _f16(b, 0), _f16(b, 2)


def _q8_0(b: np.ndarray) -> Parts:
    d = _f16(b, 0)
    return b[:, 2:34] ^ 0x80, d, -128.0 * d  # int8 q + 128 == byte with sign bit flipped


def _k_scales(b: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K/Q5_K: the 12 scale bytes -> 8 (6-bit scale, 6-bit min) pairs (get_scale_min_k4)."""
    s = b[:, 4:16]
    lo, mid, hi = s[:, 0:4], s[:, 4:8], s[:, 8:12]
    sc = np.concatenate([lo & 63, (hi & 0x0F) | ((lo >> 6) << 4)], axis=1)
    mn = np.concatenate([mid & 63, (hi >> 4) | ((mid >> 6) << 4)], axis=1)
    return sc.astype(np.float32), mn.astype(np.float32)


def _k_scales_biases(b: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    sc, mn = _k_scales(b)
    return (_f16(b, 0) * sc).reshape(-1, 1), (-(_f16(b, 2) * mn)).reshape(-1, 1)


def _k_nibbles(qs: np.ndarray) -> np.ndarray:
    """128 bytes -> 8 sub-blocks of 32: per 32-byte chunk, low nibbles then high nibbles."""
    qs = qs.reshape(-1, 4, 1, 32)
    return np.concatenate([qs & 0x0F, qs >> 4], axis=2).reshape(-1, 8, 32)


def _q4_k(b: np.ndarray) -> Parts:
    scales, biases = _k_scales_biases(b)
    return _k_nibbles(b[:, 16:144]).reshape(-1, 32), scales, biases


def _q5_k(b: np.ndarray) -> Parts:
    scales, biases = _k_scales_biases(b)
    qh = b[:, None, 16:48]  # (n, 1, 32)
    high = ((qh >> np.arange(8, dtype=np.uint8)[None, :, None]) & 1) << 4  # (n, 8, 32)
    return (_k_nibbles(b[:, 48:176]) | high).reshape(-1, 32), scales, biases


def _q6_k_dense(b: np.ndarray) -> np.ndarray:
    ql = b[:, 0:128].reshape(-1, 2, 64)
    qh = b[:, 128:192].reshape(-1, 2, 32)
    lo, hi = ql[..., :32], ql[..., 32:]
    q = np.stack(
        [
            (lo & 0x0F) | ((qh & 3) << 4),
            (hi & 0x0F) | (((qh >> 2) & 3) << 4),
            (lo >> 4) | (((qh >> 4) & 3) << 4),
            (hi >> 4) | (((qh >> 6) & 3) << 4),
        ],
        axis=2,
    ).reshape(-1, 16, 16)
    sc = b[:, 192:208].view(np.int8).astype(np.float32)
    dsc = (_f16(b, 208) * sc)[:, :, None]  # ggml order: (d*sc)*q
    return (dsc * (q.astype(np.float32) - 32.0)).reshape(-1, 256)


_AFFINE: dict[str, tuple[Callable[[np.ndarray], Parts], int]] = {
    "Q4_0": (_q4_0, 4),
    "Q4_1": (_q4_1, 4),
    "Q5_0": (_q5_0, 5),
    "Q5_1": (_q5_1, 5),
    "Q8_0": (_q8_0, 8),
    "Q4_K": (_q4_k, 4),
    "Q5_K": (_q5_k, 5),
}


def _affine_dense(fn: Callable[[np.ndarray], Parts]) -> Callable[[np.ndarray], np.ndarray]:
    def dense(b: np.ndarray) -> np.ndarray:
        q, scales, biases = fn(b)
        return (q.astype(np.float32) * scales + biases).reshape(len(b), -1)

    return dense


def _bf16(b: np.ndarray) -> np.ndarray:
    return (b.copy().view("<u2").astype(np.uint32) << 16).view(np.float32)


_DENSE: dict[str, Callable[[np.ndarray], np.ndarray]] = {
    "F32": lambda b: b.copy().view("<f4").astype(np.float32),
    "F16": lambda b: b.copy().view("<f2").astype(np.float32),
    "BF16": _bf16,
    "Q6_K": _q6_k_dense,
    **{name: _affine_dense(fn) for name, (fn, _) in _AFFINE.items()},
}

SUPPORTED = frozenset(_DENSE)
AFFINE_TYPES = frozenset(_AFFINE)


def _blocks(raw: np.ndarray, gtype: GGMLType) -> np.ndarray:
    return np.asarray(raw, dtype=np.uint8).reshape(-1, gtype.type_size)


def _check(gtype: GGMLType | str) -> GGMLType:
    gtype = BY_NAME[gtype] if isinstance(gtype, str) else gtype
    if gtype.name not in SUPPORTED:
        raise ModelLoadError(f"unsupported quant type {gtype.name}.")
    return gtype


def dequantize(
    raw: np.ndarray, gtype: GGMLType | str, shape: tuple[int, ...], dtype: np.dtype = np.float32
) -> np.ndarray:
    """Decode ggml-typed bytes to a dense array of ``shape`` (computed in float32)."""
    gtype = _check(gtype)
    blocks = _blocks(raw, gtype)
    fn = _DENSE[gtype.name]
    out = np.empty((len(blocks), gtype.block_size), dtype=dtype)
    step = max(1, _CHUNK_VALUES // gtype.block_size)
    for i in range(0, len(blocks), step):
        out[i : i + step] = fn(blocks[i : i + step])
    return out.reshape(shape)


def to_affine(raw: np.ndarray, gtype: GGMLType | str, shape: tuple[int, ...]) -> AffineWeights:
    """The exact MLX affine triple for an affine-mappable type (see ``AFFINE_TYPES``)."""
    gtype = _check(gtype)
    if gtype.name not in _AFFINE:
        raise ModelLoadError(f"quant type {gtype.name} has no exact MLX affine form.")
    fn, bits = _AFFINE[gtype.name]
    blocks = _blocks(raw, gtype)
    groups = len(blocks) * gtype.block_size // GROUP_SIZE
    weight = np.empty((groups, bits), dtype=np.uint32)
    scales = np.empty((groups, 1), dtype=np.float32)
    biases = np.empty((groups, 1), dtype=np.float32)
    step = max(1, _CHUNK_VALUES // gtype.block_size)
    per_block = gtype.block_size // GROUP_SIZE
    for i in range(0, len(blocks), step):
        q, s, b = fn(blocks[i : i + step])
        g = slice(i * per_block, i * per_block + len(q))
        weight[g], scales[g], biases[g] = pack(q, bits), s, b
    lead = shape[:-1]
    return AffineWeights(
        weight.reshape(*lead, -1),
        scales.reshape(*lead, -1),
        biases.reshape(*lead, -1),
        bits,
    )


def _symmetric8(g: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
    """Groups (n, 32) as symmetric 8-bit: q = round(g / scale) + 128 in [0, 255] with a
    float16-exact scale ~ max|g| / 127 and bias -128 * scale (Q8_0's form), or None when a
    scale does not fit float16."""
    amax = np.abs(g).max(axis=1, keepdims=True)
    with np.errstate(over="ignore"):  # a scale past float16's range: inf, refused below
        scale = (amax / np.float32(127)).astype(np.float16).astype(np.float32)
    if not np.all(np.isfinite(scale)):
        return None
    safe = np.where(scale > 0, scale, np.float32(1))
    q = np.where(scale > 0, np.clip(np.rint(g / safe), -128, 127), 0) + 128
    return q.astype(np.uint8), scale, np.float32(-128) * scale


def _affine8(g: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Groups (n, 32) as min/max affine 8-bit with float32 scales and biases."""
    lo = g.min(axis=1, keepdims=True)
    scale = (g.max(axis=1, keepdims=True) - lo) / 255.0
    safe = np.where(scale > 0, scale, 1.0)
    return np.clip(np.rint((g - lo) / safe), 0, 255).astype(np.uint8), scale, lo


def to_affine8(raw: np.ndarray, gtype: GGMLType | str, shape: tuple[int, ...]) -> AffineWeights:
    """Any supported type re-quantized to 8-bit, group 32.

    For the CPU kernels (engine/kernels), which have no Q6_K path: its groups of 16 have no
    exact affine-32 form, and 8 bits per value keep the added error far below Q6_K's own (a
    step of max|w| / 127 against Q6_K's max|w| / 32). Symmetric with float16-exact scales
    (Q8_0's form: Q6_K's values are symmetric) where every scale fits float16, so the kernels
    read 34 bytes per 32 weights (``kernels.half_scales``: the scale only) instead of 40; else
    min/max affine with float32 scales.
    """
    gtype = _check(gtype)
    blocks = _blocks(raw, gtype)
    fn = _DENSE[gtype.name]
    per_block = gtype.block_size // GROUP_SIZE
    groups = len(blocks) * per_block
    weight = np.empty((groups, 8), dtype=np.uint32)
    scales = np.empty((groups, 1), dtype=np.float32)
    biases = np.empty((groups, 1), dtype=np.float32)
    step = max(1, _CHUNK_VALUES // gtype.block_size)

    def fill(method) -> bool:
        for i in range(0, len(blocks), step):
            g = fn(blocks[i : i + step]).reshape(-1, GROUP_SIZE)
            parts = method(g)
            if parts is None:
                return False
            sl = slice(i * per_block, i * per_block + len(g))
            weight[sl], scales[sl], biases[sl] = pack(parts[0], 8), parts[1], parts[2]
        return True

    if not fill(_symmetric8):
        fill(_affine8)
    lead = shape[:-1]
    return AffineWeights(
        weight.reshape(*lead, -1), scales.reshape(*lead, -1), biases.reshape(*lead, -1), 8
    )


def pack(q: np.ndarray, bits: int) -> np.ndarray:
    """Pack (groups, 32) unsigned values as ``mx.quantize`` does: a little-endian bit stream
    (value i of a group at bit i*bits) stored as uint32 words -> (groups, bits)."""
    q = np.asarray(q, dtype=np.uint8)
    if bits == 8:
        packed = np.ascontiguousarray(q)
    elif bits == 4:
        packed = q[:, 0::2] | (q[:, 1::2] << 4)  # byte j = values 2j (low), 2j+1 (high)
    elif bits == 5:
        # 8 values of 5 bits fill 5 bytes; uint8 shifts drop the bits that spill over.
        v = [q[:, i::8] for i in range(8)]
        packed = np.stack(
            [
                v[0] | (v[1] << 5),
                (v[1] >> 3) | (v[2] << 2) | (v[3] << 7),
                (v[3] >> 1) | (v[4] << 4),
                (v[4] >> 4) | (v[5] << 1) | (v[6] << 6),
                (v[6] >> 2) | (v[7] << 3),
            ],
            axis=-1,
        )
    else:
        # Any other width: 8 values of `bits` bits fill exactly `bits` bytes, built in a uint64.
        shifts = np.arange(0, 8 * bits, bits, dtype=np.uint64)
        words = (q.reshape(len(q), 4, 8).astype(np.uint64) << shifts).sum(axis=-1, dtype=np.uint64)
        packed = words.astype("<u8").view(np.uint8).reshape(len(q), 4, 8)[..., :bits]
    return np.ascontiguousarray(packed).reshape(len(q), -1).view("<u4").astype(np.uint32, copy=False)
