"""The fused attention on 8-bit K/V rows (the CPU's live "q8" KV format, src/attention_q8.inc):
the kernel matches its scalar reference (which quantizes q the same way) for decode and
prefill-tile shapes and every mask kind, is bit-identical for 1 vs 2 threads, for a batch row vs
the row alone and for AVX2 vs AVX-512 VNNI; the pack stores what it says; q8 caches run in the
compiled decode step."""

from engine import kernels
from engine.generation.kv_cache import Q8, q8_pack, q8_unpack

import mlx.core as mx
import numpy as np
import pytest

from tests.kernel_checks import assert_same_under_isa, on_one_and_two_threads

pytestmark = pytest.mark.skipif(
    not kernels.available(), reason=f"kernels off: {kernels.status()['reason']}"
)
SCALE = 0.125


def _qkv(B, H, Hk, L, S, D=64, G=32, seed=0):
    k1, k2, k3 = mx.random.split(mx.random.key(seed), 3)
    q = mx.random.normal((B, H, L, D), key=k1)
    k = mx.random.normal((B, Hk, S, D), key=k2) * (1 + mx.arange(D) % 7)  # uneven channels
    v = mx.random.normal((B, Hk, S, D), key=k3)
    return q, q8_pack(k, G), q8_pack(v, G)


def _additive(valid):
    return mx.where(valid, mx.array(0.0), mx.array(-mx.inf))


def test_pack_is_symmetric_int8_per_group_with_float32_scales():
    x = mx.random.normal((2, 3, 5, 64)) * 3
    x = mx.concatenate([x[..., :32], mx.zeros((2, 3, 5, 32))], axis=-1)  # an all-zero group
    p = q8_pack(x, 32)
    assert p.dtype == mx.uint8 and p.shape == (2, 3, 5, 72)
    a = np.array(x, np.float32).reshape(2, 3, 5, 2, 32)
    amax = np.abs(a).max(-1, keepdims=True)
    want_q = np.clip(
        np.round(a * np.where(amax > 0, np.float32(127) / np.where(amax > 0, amax, 1), 0)),
        -127,
        127,
    )
    raw = np.array(p)
    assert np.array_equal(raw[..., :64].view(np.int8).reshape(want_q.shape), want_q.astype(np.int8))
    assert np.array_equal(
        raw[..., 64:].copy().view(np.float32), (amax / np.float32(127)).reshape(2, 3, 5, 2)
    )
    back = np.array(q8_unpack(p))
    assert np.abs(back - np.array(x)).max() <= (amax.max() / 127) / 2 * 1.0001
    assert np.array_equal(back, np.array(q8_unpack(p, D=64)))


def test_kernel_pack_gives_the_mlx_pack_bytes():
    x = mx.concatenate([mx.random.normal((2, 3, 33, 128)) * 5, mx.zeros((2, 3, 1, 128))], axis=2)
    x = mx.concatenate([x, mx.round(x * 2) / 2], axis=2)  # halves: ties of the int8 rounding
    for G in (16, 32, 64, 128):
        assert mx.array_equal(q8_pack(x, G), q8_pack(x, G, use_kernel=False)), G


@pytest.mark.parametrize("G", [32, 64])
@pytest.mark.parametrize(
    "shape", [(1, 9, 3, 1, 700), (2, 14, 2, 1, 300), (1, 9, 3, 40, 300), (1, 4, 2, 3, 129)]
)
def test_matches_the_reference_for_every_mask_kind(shape, G):
    B, H, Hk, L, S = shape
    q, k, v = _qkv(*shape, G=G, seed=S + G)
    valid = _additive(mx.arange(S) <= S - 5).reshape(1, 1, 1, S)
    for kw in (
        dict(mask=valid),
        dict(causal_offset=S - L),
        dict(causal_offset=S - L, window=50),
        {},
    ):
        got = kernels.flash_attention(q, k, v, SCALE, **kw)
        ref = kernels.flash_attention(q, k, v, SCALE, reference=True, **kw)
        assert got.shape == (B, H, L, 64)
        assert float(mx.abs(got - ref).max()) < 2e-5, kw  # float32 vs double sums


def test_head_dim_128():
    q, k, v = _qkv(1, 8, 2, 1, 500, D=128, G=64)
    got = kernels.flash_attention(q, k, v, SCALE, causal_offset=499)
    ref = kernels.flash_attention(q, k, v, SCALE, causal_offset=499, reference=True)
    assert float(mx.abs(got - ref).max()) < 2e-5


def test_one_and_two_threads_are_bit_identical():
    q, k, v = _qkv(1, 9, 3, 1, 4000)
    one, two = on_one_and_two_threads(
        lambda: kernels.flash_attention(q, k, v, SCALE, causal_offset=3999)
    )
    assert mx.array_equal(one, two)


