"""Whisper's CPU primitives (engine/kernels/src/half_matmul.cpp, activations.cpp): the float16-weight
matmul against its scalar reference bit for bit and a float64 product within float32 rounding, its
bits independent of row count and threads; the exact GELU against math.erf; bad inputs refused."""

import math

from engine import kernels

import mlx.core as mx
import numpy as np
import pytest

from tests.kernel_checks import on_one_and_two_threads

needs_ext = pytest.mark.skipif(not kernels.available() or not kernels.has("half_matmul"),
                               reason=f"kernels off: {kernels.status()['reason']}")

# (M, N, K): a decoder step's square and MLP shapes, K with a tail past the 8 lanes, N with 1-3
# weight rows after the 4-row blocks, odd M (a row alone after the pairs), a product big enough
# for the pool (> 2^18 multiply-adds) and one small enough for the calling thread.
SHAPES = [(1, 384, 384), (3, 1536, 384), (2, 384, 1536), (5, 37, 13), (1, 6, 8), (7, 1027, 260), (4, 3, 5)]


def _case(M, N, K, seed):
    rng = np.random.default_rng(seed)
    x = mx.array(rng.standard_normal((M, K)).astype(np.float32))
    w = mx.array(rng.standard_normal((N, K)).astype(np.float16))
    b = mx.array(rng.standard_normal(N).astype(np.float32))
    return x, w, b


@needs_ext
@pytest.mark.parametrize("bias", [True, False])
def test_half_matmul_is_its_reference_and_the_float64_product(bias):
    for i, (M, N, K) in enumerate(SHAPES):
        x, w, b = _case(M, N, K, i)
        b = b if bias else None
        y = kernels.half_matmul(x, w, b)
        ref = kernels.half_matmul(x, w, b, reference=True)
        assert y.shape == (M, N) and y.dtype == mx.float32
        assert mx.array_equal(y, ref).item(), (M, N, K)
        exact = np.asarray(x, np.float64) @ np.asarray(w, np.float64).T + (np.asarray(b, np.float64) if bias else 0)
        bound = 1e-6 * K * (np.abs(np.asarray(x, np.float64)) @ np.abs(np.asarray(w, np.float64)).T + 1)
        assert (np.abs(np.asarray(y, np.float64) - exact) <= bound).all(), (M, N, K)


@needs_ext
def test_half_matmul_bits_do_not_depend_on_rows_or_threads():
    # A beam's row gives the same logits alone as in the batch (streaming equals batch).
    x, w, b = _case(6, 1031, 384, 7)
    one, two = on_one_and_two_threads(lambda: kernels.half_matmul(x, w, b))
    assert mx.array_equal(one, two).item()
    rows = mx.concatenate([kernels.half_matmul(x[i:i + 1], w, b) for i in range(6)])
    assert mx.array_equal(rows, one).item()
    x3 = x.reshape(2, 3, 384)  # leading axes are rows
    assert mx.array_equal(kernels.half_matmul(x3, w, b).reshape(6, -1), one).item()


@needs_ext
def test_half_matmul_refuses_bad_inputs():
    x, w, b = _case(2, 8, 16, 1)
    with pytest.raises(ValueError, match="float16"):
        kernels.half_matmul(x, w.astype(mx.float32))
    with pytest.raises(ValueError, match="float32"):
        kernels.half_matmul(x.astype(mx.float16), w)
    with pytest.raises(ValueError, match=r"\(N, K\)"):
        kernels.half_matmul(x[:, :8], w)
    with pytest.raises(ValueError, match="bias"):
        kernels.half_matmul(x, w, b[:3])


@needs_ext
def test_gelu_erf_matches_math_erf():
    rng = np.random.default_rng(3)
    values = np.concatenate([rng.standard_normal(200_003) * 4, [0.0, -0.0, 1e-30, -1e-30, 7.5, -7.5, 30.0, -30.0, 1e4, -1e4]])
    x = mx.array(values.astype(np.float32))
    xd = np.asarray(x, np.float64)
    exact = np.array([v * 0.5 * (1.0 + math.erf(v / math.sqrt(2.0))) for v in xd])
    for reference in (False, True):
        y = np.asarray(kernels.gelu_erf(x, reference=reference), np.float64)
        assert (np.abs(y - exact) <= 1e-6 * np.maximum(1.0, np.abs(xd))).all(), reference
    # one formula whatever the size: a slice on the calling thread gives the pool's values
    small = kernels.gelu_erf(x[:1000])
    assert mx.array_equal(small, kernels.gelu_erf(x)[:1000]).item()
    one, two = on_one_and_two_threads(lambda: kernels.gelu_erf(x))
    assert mx.array_equal(one, two).item()
    with pytest.raises(ValueError, match="float32"):
        kernels.gelu_erf(x.astype(mx.float16))
