"""16-bit activations for the quantized matmul's int8 paths (``kernels.set_x16``): x / d rounds
to q16 in [-16256, 16256] per 32-block (d = amax / 16256), split as 128 * hi + lo with hi, lo
int8, and each block's integer dot is hi's dot * 128 + lo's.
Checked: a float64 reference of that scheme; every row alone = the same row among 1..15 others
= the many-row VNNI GEMM's row (prefill rows equal decode rows); 1 vs 2 threads; AVX2's maddubs
path = the widest instruction set; the many-row path never hands 16-bit activations to AMX; the
error is ~1/128 of the int8 activations'."""

from __future__ import annotations

from contextlib import contextmanager

from engine import kernels

import mlx.core as mx
import numpy as np
import pytest

from tests.kernel_checks import (
    assert_rows_are_solo_rows,
    assert_same_under_isa,
    int_activation_reference,
    on_one_and_two_threads,
)

pytestmark = pytest.mark.skipif(not kernels.available(), reason=f"kernels off: {kernels.status()['reason']}")

N, K = 77, 384  # a partial 8-row weight group and a partial 16-column panel


@contextmanager
def x16():
    """16-bit activations for the block (results are evaluated inside: the switch is read at
    evaluation time)."""
    was = kernels.set_x16(True)
    try:
        assert kernels.status()["activations"] == "int16"
        yield
    finally:
        kernels.set_x16(was)


def _weights(bits: int, gs: int, seed: int, half: bool = False, k: int = K):
    rng = np.random.default_rng(seed)
    w = mx.array(rng.standard_normal((N, k)).astype(np.float32))
    wq, s, b = mx.quantize(w, group_size=gs, bits=bits)
    if half:  # float16 scales/biases, read as such (GGUF-derived)
        s, b = s.astype(mx.float16), b.astype(mx.float16)
    return wq, s, b


