"""The decode-sized quantized matmul (M < 16 rows, int8 activations) on several rows at once:
every row's outputs are bit-identical to the same row computed alone, whatever the other
rows are and however many, on every instruction set and thread count, and they match a
float64 reference of the int8 scheme (activations quantized per 32-block, exact integer
block dot products, per-block scales, affine biases on the quantized activations' sums)."""

from __future__ import annotations

import os
import subprocess
import sys

from engine import kernels

import mlx.core as mx
import numpy as np
import pytest

from tests.kernel_checks import (
    assert_rows_are_solo_rows,
    int_activation_reference,
    on_one_and_two_threads,
)

pytestmark = pytest.mark.skipif(not kernels.available(), reason=f"kernels off: {kernels.status()['reason']}")

N, K = 77, 384  # N not a multiple of the 8-row weight groups: a partial group in every chunk


def _weights(bits: int, gs: int, seed: int, k: int = K):
    rng = np.random.default_rng(seed)
    w = mx.array(rng.standard_normal((N, k)).astype(np.float32))
    return mx.quantize(w, group_size=gs, bits=bits)


@pytest.mark.parametrize("bits", [4, 5, 8])
@pytest.mark.parametrize("gs", [32, 64, 128])
def test_every_row_count_up_to_16_gives_each_row_its_solo_bits(bits, gs):
    wq, s, b = _weights(bits, gs, seed=bits * 100 + gs)
    rng = np.random.default_rng(gs + bits)
    xs = rng.standard_normal((16, K)).astype(np.float32)
    xs[3] *= 40.0  # rows of very different magnitude share the matmul
    xs[5, :64] = 0.0  # all-zero activation blocks
    x = mx.array(xs)
    solo = assert_rows_are_solo_rows(x, wq, s, b, gs, bits, int_activation_reference(xs, wq, s, b, gs, bits))
    # The same rows in another order, with other companions: still their solo bits.
    order = [9, 3, 14, 0, 7, 5, 11]
    y = kernels.quantized_matmul(x[mx.array(order)], wq, s, b, gs, bits)
    for r, i in enumerate(order):
        assert mx.array_equal(y[r], solo[i]), (order, i)


@pytest.mark.parametrize("bits", [4, 5, 8])
def test_an_odd_number_of_blocks_per_row(bits):
    """4-bit weights are unpacked two blocks at a time; a last single block takes the other way."""
    k = 13 * 32
    wq, s, b = _weights(bits, 32, seed=13, k=k)
    xs = np.random.default_rng(bits).standard_normal((6, k)).astype(np.float32)
    x = mx.array(xs)
    y = kernels.quantized_matmul(x, wq, s, b, 32, bits)
    ref = int_activation_reference(xs, wq, s, b, 32, bits)
    assert np.abs(np.array(y, dtype=np.float64) - ref).max() / np.abs(ref).max() < 2e-6
    for i in range(6):
        assert mx.array_equal(kernels.quantized_matmul(x[i : i + 1], wq, s, b, 32, bits)[0], y[i])


