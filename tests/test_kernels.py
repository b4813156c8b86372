"""The CPU kernel extension (engine/kernels): parity with MLX's own ops, thread-count
independence, mx.compile, the model hook, the weight policy, and the engine without it."""

import os
import subprocess
import sys

from engine import kernels
from engine.kernels import hook

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest

from tests.kernel_checks import on_one_and_two_threads

needs_ext = pytest.mark.skipif(not kernels.available(), reason=f"kernels off: {kernels.status()['reason']}")


def _case(M, N, K, bits, gs, seed=0):
    rng = np.random.default_rng(seed)
    w = mx.array(rng.standard_normal((N, K)).astype(np.float32))
    x = mx.array(rng.standard_normal((M, K)).astype(np.float32))
    wq, s, b = mx.quantize(w, group_size=gs, bits=bits)
    ref = x @ mx.dequantize(wq, s, b, group_size=gs, bits=bits).T
    return x, wq, s, b, ref


def _rel(y, ref) -> float:
    return float(mx.sqrt(mx.mean((y - ref) ** 2)) / mx.sqrt(mx.mean(ref**2)))


@needs_ext
@pytest.mark.parametrize("bits", [4, 5, 8])
@pytest.mark.parametrize("gs", [32, 64, 128])
@pytest.mark.parametrize("M", [1, 3, 4, 16, 33])
def test_quantized_matmul_matches_dequantize_matmul(bits, gs, M):
    x, wq, s, b, ref = _case(M, 67, 384, bits, gs, seed=bits * 1000 + gs + M)
    exact = kernels.quantized_matmul(x, wq, s, b, gs, bits, exact=True)
    assert exact.shape == ref.shape and exact.dtype == mx.float32
    assert float(mx.abs(exact - ref).max() / mx.abs(ref).max()) < 2e-6
    fast = kernels.quantized_matmul(x, wq, s, b, gs, bits)
    # int8 activations: ~0.5% RMS (prefill sizes run float panels and stay exact, unless they
    # run on an int8 GEMM -- AMX or VNNI tiles: int8 activations as the row path, see
    # test_kernels_int8_gemm.py)
    exact_prefill = kernels.prefill_path(M) == "float panels"
    assert _rel(fast, ref) < (1e-6 if exact_prefill else 1.5e-2)


def _half_exact(a: mx.array) -> mx.array:
    return a.astype(mx.float16).astype(mx.float32)


@needs_ext
@pytest.mark.parametrize("bits", [4, 5, 8])
@pytest.mark.parametrize("M", [1, 8, 15, 16, 33])
def test_float16_scales_give_the_float32_bits(bits, M):
    """float16 scales/biases (read as such by the decode path, widened by the others) are
    the same numbers as their float32 values, so every path gives the same bits."""
    x, wq, s, b, _ = _case(M, 75, 320, bits, 32, seed=bits + M)
    s, b = _half_exact(s), _half_exact(b)
    s16, b16 = s.astype(mx.float16), b.astype(mx.float16)
    for exact in (False, True):
        y32 = kernels.quantized_matmul(x, wq, s, b, 32, bits, exact)
        y16 = kernels.quantized_matmul(x, wq, s16, b16, 32, bits, exact)
        assert mx.array_equal(y32, y16).item(), (bits, M, exact)


@needs_ext
@pytest.mark.parametrize("M", [1, 5, 20])
def test_float16_scales_in_the_fused_swiglu(M):
    gate = nn.QuantizedLinear(256, 96, bias=False, group_size=32, bits=4)
    up = nn.QuantizedLinear(256, 96, bias=False, group_size=32, bits=4)
    for lin in (gate, up):
        lin.scales, lin.biases = _half_exact(lin.scales), _half_exact(lin.biases)
    x = mx.random.normal((M, 256), key=mx.random.key(M))
    ref = [kernels.quantized_swiglu(x, gate, up, exact) for exact in (False, True)]
    assert kernels.half_scales(gate) and kernels.half_scales(up)
    assert kernels.qparams(gate)[1].dtype == mx.float16
    for exact, r in zip((False, True), ref, strict=True):
        assert mx.array_equal(kernels.quantized_swiglu(x, gate, up, exact), r).item()