def _x(m: int, seed: int, k: int = K) -> np.ndarray:
    xs = np.random.default_rng(seed).standard_normal((m, k)).astype(np.float32)
    xs[min(3, m - 1)] *= 40.0  # rows of very different magnitude share the matmul
    xs[0, :64] = 0.0  # all-zero activation blocks
    xs[m // 2, 7] = 300.0  # an outlier: its block's other values get a coarse step
    return xs


@pytest.mark.parametrize("bits", [4, 5, 8])
@pytest.mark.parametrize("gs", [32, 64, 128])
def test_rows_match_the_reference_and_their_solo_bits(bits, gs):
    wq, s, b = _weights(bits, gs, seed=bits * 100 + gs)
    xs = _x(16, gs + bits)
    x = mx.array(xs)
    ref = int_activation_reference(xs, wq, s, b, gs, bits, qmax=16256)
    with x16():
        assert_rows_are_solo_rows(x, wq, s, b, gs, bits, ref)


@pytest.mark.parametrize("bits", [4, 5, 8])
def test_an_odd_number_of_blocks_per_row(bits):
    """4-bit rows unpack two blocks at a time; a last single block takes the other way."""
    k = 13 * 32
    wq, s, b = _weights(bits, 32, seed=13, k=k)
    xs = _x(6, bits, k=k)
    x = mx.array(xs)
    ref = int_activation_reference(xs, wq, s, b, 32, bits, qmax=16256)
    with x16():
        y = kernels.quantized_matmul(x, wq, s, b, 32, bits)
        assert np.abs(np.array(y, dtype=np.float64) - ref).max() / np.abs(ref).max() < 2e-6
        for i in range(6):
            assert mx.array_equal(kernels.quantized_matmul(x[i : i + 1], wq, s, b, 32, bits)[0], y[i]).item()


@pytest.mark.parametrize("bits", [4, 5, 8])
@pytest.mark.parametrize("gs", [32, 128])
@pytest.mark.parametrize("half", [False, True])
def test_many_rows_equal_decode_rows(bits, gs, half):
    """The many-row path (the VNNI GEMM where the CPU has it, else the row path over every row)
    gives each row its decode bits; AMX never gets 16-bit activations."""
    wq, s, b = _weights(bits, gs, seed=bits + gs, half=half)
    for M in (16, 17, 47, 300):
        x = mx.array(_x(M, M))
        with x16():
            assert kernels.prefill_path(M) != "amx"
            assert kernels.prefill_path(M) in ("vnni512", "int8 many rows")
            y = kernels.quantized_matmul(x, wq, s, b, gs, bits)
            one = mx.concatenate([kernels.quantized_matmul(x[i : i + 1], wq, s, b, gs, bits) for i in range(M)])
            few = mx.concatenate([kernels.quantized_matmul(x[i : i + 15], wq, s, b, gs, bits) for i in range(0, M, 15)])
            assert mx.array_equal(y, one).item(), (bits, gs, half, M)
            assert mx.array_equal(y, few).item(), (bits, gs, half, M)


@pytest.mark.parametrize("bits", [4, 8])
def test_symmetric_weights_equal_the_stored_biases(bits):
    """GGUF Q4_0/Q8_0: the bias terms made from the scales, as the int8 activations have them."""
    rng = np.random.default_rng(bits)
    q = rng.integers(0, 2**bits, size=(N, K)).astype(np.float32)
    scale = rng.uniform(0.01, 0.1, size=(N, K // 32, 1)).astype(np.float32)
    w = mx.array(((q.reshape(N, K // 32, 32) - 2 ** (bits - 1)) * scale).reshape(N, K))
    wq, s, _ = mx.quantize(w, group_size=32, bits=bits)
    s = s.astype(mx.float16)
    b = (s.astype(mx.float32) * -(2 ** (bits - 1))).astype(mx.float16)
    x = mx.array(_x(40, bits))
    with x16():
        for m in (1, 7, 40):
            y_sym = kernels.quantized_matmul(x[:m], wq, s, b, 32, bits, symmetric=True)
            y = kernels.quantized_matmul(x[:m], wq, s, b, 32, bits)
            assert mx.array_equal(y_sym, y).item(), m


def test_one_and_two_threads_bit_identical():
    wq, s, b = _weights(4, 32, seed=1, half=True)
    x = mx.array(_x(300, 5))
    with x16():
        for m in (1, 9, 300):
            one, two = on_one_and_two_threads(lambda m=m: kernels.quantized_matmul(x[:m], wq, s, b, 32, 4))
            assert mx.array_equal(one, two).item(), m


def test_error_is_a_small_fraction_of_the_int8_activations():
    wq, s, b = _weights(4, 64, seed=7)
    x = mx.array(_x(24, 3))
    exact = kernels.quantized_matmul(x, wq, s, b, 64, 4, exact=True)
    # 24 rows: the many-row int8 path where the CPU has one (the float panels are exact anyway).
    for m in (1, 24) if kernels.prefill_path(24) != "float panels" else (1,):
        i8 = kernels.quantized_matmul(x[:m], wq, s, b, 64, 4)
        mx.eval(exact, i8)
        with x16():
            i16 = kernels.quantized_matmul(x[:m], wq, s, b, 64, 4)
            mx.eval(i16)
        e8 = float(mx.abs(i8 - exact[:m]).max())
        e16 = float(mx.abs(i16 - exact[:m]).max())
        assert 0 < e16 < e8 / 50, (m, e8, e16)


def avx2_rows() -> dict[str, np.ndarray]:
    """Rows of 4- and 5-bit matmuls with 16-bit activations, alone and 15 at a time (AVX2 runs
    8-bit weights shifted by 128, another float chain, so those are not compared)."""
    out = {}
    with x16():
        for bits in (4, 5):
            wq, s, b = _weights(bits, 64, seed=bits)
            x = mx.array(_x(15, bits))
            out[f"{bits}-solo"] = np.array(mx.concatenate([kernels.quantized_matmul(x[i : i + 1], wq, s, b, 64, bits) for i in range(15)]))
            out[f"{bits}-15"] = np.array(kernels.quantized_matmul(x, wq, s, b, 64, bits))
            np.testing.assert_array_equal(out[f"{bits}-solo"], out[f"{bits}-15"])
    return out


def test_avx2_gives_the_same_bits(tmp_path):
    assert_same_under_isa(avx2_rows, tmp_path, "avx2")
