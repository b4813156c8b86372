"""The KV write primitive (engine/kernels/src/kv_write.cpp) of batched steps and prompt forwards:
each row's entries from its own position on, bit for bit ``mx.put_along_axis`` (after ``astype``
for float32 rows into a float16 / bfloat16 buffer, the float16 cast checked on every kind of
value); eager, compiled, on strided inputs, with a buffer still in use elsewhere (copied, never
written under its other holder), and positions outside the buffer. StaticKVCache's prompt
writes through it equal mlx_lm's slice assignment byte for byte."""

from engine import kernels
from engine.generation import kv_cache
from engine.generation.kv_cache import StaticKVCache

import mlx.core as mx
import numpy as np
import pytest

needs_ext = pytest.mark.skipif(not kernels.available(), reason=f"kernels off: {kernels.status()['reason']}")


def _put(buf: mx.array, x: mx.array, pos: mx.array) -> mx.array:
    """The reference: MLX's scatter along the position axis."""
    at = mx.broadcast_to(pos.reshape(-1, 1, 1, 1), x.shape)
    return mx.put_along_axis(buf, at, x.astype(buf.dtype), axis=2)


def _same(a: mx.array, b: mx.array) -> bool:
    return a.dtype == b.dtype and np.array_equal(np.array(a.view(mx.uint8)), np.array(b.view(mx.uint8)))


@needs_ext
@pytest.mark.parametrize(
    "buf_dtype,x_dtype",
    [(mx.float32, mx.float32), (mx.float16, mx.float32), (mx.float16, mx.float16), (mx.bfloat16, mx.float32), (mx.uint8, mx.uint8)],
)
def test_rows_land_at_their_positions_as_put_along_axis(buf_dtype, x_dtype):
    B, H, S, D = 5, 3, 40, 24
    mx.random.seed(3)
    buf = (mx.random.normal((B, H, S, D)) * 40).astype(buf_dtype)
    x = (mx.random.normal((B, H, 1, D)) * 40).astype(x_dtype)
    pos = mx.array([0, 7, 39, 7, 21], mx.int32)
    mx.eval(buf, x, pos)
    want = _put(buf, x, pos)
    got = kernels.kv_write_rows(buf, x, pos)
    assert _same(got, want)
    assert _same(mx.compile(kernels.kv_write_rows)(buf, x, pos), want)
    # The input buffer was still held here, so it was copied, not written in place.
    assert not _same(buf, want)


@needs_ext
def test_strided_inputs_and_positions_outside_the_buffer():
    B, H, S, D = 4, 2, 16, 8
    mx.random.seed(4)
    base = mx.random.normal((B, H, D, S)).astype(mx.float16)
    buf = base.transpose(0, 1, 3, 2)  # not row contiguous
    x = mx.random.normal((B, H, D, 1)).transpose(0, 1, 3, 2)
    pos = mx.array([3, 16, -1, 15], mx.int32)  # rows 1 and 2: outside, nothing written
    mx.eval(buf, x, pos)
    assert _same(kernels.kv_write_rows(buf, x, mx.broadcast_to(mx.array([5], mx.int32), (B,))),
                 _put(buf, x, mx.full((B,), 5, mx.int32)))  # a stride-0 position array
    got = kernels.kv_write_rows(buf, x, pos)
    keep = mx.array([3, 0, 0, 15], mx.int32)
    want = _put(buf, x, keep)
    want = mx.concatenate([want[:1], buf[1:3], want[3:]])
    assert _same(got, want)


@needs_ext
def test_a_buffer_cut_along_the_position_axis_is_copied_whole():
    """A batch's buffers cut to a smaller capacity (BatchKV: a slice along the position axis)."""
    mx.random.seed(6)
    full = mx.random.normal((3, 2, 24, 8)).astype(mx.float16)
    buf = full[:, :, :16]
    x = mx.random.normal((3, 2, 1, 8))
    pos = mx.array([0, 9, 15], mx.int32)
    mx.eval(full, buf, x, pos)
    assert _same(kernels.kv_write_rows(buf, x, pos), _put(buf, x, pos))