@needs_ext
def test_half_scales_only_when_exact_and_while_current():
    lin = nn.QuantizedLinear(128, 40, group_size=32, bits=4)
    assert not kernels.half_scales(lin)  # random float32 scales do not fit float16
    assert kernels.qparams(lin)[1].dtype == mx.float32
    lin.scales, lin.biases = _half_exact(lin.scales), _half_exact(lin.biases)
    assert kernels.half_scales(lin)
    w, s, b = kernels.qparams(lin)
    assert s.dtype == b.dtype == mx.float16
    assert mx.array_equal(s.astype(mx.float32), lin.scales).item()
    assert "_kernel_half" not in dict(nn.utils.tree_flatten(lin.parameters()))  # not a parameter
    lin.scales = lin.scales * 2  # new weights: the stale copies are not used
    assert kernels.qparams(lin)[1] is lin.scales


@needs_ext
@pytest.mark.parametrize("bits", [4, 5, 8])
@pytest.mark.parametrize("M", [1, 8, 15, 40])
def test_symmetric_weights_skip_the_biases_with_the_same_bits(bits, M):
    """GGUF Q8_0/Q4_0/Q5_0 biases are exactly -2^(bits-1) * scale: ``symmetric`` makes every
    path derive them from the scales (no copy is kept), with the very same results; and it
    really does not read them (nonsense biases under the flag change nothing, exact too)."""
    x, wq, s, _, _ = _case(M, 75, 320, bits, 32, seed=7 * bits + M)
    s16 = s.astype(mx.float16)
    b16 = (s16.astype(mx.float32) * -(2 ** (bits - 1))).astype(mx.float16)
    y = kernels.quantized_matmul(x, wq, s16, b16, 32, bits)
    assert mx.array_equal(
        kernels.quantized_matmul(x, wq, s16, b16, 32, bits, symmetric=True), y
    ).item()
    junk = mx.zeros_like(b16)
    assert mx.array_equal(kernels.quantized_matmul(x, wq, s16, junk, 32, bits, symmetric=True), y).item()
    exact = kernels.quantized_matmul(x, wq, s16, b16, 32, bits, exact=True)
    assert mx.array_equal(kernels.quantized_matmul(x, wq, s16, junk, 32, bits, exact=True, symmetric=True),
                          exact).item()
    lin = nn.QuantizedLinear(320, 75, group_size=32, bits=bits)
    lin.weight, lin.scales, lin.biases = wq, s16.astype(mx.float32), b16.astype(mx.float32)
    assert kernels.half_scales(lin) and kernels.symmetric(lin)
    assert kernels.qparams(lin)[2] is kernels.qparams(lin)[1]  # no float16 biases kept
    lin.biases = lin.biases * 0.5  # an affine layer (and stale copies): not symmetric
    assert not kernels.symmetric(lin)
    assert kernels.half_scales(lin) and not kernels.symmetric(lin)


@needs_ext
def test_batched_and_non_contiguous_inputs():
    x, wq, s, b, _ = _case(6, 40, 256, 4, 32)
    x3 = mx.stack([x, 2 * x])  # (2, 6, 256)
    y = kernels.quantized_matmul(x3, wq, s, b, 32, 4, exact=True)
    ref = x3 @ mx.dequantize(wq, s, b, group_size=32, bits=4).T
    assert y.shape == (2, 6, 40)
    assert float(mx.abs(y - ref).max()) < 1e-3
    xt = mx.array(np.asfortranarray(np.array(x))).T.T  # strided view of the same values
    xs = mx.transpose(mx.transpose(x3, (2, 1, 0)), (2, 1, 0))
    assert mx.array_equal(kernels.quantized_matmul(xs, wq, s, b, 32, 4, exact=True), y)
    assert mx.array_equal(kernels.quantized_matmul(xt, wq, s, b, 32, 4, exact=True), y[0])


@needs_ext
def test_bad_shapes_raise():
    x, wq, s, b, _ = _case(2, 16, 128, 4, 32)
    with pytest.raises(ValueError):
        kernels.quantized_matmul(x, wq, s, b, 32, 3)
    with pytest.raises(ValueError):
        kernels.quantized_matmul(x[:, :96], wq, s, b, 32, 4)


@needs_ext
@pytest.mark.parametrize("M", [1, 2, 5, 7, 8, 9, 15, 40])  # every multi-row tiling, and dense
def test_one_and_two_threads_are_bit_identical(M):
    x, wq, s, b, _ = _case(M, 301, 512, 5, 32, seed=M)
    one, two = on_one_and_two_threads(lambda: kernels.quantized_matmul(x, wq, s, b, 32, 5))
    assert mx.array_equal(one, two)


