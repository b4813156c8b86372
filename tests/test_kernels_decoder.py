"""The decoder-layer primitives (engine/kernels/src/decoder.cpp): ``norm_qkv_rope`` and
``attn_out_mlp`` against the single fused ops they replace (bit for bit) and a float64
reference of the layer, 1 vs 2 threads, mx.compile with an array offset, and the hook's
routing of llama/qwen2 decoder layers (on the CPU only, decode- and prefill-sized inputs,
bit-identical to the layer op by op: the compiled decode step, a row of a batch and a speculative verify
forward see the same numbers as before). The ``hook.FUSED`` switch is tested for the layers
and the single ops at once in test_kernels_fused."""

from engine import kernels
from engine.kernels import hook

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest

from tests.kernel_checks import on_one_and_two_threads

needs_ext = pytest.mark.skipif(not kernels.available(), reason=f"kernels off: {kernels.status()['reason']}")


def _random_model(arch: str, seed: int, layers: int, **args) -> nn.Module:
    """A random-weight mlx_lm ``arch`` model: 128 wide, 4 query heads, 96 tokens, tied embeddings."""
    import importlib

    module = importlib.import_module(f"mlx_lm.models.{arch}")
    margs = module.ModelArgs(
        model_type=arch, hidden_size=128, num_hidden_layers=layers, num_attention_heads=4,
        vocab_size=96, tie_word_embeddings=True, **args,
    )
    mx.random.seed(seed)
    return module.Model(margs)


def _llama(bits_o: int = 4, bits_down: int = 4, layers: int = 2):
    m = _random_model(
        "llama", 3, layers, intermediate_size=192, num_key_value_heads=2, rms_norm_eps=1e-5,
        rope_theta=10000.0,
    )
    nn.quantize(m, group_size=32, bits=4)
    for layer in m.layers:  # mixed formats, as K-quant GGUFs load
        layer.self_attn.o_proj = _requant(layer.self_attn.o_proj, bits_o)
        layer.mlp.down_proj = _requant(layer.mlp.down_proj, bits_down)
    mx.eval(m.parameters())
    return m


def _qwen2(layers: int = 2):
    m = _random_model(
        "qwen2", 4, layers, intermediate_size=160, num_key_value_heads=1, rms_norm_eps=1e-6,
        rope_theta=1e6,
    )
    for layer in m.layers:  # q/k/v carry biases in qwen2: give them non-zero values
        for p in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
            p.bias = mx.random.normal(p.bias.shape) * 0.5
    nn.quantize(m, group_size=32, bits=4)
    mx.eval(m.parameters())
    return m


def _requant(lin: nn.QuantizedLinear, bits: int) -> nn.QuantizedLinear:
    if bits == lin.bits:
        return lin
    w = mx.dequantize(lin.weight, lin.scales, lin.biases, lin.group_size, lin.bits)
    q = nn.QuantizedLinear(w.shape[1], w.shape[0], bias=False, group_size=32, bits=bits)
    q.weight, q.scales, q.biases = mx.quantize(w, group_size=32, bits=bits)
    return q


def _ops_forward(model, *args, **kw):
    """The same model forward with its layers op by op (single fused ops still routed)."""
    hook.remove_blocks(model)
    try:
        return model(*args, **kw)
    finally:
        hook.install(model)


@pytest.fixture
def fused_on(monkeypatch):
    monkeypatch.setattr(hook, "FUSED", True)


def _block_types(model) -> set[str]:
    return {type(layer).__name__ for layer in model.layers}


@needs_ext
@pytest.mark.parametrize("make", [_llama, lambda: _llama(bits_o=5, bits_down=8), _qwen2])
def test_routed_layers_equal_the_layer_op_by_op(fused_on, make):
    from engine.generation.kv_cache import make_cache

    m = make()
    hook.install(m)
    assert _block_types(m) == {"KernelTransformerBlock"}
    for L in (1, 3, 15):
        tokens = mx.array([[(7 * i + 5) % 96 for i in range(L)]])
        assert mx.array_equal(m(tokens), _ops_forward(m, tokens))  # no cache, offset 0
    # with caches: a prompt, then single tokens at growing offsets (array offsets in the step)
    caches = [make_cache(m), make_cache(m)]
    prompt = mx.array([[3, 14, 15, 92, 65, 35]])
    a = m(prompt, cache=caches[0])
    b = _ops_forward(m, prompt, cache=caches[1])
    assert mx.array_equal(a, b)
    for t in (26, 53, 58):
        tok = mx.array([[t]])
        assert mx.array_equal(m(tok, cache=caches[0]), _ops_forward(m, tok, cache=caches[1]))


