"""GGUF Q6_K blocks run as the file stores them (engine/kernels/q6k.py, src/q6k.h): the kernel
against its scalar reference bit for bit, rows against solo rows, every instruction set alike,
near the float product of the dequantized weights; the MLX fallback's dequantization against
ggml's; and a GGUF whose down projections and head are Q6_K loaded as Q6KLinear layers (the
decoder primitive's down included), through the conversion cache and back."""

import json
import os
import subprocess
import sys
from pathlib import Path

from engine import kernels
from engine.kernels import hook, q6k
from engine.kernels.q6k import Q6KLinear
from engine.model.gguf import cache as gguf_cache
from engine.model.gguf import load_gguf, quants
from engine.model.gguf.writer import RawTensor, write_gguf

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx.utils import tree_flatten
from mlx_lm.models import qwen2

from tests.test_gguf_loader import encode_q8_0, gguf_metadata, gguf_name
from tests.test_gguf_quants import make_blocks

needs_ext = pytest.mark.skipif(not kernels.has("q6k_matmul"), reason=f"kernels off: {kernels.status()['reason']}")
ROOT = Path(__file__).resolve().parents[1]


def q6k_weights(n: int, k: int, seed: int = 0) -> np.ndarray:
    """(n, k / 256 * 210) random Q6_K blocks, every q and scale value, small d (|w| < ~1.3)."""
    raw, _ = make_blocks("Q6_K", n * k // 256)
    raw = raw.reshape(-1, 210).copy()
    rng = np.random.default_rng(seed)
    raw[:, 208:210] = rng.uniform(1e-4, 3e-4, len(raw)).astype(np.float16).view(np.uint8).reshape(-1, 2)
    return raw.reshape(n, -1)


def x_rows(m: int, k: int, seed: int = 1) -> np.ndarray:
    x = np.random.default_rng(seed).standard_normal((m, k)).astype(np.float32)
    x[:, 7] *= 40  # an outlier channel, as real activations have
    return x


def matmul(x: np.ndarray, w: np.ndarray, reference: bool = False) -> np.ndarray:
    return np.array(kernels.q6k_matmul(mx.array(x), mx.array(w), reference))


@pytest.fixture(params=[False, True], ids=["int8", "x16"])
def x16(request):
    was = kernels.set_x16(request.param)
    yield request.param
    kernels.set_x16(was)


@needs_ext
@pytest.mark.parametrize("m", [1, 2, 3, 7, 17, 40])
@pytest.mark.parametrize("n,k", [(1, 256), (37, 768), (64, 512)])
def test_kernel_matches_its_scalar_reference_and_solo_rows(x16, m, n, k):
    w, x = q6k_weights(n, k), x_rows(m, k)
    y = matmul(x, w)
    np.testing.assert_array_equal(y.view(np.uint32), matmul(x, w, reference=True).view(np.uint32))
    solo = np.concatenate([matmul(x[i : i + 1], w) for i in range(m)])
    np.testing.assert_array_equal(y.view(np.uint32), solo.view(np.uint32))


@needs_ext
def test_near_the_float_product_of_the_dequantized_weights(x16):
    w, x = q6k_weights(96, 1536), x_rows(5, 1536)
    dense = quants.dequantize(w.reshape(-1), "Q6_K", (96, 1536))
    ref = x.astype(np.float64) @ dense.T.astype(np.float64)
    err = np.abs(matmul(x, w) - ref).max() / np.abs(ref).max()
    # A step of amax / 127 (int8) or amax / 16256 (16-bit) per 256 values, and the outlier
    # channel makes amax ~40x the others
    assert err < (1e-3 if x16 else 5e-2)


@needs_ext
def test_every_instruction_set_gives_the_same_bits(tmp_path):
    w, x = q6k_weights(40, 768), x_rows(19, 768)
    np.save(tmp_path / "w.npy", w)
    np.save(tmp_path / "x.npy", x)
    ours = np.concatenate([matmul(x, w), matmul(x[:1], w)])
    code = (
        "import engine, numpy as np, mlx.core as mx\n"
        "from engine import kernels\n"
        f"w, x = np.load({str(tmp_path / 'w.npy')!r}), np.load({str(tmp_path / 'x.npy')!r})\n"
        "f = lambda a: np.array(kernels.q6k_matmul(mx.array(a), mx.array(w)))\n"
        f"np.save({str(tmp_path / 'y.npy')!r}, np.concatenate([f(x), f(x[:1])]))\n"
        "print(kernels.status()['isa'])\n"
    )
    env = {**os.environ, "MLXTERM_KERNELS": "avx2"}
    out = subprocess.run([sys.executable, "-c", code], env=env, cwd=ROOT, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "avx2"
    np.testing.assert_array_equal(np.load(tmp_path / "y.npy").view(np.uint32), ours.view(np.uint32))


def test_mlx_dequantization_is_ggmls():
    w = q6k_weights(6, 512)
    ours = np.array(q6k.dequantize(mx.array(w)))
    np.testing.assert_array_equal(ours, quants.dequantize(w.reshape(-1), "Q6_K", (6, 512)))


@needs_ext
def test_bad_shapes_are_refused():
    w = mx.array(q6k_weights(4, 512))
    with pytest.raises(ValueError, match="multiple of 256"):
        kernels.q6k_matmul(mx.zeros((1, 500)), w)
    with pytest.raises(ValueError, match="multiple of 256"):
        kernels.q6k_matmul(mx.zeros((1, 768)), w)  # w holds 512 values a row
    with pytest.raises(ValueError, match="float32"):
        kernels.q6k_matmul(mx.zeros((1, 512), dtype=mx.float16), w)
    with pytest.raises(ValueError, match="256"):
        Q6KLinear(300, 4)


def test_layer_on_the_kernels_and_off_them(monkeypatch):
    layer = Q6KLinear(512, 24, bias=True)
    layer.weight = mx.array(q6k_weights(24, 512))
    layer.bias = mx.arange(24, dtype=mx.float32)
    x = mx.array(np.random.default_rng(2).standard_normal((3, 512)).astype(np.float32))
    dense = layer.dense()
    assert type(dense) is nn.Linear
    want = np.array(dense(x))
    got = np.array(layer(x))
    np.testing.assert_allclose(got, want, rtol=0, atol=2e-2 * np.abs(want).max())
    monkeypatch.setattr(q6k, "runs_on_kernels", lambda m: False)  # another device: MLX's ops
    np.testing.assert_allclose(np.array(layer(x)), want, rtol=1e-5, atol=1e-4)
    quantized = layer.to_quantized()
    assert type(quantized) is nn.QuantizedLinear and quantized.bits == 8
    np.testing.assert_allclose(np.array(quantized(x)), want, rtol=0, atol=2e-2 * np.abs(want).max())


# A qwen2 shape whose down projection (512 inputs) and head (256) hold whole Q6_K blocks.
CFG = dict(
    model_type="qwen2", hidden_size=256, num_hidden_layers=2, intermediate_size=512,
    num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-6, vocab_size=128,
    rope_theta=1e6, max_position_embeddings=256, tie_word_embeddings=False,
)
Q6K_TENSORS = ("ffn_down", "output", "attn_v")


def write_q6k_gguf(tmp_path: Path) -> Path:
    """Q4_K_M's mix in small: ffn_down, output and attn_v in Q6_K, other matrices Q8_0."""
    model = qwen2.Model(qwen2.ModelArgs.from_dict(CFG))
    rng = np.random.default_rng(5)
    tensors = []
    for hf, p in tree_flatten(model.parameters()):
        name = gguf_name(hf)
        if p.ndim == 2 and name.split(".")[-2] in Q6K_TENSORS:
            tensors.append(RawTensor(name, q6k_weights(*p.shape, seed=len(tensors)).tobytes(), "Q6_K", p.shape))
        elif p.ndim == 2:
            tensors.append(RawTensor(name, encode_q8_0(0.05 * rng.standard_normal(p.shape))[0], "Q8_0", p.shape))
        else:
            base = 1.0 if "norm" in name else 0.0
            tensors.append(RawTensor(name, (base + 0.05 * rng.standard_normal(p.shape)).astype(np.float32).tobytes(),
                                     "F32", p.shape))
    md = gguf_metadata("qwen2")
    md.update({
        "qwen2.embedding_length": CFG["hidden_size"], "qwen2.feed_forward_length": CFG["intermediate_size"],
        "qwen2.block_count": CFG["num_hidden_layers"],
    })
    return write_gguf(tmp_path / "q6k.gguf", md, tensors)


def forward(model: nn.Module) -> np.ndarray:
    from mlx_lm.models.cache import make_prompt_cache

    cache = make_prompt_cache(model)
    out = [model(mx.array([[3, 17, 42, 5, 99, 23, 64, 8, 77, 11, 2, 9, 31, 60, 1, 4, 5, 90]]), cache=cache)[0]]
    for t in (7, 12, 40):
        out.append(model(mx.array([[t]]), cache=cache)[0])
    return np.concatenate([np.array(o) for o in out])


@needs_ext
def test_q6k_downs_and_head_load_as_their_own_blocks(tmp_path, monkeypatch):
    monkeypatch.setenv("MLXTERM_GGUF_CACHE", "1")
    path = write_q6k_gguf(tmp_path)
    lm = load_gguf(path, "quantized")
    hook.install(lm.model)
    layer = lm.model.layers[0]
    assert type(layer.mlp.down_proj) is Q6KLinear and type(lm.model.lm_head) is Q6KLinear
    assert layer.self_attn.v_proj.bits == 8  # the attention inputs' shared path: re-quantized
    assert lm.model.lm_head["weight"].shape == (128, 210)
    assert hook._block_fits(layer, mx.zeros((1, 1, 256)), None)  # the decoder primitive runs the Q6_K down
    got = forward(lm.model)
    # The same file dequantized to float32: near (int8 activations).
    dense = forward(load_gguf(path, "fp32").model)
    assert np.abs(got - dense).max() < 0.05 * np.abs(dense).max()
    # Layer by layer (no decoder primitive): the same bits.
    hook.remove_blocks(lm.model)
    np.testing.assert_array_equal(forward(lm.model).view(np.uint32), got.view(np.uint32))
    # From the conversion cache: the same layers, the same bits.
    assert gguf_cache.load(path, gguf_cache.mode("quantized")) is not None
    again = load_gguf(path, "quantized")
    hook.install(again.model)
    assert type(again.model.layers[1].mlp.down_proj) is Q6KLinear
    np.testing.assert_array_equal(forward(again.model).view(np.uint32), got.view(np.uint32))
    # The stock-MLX arm: MLX's own 8-bit layers in their place.
    hook.uninstall(again.model)
    assert type(again.model.lm_head) is nn.QuantizedLinear
    assert np.abs(forward(again.model) - dense).max() < 0.05 * np.abs(dense).max()


def test_cache_metadata_names_the_layout(tmp_path, monkeypatch):
    """The conversion cache's bits map says 6 for Q6_K layers (what _build swaps in)."""
    if not kernels.has("q6k_matmul"):
        pytest.skip("kernels off")
    monkeypatch.setenv("MLXTERM_GGUF_CACHE", "1")
    path = write_q6k_gguf(tmp_path)
    load_gguf(path, "quantized")
    entries = list((gguf_cache.cache_dir() / "gguf").glob("*.safetensors"))
    assert len(entries) == 1
    _, meta = mx.load(str(entries[0]), return_metadata=True)
    bits = json.loads(meta["mlxterm.bits"])
    assert bits["lm_head"] == 6 and bits["model.layers.0.mlp.down_proj"] == 6
    assert bits["model.layers.0.self_attn.v_proj"] == 8