@needs_ext
def test_runs_inside_mx_compile():
    x, wq, s, b, _ = _case(1, 96, 256, 4, 64)

    def f(x):
        return mx.tanh(kernels.quantized_matmul(x, wq, s, b, 64, 4)) * 2

    compiled = mx.compile(f)
    assert mx.array_equal(compiled(x), f(x))
    assert mx.array_equal(compiled(x + 1), f(x + 1))  # traced once, re-run on new input


@needs_ext
def test_hook_routes_quantized_layers_and_matches_mlx():
    mx.random.seed(0)
    model = nn.Sequential(nn.Linear(256, 96), nn.Linear(96 + 32, 64, bias=False))
    model.layers[1] = nn.Linear(128, 64)
    emb = nn.Embedding(50, 128)
    nn.quantize(model, group_size=32, bits=4)
    emb = nn.QuantizedEmbedding.from_embedding(emb, group_size=32, bits=8)
    x = mx.random.normal((3, 256))
    ref_hidden = model.layers[0](x)
    ref_head = emb.as_linear(mx.random.normal((2, 128), key=mx.random.key(1)))
    holder = nn.Module()
    holder.net, holder.emb = model, emb
    assert hook.install(holder) == 3
    assert type(model.layers[0]) is hook.KernelQuantizedLinear
    hidden = model.layers[0](x)
    head = emb.as_linear(mx.random.normal((2, 128), key=mx.random.key(1)))
    assert _rel(hidden, ref_hidden) < 1.5e-2 and _rel(head, ref_head) < 1.5e-2
    hook.uninstall(holder)
    assert type(model.layers[0]) is nn.QuantizedLinear


@needs_ext
def test_weight_policy_keeps_quantized_on_cpu_with_kernels():
    from engine.model.weight_policy import choose_weights

    assert choose_weights("auto") == "quantized"
    assert choose_weights("fp32") == "fp32"


def test_engine_without_extension_falls_back_and_says_so_once(tiny_llama_dir):
    """MLXTERM_KERNELS=off (as on a machine where the build failed): fp32 policy, one note,
    and a model still generates."""
    code = (
        "import engine\n"
        "from engine import kernels\n"
        "from engine.model.weight_policy import choose_weights, blas_note\n"
        "from engine.model.loader import load_bundle\n"
        "from engine.kernels import hook\n"
        "import mlx.core as mx\n"
        "assert not kernels.available()\n"
        "print(choose_weights('auto'))\n"
        "print(blas_note())\n"
        "print(blas_note())\n"
        f"b = load_bundle({str(tiny_llama_dir)!r}, 'quantized')\n"
        "assert not any(isinstance(m, hook.KernelQuantizedLinear) for _, m in b.model.named_modules())\n"
        "print(b.model(mx.array([[1, 2, 3]])).shape)\n"
    )
    env = dict(os.environ, MLXTERM_KERNELS="off")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[0] == "fp32"
    assert "CPU kernels off (turned off by MLXTERM_KERNELS=off)" in lines[1]
    assert lines[2] == "None" or "CPU kernels off" not in lines[2]
    assert lines[3].startswith("(1, 3,")


def test_requantized_q6k_stays_close():
    from engine.model.gguf.quants import dequantize, to_affine8

    rng = np.random.default_rng(3)
    raw = rng.integers(0, 256, size=(4 * 210,), dtype=np.uint8)  # 4 Q6_K blocks of 256 values
    raw = raw.reshape(4, 210)
    raw[:, 208:210] = np.frombuffer(np.float16(0.01).tobytes(), np.uint8)  # sane d
    raw = raw.reshape(-1)
    dense = dequantize(raw, "Q6_K", (2, 512))
    a = to_affine8(raw, "Q6_K", (2, 512))
    back = mx.dequantize(mx.array(a.weight), mx.array(a.scales), mx.array(a.biases), group_size=32, bits=8)
    step = np.array(a.scales)[..., None]
    err = np.abs(np.array(back).reshape(2, 16, 32) - dense.reshape(2, 16, 32))
    # half a step of rounding, plus float32 slop on values of size ~30
    assert (err <= step * 0.5 + 1e-5 * np.abs(dense).reshape(2, 16, 32).max()).all()


@pytest.fixture
def routed_attention():
    from engine.kernels import attention

    attention._active.on = True
    yield attention
    attention._active.on = False


def _attn_case(B, H, Hk, L, S, seed=0):
    k1, k2, k3 = mx.random.split(mx.random.key(seed), 3)
    return (
        mx.random.normal((B, H, L, 64), key=k1),
        mx.random.normal((B, Hk, S, 64), key=k2),
        mx.random.normal((B, Hk, S, 64), key=k3),
    )


