"""The fused attention kernel (engine/kernels/src/attention.cpp): parity with MLX's
``fast.scaled_dot_product_attention`` and with the scalar reference for every mask kind, GQA,
float32/float16 K/V and odd lengths; key splitting (decode) is thread-count independent; the
routed mlx_lm attention sends every shape it handles to the kernel; bad input raises."""

from engine import kernels

import mlx.core as mx
import numpy as np
import pytest

from tests.kernel_checks import assert_same_under_isa, on_one_and_two_threads

pytestmark = pytest.mark.skipif(not kernels.available(), reason=f"kernels off: {kernels.status()['reason']}")

SCALE = 0.125


def _qkv(B, H, Hk, L, S, D=64, Dv=None, seed=0, kv_dtype=mx.float32):
    k1, k2, k3 = mx.random.split(mx.random.key(seed), 3)
    q = mx.random.normal((B, H, L, D), key=k1)
    k = mx.random.normal((B, Hk, S, D), key=k2).astype(kv_dtype)
    v = mx.random.normal((B, Hk, S, Dv or D), key=k3).astype(kv_dtype)
    return q, k, v


def _ref(q, k, v, mask):
    return mx.fast.scaled_dot_product_attention(
        q, k.astype(mx.float32), v.astype(mx.float32), scale=SCALE, mask=mask)


def _window(L, S, w):
    qpos = mx.arange(S - L, S)[:, None]
    kpos = mx.arange(S)[None]
    return (kpos <= qpos) & (kpos > qpos - w)


def _additive(mask):
    return mx.where(mask, 0.0, -mx.inf).astype(mx.float32)


# (B, H, Hk, L, S): decode (1 row per head, GQA 3 and 7), verify-sized, prefill tiles with odd
# lengths past one key block (128) and one query tile, batched rows.
SHAPES = [(1, 9, 3, 1, 300), (1, 14, 2, 1, 77), (1, 9, 3, 5, 261), (2, 4, 2, 7, 7),
          (1, 14, 2, 70, 333), (1, 6, 6, 131, 131), (2, 8, 2, 33, 150)]


@pytest.mark.parametrize("kv_dtype", [mx.float32, mx.float16])
@pytest.mark.parametrize("shape", SHAPES)
def test_matches_mlx_and_reference_for_every_mask_kind(shape, kv_dtype):
    B, H, Hk, L, S = shape
    q, k, v = _qkv(*shape, seed=sum(shape), kv_dtype=kv_dtype)
    valid = mx.arange(S) <= S - 4
    per_row = mx.random.uniform(shape=(B, 1, L, S), key=mx.random.key(7)) > 0.4
    per_row = per_row | (mx.arange(S) == S - 1)  # every row sees at least one key
    cases = [
        ("none", {}, None),
        ("causal", {"causal_offset": S - L}, "causal"),
        ("window", {"causal_offset": S - L, "window": 5}, _window(L, S, 5)),
        ("validity", {"mask": _additive(valid).reshape(1, 1, 1, S)}, valid),
        ("per-row", {"mask": _additive(per_row)}, per_row),
        ("additive", {"mask": mx.random.normal((1, 1, L, S), key=mx.random.key(3))}, None),
    ]
    for name, kw, ref_mask in cases:
        if name == "additive":
            ref_mask = kw["mask"]
        got = kernels.flash_attention(q, k, v, SCALE, **kw)
        ref = _ref(q, k, v, ref_mask)
        scalar = kernels.flash_attention(q, k, v, SCALE, reference=True, **kw)
        assert got.shape == ref.shape and got.dtype == mx.float32
        assert float(mx.abs(got - ref).max()) < 3e-6, name
        assert float(mx.abs(scalar - ref).max()) < 3e-6, name


