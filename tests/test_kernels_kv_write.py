"""The batched step's KV write primitive (engine/kernels/src/kv_write.cpp): each row's entry at
its own position, bit for bit ``mx.put_along_axis`` (after ``astype`` for float32 rows into a
float16 / bfloat16 buffer); eager, compiled, on strided inputs, with a buffer still in use
elsewhere (copied, never written under its other holder), and a position outside the buffer."""

from engine import kernels

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
        kernels.kv_write_rows(buf, mx.zeros((2, 1, 2, 8)), mx.array([0, 1], mx.int32))
    with pytest.raises(ValueError):
        kernels.kv_write_rows(buf, mx.zeros((2, 1, 1, 8), mx.int32), mx.array([0, 1], mx.int32))
    with pytest.raises(ValueError):
        kernels.kv_write_rows(buf, mx.zeros((2, 1, 1, 8)), mx.array([0, 1, 2], mx.int32))