def _symmetric_llama():
    """_llama with every quantized layer in a symmetric form (float16-exact scales, biases
    -2^(bits-1) * scale, as GGUF Q4_0/Q5_0/Q8_0 load)."""
    m = _llama(bits_o=5, bits_down=8)
    for _, lin in m.named_modules():
        if isinstance(lin, (nn.QuantizedLinear, nn.QuantizedEmbedding)):
            s = lin.scales.astype(mx.float16).astype(mx.float32)
            lin.scales, lin.biases = s, s * -(2 ** (lin.bits - 1))
    mx.eval(m.parameters())
    return m


@needs_ext
def test_symmetric_weights_give_the_bits_of_reading_their_biases(fused_on, monkeypatch):
    """The decoder primitives and the head take each layer's ``symmetric`` flag (the biases
    are then made from the scales, and no float16 copy of them is kept): same logits as with
    no copies at all (the kernels reading the float32 scales and biases)."""
    from engine.generation.kv_cache import make_cache

    m = _symmetric_llama()
    hook.install(m)
    flags = [kernels.symmetric(x) for _, x in m.named_modules() if hasattr(x, "bits")]
    assert len(flags) == 15 and all(flags)  # 2 layers x 7 linears + the tied embedding

    def run():
        cache = make_cache(m)
        outs = [m(mx.array([[3, 14, 15, 92, 65, 35]]), cache=cache)]
        outs += [m(mx.array([[t]]), cache=cache) for t in (26, 53)]
        outs.append(m(mx.array([[1, 2, 3]])))
        return outs

    flagged = run()
    for _, x in m.named_modules():
        half = x.__dict__.get("_kernel_half")
        if half is not None:
            assert half[3] is half[2]  # no biases kept: the scales stand in their slot
            x.__dict__.pop("_kernel_half")
    assert not any(kernels.symmetric(x) for _, x in m.named_modules() if hasattr(x, "bits"))
    for a, b in zip(flagged, run(), strict=True):
        assert mx.array_equal(a, b)


@needs_ext
@pytest.mark.parametrize("make", [_llama, lambda: _llama(bits_o=5, bits_down=8), _qwen2])
def test_prefill_sized_inputs_run_the_primitives_bit_identical(fused_on, make, monkeypatch):
    """Prompt forwards (rows on the many-row matmul paths) take the decoder primitives too and
    give the bits of the layer op by op: no cache, a prompt into a cache after a prefix, two
    batch rows at once; PREFILL_LAYERS = False keeps them op by op."""
    from engine.generation.kv_cache import make_cache

    m = make()
    hook.install(m)
    layer = m.layers[0]
    x = mx.random.normal((1, kernels.dense_rows(), 128), key=mx.random.key(1))
    assert hook._block_fits(layer, x, None) and hook._block_fits(layer, x[:, :-1], None)
    assert not hook._block_fits(layer, x[:, :1].astype(mx.float16), None)
    for L in (kernels.dense_rows(), 40, 67, 200, 600):  # 200: pool threads; 600: per-call scratch
        tokens = mx.array([[(5 * i + 2) % 96 for i in range(L)]])
        assert mx.array_equal(m(tokens), _ops_forward(m, tokens))
    caches = [make_cache(m), make_cache(m)]
    for part in ([[3, 14, 15, 92, 65, 35]], [[(3 * i + 1) % 96 for i in range(40)]]):
        a, b = m(mx.array(part), cache=caches[0]), _ops_forward(m, mx.array(part), cache=caches[1])
        assert mx.array_equal(a, b)
    for c0, c1 in zip(*caches, strict=True):
        assert mx.array_equal(c0.keys, c1.keys) and mx.array_equal(c0.values, c1.values)
    two = mx.array([[(7 * i + r) % 96 for i in range(24)] for r in (1, 2)])
    assert mx.array_equal(m(two), _ops_forward(m, two))
    monkeypatch.setattr(hook, "PREFILL_LAYERS", False)
    assert not hook._block_fits(layer, x, None)
    assert hook._block_fits(layer, x[:, :-1], None)