def test_a_batch_row_equals_the_same_row_alone():
    B, S = 5, 900
    q, k, v = _qkv(B, 9, 3, 1, S, seed=3)
    mask = _additive(
        mx.arange(S)[None, :] < mx.array([S - 31 * b for b in range(B)])[:, None]
    ).reshape(B, 1, 1, S)
    batch = kernels.flash_attention(q, k, v, SCALE, mask=mask)
    for b in range(B):
        alone = kernels.flash_attention(
            q[b : b + 1], k[b : b + 1], v[b : b + 1], SCALE, mask=mask[b : b + 1]
        )
        assert mx.array_equal(batch[b : b + 1], alone), b


# Decode shapes beyond SmolLM2's for the AVX-512 scores (16 keys per vector, rows in passes of
# 3 or 4): 4 and 8 query rows per KV head, a 32-dim tail chunk (D 96), groups spanning two
# 64-dim chunks (G 128), key counts that leave a partial 16-key tile.
_DECODE_SHAPES = (
    ((1, 8, 2, 1, 517), 96, 32),
    ((1, 8, 1, 1, 301), 128, 128),
    ((2, 4, 1, 1, 263), 128, 32),
    ((1, 10, 2, 1, 95), 64, 64),
)


@pytest.mark.parametrize("shape,D,G", _DECODE_SHAPES)
def test_decode_shapes_match_the_reference(shape, D, G):
    q, k, v = _qkv(*shape, D=D, G=G, seed=D + G)
    S = shape[4]
    got = kernels.flash_attention(q, k, v, SCALE, causal_offset=S - 1)
    ref = kernels.flash_attention(q, k, v, SCALE, causal_offset=S - 1, reference=True)
    assert float(mx.abs(got - ref).max()) < 2e-5


def _isa_results() -> dict:
    out = {}
    for shape, G, D in (
        ((1, 9, 3, 1, 3000), 32, 64),
        ((2, 14, 2, 1, 700), 64, 64),
        ((1, 9, 3, 2, 333), 32, 64),
        ((1, 9, 3, 40, 400), 64, 64),
        *((s, g, d) for s, d, g in _DECODE_SHAPES),
    ):
        q, k, v = _qkv(*shape, D=D, G=G, seed=shape[4])
        out[f"{shape}-{G}-{D}"] = np.array(
            kernels.flash_attention(q, k, v, SCALE, causal_offset=shape[4] - shape[3])
        )
        out[f"{shape}-{G}-{D}-rotated"] = np.array(
            kernels.flash_attention(q, k, v, SCALE, causal_offset=shape[4] - shape[3], rotate_q=True)
        )
    return out


def test_bit_identical_across_instruction_sets(tmp_path):
    # AVX-512 VNNI dpbusd vs AVX2 maddubs: the same integer dots; 512- vs 256-bit P @ V: the
    # same FMA chain per element.
    assert_same_under_isa(_isa_results, tmp_path)


def test_q8_cache_in_the_compiled_decode_step(tiny_llama_dir):
    """A q8 cache stores uint8 rows through prefill and the compiled step (whose scratch caches
    store like the bound buffer), and the compiled step gives the plain forward's tokens. The
    tiny model's head dim (16) is below the kernel's group sizes: its attention takes the
    pure-MLX path for q8 rows (unpacked to float), as any model the kernel cannot read."""
    from engine.generation.generate import generate_step
    from engine.generation.kv_cache import make_cache
    from engine.model.loader import load_bundle
    from engine.sampling import SamplingParams

    bundle = load_bundle(tiny_llama_dir, "quantized")
    prompt = [(7 * i + 3) % 50 + 1 for i in range(21)]
    params = SamplingParams(temperature=0.0, max_tokens=12, logprobs=True)
    cache = make_cache(bundle.model, kv_dtype=Q8(16))
    steps = list(generate_step(bundle.model, prompt, cache, params))
    assert all(c.keys.dtype == mx.uint8 and c.offset > len(prompt) for c in cache)
    # the same tokens one plain forward at a time (no compile) on a fresh q8 cache
    plain = make_cache(bundle.model, kv_dtype=Q8(16))
    logits = bundle.model(mx.array(prompt)[None], cache=plain)[0, -1]
    toks = []
    for _ in range(12):
        toks.append(int(mx.argmax(logits).item()))
        logits = bundle.model(mx.array([[toks[-1]]]), cache=plain)[0, -1]
    assert [s.token for s in steps] == toks