@needs_ext
@pytest.mark.parametrize("shape", [(1, 9, 3, 1, 100), (1, 9, 3, 7, 40), (2, 4, 2, 5, 5), (1, 14, 2, 33, 70)])
# (1, 9, 3, 1, 100) is a decode step: MLX's own path, which must agree all the same
def test_attention_matches_mlx_sdpa_for_every_mask_kind(shape, routed_attention):
    attention = routed_attention
    B, H, Hk, L, S = shape
    q, k, v = _attn_case(*shape)
    window = (mx.arange(S)[None] <= mx.arange(S - L, S)[:, None]) & (
        mx.arange(S)[None] > mx.arange(S - L, S)[:, None] - 4
    )
    masks = [
        None,
        "causal",
        mx.arange(S) <= S - 3,  # a static cache's key-validity mask in the compiled decode step
        window,  # sliding window, boolean (L, S)
        mx.random.normal((L, S)),  # additive
        mx.random.uniform(shape=(B, 1, L, S), key=mx.random.key(5)) > 0.3,  # per-row (batched)
    ]
    for m in masks:
        got = attention.scaled_dot_product_attention(q, k, v, None, 0.125, m)
        ref = mx.fast.scaled_dot_product_attention(q, k, v, scale=0.125, mask=m)
        assert float(mx.abs(got - ref).max()) < 2e-6, m


@needs_ext
def test_attention_falls_back_for_what_it_does_not_handle(monkeypatch, routed_attention):
    attention = routed_attention
    calls = []
    monkeypatch.setattr(attention, "_original", lambda *a: calls.append(a) or "mlx")
    q, k, v = _attn_case(1, 4, 2, 3, 8)
    per_head = mx.zeros((1, 4, 3, 8))  # differs per head: not this kernel's shape
    assert attention.scaled_dot_product_attention(q, k, v, None, 1.0, per_head) == "mlx"
    assert attention.scaled_dot_product_attention(q.astype(mx.float16), k, v, None, 1.0, None) == "mlx"
    assert attention.scaled_dot_product_attention(q, k, v, None, 1.0, None, sinks=mx.zeros((4,))) == "mlx"
    assert len(calls) == 3
    attention._active.on = False  # outside a routed model's forward pass: mlx_lm's own
    assert attention.scaled_dot_product_attention(q, k, v, None, 1.0, None) == "mlx"


@needs_ext
def test_attention_inside_compile_matches(routed_attention):
    attention = routed_attention
    q, k, v = _attn_case(1, 6, 2, 4, 64)  # 3 query heads per KV head x 4 rows: the kernel path
    valid = mx.arange(64) <= 40

    def f(q, k, v):
        return attention.scaled_dot_product_attention(q, k, v, None, 0.125, valid)

    ref = mx.fast.scaled_dot_product_attention(q, k, v, scale=0.125, mask=valid)
    assert float(mx.abs(mx.compile(f)(q, k, v) - ref).max()) < 2e-6


@needs_ext
@pytest.mark.parametrize("isa", ["avx2", "avxvnni"])
def test_narrower_instruction_sets_agree(isa):
    """The AVX2-only (maddubs) and AVX-VNNI paths, as CPUs without AVX512-VNNI run them."""
    code = (
        "import engine, sys\n"
        "import mlx.core as mx\n"
        "from engine import kernels\n"
        "from tests.test_kernels import _case, _rel\n"
        "print(kernels.status()['isa'])\n"
        "for bits in (4, 5, 8):\n"
        "    for M in (1, 5):\n"
        "        x, wq, s, b, ref = _case(M, 45, 256, bits, 64, seed=bits + M)\n"
        "        e = kernels.quantized_matmul(x, wq, s, b, 64, bits, exact=True)\n"
        "        f = kernels.quantized_matmul(x, wq, s, b, 64, bits)\n"
        "        assert _rel(e, ref) < 1e-6 and _rel(f, ref) < 1.5e-2, (bits, M, _rel(f, ref))\n"
        "        h = [a.astype(mx.float16) for a in (s, b)]\n"
        "        s, b = [a.astype(mx.float32) for a in h]\n"
        "        f = kernels.quantized_matmul(x, wq, s, b, 64, bits)\n"
        "        assert mx.array_equal(kernels.quantized_matmul(x, wq, *h, 64, bits), f).item()\n"
    )
    env = dict(os.environ, MLXTERM_KERNELS=isa)
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    if isa == "avx2":
        assert out.stdout.strip() == "avx2"
