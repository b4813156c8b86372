"""K-quant scale records (engine/kernels/kscales.py, QmmProblem::kscales): the float32 scales
and biases of a GGUF Q4_K/Q5_K found back as d * sc and -(dmin * m), and every kernel path
reading the records gives the bits of the float32 arrays; plus the symmetric 8-bit re-quantization
of Q6_K (quants.to_affine8)."""

from engine import kernels
from engine.kernels import hook, kscales
from engine.model.gguf import quants

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest

from tests.test_gguf_quants import enc_q6_k, make_blocks

needs_ext = pytest.mark.skipif(not kernels.available(), reason=f"kernels off: {kernels.status()['reason']}")


def _kquant(name: str, rows: int, cols: int) -> quants.AffineWeights:
    raw, _ = make_blocks(name, rows * cols // 256)
    return quants.to_affine(raw, name, (rows, cols))


@pytest.mark.parametrize("name", ["Q4_K", "Q5_K"])
def test_records_give_back_the_float32_scales_bit_for_bit(name):
    a = _kquant(name, 6, 768)
    rec = kscales.pack(a.scales, a.biases)
    assert rec is not None and rec.dtype == np.uint8
    assert rec.shape == (6, 768 // 256 * kscales.RECORD_BYTES)
    s, b = kscales.unpack(rec)
    np.testing.assert_array_equal(s.view(np.uint32), a.scales.view(np.uint32))
    np.testing.assert_array_equal(b.view(np.uint32), a.biases.view(np.uint32))


def test_scales_without_a_k_quant_form_are_refused():
    rng = np.random.default_rng(3)
    s = rng.uniform(0.01, 0.1, (4, 16)).astype(np.float32)  # not d * small integers
    b = -s * 3
    assert kscales.pack(s, b) is None
    a = _kquant("Q4_K", 2, 512)
    assert kscales.pack(a.scales[:, :12], a.biases[:, :12]) is None  # not whole super-blocks
    bad = a.biases.copy()
    bad[0, 5] = np.nextafter(bad[0, 5], np.float32(1))  # one bias off by an ulp
    assert kscales.pack(a.scales, bad) is None


def test_factor_handles_zero_rows_and_small_largest_values():
    v = np.zeros((3, 8), np.float32)
    d16 = np.float32(np.float16(0.0123))
    v[1] = d16 * np.array([1, 2, 3, 0, 0, 5, 7, 2], np.float32)  # largest q 7, not 63
    v[2] = d16 * np.array([63, 0, 1, 62, 9, 9, 9, 9], np.float32)
    d, q = kscales.factor(v)
    np.testing.assert_array_equal((d[:, None] * q.astype(np.float32)).view(np.uint32), v.view(np.uint32))


@needs_ext
@pytest.mark.parametrize("name", ["Q4_K", "Q5_K"])
def test_the_extension_packs_the_same_bytes_as_the_reference(name):
    ext = kernels._required()
    a = _kquant(name, 9, 1024)
    want = kscales.pack(a.scales, a.biases)
    got = ext.kscales_pack(mx.array(a.scales), mx.array(a.biases))
    np.testing.assert_array_equal(np.array(got), want)
    rng = np.random.default_rng(5)
    s = rng.uniform(0.01, 0.1, (4, 16)).astype(np.float32)
    assert ext.kscales_pack(mx.array(s), mx.array(-3 * s)).size == 0  # no K-quant form
    bad = a.biases.copy()
    bad[2, 3] = np.nextafter(bad[2, 3], np.float32(1))
    assert ext.kscales_pack(mx.array(a.scales), mx.array(bad)).size == 0
    zero_sign = a.biases.copy()
    zero_sign[zero_sign == 0] = 0.0  # +0.0 where -(dmin * 0) gives -0.0
    if np.any(a.biases.view(np.uint32) != zero_sign.view(np.uint32)):
        assert ext.kscales_pack(mx.array(a.scales), mx.array(zero_sign)).size == 0
        assert kscales.pack(a.scales, zero_sign) is None


def _records(a: quants.AffineWeights) -> tuple[mx.array, ...]:
    rec = mx.array(kscales.pack(a.scales, a.biases))
    return mx.array(a.weight), mx.array(a.scales), mx.array(a.biases), rec


@needs_ext
@pytest.mark.parametrize("name,bits", [("Q4_K", 4), ("Q5_K", 5)])
@pytest.mark.parametrize("M", [1, 3, 8, 15, 16, 33])
def test_matmul_on_records_gives_the_float32_bits(name, bits, M):
    a = _kquant(name, 75, 512)
    w, s, b, rec = _records(a)
    x = mx.random.normal((M, 512), key=mx.random.key(M))
    for exact in (False, True):
        y32 = kernels.quantized_matmul(x, w, s, b, 32, bits, exact)
        yk = kernels.quantized_matmul(x, w, rec, rec, 32, bits, exact)
        assert mx.array_equal(y32, yk).item(), (M, exact)
    ref = x @ mx.dequantize(w, s, b, group_size=32, bits=bits).T
    exact = kernels.quantized_matmul(x, w, rec, rec, 32, bits, True)
    assert float(mx.abs(exact - ref).max() / mx.abs(ref).max()) < 2e-6


@needs_ext
def test_records_of_the_wrong_shape_are_an_error():
    a = _kquant("Q4_K", 8, 512)
    w, _, _, rec = _records(a)
    x = mx.zeros((1, 512))
    with pytest.raises(ValueError, match="K-quant scales"):
        kernels.quantized_matmul(x, w, rec[:, :-1], rec[:, :-1], 32, 4)
    with pytest.raises(ValueError, match="K-quant scales"):
        kernels.quantized_matmul(x, w, rec, rec, 64, 4)


def _linear(a: quants.AffineWeights, bits: int) -> nn.QuantizedLinear:
    n, k = a.scales.shape[0], a.scales.shape[1] * 32
    lin = nn.QuantizedLinear(k, n, bias=False, group_size=32, bits=bits)
    lin.weight, lin.scales, lin.biases = mx.array(a.weight), mx.array(a.scales), mx.array(a.biases)
    return lin


@needs_ext
@pytest.mark.parametrize("M", [1, 5, 20])
def test_k_scales_in_the_layer_and_the_fused_swiglu(M):
    gate, up = _linear(_kquant("Q4_K", 96, 512), 4), _linear(_kquant("Q4_K", 96, 512), 4)
    x = mx.random.normal((M, 512), key=mx.random.key(10 + M))
    ref = [kernels.quantized_swiglu(x, gate, up, exact) for exact in (False, True)]
    ref_lin = kernels.quantized_matmul(x, *kernels.qparams(gate), 32, 4)
    assert kernels.compact_scales(gate) == "kquant" and kernels.k_scales(up)
    assert kernels.qparams(gate)[1].dtype == mx.uint8
    for exact, r in zip((False, True), ref, strict=True):
        assert mx.array_equal(kernels.quantized_swiglu(x, gate, up, exact), r).item()
    assert mx.array_equal(kernels.quantized_matmul(x, *kernels.qparams(gate), 32, 4), ref_lin).item()
    gate.scales = gate.scales * 2  # new weights: the stale records are not used
    assert kernels.qparams(gate)[1] is gate.scales


@needs_ext
def test_k_scales_only_for_k_quant_layers():
    lin = nn.QuantizedLinear(512, 40, group_size=32, bits=4)  # mx.quantize's float32 scales
    assert not kernels.k_scales(lin)
    assert kernels.qparams(lin)[1].dtype == mx.float32
    lin8 = nn.QuantizedLinear(512, 40, group_size=32, bits=8)
    assert not kernels.k_scales(lin8)


@needs_ext
def test_hook_gives_k_quant_layers_records():
    class Tiny(nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = nn.Linear(512, 64, bias=False)

    m = Tiny()
    nn.quantize(m, group_size=32, bits=4)
    a = _kquant("Q4_K", 64, 512)
    m.proj.weight, m.proj.scales, m.proj.biases = mx.array(a.weight), mx.array(a.scales), mx.array(a.biases)
    x = mx.random.normal((1, 512), key=mx.random.key(0))
    want = kernels.quantized_matmul(x, m.proj.weight, m.proj.scales, m.proj.biases, 32, 4)
    hook.install(m)
    assert kernels.qparams(m.proj)[1].dtype == mx.uint8
    assert mx.array_equal(m.proj(x), want).item()


def test_q6_k_requantizes_to_symmetric_8_bit_with_float16_scales():
    raw, _ = make_blocks("Q6_K", 8)
    dense = quants.dequantize(raw, "Q6_K", (4, 512))
    a = quants.to_affine8(raw, "Q6_K", (4, 512))
    assert a.bits == 8 and a.scales.dtype == np.float32
    np.testing.assert_array_equal(a.scales.astype(np.float16).astype(np.float32), a.scales)
    np.testing.assert_array_equal(a.biases, np.float32(-128) * a.scales)
    back = np.array(mx.dequantize(mx.array(a.weight), mx.array(a.scales), mx.array(a.biases), group_size=32, bits=8))
    g = dense.reshape(-1, 32)
    err = np.abs(back.reshape(-1, 32) - g).max(axis=1)
    # half a step of max|w| / 127 (the float16 rounding of the scale moves it by < 0.1%)
    assert np.all(err <= np.abs(g).max(axis=1) / 127 * 0.502 + 1e-12)


def test_requantization_falls_back_to_affine_when_a_scale_overflows_float16():
    blk, _ = enc_q6_k(60000.0, [127] * 16, [0, 63] * 128)  # max|w| / 127 > float16's largest
    raw = np.frombuffer(blk, np.uint8)
    dense = quants.dequantize(raw, "Q6_K", (1, 256))
    a = quants.to_affine8(raw, "Q6_K", (1, 256))
    assert not np.all(a.biases == np.float32(-128) * a.scales)  # min/max affine, float32
    back = np.array(mx.dequantize(mx.array(a.weight), mx.array(a.scales), mx.array(a.biases), group_size=32, bits=8))
    assert np.abs(back - dense).max() <= np.abs(dense).max() * 2 / 255 * 0.51


def _qwen2_kquant(seed: int = 4) -> nn.Module:
    """A random qwen2 model (256 wide: every K a multiple of 256) whose 4-bit layers and
    embedding have Q4_K-form scales and biases (float16 d, dmin per super-block, 6-bit sc, m
    per group)."""
    import importlib

    module = importlib.import_module("mlx_lm.models.qwen2")
    args = module.ModelArgs(model_type="qwen2", hidden_size=256, num_hidden_layers=2, num_attention_heads=4,
                            num_key_value_heads=2, intermediate_size=512, vocab_size=96, rms_norm_eps=1e-6,
                            rope_theta=1e6, tie_word_embeddings=False)
    mx.random.seed(seed)
    m = module.Model(args)
    nn.quantize(m, group_size=32, bits=4)
    rng = np.random.default_rng(seed)
    for _, lin in m.named_modules():
        if isinstance(lin, (nn.QuantizedLinear, nn.QuantizedEmbedding)):
            n, ng = lin.scales.shape
            d = rng.uniform(0.0005, 0.002, (n, ng // 8, 1)).astype(np.float16).astype(np.float32)
            dmin = rng.uniform(0.001, 0.004, (n, ng // 8, 1)).astype(np.float16).astype(np.float32)
            sc = rng.integers(0, 64, (n, ng // 8, 8)).astype(np.float32)
            mn = rng.integers(0, 64, (n, ng // 8, 8)).astype(np.float32)
            lin.scales = mx.array((d * sc).reshape(n, ng))
            lin.biases = mx.array((-(dmin * mn)).reshape(n, ng))
    mx.eval(m.parameters())
    return m


@needs_ext
def test_decoder_layers_on_records_give_the_float32_bits():
    """The hook's decoder-layer primitives (norm_qkv_rope, attn_out_mlp, SwiGLU, the head) read
    the records for every K-quant layer and give the float32 arrays' logits bit for bit, at
    decode and prompt sizes."""
    from mlx_lm.models.cache import make_prompt_cache

    m = _qwen2_kquant()
    hook.install(m)
    lins = [lin for _, lin in m.named_modules() if isinstance(lin, nn.QuantizedLinear)]
    assert all(kernels.qparams(lin)[1].dtype == mx.uint8 for lin in lins)
    records = {id(lin): lin.__dict__["_kernel_half"] for lin in lins}

    def run(use_records: bool) -> list[mx.array]:
        for lin in lins:
            if use_records:
                object.__setattr__(lin, "_kernel_half", records[id(lin)])
            else:
                lin.__dict__.pop("_kernel_half", None)
        outs = []
        for n in (5, 20):  # decode-sized rows, then a prompt-sized forward
            cache = make_prompt_cache(m)
            tokens = mx.array([[(7 * i + n) % 96 for i in range(n)]])
            outs.append(m(tokens, cache=cache))
            outs.append(m(mx.array([[3]]), cache=cache))  # one decode step after it
        mx.eval(outs)
        return outs

    with_records, without = run(True), run(False)
    assert kernels.qparams(lins[0])[1].dtype == mx.float32  # the second run really read float32
    for a, b in zip(with_records, without, strict=True):
        assert mx.array_equal(a, b).item()


@pytest.mark.parametrize("name", ["Q4_K", "Q5_K"])
def test_unpack_in_mlx_gives_the_reference_bits(name):
    a = _kquant(name, 6, 768)
    rec = kscales.pack(a.scales, a.biases)
    s, b = kscales.unpack_mx(mx.array(rec))
    assert s.dtype == mx.float32 and s.shape == a.scales.shape
    np.testing.assert_array_equal(np.array(s).view(np.uint32), a.scales.view(np.uint32))
    np.testing.assert_array_equal(np.array(b).view(np.uint32), a.biases.view(np.uint32))
    rows = mx.array([[2, 0], [5, 5]])  # an embedding lookup's rows: leading dimensions kept
    s2, b2 = kscales.unpack_mx(mx.array(rec)[rows])
    assert s2.shape == (2, 2, a.scales.shape[1])
    np.testing.assert_array_equal(np.array(b2).view(np.uint32), a.biases[np.array(rows)].view(np.uint32))


@needs_ext
def test_hook_releases_the_float32_scales_and_keeps_every_value(monkeypatch):
    """With compact copies made, the hook drops the layers' float32 scales and biases
    (release_float_scales): the modules then hold expressions of the copies, the same bits; the
    logits (prompt and decode, the embedding looked up from the records) are those of the model
    that keeps them, and the live arrays shrink by about the float32 arrays' bytes."""
    import gc

    from mlx_lm.models.cache import make_prompt_cache

    kept, released = _qwen2_kquant(), _qwen2_kquant()
    monkeypatch.setattr(hook, "RELEASE_FLOAT_SCALES", False)
    hook.install(kept)
    monkeypatch.setattr(hook, "RELEASE_FLOAT_SCALES", True)
    layers = [m for _, m in released.named_modules() if isinstance(m, (nn.QuantizedLinear, nn.QuantizedEmbedding))]
    f32 = sum(m.scales.nbytes + m.biases.nbytes for m in layers)
    gc.collect()
    before = mx.get_active_memory()
    hook.install(released)
    gc.collect()
    added = sum(kernels.qparams(m)[1].nbytes for m in layers)  # the records (one array per layer)
    assert before - mx.get_active_memory() >= (f32 - added) // 2

    pairs = zip((m for _, m in kept.named_modules()), (m for _, m in released.named_modules()), strict=True)
    for a, b in pairs:
        if isinstance(b, (nn.QuantizedLinear, nn.QuantizedEmbedding)):
            assert kernels.qparams(b)[1].dtype == mx.uint8, type(b)
            for key in ("scales", "biases"):
                np.testing.assert_array_equal(np.array(b[key]).view(np.uint32), np.array(a[key]).view(np.uint32))

    def run(m: nn.Module) -> list[mx.array]:
        cache = make_prompt_cache(m)
        outs = [m(mx.array([[(5 * i + 1) % 96 for i in range(20)]]), cache=cache)]
        outs.append(m(mx.array([[3]]), cache=cache))
        return outs

    for a, b in zip(run(kept), run(released), strict=True):
        assert mx.array_equal(a, b).item()
