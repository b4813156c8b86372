"""The prefill (M >= 16) float-panel path: the AVX-512 12x32 micro-kernel gives bit-identical
results to the AVX2 6x16 one (same FMA chain per output element), for every bit width, row
remainder, partial panel and K-block split; both match dequantize + matmul. The panels run
exact=True matmuls of every size and the non-exact ones only where no int8 GEMM (AMX or AVX512-VNNI
tiles: test_kernels_int8_gemm.py) is on, so they are checked with exact=True."""

import engine  # noqa: F401
from engine import kernels

import mlx.core as mx
import numpy as np
import pytest

from tests.kernel_checks import assert_same_under_isa

needs_ext = pytest.mark.skipif(not kernels.available(), reason="CPU kernels not built")

# (M, N, K): row remainders of both micro-kernels (12 and 6), partial panels, K over 2 blocks.
SHAPES = [(16, 67, 256), (29, 333, 384), (40, 100, 640), (17, 32, 96)]


def _results(bits_list=(4, 5, 8)) -> dict[str, np.ndarray]:
    out = {}
    for bits in bits_list:
        for i, (M, N, K) in enumerate(SHAPES):
            rng = np.random.default_rng(100 * bits + i)
            w = mx.array(rng.standard_normal((N, K)).astype(np.float32))
            x = mx.array(rng.standard_normal((M, K)).astype(np.float32))
            wq, s, b = mx.quantize(w, group_size=32, bits=bits)
            y = kernels.quantized_matmul(x, wq, s, b, 32, bits, exact=True)
            ref = x @ mx.dequantize(wq, s, b, group_size=32, bits=bits).T
            assert float(mx.abs(y - ref).max() / mx.abs(ref).max()) < 2e-6, (bits, M, N, K)
            out[f"{bits}-{M}-{N}-{K}"] = np.array(y)
    return out


@needs_ext
def test_panel_path_bit_identical_across_instruction_sets(tmp_path):
    assert_same_under_isa(_results, tmp_path)
