"""The live 8-bit KV row format ("q8"), below both engine.kernels and engine.generation.

Each token's K and V per head is one uint8 row (..., D + 4 * D / group): the D values quantized
symmetrically per group of ``group`` dims (int8, -127..127), then the D / group float32 scales.
One array per K and V, so the compiled step, batching, snapshots and checkpoints carry it like
any other dtype; the fused attention kernel reads the rows as stored (0.56 of float16's bytes at
D = 64, group 32) and ``q8_unpack`` gives the values anywhere else.

K rows hold the key rotated (``q8_rotate``: an orthonormal Walsh-Hadamard transform of the head
dims) and attention rotates q the same way, so q . k is unchanged up to float32 rounding while a
group's int8 step shrinks (SmolLM2's decode KL to fp16 KV drops 3.2x: docs/benchmarks-log.md, "Long
context, round 6"). V rows are stored as computed. Checkpoints name this format "q8hrows-g<group>" (``Q8_FORMAT``); the
older unrotated "q8rows-g<group>" rows are never read as these.
"""

from __future__ import annotations

import mlx.core as mx


def q8_rotate(x: mx.array) -> mx.array:
    """``x`` (..., D) times H, the orthonormal Walsh-Hadamard matrix (symmetric, H @ H = I) on
    blocks of the largest power of two dividing D (all of D for the usual 64/128): how q8 K
    rows store keys and how attention reads queries against them. One op per call, row by row
    (a row's result does not depend on how many rows share the call: batches and the
    compiled step store the bytes a solo prefill does). Exact at D = 64 (scale 1/8)."""
    D = x.shape[-1]
    p = D & -D
    if p == D:
        return mx.hadamard_transform(x, scale=p**-0.5)
    blocks = x.reshape(*x.shape[:-1], D // p, p)
    return mx.hadamard_transform(blocks, scale=p**-0.5).reshape(x.shape)


def q8_pack(x: mx.array, group: int) -> mx.array:
    """Float (..., D) -> uint8 (..., D + 4 * D / group): per group, scale = max|x| / 127 and
    int8 round(x * 127 / max|x|) (0 for an all-zero group), then the float32 scales, in MLX
    ops (~15 graph nodes; ``kv_cache.q8_pack`` uses the kernels' one op for the same bytes)."""
    *lead, D = x.shape
    g = x.astype(mx.float32).reshape(*lead, D // group, group)
    amax = mx.max(mx.abs(g), axis=-1, keepdims=True)
    inv = mx.where(amax > 0, 127.0 / mx.where(amax > 0, amax, 1.0), 0.0)
    q = mx.clip(mx.round(g * inv), -127, 127).astype(mx.int8).reshape(*lead, D)
    scales = (amax / 127.0).reshape(*lead, D // group)
    return mx.concatenate([q.view(mx.uint8), scales.view(mx.uint8)], axis=-1)


def q8_unpack(x: mx.array, dtype: mx.Dtype = mx.float32, D: int | None = None) -> mx.array:
    """The values of q8 rows (uint8 (..., D + 4 * D / G)); without ``D`` the dims come from
    the row width (group size in ``GROUPS``)."""
    W = x.shape[-1]
    if D is None:
        D, group = q8_dims(W)
    else:
        group = q8_group(D, W)
    q = mx.contiguous(x[..., :D]).view(mx.int8).astype(mx.float32)
    s = mx.contiguous(x[..., D:]).view(mx.float32)
    *lead, _ = x.shape
    out = q.reshape(*lead, D // group, group) * s[..., None]
    return out.reshape(*lead, D).astype(dtype)


GROUPS = (32, 64, 128)


def q8_group(D: int, width: int) -> int:
    """The group size of q8 rows ``width`` bytes wide holding ``D`` values (D int8 bytes, then
    one float32 scale per group); 0 when no whole number of groups fits."""
    scales = (width - D) // 4
    if width <= D or (width - D) % 4 or D % scales:
        return 0
    return D // scales


def q8_dims(width: int, group: int | None = None) -> tuple[int, int]:
    """(D, group) of a q8 row ``width`` bytes wide (the largest D when several fit)."""
    for g in (group,) if group else GROUPS:
        if width * g % (g + 4) == 0 and (width * g // (g + 4)) % g == 0:
            return width * g // (g + 4), g
    raise ValueError(f"no q8 row layout is {width} bytes wide")


# The fingerprint's name of live q8 rows (K rotated, see the module docstring): "-g<group>"
# follows. A new rule for what the rows hold gets a new name, so older checkpoints miss.
Q8_FORMAT = "q8hrows"