# -- K rows hold rotated keys (kv_cache.q8_rotate), attention rotates q to match -------------
def test_rotation_is_orthonormal_self_inverse_and_row_by_row():
    from engine.generation.kv_cache import q8_rotate

    for D in (16, 64, 96, 128):  # 96: three 32-wide blocks
        x = mx.random.normal((3, 4, 7, D), key=mx.random.key(D))
        y = mx.random.normal((3, 4, 7, D), key=mx.random.key(D + 1))
        rx = q8_rotate(x)
        assert float(mx.abs(q8_rotate(rx) - x).max()) < 1e-5, D  # H @ H = I
        dots = (rx * q8_rotate(y)).sum(-1)
        assert float(mx.abs(dots - (x * y).sum(-1)).max()) < 1e-4 * D, D  # q . k kept
        assert mx.array_equal(q8_rotate(x[1:2, :, 3:4]), rx[1:2, :, 3:4]), D  # a row alone
    x = mx.zeros((1, 1, 1, 64)).at[..., 5].add(8.0)
    assert mx.array_equal(mx.abs(q8_rotate(x)), mx.ones((1, 1, 1, 64)))  # exact at D = 64


def _outlier_qkv(S=400, seed=5):
    """K with a few large channels (as real models' keys have), q, v plain."""
    k1, k2, k3 = mx.random.split(mx.random.key(seed), 3)
    q = mx.random.normal((1, 9, 1, 64), key=k1)
    boost = mx.where(mx.arange(64) % 16 == 3, 12.0, 1.0)
    k = mx.random.normal((1, 3, S, 64), key=k2) * boost
    v = mx.random.normal((1, 3, S, 64), key=k3)
    return q, k, v


@pytest.mark.parametrize("shape,D,G", [((1, 9, 3, 1, 700), 64, 64), ((1, 8, 2, 1, 300), 128, 64),
                                       ((1, 8, 2, 1, 517), 96, 32), ((1, 9, 3, 40, 400), 64, 32)])
def test_kernel_rotates_q_as_q8_rotate_does(shape, D, G):
    """``rotate_q`` rotates q inside the kernel (decode and prefill tiles; D 96: two 32-blocks):
    its reference reads the same rotated q, and up to float rounding of the rotated q it is
    attention on ``q8_rotate(q)`` -- which it would be far from if q were not rotated."""
    from engine.generation.kv_cache import q8_rotate

    q, k, v = _qkv(*shape, D=D, G=G, seed=D + shape[4])
    off = shape[4] - shape[3]
    got = kernels.flash_attention(q, k, v, SCALE, causal_offset=off, rotate_q=True)
    ref = kernels.flash_attention(q, k, v, SCALE, causal_offset=off, reference=True, rotate_q=True)
    mlx_rot = kernels.flash_attention(q8_rotate(q), k, v, SCALE, causal_offset=off, reference=True)
    unrotated = kernels.flash_attention(q, k, v, SCALE, causal_offset=off, reference=True)
    assert float(mx.abs(got - ref).max()) < 2e-5
    # q rounds to int8 per group: a 1-ulp difference in the rotated q may flip one rounding
    assert float(mx.abs(ref - mlx_rot).max()) < 2e-3
    assert float(mx.abs(ref - unrotated).max()) > 1e-2
    one, two = on_one_and_two_threads(
        lambda: kernels.flash_attention(q, k, v, SCALE, causal_offset=off, rotate_q=True)
    )
    assert mx.array_equal(one, two) and mx.array_equal(one, got)


def test_q8_cache_stores_rotated_keys_and_plain_values():
    from engine.generation.kv_cache import StaticKVCache, q8_rotate

    _, k, v = _outlier_qkv(S=40)
    cache = StaticKVCache(Q8(32))
    ks, vs = cache.update_and_fetch(k, v)
    assert mx.array_equal(ks, q8_pack(q8_rotate(k), 32))
    assert mx.array_equal(vs, q8_pack(v, 32))


@pytest.mark.parametrize("impl", ["flash", "mlx"])
def test_attention_over_q8_caches_reads_the_rotated_keys(impl, monkeypatch):
    """Through the model-facing function (kernel and MLX fallback alike): attention over a q8
    cache is close to float attention -- it would be far off if q were not rotated like K --
    and the rotation makes it closer than unrotated rows are on keys with large channels."""
    from engine.generation.kv_cache import StaticKVCache
    from engine.kernels import attention

    monkeypatch.setattr(attention, "impl", impl)
    q, k, v = _outlier_qkv()
    S = k.shape[2]
    scale = 0.125
    want = kernels.flash_attention(q, k, v, scale, reference=True)
    cache = StaticKVCache(Q8(64))
    ks, vs = cache.update_and_fetch(k, v)
    with attention.routing():
        got = attention.scaled_dot_product_attention(q, ks, vs, cache, scale, None)
    # the same rows without the rotation (round 4-5's format), read with the plain q
    plain = kernels.flash_attention(q, q8_pack(k, 64), vs, scale)
    err, err_plain = (float(mx.abs(x - want).max()) for x in (got, plain))
    assert got.shape == want.shape == (1, 9, 1, 64) and cache.offset == S
    assert err < 0.6 * err_plain, (err, err_plain)