@needs_ext
def test_a_step_chain_writes_in_place_and_keeps_every_row():
    """Step after step on a donated buffer (the compiled batched step's use): every written
    entry stays, as with put_along_axis."""
    B, H, S, D = 3, 2, 12, 8
    step = mx.compile(lambda b, x, p: kernels.kv_write_rows(b, x, p))
    buf = mx.zeros((B, H, S, D), mx.float16)
    ref = mx.zeros((B, H, S, D), mx.float16)
    mx.random.seed(5)
    for t in range(6):
        x = mx.random.normal((B, H, 1, D))
        pos = mx.array([t, t + 2, 2 * t], mx.int32)
        buf, ref = step(buf, x, pos), _put(ref, x, pos)
        mx.eval(buf, ref)
    assert _same(buf, ref)


@needs_ext
def test_bad_shapes_are_refused():
    buf = mx.zeros((2, 1, 4, 8), mx.float16)
    with pytest.raises(ValueError):
        kernels.kv_write_rows(buf, mx.zeros((2, 2, 1, 8)), mx.array([0, 1], mx.int32))
    with pytest.raises(ValueError):
        kernels.kv_write_rows(buf, mx.zeros((2, 1, 1, 8), mx.int32), mx.array([0, 1], mx.int32))
    with pytest.raises(ValueError):
        kernels.kv_write_rows(buf, mx.zeros((2, 1, 1, 8)), mx.array([0, 1, 2], mx.int32))


def _put_span(buf: np.ndarray, x: np.ndarray, pos: list[int]) -> np.ndarray:
    """numpy reference for L rows per batch row: row l at pos[b] + l, outside ones dropped."""
    out = buf.copy()
    for b, p in enumerate(pos):
        for r in range(x.shape[2]):
            if 0 <= p + r < buf.shape[2]:
                out[b, :, p + r] = x[b, :, r]
    return out


@needs_ext
@pytest.mark.parametrize("buf_dtype", [mx.float32, mx.float16, mx.bfloat16])
def test_many_rows_per_call_land_from_their_positions(buf_dtype):
    """A prompt forward's L rows per head (D = 20: a vector part and a tail), one row's span
    running past the buffer's end and one starting before it."""
    B, H, S, D, L = 4, 3, 40, 20, 7
    mx.random.seed(8)
    buf = (mx.random.normal((B, H, S, D)) * 30).astype(buf_dtype)
    x = mx.random.normal((B, H, L, D)) * 30
    pos = [0, 36, 12, -3]
    mx.eval(buf, x)
    got = kernels.kv_write_rows(buf, x, mx.array(pos, mx.int32))
    view = mx.uint8 if buf_dtype == mx.float32 else mx.uint16
    want = _put_span(np.array(buf.view(view)), np.array(x.astype(buf_dtype).view(view)), pos)
    assert np.array_equal(np.array(got.view(view)), want)
    strided = mx.random.normal((B, H, D, L)).transpose(0, 1, 3, 2) * 30  # d stride L: the scalar cast
    got = kernels.kv_write_rows(buf, strided, mx.array(pos, mx.int32))
    want = _put_span(np.array(buf.view(view)), np.array(strided.astype(buf_dtype).view(view)), pos)
    assert np.array_equal(np.array(got.view(view)), want)