@needs_ext
@pytest.mark.parametrize("make", [_llama, _qwen2])
def test_shared_x_matmuls_in_one_pool_job_give_the_bits_of_one_job_each(fused_on, make):
    """q/k/v and gate/up of a prompt forward as one pool job (kernels.set_shared_job) or one job
    per matmul: the same bits, on 1 and 2 threads (qwen2: q wider than k and v, so the job's
    chunks differ in size)."""
    m = make()
    hook.install(m)
    tokens = mx.array([[(5 * i + 2) % 96 for i in range(67)]])
    was = kernels.set_shared_job(False)
    try:
        per_matmul = on_one_and_two_threads(lambda: m(tokens))
        kernels.set_shared_job(True)
        one_job = on_one_and_two_threads(lambda: m(tokens))
    finally:
        kernels.set_shared_job(was)
    assert all(mx.array_equal(a, per_matmul[0]) for a in (*per_matmul, *one_job))


@needs_ext
def test_compiled_decode_and_batch_rows(fused_on):
    """generate_step's compiled step gives the same tokens and logprobs, and a row of a batch
    (per-row offsets) equals that row alone."""
    from engine.generation import generate as G
    from engine.generation.generate import generate_step
    from engine.generation.kv_cache import make_cache
    from engine.sampling import SamplingParams

    m = _llama()
    hook.install(m)
    prompt = [5, 9, 11, 3, 7, 60, 61, 2, 1, 4]

    def run():
        G._steps.clear()
        out = list(generate_step(m, prompt, make_cache(m), SamplingParams(temperature=0.0, max_tokens=12)))
        return [o.token for o in out], mx.stack([o.logprobs for o in out])

    toks, lps = run()
    hook.remove_blocks(m)
    try:
        toks2, lps2 = run()
    finally:
        hook.install(m)
    assert toks == toks2 and mx.array_equal(lps, lps2)

    # Two rows at different positions (array offset per row) vs each row alone.
    layer = m.layers[0]
    x = mx.random.normal((2, 1, 128), key=mx.random.key(2))
    attn = layer.self_attn

    def qkv(xx, off):
        return kernels.norm_qkv_rope(
            xx, layer.input_layernorm.weight, 1e-5, attn.q_proj, attn.k_proj, attn.v_proj, off,
            4, 2, rope_dims=32, traditional=False, base=10000.0, scale=1.0,
        )

    both = qkv(x, mx.array([7, 300]))
    for r, off in ((0, 7), (1, 300)):
        alone = qkv(x[r : r + 1], off)
        assert all(mx.array_equal(u[r : r + 1], w) for u, w in zip(both, alone, strict=True))
    a = mx.random.normal((2, 4, 1, 32), key=mx.random.key(3))
    mlp = layer.mlp
    full = kernels.attn_out_mlp(a, x, attn.o_proj, layer.post_attention_layernorm.weight, 1e-5,
                                mlp.gate_proj, mlp.up_proj, mlp.down_proj)
    one = kernels.attn_out_mlp(a[1:], x[1:], attn.o_proj, layer.post_attention_layernorm.weight, 1e-5,
                               mlp.gate_proj, mlp.up_proj, mlp.down_proj)
    assert mx.array_equal(full[1:], one)


def _dq(lin) -> np.ndarray:
    return np.array(mx.dequantize(lin.weight, lin.scales, lin.biases, lin.group_size, lin.bits), dtype=np.float64)


