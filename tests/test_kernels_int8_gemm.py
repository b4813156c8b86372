"""The many-row int8 matmul paths -- AMX-INT8 tiles (engine/kernels/src/qmm_amx.cpp) and
AVX512-VNNI register tiles (src/qmm_gemm512.cpp) -- checked as one parametrized set: their outputs
are the row path's bit for bit (prefill rows equal decode rows), for every format the row path
takes, row and column remainders and odd K; the same bits on 1 and 2 threads; off (set_amx /
set_vnni_gemm) the float panels run again. Each path
is skipped where the CPU (or the OS, for AMX's tile state) does not have it. Narrowed to AVX2 or
AVX-VNNI (a subprocess), the many rows run the decode row path itself: the same bits again."""

import json
import os
import subprocess
import sys

from engine import kernels

import mlx.core as mx
import numpy as np
import pytest

from tests.kernel_checks import on_one_and_two_threads


def _ext():
    return kernels._load()


# Whether each path can run here, read once before any test switches anything.
_HAVE = {
    "amx": kernels.available() and bool(_ext().amx()),
    "vnni512": kernels.available() and _ext().isa() == "avx2+avx512vnni",
}
_MISSING = {
    "amx": "CPU feature missing: no AMX-INT8 here (no amx_tile/amx_int8, the OS refused the tile state, "
           "or set_amx(False))",
    "vnni512": "CPU feature missing: no AVX512-VNNI here (or MLXTERM_KERNELS narrows it)",
}


@pytest.fixture(params=["amx", "vnni512"])
def path(request):
    """One int8 many-row path switched on, the other off, for the test's duration."""
    name = request.param
    if not _HAVE[name]:
        pytest.skip(_MISSING[name])
    was = kernels.set_int8_prefill(False)
    (kernels.set_amx if name == "amx" else kernels.set_vnni_gemm)(True)
    try:
        assert kernels.status()["prefill"] == name
        yield name
    finally:
        kernels.restore_int8_prefill(was)


# (M, N, K): one tile, a row past it, many tiles with a remainder, a long prefill chunk; odd N
# (partial 16-column panels and panels of <= 8 rows), one whole panel, K an odd number of 32-blocks.
SHAPES = [(16, 67, 256), (17, 37, 96), (64, 128, 512), (300, 77, 640), (33, 8, 160), (47, 16, 224), (40, 24, 576)]


def _weights(N, K, bits, gs, seed, fmt):
    rng = np.random.default_rng(seed)
    w = mx.array(rng.standard_normal((N, K)).astype(np.float32))
    wq, s, b = mx.quantize(w, group_size=gs, bits=bits)
    if fmt == "half":  # float16 scales/biases, read as such (GGUF-derived)
        s, b = s.astype(mx.float16), b.astype(mx.float16)
    return wq, s, b


def _rows_one_by_one(x, wq, s, b, gs, bits, step, symmetric=False):
    return mx.concatenate(
        [
            kernels.quantized_matmul(x[i : i + step], wq, s, b, gs, bits, symmetric=symmetric)
            for i in range(0, x.shape[0], step)
        ]
    )


@pytest.mark.parametrize("bits", [4, 5, 8])
@pytest.mark.parametrize("gs", [32, 64, 128])
@pytest.mark.parametrize("fmt", ["f32", "half"])
def test_many_rows_equal_decode_rows(path, bits, gs, fmt):
    for i, (M, N, K) in enumerate(SHAPES):
        if K % gs:
            continue
        wq, s, b = _weights(N, K, bits, gs, 10 * bits + gs + i, fmt)
        x = mx.array(np.random.default_rng(i).standard_normal((M, K)).astype(np.float32))
        y = kernels.quantized_matmul(x, wq, s, b, gs, bits)
        one = _rows_one_by_one(x, wq, s, b, gs, bits, 1)  # decode: M = 1
        few = _rows_one_by_one(x, wq, s, b, gs, bits, 15)  # the multi-row step: M < 16
        assert mx.array_equal(y, one).item(), (bits, gs, fmt, M, N, K, float(mx.abs(y - one).max()))
        assert mx.array_equal(y, few).item(), (bits, gs, fmt, M, N, K)