@pytest.mark.parametrize("isa", ["avx2", "avxvnni"])
def test_narrower_instruction_sets_keep_rows_independent(isa):
    """AVX2 (maddubs, 4-row tiles) and AVX-VNNI: rows alone = rows among 1..15, and the same
    bits as the widest instruction set (the integer dot products are exact on every path;
    AVX2 runs 8-bit weights shifted by 128, so only its 4/5-bit results are compared)."""
    code = (
        "import sys\n"
        "import mlx.core as mx\n"
        "from engine import kernels\n"
        "from tests.test_kernels_rows import _weights, K\n"
        "print(kernels.status()['isa'])\n"
        "for bits in (4, 5, 8):\n"
        "    wq, s, b = _weights(bits, 64, seed=bits)\n"
        "    x = mx.random.normal((15, K), key=mx.random.key(bits))\n"
        "    solo = [kernels.quantized_matmul(x[i:i + 1], wq, s, b, 64, bits)[0] for i in range(15)]\n"
        "    for m in (2, 3, 4, 5, 8, 15):\n"
        "        y = kernels.quantized_matmul(x[:m], wq, s, b, 64, bits)\n"
        "        assert all(mx.array_equal(y[i], solo[i]) for i in range(m)), (bits, m)\n"
        "    mx.save(sys.argv[1] + f'/{bits}.npy', mx.stack(solo))\n"
    )
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        outs, names = {}, {}
        for arm in (isa, ""):
            d = os.path.join(tmp, arm or "best")
            os.makedirs(d)
            env = dict(os.environ, MLXTERM_KERNELS=arm)
            r = subprocess.run([sys.executable, "-c", code, d], env=env, capture_output=True, text=True, timeout=120)
            assert r.returncode == 0, r.stderr
            outs[arm] = [mx.load(os.path.join(d, f"{bits}.npy")) for bits in (4, 5, 8)]
            names[arm] = r.stdout.strip()
        if isa == "avx2":
            assert names[isa] == "avx2"
        compared = 2 if isa == "avx2" else 3
        for a, c in list(zip(outs[isa], outs[""], strict=True))[:compared]:
            assert mx.array_equal(a, c)


_ROWS512 = kernels.available() and kernels.status()["isa"] == "avx2+avx512vnni"


def _on_equals_off(switch, run):
    """run() with switch(True) and switch(False), each on 1 and 2 threads: all four the same bits;
    returns the output with the switch on (one thread)."""
    outs = {}
    for on in (True, False):
        switch(on)
        outs[on] = on_one_and_two_threads(run)
    ref = outs[False][0]
    assert all(mx.array_equal(a, ref).item() for a in (*outs[True], outs[False][1]))
    return outs[True][0]


@pytest.mark.skipif(not _ROWS512, reason="CPU feature missing: the 16-column few-row path needs AVX512-VNNI")
@pytest.mark.parametrize("bits", [4, 5, 8])
@pytest.mark.parametrize("scales", ["float32", "float16", "symmetric"])
@pytest.mark.parametrize("x16", [False, True])
def test_the_16_column_few_row_path_gives_the_8_column_paths_bits(bits, scales, x16):
    """2..15 rows on the VNNI GEMM's 16-column zmm tiles (set_rows512) = the same rows on the
    8-column row path, bit for bit: float16 and symmetric scales read as such, 16-bit
    activations, N not a multiple of 16, a group size of 64; on 1 and 2 threads."""
    ext = kernels._load()
    wq, s, b = _weights(bits, 64, seed=bits + 7)
    if scales != "float32":
        s = s.astype(mx.float16)
        b = (s * -(2 ** (bits - 1))) if scales == "symmetric" else b.astype(mx.float16)
    x = mx.random.normal((15, K), key=mx.random.key(bits))
    sym = scales == "symmetric"
    was_x16 = kernels.set_x16(x16)
    was = ext.set_rows512(True)
    try:
        assert ext.rows512()
        for m in (2, 3, 5, 8, 15):
            _on_equals_off(ext.set_rows512, lambda m=m: kernels.quantized_matmul(x[:m], wq, s, b, 64, bits, symmetric=sym))
    finally:
        ext.set_rows512(was)
        kernels.set_x16(was_x16)


