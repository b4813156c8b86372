"""The decode step's fused CPU primitives (engine/kernels/src/fused.cpp): RMSNorm and RoPE
against MLX's own ops and a float64 reference, thread-count independence, mx.compile with an
array offset (the compiled decode step), the hook routing and its off switch (which also keeps
the decoder layers of test_kernels_decoder op by op)."""

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


def _rope_ref(x: np.ndarray, dims: int, traditional: bool, base: float, scale: float, offsets) -> np.ndarray:
    """Rotary embedding in float64, straight from its definition."""
    B, H, T, D = x.shape
    x = x.astype(np.float64)
    out = x.copy()
    half = dims // 2
    inv = base ** (-np.arange(half) / half)
    for b in range(B):
        theta = ((offsets[b] + np.arange(T)) * scale)[:, None] * inv[None, :]  # (T, half)
        c, s = np.cos(theta), np.sin(theta)
        if traditional:
            x1, x2 = x[b, :, :, 0:dims:2], x[b, :, :, 1:dims:2]
            out[b, :, :, 0:dims:2] = x1 * c - x2 * s
            out[b, :, :, 1:dims:2] = x1 * s + x2 * c
        else:
            x1, x2 = x[b, :, :, :half], x[b, :, :, half:dims]
            out[b, :, :, :half] = x1 * c - x2 * s
            out[b, :, :, half:dims] = x1 * s + x2 * c
    return out


@needs_ext
@pytest.mark.parametrize("shape", [(1, 1, 576), (2, 3, 7, 896), (5, 13), (1, 700, 64)])
def test_rms_norm_matches_mlx(shape):
    rng = np.random.default_rng(len(shape))
    x = mx.array(rng.standard_normal(shape).astype(np.float32) * 3)
    w = mx.array(rng.standard_normal(shape[-1]).astype(np.float32))
    y = kernels.rms_norm(x, w, 1e-5)
    ref = mx.fast.rms_norm(x, w, 1e-5)
    assert y.shape == ref.shape and y.dtype == mx.float32
    assert float(mx.abs(y - ref).max()) < 1e-5 * float(mx.abs(ref).max())


@needs_ext
def test_rms_norm_strided_input_and_bad_shapes():
    x = mx.random.normal((4, 6, 64), key=mx.random.key(1)).transpose(1, 0, 2)  # a non-contiguous view
    w = mx.random.normal((64,), key=mx.random.key(2))
    assert mx.allclose(kernels.rms_norm(x, w, 1e-6), mx.fast.rms_norm(x, w, 1e-6), atol=1e-5)
    with pytest.raises(ValueError):
        kernels.rms_norm(x, w[:63], 1e-6)
    with pytest.raises(ValueError):
        kernels.rms_norm(x.astype(mx.float16), w, 1e-6)


@needs_ext
@pytest.mark.parametrize("traditional", [False, True])
@pytest.mark.parametrize("dims", [64, 48])
@pytest.mark.parametrize("offset", [0, 17, 1500, "array", "per-row"])
def test_rope_matches_reference_and_mlx(traditional, dims, offset):
    rng = np.random.default_rng(dims + len(str(offset)))
    # (B, T, H, D) transposed to (B, H, T, D): the strided view attention layers pass in
    xn = rng.standard_normal((2, 5, 3, 64)).astype(np.float32)
    x = mx.array(xn).transpose(0, 2, 1, 3)
    if offset == "array":
        off, offs = mx.array(901), [901, 901]
    elif offset == "per-row":
        off, offs = mx.array([4, 1200]), [4, 1200]
    else:
        off, offs = offset, [offset, offset]
    kw = dict(traditional=traditional, base=100000.0, scale=1.0)
    y = kernels.rope(x, dims, offset=off, **kw)
    ref = _rope_ref(xn.transpose(0, 2, 1, 3), dims, traditional, 100000.0, 1.0, offs)
    # float64 tables: as exact as float32 output allows, at any position
    assert float(np.abs(np.array(y) - ref).max()) < 2e-6
    mlx = mx.fast.rope(x, dims, offset=off, **kw)
    # MLX builds its angle table in float32 (error ~ position * 6e-8), hence the looser bound
    assert float(mx.abs(y - mlx).max()) < 1e-6 + 3e-7 * max(offs)
    if dims < 64:  # features past `dims` pass through untouched
        assert mx.array_equal(y[..., dims:], x[..., dims:])