@needs_ext
def test_float16_cast_is_astype_bit_for_bit():
    """Every kind of float32: NaNs with payloads and signs (MLX writes one NaN per sign), +-inf,
    the overflow edge, ties to even in normal and subnormal range, underflow to zero, -0, and
    a million random values over the whole exponent range; vector lanes and the scalar tail."""
    special = np.array([np.nan, -np.nan, np.inf, -np.inf, 0.0, -0.0, 65504.0, 65519.996, 65520.0, -65520.0,
                        1e10, 2.0**-24, 2.0**-25, 3 * 2.0**-25, 2.0**-26, 2.0**-14, 2.0**-14 - 2.0**-25,
                        1 + 2.0**-11, 1 + 3 * 2.0**-11, -(1 + 2.0**-11), 1e-30], np.float32)
    payload = np.array([0x7FC00001, 0xFFC12345, 0x7F800001, 0xFF812345], np.uint32).view(np.float32)
    halves = np.arange(0, 2**16, dtype=np.uint32).astype(np.uint16).view(np.float16).astype(np.float32)
    with np.errstate(invalid="ignore"):  # ties to even (and NaN from the inf/nan neighbours)
        mids = (halves[:-1] + (halves[1:] - halves[:-1]) / 2).astype(np.float32)
    rng = np.random.default_rng(0)
    rnd = (rng.standard_normal(1 << 20) * np.exp2(rng.uniform(-40, 40, 1 << 20))).astype(np.float32)
    vals = np.concatenate([special, payload, halves, mids, rnd])
    D = 20  # 16 values in F16C vectors, 4 in the scalar tail, per row
    vals = np.concatenate([vals, np.zeros(-len(vals) % D, np.float32)]).reshape(1, 1, -1, D)
    x = mx.array(vals)
    buf = mx.zeros(x.shape, mx.float16)
    got = kernels.kv_write_rows(buf, x, mx.array([0], mx.int32))
    assert np.array_equal(np.array(got.view(mx.uint16)), np.array(x.astype(mx.float16).view(mx.uint16)))


def _prompt_writes(on: bool, dtype, chunks: list[int], seed: int = 9) -> tuple[list, StaticKVCache]:
    kv_cache.PROMPT_KV_WRITE = on
    try:
        c = StaticKVCache(dtype)
        mx.random.seed(seed)
        seen = []
        for n in chunks:
            k, v = mx.random.normal((1, 3, n, 16)), mx.random.normal((1, 3, n, 8))
            keys, values = c.update_and_fetch(k, v)
            mx.eval(keys, values)
            seen.append((np.array(keys.view(mx.uint8)), np.array(values.view(mx.uint8)), c.offset))
        return seen, c
    finally:
        kv_cache.PROMPT_KV_WRITE = True


@needs_ext
@pytest.mark.parametrize("dtype", [None, mx.float16, mx.bfloat16])
def test_prompt_writes_equal_mlx_lm_slice_assignment(dtype):
    """Chunks that fit, grow the buffer from a step boundary and from inside a step (mlx_lm cuts
    the buffer to the offset first), and single rows: the same K/V, offsets and capacity."""
    chunks = [30, 200, 300, 1, 600, 3]
    on, c_on = _prompt_writes(True, dtype, chunks)
    off, c_off = _prompt_writes(False, dtype, chunks)
    assert StaticKVCache(dtype)._writes_rows(dtype, mx.zeros((1, 3, 2, 16)), mx.zeros((1, 3, 2, 8)))
    for a, b in zip(on, off, strict=True):
        assert a[2] == b[2] and np.array_equal(a[0], b[0]) and np.array_equal(a[1], b[1])
    assert c_on.keys.shape == c_off.keys.shape and c_on.keys.dtype == c_off.keys.dtype


@needs_ext
def test_prompt_write_leaves_an_earlier_holder_of_the_buffer_alone():
    """A snapshot that still holds the buffer (a prefix cache's copy) keeps its contents."""
    c = StaticKVCache(mx.float16)
    c.update_and_fetch(mx.ones((1, 2, 4, 8)), mx.ones((1, 2, 4, 8)))
    held = c.keys
    mx.eval(held)
    before = np.array(held.view(mx.uint16))
    keys, _ = c.update_and_fetch(mx.full((1, 2, 5, 8), 2.0), mx.full((1, 2, 5, 8), 2.0))
    mx.eval(keys)
    assert np.array_equal(np.array(held.view(mx.uint16)), before)
    assert np.array(keys[0, 0, :, 0]).tolist() == [1.0] * 4 + [2.0] * 5