@pytest.mark.skipif(not _ROWS512, reason="CPU feature missing: the 16-column tiles need AVX512-VNNI")
@pytest.mark.parametrize("bits", [4, 5, 8])
@pytest.mark.parametrize("scales", ["float32", "float16", "symmetric"])
@pytest.mark.parametrize("x16", [False, True])
def test_the_pipelined_panels_give_the_panel_by_panel_bits(bits, scales, x16):
    """Weights on the 16-column tiles decode the next panel between a panel's block dots
    (set_rows512_pipe; 4- and 5-bit two rows per zmm): the same bits as pack_pair16's panel by
    panel decode -- for 2..15 rows, and for 16+ rows (the VNNI GEMM with AMX off) where 4-bit
    panels pipeline too (the fill beside a tile of up to 8 rows, then tiles of up to 16, sizes
    within one row of each other: 10 = 5 + 5, 18 = 8 + 10, 33 = 8 + 13 + 12; 5- and 8-bit stay
    panel by panel there: 18 = 9 + 9), with several panels per pool chunk, a partial last panel (and a last
    panel of <= 8 rows) and an odd block count; on 1 and 2 threads. Each row also keeps its solo
    bits."""
    ext = kernels._load()
    n, k = 597, 13 * 32  # 597 = 37 * 16 + 5
    rng = np.random.default_rng(11)
    wq, s, b = mx.quantize(mx.array(rng.standard_normal((n, k)).astype(np.float32)), group_size=32, bits=bits)
    if scales != "float32":
        s = s.astype(mx.float16)
        b = (s * -(2 ** (bits - 1))) if scales == "symmetric" else b.astype(mx.float16)
    sym = scales == "symmetric"
    x = mx.random.normal((40, k), key=mx.random.key(3))
    was = (kernels.set_x16(x16), ext.set_rows512(True), ext.set_rows512_pipe(True), kernels.set_amx(False),
           ext.set_vnni_gemm(True))
    try:
        assert ext.rows512_pipe()
        solo = [kernels.quantized_matmul(x[i : i + 1], wq, s, b, 32, bits, symmetric=sym) for i in range(40)]
        for m in (2, 7, 8, 10, 15, 17, 18, 20, 25, 33, 40):
            y = _on_equals_off(
                ext.set_rows512_pipe, lambda m=m: kernels.quantized_matmul(x[:m], wq, s, b, 32, bits, symmetric=sym)
            )
            for i in range(m):
                assert mx.array_equal(y[i], solo[i][0]), (m, i)
    finally:
        kernels.set_x16(was[0])
        ext.set_rows512(was[1])
        ext.set_rows512_pipe(was[2])
        kernels.set_amx(was[3])
        ext.set_vnni_gemm(was[4])