@pytest.mark.parametrize("kv_dtype", [mx.float32, mx.float16, "q8"])
def test_views_of_a_longer_cache_buffer_give_the_dense_bits(kv_dtype):
    """K/V passed as the first S slots of a longer buffer (a static cache's view) are read in
    place; a transposed layout is copied first: both give the bits of dense copies, for the
    kernel and the scalar reference alike, batched and causal."""
    from engine.generation.kv_cache import q8_pack

    B, H, Hk, L, S, cap = 2, 6, 3, 5, 150, 256
    q, kbuf, vbuf = _qkv(B, H, Hk, L, cap, seed=11, kv_dtype=mx.float16 if kv_dtype == "q8" else kv_dtype)
    if kv_dtype == "q8":
        kbuf, vbuf = q8_pack(kbuf.astype(mx.float32), 32), q8_pack(vbuf.astype(mx.float32), 32)
        rot = {"rotate_q": True}
    else:
        rot = {}
    k, v = kbuf[:, :, :S], vbuf[:, :, :S]
    kd, vd = mx.array(np.array(k)), mx.array(np.array(v))
    # (B, S, Hk, row) stored, read as (B, Hk, S, row): rows Hk apart, copied by the primitive
    kt = mx.array(np.ascontiguousarray(np.array(k).transpose(0, 2, 1, 3))).transpose(0, 2, 1, 3)
    vt = mx.array(np.ascontiguousarray(np.array(v).transpose(0, 2, 1, 3))).transpose(0, 2, 1, 3)
    for kw in ({}, {"causal_offset": S - L}):
        for reference in (False, True):
            dense = kernels.flash_attention(q, kd, vd, SCALE, reference=reference, **kw, **rot)
            view = kernels.flash_attention(q, k, v, SCALE, reference=reference, **kw, **rot)
            moved = kernels.flash_attention(q, kt, vt, SCALE, reference=reference, **kw, **rot)
            assert np.array_equal(np.array(view), np.array(dense)), (kw, reference)
            assert np.array_equal(np.array(moved), np.array(dense)), (kw, reference)


def test_other_head_sizes_and_value_width():
    q, k, v = _qkv(1, 4, 2, 3, 200, D=128, Dv=32)
    got = kernels.flash_attention(q, k, v, SCALE, causal_offset=197)
    assert float(mx.abs(got - _ref(q, k, v, "causal")).max()) < 3e-6
    q, k, v = _qkv(1, 8, 1, 1, 1000, D=256)  # Gemma-sized heads, one KV head, decode
    assert float(mx.abs(kernels.flash_attention(q, k, v, SCALE) - _ref(q, k, v, None)).max()) < 3e-6


def test_fully_masked_rows_are_zero_and_empty_cache_tail_is_skipped():
    q, k, v = _qkv(1, 4, 2, 2, 600)
    mask = mx.full((1, 1, 2, 600), -mx.inf)
    mask[:, :, 1, :10] = 0.0
    got = kernels.flash_attention(q, k, v, SCALE, mask=mask)
    assert float(mx.abs(got[:, :, 0]).max()) == 0.0
    ref = _ref(q[:, :, 1:], k[:, :, :10], v[:, :, :10], None)
    assert float(mx.abs(got[:, :, 1:] - ref).max()) < 3e-6
    # A static cache with garbage past the valid keys: the validity vector ends the range.
    k2 = mx.concatenate([k[:, :, :100], mx.full((1, 2, 500, 64), mx.nan)], axis=2)
    v2 = mx.concatenate([v[:, :, :100], mx.full((1, 2, 500, 64), mx.nan)], axis=2)
    valid = _additive(mx.arange(600) < 100).reshape(1, 1, 1, 600)
    got = kernels.flash_attention(q, k2, v2, SCALE, mask=valid)
    assert float(mx.abs(got - _ref(q, k[:, :, :100], v[:, :, :100], None)).max()) < 3e-6


@pytest.mark.parametrize("shape", [(1, 9, 3, 1, 4000), (1, 9, 3, 64, 700)])
def test_one_and_two_threads_are_bit_identical(shape):
    # Decode at long context splits the keys across tasks and merges: the split must not
    # depend on the thread count.
    q, k, v = _qkv(*shape)
    one, two = on_one_and_two_threads(
        lambda: kernels.flash_attention(q, k, v, SCALE, causal_offset=shape[4] - shape[3]))
    assert mx.array_equal(one, two)