def _rms(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    return x / np.sqrt((x * x).mean(-1, keepdims=True) + eps) * w


def _rope(x: np.ndarray, offsets, base: float) -> np.ndarray:  # (B, H, L, D), non-traditional
    B, H, L, D = x.shape
    half = D // 2
    inv = base ** (-np.arange(half) / half)
    out = x.copy()
    for b in range(B):
        th = (offsets[b] + np.arange(L))[:, None] * inv[None, :]
        c, s = np.cos(th), np.sin(th)
        x1, x2 = x[b, ..., :half], x[b, ..., half:]
        out[b, ..., :half] = x1 * c - x2 * s
        out[b, ..., half:] = x1 * s + x2 * c
    return out


@needs_ext
def test_primitives_match_a_float64_reference(fused_on):
    """Within the int8 activations' error (~1%) of the layer computed in float64."""
    m = _qwen2(layers=1)
    layer = m.layers[0]
    attn, mlp = layer.self_attn, layer.mlp
    B, L = 2, 3
    x = mx.random.normal((B, L, 128), key=mx.random.key(5))
    offsets = [4, 11]
    q, k, v = kernels.norm_qkv_rope(
        x, layer.input_layernorm.weight, 1e-6, attn.q_proj, attn.k_proj, attn.v_proj, mx.array(offsets),
        4, 1, rope_dims=32, traditional=False, base=1e6, scale=1.0,
    )
    xn = _rms(np.array(x, dtype=np.float64), np.array(layer.input_layernorm.weight, dtype=np.float64), 1e-6)

    def proj(lin, heads):
        y = xn @ _dq(lin).T + np.array(lin.bias, dtype=np.float64)
        return y.reshape(B, L, heads, -1).transpose(0, 2, 1, 3)

    refs = (_rope(proj(attn.q_proj, 4), offsets, 1e6), _rope(proj(attn.k_proj, 1), offsets, 1e6), proj(attn.v_proj, 1))
    for got, ref in zip((q, k, v), refs, strict=True):
        assert got.shape == ref.shape
        assert np.abs(np.array(got) - ref).max() < 0.03 * np.abs(ref).max()

    a = mx.random.normal((B, 4, L, 32), key=mx.random.key(6))
    out = kernels.attn_out_mlp(a, x, attn.o_proj, layer.post_attention_layernorm.weight, 1e-6,
                               mlp.gate_proj, mlp.up_proj, mlp.down_proj)
    a64 = np.array(a, dtype=np.float64).transpose(0, 2, 1, 3).reshape(B, L, -1)
    h1 = np.array(x, dtype=np.float64) + a64 @ _dq(attn.o_proj).T
    n = _rms(h1, np.array(layer.post_attention_layernorm.weight, dtype=np.float64), 1e-6)
    g, u = n @ _dq(mlp.gate_proj).T, n @ _dq(mlp.up_proj).T
    ref = h1 + (g / (1 + np.exp(-g)) * u) @ _dq(mlp.down_proj).T
    assert np.abs(np.array(out) - ref).max() < 0.03 * np.abs(ref).max()


@needs_ext
def test_rope_table_follows_offsets_and_settings_between_calls(fused_on):
    """The primitive keeps its RoPE table between calls of the same key: calls that differ
    only in offsets or base (same shapes) must each get their own rotation, and a repeated
    call the bits of its first."""
    m = _qwen2(layers=1)
    layer = m.layers[0]
    attn = layer.self_attn
    B, L = 2, 3
    x = mx.random.normal((B, L, 128), key=mx.random.key(7))
    xn = _rms(np.array(x, dtype=np.float64), np.array(layer.input_layernorm.weight, dtype=np.float64), 1e-6)
    k_lin = xn @ _dq(attn.k_proj).T + np.array(attn.k_proj.bias, dtype=np.float64)
    k_lin = k_lin.reshape(B, L, 1, -1).transpose(0, 2, 1, 3)
    first = {}
    for offsets, base in (([4, 11], 1e6), ([5, 11], 1e6), ([5, 11], 1e4), ([4, 11], 1e6)):
        _, k, _ = kernels.norm_qkv_rope(
            x, layer.input_layernorm.weight, 1e-6, attn.q_proj, attn.k_proj, attn.v_proj, mx.array(offsets),
            4, 1, rope_dims=32, traditional=False, base=base, scale=1.0,
        )
        ref = _rope(k_lin, offsets, base)
        assert np.abs(np.array(k) - ref).max() < 0.03 * np.abs(ref).max()
        key = (tuple(offsets), base)
        if key in first:
            assert mx.array_equal(k, first[key])
        first.setdefault(key, k)


def test_threads_and_compile_are_bit_identical(fused_on):
    m = _llama(bits_o=5, bits_down=8, layers=1)
    layer = m.layers[0]
    attn, mlp = layer.self_attn, layer.mlp
    x = mx.random.normal((1, 2, 128), key=mx.random.key(7))
    a = mx.random.normal((1, 4, 2, 32), key=mx.random.key(8))

    def both(xx, aa, off):
        q, k, v = kernels.norm_qkv_rope(
            xx, layer.input_layernorm.weight, 1e-5, attn.q_proj, attn.k_proj, attn.v_proj, off, 4, 2,
            rope_dims=32, traditional=False, base=10000.0, scale=1.0,
        )
        o = kernels.attn_out_mlp(aa, xx, attn.o_proj, layer.post_attention_layernorm.weight, 1e-5,
                                 mlp.gate_proj, mlp.up_proj, mlp.down_proj)
        return q, k, v, o

    one, two = on_one_and_two_threads(lambda: both(x, a, mx.array(9)))
    assert all(mx.array_equal(u, w) for u, w in zip(one, two, strict=True))
    compiled = mx.compile(both)
    for pos in (9, 10, 700):  # one trace serves every position
        got, ref = compiled(x, a, mx.array(pos)), both(x, a, mx.array(pos))
        assert all(mx.array_equal(u, w) for u, w in zip(got, ref, strict=True))


@needs_ext
def test_bad_input_raises():
    m = _llama(layers=1)
    layer = m.layers[0]
    attn, mlp = layer.self_attn, layer.mlp
    w = layer.input_layernorm.weight

    def qkv(x, heads=4, off=0, dims=32):
        return kernels.norm_qkv_rope(x, w, 1e-5, attn.q_proj, attn.k_proj, attn.v_proj, off, heads, 2,
                                     rope_dims=dims, traditional=False, base=1e4, scale=1.0)

    with pytest.raises(ValueError):
        qkv(mx.zeros((1, 128)))  # not (B, L, D)
    with pytest.raises(ValueError):
        qkv(mx.zeros((1, 1, 96)))  # wrong width
    with pytest.raises(ValueError):
        qkv(mx.zeros((1, 1, 128)), heads=3)  # heads do not split q
    with pytest.raises(ValueError):
        qkv(mx.zeros((1, 1, 128)), dims=33)
    with pytest.raises(ValueError):
        qkv(mx.zeros((2, 1, 128)), off=mx.array([1, 2, 3]))
    with pytest.raises(ValueError):
        kernels.attn_out_mlp(mx.zeros((1, 4, 1, 16)), mx.zeros((1, 1, 128)), attn.o_proj, w, 1e-5,
                             mlp.gate_proj, mlp.up_proj, mlp.down_proj)  # a does not fit o


@needs_ext
def test_routing_rules(fused_on, monkeypatch):
    # fp32 (unquantized) layers are not routed; uninstall restores the classes.
    from mlx_lm.models import llama

    m = _llama(layers=1)
    hook.install(m)
    layer = m.layers[0]
    x = mx.random.normal((1, 1, 128), key=mx.random.key(9))
    assert hook._block_fits(layer, x, None)
    monkeypatch.setattr(hook.mx, "default_device", lambda: mx.gpu)
    assert not hook._block_fits(layer, x, None)  # never on Metal/CUDA
    monkeypatch.undo()
    hook.uninstall(m)
    assert type(layer) is llama.TransformerBlock
    dense = llama.Model(m.args)
    hook.install(dense)
    assert not hook._block_fits(dense.layers[0], x, None)
    # the extension missing: nothing is routed
    m2 = _llama(layers=1)
    monkeypatch.setattr(kernels, "available", lambda: False)
    assert hook.install(m2) == 0 and _block_types(m2) == {"TransformerBlock"}


@needs_ext
@pytest.mark.parametrize("shape", [(1, 49152), (3, 1000), (2, 5, 37), (1, 7)])
def test_log_softmax_matches_reference_and_mlx(shape):
    x = mx.random.normal(shape, key=mx.random.key(len(shape))) * 6
    got, ref = kernels.log_softmax(x), kernels.log_softmax(x, reference=True)
    mlx = x - mx.logsumexp(x, axis=-1, keepdims=True)
    assert got.shape == x.shape and got.dtype == mx.float32
    assert float(mx.abs(got - ref).max()) < 2e-5 and float(mx.abs(mlx - ref).max()) < 2e-5
    # a constraint's -inf entries stay -inf and do not disturb the rest
    masked = mx.where(mx.arange(shape[-1]) % 3 == 0, -mx.inf, x)
    got, ref = kernels.log_softmax(masked), kernels.log_softmax(masked, reference=True)
    assert mx.array_equal(mx.isinf(got), mx.isinf(ref))
    finite = ~mx.isinf(ref)
    assert float(mx.abs(mx.where(finite, got - ref, 0.0)).max()) < 2e-5


@needs_ext
def test_log_softmax_rows_threads_compile_and_bad_input():
    x = mx.random.normal((4, 3000), key=mx.random.key(11)) * 4
    one, two = on_one_and_two_threads(lambda: kernels.log_softmax(x))
    assert mx.array_equal(one, two)
    assert mx.array_equal(kernels.log_softmax(x[2:3]), one[2:3])  # a row alone = that row of many
    assert mx.array_equal(mx.compile(kernels.log_softmax)(x), one)
    with pytest.raises(ValueError):
        kernels.log_softmax(x.astype(mx.float16))


@needs_ext
def test_sampler_uses_the_kernel_and_the_switch_restores_mlx(monkeypatch):
    from engine.generation.sampling import SamplingParams, make_sampler

    logits = mx.random.normal((1, 500), key=mx.random.key(12)) * 5
    recent = mx.array([-1] * 4, dtype=mx.int32)
    monkeypatch.setattr(hook, "FUSED", True)
    tok, lp = make_sampler(SamplingParams(temperature=0.0))(logits, mx.random.key(0), recent)
    assert mx.array_equal(lp, kernels.log_softmax(logits)) and tok.item() == mx.argmax(logits).item()
    monkeypatch.setattr(hook, "FUSED", False)
    _, lp = make_sampler(SamplingParams(temperature=0.0))(logits, mx.random.key(0), recent)
    assert mx.array_equal(lp, logits - mx.logsumexp(logits, axis=-1, keepdims=True))


@needs_ext
@pytest.mark.parametrize("shape", [(8, 49152), (3, 1000), (2, 5, 37), (1, 7), (4, 1), (2, 151936)])
def test_argmax_rows_matches_reference_and_mlx_ties_first(shape):
    # Values on a coarse grid: many rows hold their maximum more than once (in one lane, in
    # different lanes, in the scalar tail), and the first index must win, as mx.argmax's does.
    x = mx.round(mx.random.normal(shape, key=mx.random.key(len(shape) + shape[-1])) * 2) / 2
    x = mx.where(mx.arange(shape[-1]) % 5 == 1, -mx.inf, x)  # a constraint's masked entries
    got, ref = kernels.argmax_rows(x), kernels.argmax_rows(x, reference=True)
    want = mx.argmax(x, axis=-1).astype(mx.int32)
    assert got.shape == shape[:-1] and got.dtype == mx.int32
    assert mx.array_equal(got, ref) and mx.array_equal(got, want)
    rows = x.reshape(-1, shape[-1])
    top = mx.max(rows, axis=-1, keepdims=True)
    if shape[-1] >= 16:  # the ties do happen, so the first-index rule is exercised
        assert int(mx.sum(rows == top, axis=-1).max()) > 1
    # a maximum only in the scalar tail, or in the last lane of the last chain or of another
    for at in (shape[-1] - 1, (shape[-1] // 32) * 32 - 1, (shape[-1] // 32) * 32 - 9):
        if at >= 0:
            y = mx.where(mx.arange(shape[-1]) == at, 100.0, x)
            assert (kernels.argmax_rows(y) == at).all().item()


@needs_ext
def test_argmax_rows_threads_compile_all_equal_and_bad_input(monkeypatch):
    from engine.generation.sampling import greedy_tokens

    x = mx.random.normal((4, 3000), key=mx.random.key(13)) * 4
    one, two = on_one_and_two_threads(lambda: kernels.argmax_rows(x))
    assert mx.array_equal(one, two)
    assert mx.array_equal(kernels.argmax_rows(x[2:3]), one[2:3])  # a row alone = that row of many
    assert mx.array_equal(mx.compile(kernels.argmax_rows)(x), one)
    masked = mx.full((2, 40), -mx.inf)  # all masked: index 0, as MLX's
    assert kernels.argmax_rows(masked).tolist() == [0, 0] == mx.argmax(masked, axis=-1).tolist()
    assert kernels.argmax_rows(mx.zeros((1, 40))).tolist() == [0]
    with pytest.raises(ValueError):
        kernels.argmax_rows(x.astype(mx.float16))
    # the batched lane's greedy picks: the kernel, or MLX's argmax with the switch off
    monkeypatch.setattr(hook, "FUSED", True)
    assert mx.array_equal(greedy_tokens(x.astype(mx.float16)), kernels.argmax_rows(x.astype(mx.float16).astype(mx.float32)))
    monkeypatch.setattr(hook, "FUSED", False)
    picks = greedy_tokens(x)
    assert picks.dtype == mx.int32 and mx.array_equal(picks, one)