def _few_row_cases():
    """(name, weights, bits, group size, symmetric) for the few-row path's checks: every scale
    form the 1.5B's decode reads (K-quant records, float16 symmetric 8-bit), float32 and float16
    scales, group sizes 32/64/128, an odd block count, N not a multiple of 8."""
    from engine.kernels import kscales
    from engine.model.gguf import quants

    from tests.test_gguf_quants import make_blocks

    cases = []
    for bits in (4, 5, 8):
        for gs in (32, 64, 128):
            wq, s, b = _weights(bits, gs, seed=bits * 10 + gs)
            cases.append((f"f32-{bits}b-g{gs}", (wq, s, b), bits, gs, False))
        wq, s, b = _weights(bits, 32, seed=bits, k=13 * 32)  # 13 blocks: a last single one
        cases.append((f"odd-{bits}b", (wq, s, b), bits, 32, False))
        wq, s, _ = _weights(bits, 64, seed=bits + 1)
        s16 = s.astype(mx.float16)
        cases.append((f"f16-sym-{bits}b", (wq, s16, s16 * -(2 ** (bits - 1))), bits, 64, True))
        cases.append((f"f16-{bits}b", (wq, s16, (s16 * -3).astype(mx.float16)), bits, 64, False))
    for name, bits in (("Q4_K", 4), ("Q5_K", 5)):
        raw, _ = make_blocks(name, 45 * 768 // 256)
        a = quants.to_affine(raw, name, (45, 768))
        rec = mx.array(kscales.pack(a.scales, a.biases))
        cases.append((f"{name}-records", (mx.array(a.weight), rec, rec), bits, 32, False))
    return cases


def few_rows_check() -> None:
    """Run under MLXTERM_KERNELS=avx2 (test below): for every case and M = 2..8, the few-row path
    gives the panel path's bits (on vs off, 1 and 2 threads) and every row its solo bits; 1 and
    9+ rows do not take it."""
    ext = kernels._load()
    assert kernels.status()["isa"] == "avx2"
    assert [ext.qmm_path(m) for m in (1, 2, 8, 9, 16)] == [
        "int8 rows", "int8 few rows", "int8 few rows", "int8 rows", "int8 many rows"]
    was = ext.set_small_rows(True)
    try:
        for name, (wq, s, b), bits, gs, sym in _few_row_cases():
            k = int(wq.shape[1]) * 32 // bits
            xs = np.random.default_rng(len(name)).standard_normal((9, k)).astype(np.float32)
            xs[2] *= 30.0  # rows of very different magnitude share the matmul
            xs[4, :64] = 0.0  # all-zero activation blocks
            x = mx.array(xs)

            def mm(m, x=x, wq=wq, s=s, b=b, gs=gs, bits=bits, sym=sym):
                return kernels.quantized_matmul(x[:m], wq, s, b, gs, bits, symmetric=sym)

            solo = [kernels.quantized_matmul(x[i : i + 1], wq, s, b, gs, bits, symmetric=sym)[0] for i in range(9)]
            for m in range(2, 10):
                y = _on_equals_off(ext.set_small_rows, lambda m=m, mm=mm: mm(m))
                assert all(mx.array_equal(y[i], solo[i]).item() for i in range(m)), (name, m)
            ext.set_small_rows(True)
    finally:
        ext.set_small_rows(was)


def test_the_avx2_few_row_path_gives_the_panel_paths_bits():
    """2..8 rows on AVX2 (qmm_small_rows.inc: each weight block decoded in registers once for all
    rows) = the stored-panel path bit for bit and each row its solo bits, for 4/5/8-bit weights
    with float32, float16, symmetric and K-quant scales; forced to AVX2 in a subprocess so that
    every x86 machine runs it."""
    env = dict(os.environ, MLXTERM_KERNELS="avx2")
    code = "from tests.test_kernels_rows import few_rows_check; few_rows_check()"
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]


def rows4_check() -> None:
    """One activation row against 4-bit weights with an even block count runs row by row
    (row1_rows4): the bits of the
    transposing one-row path (set_rows4(False): row1_direct4), on 1 and 2 threads, for every
    4-bit case of the few-row checks (an odd block count takes row1_direct4 either way)."""
    ext = kernels._load()
    was = ext.set_rows4(True)
    try:
        for name, (wq, s, b), bits, gs, sym in _few_row_cases():
            if bits != 4:
                continue
            k = int(wq.shape[1]) * 32 // bits
            xs = np.random.default_rng(len(name)).standard_normal((2, k)).astype(np.float32)
            xs[1, :64] = 0.0  # all-zero activation blocks
            xs[1, 64:] *= 30.0
            for i in range(2):
                x = mx.array(xs[i : i + 1])
                _on_equals_off(ext.set_rows4, lambda x=x, wq=wq, s=s, b=b, gs=gs, sym=sym: kernels.quantized_matmul(
                    x, wq, s, b, gs, 4, symmetric=sym))
                ext.set_rows4(True)
    finally:
        ext.set_rows4(was)


@pytest.mark.parametrize("isa", ["native", "avx2"])
def test_one_row_4_bit_row_by_row_gives_the_transposing_paths_bits(isa):
    """rows4_check on this CPU's widest kernels (VNNI: two vpdpbusd per row and block pair) and
    forced to AVX2 (maddubs + madd) in a subprocess, so every x86 machine runs both."""
    if isa == "native":
        rows4_check()
        return
    env = dict(os.environ, MLXTERM_KERNELS="avx2")
    code = "from tests.test_kernels_rows import rows4_check; rows4_check()"
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