@pytest.mark.parametrize("S", [300, 700, 4000])
def test_a_batch_row_equals_the_same_row_alone(S):
    # Batched decode and speculative verify (L single-query rows) must give each row the bits
    # of its solo decode step: the key split may not depend on the batch size.
    B = 6
    q, k, v = _qkv(B, 9, 3, 1, S, seed=S)
    valid = mx.arange(S)[None, :] < mx.array([S - 13 * b for b in range(B)])[:, None]
    mask = _additive(valid).reshape(B, 1, 1, S)
    batch = kernels.flash_attention(q, k, v, SCALE, mask=mask)
    for b in range(B):
        alone = kernels.flash_attention(q[b : b + 1], k[b : b + 1], v[b : b + 1], SCALE, mask=mask[b : b + 1])
        assert mx.array_equal(batch[b : b + 1], alone), f"row {b} of {B} at {S} keys"


def _tile_results() -> dict:
    """Many-query (register-tiled) calls over fp32/fp16 K/V, head sizes 64/128, odd lengths."""
    out = {}
    for D, Dv, L, S in ((64, 64, 70, 333), (128, 32, 131, 131), (64, 64, 40, 1000)):
        for dt in (mx.float32, mx.float16):
            q, k, v = _qkv(1, 9, 3, L, S, D=D, Dv=Dv, seed=L + S, kv_dtype=dt)
            y = kernels.flash_attention(q, k, v, SCALE, causal_offset=S - L)
            out[f"{D}-{Dv}-{L}-{S}-{dt}"] = np.array(y)
    return out


def test_prefill_tiles_bit_identical_across_instruction_sets(tmp_path):
    # The AVX-512 tiles (src/attention_avx512.cpp) run the same FMA chains as the AVX2 ones.
    assert_same_under_isa(_tile_results, tmp_path)


# (H, Hk, D, Dv, S) of one decode query per head: GQA 3 (3-row score tiles) and 7 (2-row),
# value widths 64/48/112/16 (AVX-512 P @ V's 64-column tiles and 16/32/48 remainders).
DECODE_SHAPES = [
    (9, 3, 64, 64, 4000),
    (14, 2, 64, 48, 700),
    (9, 3, 128, 112, 333),
    (4, 4, 64, 16, 77),
]


def _decode_results() -> dict:
    """Decode-sized calls (3-row score tiles at GQA 3, 2-row at GQA 7; P @ V 64 columns per
    AVX-512 tile, remainders of 16/32/48 columns) over fp32/fp16 K/V, split keys, masks."""
    out = {}
    for H, Hk, D, Dv, S in DECODE_SHAPES:
        for dt in (mx.float32, mx.float16):
            q, k, v = _qkv(1, H, Hk, 1, S, D=D, Dv=Dv, seed=H + S, kv_dtype=dt)
            valid = mx.arange(S) <= S - 9
            y = kernels.flash_attention(q, k, v, SCALE, mask=_additive(valid).reshape(1, 1, 1, S))
            out[f"{H}-{Hk}-{D}-{Dv}-{S}-{dt}"] = np.array(y)
    return out


def test_decode_bit_identical_across_instruction_sets(tmp_path):
    # AVX-512 decode P @ V (src/attention_avx512.cpp: pv_decode) runs the AVX2 chains.
    assert_same_under_isa(_decode_results, tmp_path)