@pytest.mark.parametrize("bits", [4, 5, 8])
def test_symmetric_weights_equal_decode_rows(path, bits):
    # GGUF Q4_0/Q5_0/Q8_0: bias = -2^(bits-1) * scale, float16 scales, the biases never read.
    M, N, K = 40, 45, 256
    rng = np.random.default_rng(bits)
    q = rng.integers(0, 2**bits, size=(N, K)).astype(np.float32)
    scale = rng.uniform(0.01, 0.1, size=(N, K // 32, 1)).astype(np.float32)
    w = mx.array(((q.reshape(N, K // 32, 32) - 2 ** (bits - 1)) * scale).reshape(N, K))
    wq, s, b = mx.quantize(w, group_size=32, bits=bits)
    s = s.astype(mx.float16)
    b = (s.astype(mx.float32) * -(2 ** (bits - 1))).astype(mx.float16)
    x = mx.array(rng.standard_normal((M, K)).astype(np.float32))
    y = kernels.quantized_matmul(x, wq, s, b, 32, bits, symmetric=True)
    one = _rows_one_by_one(x, wq, s, b, 32, bits, 1, symmetric=True)
    assert mx.array_equal(y, one).item()


def test_close_to_float_reference_and_exact_stays_on_float_panels(path):
    M, N, K = 64, 96, 384
    wq, s, b = _weights(N, K, 4, 64, 7, "f32")
    x = mx.array(np.random.default_rng(3).standard_normal((M, K)).astype(np.float32))
    ref = x @ mx.dequantize(wq, s, b, group_size=64, bits=4).T
    y = kernels.quantized_matmul(x, wq, s, b, 64, 4)
    rel = float(mx.sqrt(mx.mean((y - ref) ** 2)) / mx.sqrt(mx.mean(ref**2)))
    assert 0 < rel < 1.5e-2  # int8 activations: the row path's tolerance (and not the fp32 path)
    exact = kernels.quantized_matmul(x, wq, s, b, 64, 4, exact=True)
    assert float(mx.abs(exact - ref).max() / mx.abs(ref).max()) < 2e-6


def test_one_and_two_threads_bit_identical(path):
    M, N, K = 300, 77, 640
    wq, s, b = _weights(N, K, 4, 32, 1, "half")
    x = mx.array(np.random.default_rng(5).standard_normal((M, K)).astype(np.float32))
    one, two = on_one_and_two_threads(lambda: kernels.quantized_matmul(x, wq, s, b, 32, 4))
    assert mx.array_equal(one, two).item()


def test_switched_off_runs_the_float_panels(path):
    M, N, K = 48, 64, 256
    wq, s, b = _weights(N, K, 8, 32, 2, "f32")
    x = mx.array(np.random.default_rng(6).standard_normal((M, K)).astype(np.float32))
    on = kernels.quantized_matmul(x, wq, s, b, 32, 8)
    panels = kernels.quantized_matmul(x, wq, s, b, 32, 8, exact=True)
    mx.eval(on, panels)
    was = (kernels.set_amx if path == "amx" else kernels.set_vnni_gemm)(False)
    try:
        assert kernels.status()["prefill"] == "float panels"
        off = kernels.quantized_matmul(x, wq, s, b, 32, 8)
        mx.eval(off)  # lazily evaluated: while the switch is off
    finally:
        (kernels.set_amx if path == "amx" else kernels.set_vnni_gemm)(was)
    assert mx.array_equal(off, panels).item() and not mx.array_equal(on, off).item()


def narrow_many_rows_mismatches() -> list:
    """In a process narrowed to AVX2 / AVX-VNNI: the path, and the cases where many rows (the
    row path over every row, "int8 many rows") differ from the rows one by one or 15 at a time."""
    bad = []
    for bits in (4, 5, 8):
        for fmt in ("f32", "half"):
            for i, (M, N, K) in enumerate(SHAPES[:5]):
                wq, s, b = _weights(N, K, bits, 32, 10 * bits + i, fmt)
                x = mx.array(np.random.default_rng(i).standard_normal((M, K)).astype(np.float32))
                y = kernels.quantized_matmul(x, wq, s, b, 32, bits)
                for step in (1, 15):
                    if not mx.array_equal(y, _rows_one_by_one(x, wq, s, b, 32, bits, step)).item():
                        bad.append([bits, fmt, M, N, K, step])
    return [kernels.prefill_path(), bad]


@pytest.mark.skipif(not kernels.available(), reason="CPU kernels not built")
@pytest.mark.parametrize("isa", ["avx2", "avxvnni"])
def test_narrower_instruction_set_runs_the_row_path_over_many_rows(isa):
    """Without AVX512-VNNI the many-row matmuls run the decode row path over every row (int8
    activations, a weight group decoded once for all rows): the decode rows' bits, so a prompt
    forward writes the K/V a decode writes; set_vnni_gemm(False) brings back the float panels."""
    if isa == "avxvnni" and "avx_vnni" not in kernels._cpu_flags():
        pytest.skip("CPU feature missing: no AVX-VNNI here")
    code = (
        "import json, engine\nfrom engine import kernels\n"
        "from tests.test_kernels_int8_gemm import narrow_many_rows_mismatches\n"
        "ext = kernels._load()\n"
        "head = [ext.isa(), ext.amx(), ext.vnni_gemm()]\n"
        "got = narrow_many_rows_mismatches()\n"
        "kernels.set_vnni_gemm(False)\n"
        "print(json.dumps(head + got + [kernels.prefill_path()]))\n"
    )
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, MLXTERM_KERNELS=isa, PYTHONPATH=root)
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300, cwd=root
    )
    assert out.returncode == 0, out.stderr[-3000:]
    name = {"avx2": "avx2", "avxvnni": "avx2+avxvnni"}[isa]
    assert json.loads(out.stdout.strip().splitlines()[-1]) == [name, False, False, "int8 many rows", [],
                                                               "float panels"]


@pytest.mark.parametrize("bits", [4, 8])
def test_rows_over_several_activation_slices(path, bits):
    # K = 3072: the activation rows go in slices (AMX 256, VNNI 160; each panel rebuilt per slice).
    M, N, K = 300, 40, 3072
    wq, s, b = _weights(N, K, bits, 128, 11 + bits, "f32")
    x = mx.array(np.random.default_rng(9).standard_normal((M, K)).astype(np.float32))
    y = kernels.quantized_matmul(x, wq, s, b, 128, bits)
    few = _rows_one_by_one(x, wq, s, b, 128, bits, 15)
    assert mx.array_equal(y, few).item()