@needs_ext
def test_rope_scale_and_base():
    xn = np.random.default_rng(3).standard_normal((1, 2, 4, 32)).astype(np.float32)
    y = kernels.rope(mx.array(xn), 32, traditional=False, base=10000.0, scale=0.25, offset=40)
    ref = _rope_ref(xn, 32, False, 10000.0, 0.25, [40])
    assert float(np.abs(np.array(y) - ref).max()) < 2e-6


@needs_ext
def test_rope_bad_input():
    with pytest.raises(ValueError):
        kernels.rope(mx.zeros((2, 3, 64)), 64, traditional=False, base=1e4, scale=1.0, offset=0)
    with pytest.raises(ValueError):
        kernels.rope(mx.zeros((1, 2, 3, 64)), 65, traditional=False, base=1e4, scale=1.0, offset=0)
    with pytest.raises(ValueError):
        kernels.rope(mx.zeros((2, 2, 3, 64)), 64, traditional=False, base=1e4, scale=1.0, offset=mx.array([1, 2, 3]))


@needs_ext
def test_one_and_two_threads_are_bit_identical():
    x = mx.random.normal((1, 9, 300, 64), key=mx.random.key(4))  # enough rows for several chunks
    w = mx.random.normal((64,), key=mx.random.key(5))
    one, two = on_one_and_two_threads(
        lambda: (kernels.rms_norm(x, w, 1e-5), kernels.rope(x, 64, traditional=False, base=1e4, scale=1.0, offset=9)))
    assert mx.array_equal(one[0], two[0]) and mx.array_equal(one[1], two[1])


@needs_ext
def test_inside_compile_with_an_array_offset():
    """The compiled decode step passes the position as an array: one trace serves every step."""
    w = mx.random.normal((64,), key=mx.random.key(6))

    def step(x, pos):
        return kernels.rope(kernels.rms_norm(x, w, 1e-5), 64, traditional=False, base=1e4, scale=1.0, offset=pos)

    compiled = mx.compile(step)
    x = mx.random.normal((1, 3, 1, 64), key=mx.random.key(7))
    for p in (5, 6, 700):
        assert mx.array_equal(compiled(x, mx.array(p)), step(x, mx.array(p)))
        ref = mx.fast.rope(mx.fast.rms_norm(x, w, 1e-5), 64, traditional=False, base=1e4, scale=1.0, offset=p)
        assert mx.allclose(compiled(x, mx.array(p)), ref, atol=5e-4)


class _Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = nn.RMSNorm(64)
        self.rope = nn.RoPE(64, base=1e4)
        self.proj = nn.QuantizedLinear(64, 64, group_size=32, bits=4)

    def __call__(self, x, offset=0):
        h = self.proj(self.norm(x))
        return self.rope(h.reshape(1, 1, -1, 64), offset=offset)


@needs_ext
def test_hook_routes_norm_and_rope_and_back(monkeypatch):
    monkeypatch.setattr(hook, "FUSED", True)
    m = _Block()
    x = mx.random.normal((1, 3, 64), key=mx.random.key(8))
    before = m(x, offset=10)
    hook.install(m)
    assert type(m.norm) is hook.KernelRMSNorm and type(m.rope) is hook.KernelRoPE
    routed = m(x, offset=10)
    assert float(mx.abs(routed - before).max()) < 0.05 * float(mx.abs(before).max())  # int8 activations
    hook.uninstall(m)
    assert type(m.norm) is nn.RMSNorm and type(m.rope) is nn.RoPE
    assert mx.array_equal(m(x, offset=10), before)