@pytest.mark.skipif(not kernels.available() or not kernels._load().decode512(), reason="CPU feature missing: no AVX-512 decode scores here")
def test_decode_scores_two_keys_per_zmm_give_the_avx2_tiles_bits():
    # src/attention_decode512.cpp (two keys per zmm) vs the AVX2 score_rows tiles in one process:
    # every GQA row count 1..7 (3-row tiles and their 2/1-row rests), key counts that end inside
    # an 8-key tile, head sizes 64/128, float32 and float16 K/V, batched rows under a mask.
    ext = kernels._load()
    cases = [(1, H, 1, 64, S) for H in range(1, 8) for S in (1, 5, 13, 131)]
    cases += [(3, 9, 3, 128, 333), (4, 14, 2, 64, 300), (2, 6, 6, 64, 2000)]
    try:
        for B, H, Hk, D, S in cases:
            for dt in (mx.float32, mx.float16):
                q, k, v = _qkv(B, H, Hk, 1, S, D=D, seed=H + S + D, kv_dtype=dt)
                valid = mx.arange(S)[None, :] <= mx.array([S - 1 - 3 * b for b in range(B)])[:, None]
                mask = _additive(valid).reshape(B, 1, 1, S)
                outs = []
                for on in (True, False):
                    ext.set_decode512(on)
                    outs.append(kernels.flash_attention(q, k, v, SCALE, mask=mask))
                    mx.eval(outs[-1])
                assert mx.array_equal(outs[0], outs[1]), f"{(B, H, Hk, D, S, dt)}"
    finally:
        ext.set_decode512(True)


def test_decode_shapes_match_the_reference():
    # The decode tiles (3-row / 2-row scores, wide P @ V remainders) vs the scalar reference.
    for H, Hk, D, Dv, S in DECODE_SHAPES:
        for dt in (mx.float32, mx.float16):
            q, k, v = _qkv(1, H, Hk, 1, S, D=D, Dv=Dv, seed=H + S, kv_dtype=dt)
            got = kernels.flash_attention(q, k, v, SCALE)
            ref = kernels.flash_attention(q, k, v, SCALE, reference=True)
            assert float(mx.abs(got - ref).max()) < 3e-6, (H, Hk, D, Dv, S, dt)


def test_back_to_back_pool_jobs_of_different_sizes():
    # Split attention runs two pool jobs (tasks, merge) and the quantized matmul then runs
    # one with many more chunks: a worker must never carry a chunk index from one job into
    # the next (a race the pool had: it crashed or returned early).
    before = kernels.status()["threads"]
    kernels.set_threads(max(2, before))
    try:
        q, k, v = _qkv(1, 9, 3, 1, 2000)
        w = mx.random.normal((512, 256))
        wq, s, b = mx.quantize(w, group_size=32, bits=4)
        x = mx.random.normal((1, 256))
        att_ref = kernels.flash_attention(q, k, v, SCALE)
        mm_ref = kernels.quantized_matmul(x, wq, s, b, 32, 4)
        mx.eval(att_ref, mm_ref)
        for _ in range(150):
            att = kernels.flash_attention(q, k, v, SCALE)
            mm = kernels.quantized_matmul(x, wq, s, b, 32, 4)
            mx.eval(att, mm)
            assert mx.array_equal(att, att_ref) and mx.array_equal(mm, mm_ref)
    finally:
        kernels.set_threads(before)


def test_inside_compile_with_a_moving_validity_mask():
    q, k, v = _qkv(1, 9, 3, 1, 512, kv_dtype=mx.float16)

    def step(q, k, v, pos):
        m = mx.where(mx.arange(512) <= pos, 0.0, -mx.inf).reshape(1, 1, 1, 512)
        return kernels.flash_attention(q, k, v, SCALE, mask=m)

    compiled = mx.compile(step)
    for pos in (0, 37, 300, 511):
        ref = _ref(q, k[:, :, : pos + 1], v[:, :, : pos + 1], None)
        assert float(mx.abs(compiled(q, k, v, mx.array(pos)) - ref).max()) < 3e-6


@pytest.fixture
def routed():
    from engine.kernels import attention

    attention._active.on = True
    yield attention
    attention._active.on = False


def test_routed_attention_uses_the_kernel_for_decode_prefill_and_fp16(monkeypatch, routed):
    calls = []
    real = kernels.flash_attention
    monkeypatch.setattr(kernels, "flash_attention", lambda *a, **kw: calls.append(kw) or real(*a, **kw))
    monkeypatch.setattr(routed, "impl", "flash")
    for shape, mask in [((1, 9, 3, 1, 100), None), ((1, 9, 3, 1, 512), mx.arange(512) <= 99),
                        ((1, 9, 3, 40, 40), "causal"), ((2, 4, 2, 3, 9), mx.ones((2, 1, 3, 9), mx.bool_))]:
        for kv_dtype in (mx.float32, mx.float16):
            q, k, v = _qkv(*shape, kv_dtype=kv_dtype)
            got = routed.scaled_dot_product_attention(q, k, v, None, SCALE, mask)
            assert float(mx.abs(got - _ref(q, k, v, mask)).max()) < 3e-6
    assert len(calls) == 8
    assert calls[1] == {} and calls[2]["mask"].shape == (1, 1, 1, 512) and calls[4] == {"causal_offset": 0}