@needs_ext
def test_hook_leaves_other_dtypes_and_subclasses_to_mlx(monkeypatch):
    monkeypatch.setattr(hook, "FUSED", True)

    class GemmaLikeNorm(nn.RMSNorm):  # a subclass with its own formula must keep it
        def __call__(self, x):
            return mx.fast.rms_norm(x, 1.0 + self.weight, self.eps)

    holder = nn.Module()
    holder.a, holder.b = nn.RMSNorm(32), GemmaLikeNorm(32)
    hook.install(holder)
    assert type(holder.a) is hook.KernelRMSNorm and type(holder.b) is GemmaLikeNorm
    x16 = mx.random.normal((2, 32), key=mx.random.key(9)).astype(mx.float16)
    assert mx.array_equal(holder.a(x16), mx.fast.rms_norm(x16, holder.a.weight, 1e-5))  # MLX's op
    hook.uninstall(holder)


@needs_ext
def test_fused_switch_keeps_mlx_ops():
    # FUSED off leaves the single ops (RMSNorm, RoPE) and the decoder layers as MLX has them.
    code = (
        "import mlx.nn as nn\n"
        "from mlx_lm.models import llama\n"
        "from engine.kernels import hook\n"
        "hook.FUSED = False\n"
        "h = nn.Module(); h.n = nn.RMSNorm(8); h.r = nn.RoPE(8)\n"
        "a = llama.ModelArgs(model_type='llama', hidden_size=64, num_hidden_layers=1, intermediate_size=96,"
        " num_attention_heads=2, rms_norm_eps=1e-5, vocab_size=32)\n"
        "h.m = llama.Model(a); nn.quantize(h.m, group_size=32, bits=4)\n"
        "hook.install(h)\n"
        "print(type(h.n).__name__, type(h.r).__name__, type(h.m.layers[0]).__name__)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["RMSNorm", "RoPE", "TransformerBlock"]


def _qlinear(n_out: int, n_in: int, bits: int, seed: int) -> nn.QuantizedLinear:
    mx.random.seed(seed)
    return nn.QuantizedLinear(n_in, n_out, bias=False, group_size=32, bits=bits)


@needs_ext
@pytest.mark.parametrize("bits", [4, 5, 8])
@pytest.mark.parametrize("M", [1, 3, 16, 21])
@pytest.mark.parametrize("exact", [False, True])
def test_quantized_swiglu_matches_its_parts(bits, M, exact):
    """Same per-column kernels as quantized_matmul (M < 16 int8 or exact, M >= 16 float panels)."""
    g, u = _qlinear(202, 256, bits, 1), _qlinear(202, 256, bits, 2)
    x = mx.random.normal((M, 256), key=mx.random.key(M))
    y = kernels.quantized_swiglu(x, g, u, exact=exact)

    def qmm(m):
        return kernels.quantized_matmul(x, m["weight"], m["scales"], m["biases"], 32, bits, exact=exact)

    ref = nn.silu(qmm(g)) * qmm(u)
    assert y.shape == (M, 202) and y.dtype == mx.float32
    assert float(mx.abs(y - ref).max()) < 1e-6 * float(mx.abs(ref).max())
    if exact:  # and against MLX's own dequantize + matmul
        dq = lambda m: mx.dequantize(m["weight"], m["scales"], m["biases"], 32, bits)  # noqa: E731
        mlx = nn.silu(x @ dq(g).T) * (x @ dq(u).T)
        assert float(mx.abs(y - mlx).max()) < 1e-5 * float(mx.abs(mlx).max())


@needs_ext
@pytest.mark.skipif(kernels.prefill_path(20) not in ("amx", "vnni512"),
                    reason="CPU feature missing: no int8 many-row path here (AMX or AVX512-VNNI), so "
                           "a prefill pass rounds activations differently from a decode row")
@pytest.mark.parametrize("bits", [4, 8])
def test_quantized_swiglu_row_is_the_same_in_any_pass(bits):
    """A row's SwiGLU output has the same bits alone (decode), among 5 rows (a verify step) and
    among 20 (a prefill chunk on the int8 GEMM): the matmul rows are equal by construction, and
    the activation is the same 8-lane silu on both paths (it was std::exp per element on the
    per-row path), so a reply does not depend on how its prompt was cut into chunks. N = 202
    leaves a ragged tail in every column chunk."""
    g, u = _qlinear(202, 256, bits, 1), _qlinear(202, 256, bits, 2)
    x = mx.random.normal((20, 256), key=mx.random.key(7)) * 3
    whole = kernels.quantized_swiglu(x, g, u)
    five = kernels.quantized_swiglu(x[5:10], g, u)
    assert mx.array_equal(whole[5:10], five).item()
    for m in (0, 7, 19):
        assert mx.array_equal(whole[m : m + 1], kernels.quantized_swiglu(x[m : m + 1], g, u)).item()


@needs_ext
def test_quantized_swiglu_threads_compile_and_bad_shapes():
    g, u = _qlinear(300, 128, 4, 3), _qlinear(300, 128, 4, 4)
    x = mx.random.normal((1, 1, 128), key=mx.random.key(5))
    one, two = on_one_and_two_threads(lambda: kernels.quantized_swiglu(x, g, u))
    assert mx.array_equal(one, two)
    compiled = mx.compile(lambda x: kernels.quantized_swiglu(x, g, u))
    assert mx.array_equal(compiled(x), one) and mx.array_equal(compiled(x + 1), kernels.quantized_swiglu(x + 1, g, u))
    with pytest.raises(ValueError):
        kernels.quantized_swiglu(x, g, _qlinear(64, 128, 4, 5))
    with pytest.raises(ValueError):
        kernels.quantized_swiglu(mx.zeros((1, 96)), g, u)


@needs_ext
def test_hook_routes_llama_and_qwen2_mlps(monkeypatch):
    monkeypatch.setattr(hook, "FUSED", True)
    from mlx_lm.models import llama, qwen2

    args = llama.ModelArgs(model_type="llama", hidden_size=64, num_hidden_layers=1, intermediate_size=96,
                           num_attention_heads=2, rms_norm_eps=1e-5, vocab_size=32)
    for mod, mlp in ((llama, llama.MLP(args)), (qwen2, qwen2.MLP(64, 96))):
        nn.quantize(mlp, group_size=32, bits=4)
        x = mx.random.normal((1, 1, 64), key=mx.random.key(6))
        holder = nn.Module()
        holder.mlp = mlp
        hook.install(holder)
        assert type(mlp).__name__ == "KernelMLP" and isinstance(mlp, mod.MLP)
        routed = mlp(x)
        parts = mlp.down_proj(nn.silu(mlp.gate_proj(x)) * mlp.up_proj(x))
        assert float(mx.abs(routed - parts).max()) < 1e-5 * float(mx.abs(parts).max())
        hook.uninstall(holder)
        assert type(mlp) is mod.MLP


@needs_ext
def test_hook_mlp_with_biases_or_mixed_formats_keeps_mlx_path(monkeypatch):
    monkeypatch.setattr(hook, "FUSED", True)
    from mlx_lm.models import qwen2

    x = mx.random.normal((1, 2, 64), key=mx.random.key(10))
    for bias, bits_up in ((True, 4), (False, 8)):
        mlp = qwen2.MLP(64, 96)
        mlp.gate_proj = nn.QuantizedLinear(64, 96, bias=bias, group_size=32, bits=4)
        mlp.up_proj = nn.QuantizedLinear(64, 96, bias=bias, group_size=32, bits=bits_up)
        mlp.down_proj = nn.QuantizedLinear(96, 64, bias=False, group_size=32, bits=4)
        holder = nn.Module()
        holder.mlp = mlp
        hook.install(holder)
        assert not hook._swiglu_fits(mlp, x)
        parts = mlp.down_proj(nn.silu(mlp.gate_proj(x)) * mlp.up_proj(x))
        assert mx.array_equal(mlp(x), parts)  # the base class's forward, bit for bit