def test_routed_attention_previous_path_and_fallbacks(monkeypatch, routed):
    q, k, v = _qkv(1, 9, 3, 6, 50, kv_dtype=mx.float16)
    monkeypatch.setattr(routed, "impl", "softmax")  # the previous round's path, widened K/V
    got = routed.scaled_dot_product_attention(q, k, v, None, SCALE, "causal")
    assert float(mx.abs(got - _ref(q, k, v, "causal")).max()) < 3e-6
    monkeypatch.setattr(routed, "impl", "flash")
    seen = []
    monkeypatch.setattr(routed, "_original", lambda q, k, v, *a: seen.append(k.dtype) or "mlx")
    per_head = mx.zeros((1, 9, 6, 50))
    assert routed.scaled_dot_product_attention(q, k, v, None, SCALE, per_head) == "mlx"
    assert seen == [mx.float32]  # float16 K/V reach MLX's path widened to the queries' dtype
    q5, k5, v5 = _qkv(1, 4, 2, 3, 20, D=20)  # head size the kernel does not tile
    assert routed.scaled_dot_product_attention(q5, k5, v5, None, SCALE, None) == "mlx"


def test_bad_inputs_raise():
    q, k, v = _qkv(1, 4, 2, 3, 20)
    with pytest.raises(ValueError, match="multiple"):
        kernels.flash_attention(q, mx.concatenate([k, k[:, :1]], 1), mx.concatenate([v, v[:, :1]], 1), SCALE)
    with pytest.raises(ValueError, match="float32, float16 or 8-bit rows"):
        kernels.flash_attention(q, k, v.astype(mx.float16), SCALE)
    with pytest.raises(ValueError, match="8-bit k rows"):  # 64 + 4 bytes: one group of 64 > D = 32
        kernels.flash_attention(q[..., :32], mx.zeros((1, 2, 20, 68), mx.uint8), mx.zeros((1, 2, 20, 68), mx.uint8), SCALE)
    with pytest.raises(ValueError, match="mask"):
        kernels.flash_attention(q, k, v, SCALE, mask=mx.zeros((1, 4, 3, 20)))
    with pytest.raises(ValueError, match="multiples"):
        kernels.flash_attention(q[..., :12], k[..., :12], v, SCALE)


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_float16_kv_cache_in_the_compiled_decode_step(arch, tiny_llama_dir, tiny_gemma_dir):
    """Static and sliding-window caches storing float16 K/V: the routed model's compiled
    decode reads them through the kernel and follows the float32-cache run closely."""
    from engine.generation.generate import generate_step
    from engine.generation.kv_cache import make_cache
    from engine.model.loader import load_bundle
    from engine.sampling import SamplingParams

    bundle = load_bundle({"llama": tiny_llama_dir, "gemma3": tiny_gemma_dir}[arch], "quantized")
    assert "_routed_base" in type(bundle.model).__dict__
    prompt = [(7 * i + 3) % 50 + 1 for i in range(21)]  # past gemma's window of 8
    params = SamplingParams(temperature=0.0, max_tokens=12, logprobs=True)
    runs = {}
    for dtype in (None, mx.float16):
        cache = make_cache(bundle.model, kv_dtype=dtype)
        runs[dtype] = [(s.token, s.logprobs) for s in generate_step(bundle.model, prompt, cache, params)]
        assert all(c.keys.dtype == (dtype or mx.float32) for c in cache)
    for (t32, lp32), (t16, lp16) in zip(runs[None], runs[mx.float16], strict=True):
        assert float(mx.abs(lp32 - lp16).max()) < 2e-2
        if t32 != t16:  # the same history only up to a near-tie
            break
