"""Per-architecture knowledge: GGUF metadata -> mlx_lm ModelArgs, tensor names -> HF names.

llama.cpp's converter changes some tensors on the way to GGUF; ``ArchSpec`` records how
to undo that:
  * llama: Q/K rows are permuted for ggml's interleaved ("normal") RoPE; mlx_lm uses the
    HF half-split layout, so the rows are un-permuted (``permute_qk``).
  * gemma3: every ``*norm.weight`` was stored as ``w + 1``; mlx_lm's Gemma RMSNorm adds the 1
    itself, so it is subtracted again (``norm_shift``). Gemma/Qwen2 use NEOX RoPE: no permute.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from engine.errors import ModelLoadError

import numpy as np

_COMMON = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_LLAMA_LAYER = {**_COMMON, "ffn_norm": "post_attention_layernorm"}
_GEMMA3_LAYER = {
    **_COMMON,
    "ffn_norm": "pre_feedforward_layernorm",
    "post_attention_norm": "post_attention_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
}
_GLOBAL = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
_LAYER_RE = re.compile(r"^blk\.(\d+)\.([a-z0-9_]+)\.(weight|bias)$")
_GLOBAL_RE = re.compile(r"^([a-z0-9_]+)\.(weight|bias)$")


class Meta:
    """Typed access to ``{arch}.*`` metadata keys, with errors that name the file and key."""

    def __init__(self, path: Path, arch: str, metadata: dict[str, Any]):
        self.path, self.arch, self.md = path, arch, metadata

    def get(self, key: str, default: Any = None) -> Any:
        return self.md.get(f"{self.arch}.{key}", default)

    def int(self, key: str, default: int | None = None) -> int:
        v = self.get(key, default)
        if isinstance(v, list) and v and all(x == v[0] for x in v):  # per-layer arrays
            v = v[0]
        if not isinstance(v, int) or isinstance(v, bool):
            raise ModelLoadError(
                f"{self.path}: metadata {self.arch}.{key} is missing or not an integer."
            )
        return v

    def float(self, key: str, default: float | None = None) -> float:
        v = self.get(key, default)
        if not isinstance(v, (int, float)) or isinstance(v, bool):
            raise ModelLoadError(f"{self.path}: metadata {self.arch}.{key} is missing or not a number.")
        return float(v)


@dataclass(frozen=True)
class ArchSpec:
    arch: str  # general.architecture
    model_type: str  # mlx_lm.models module
    layer_names: dict[str, str]
    build_args: Callable[[Meta, dict[str, tuple[int, ...]]], dict[str, Any]]
    permute_qk: bool = False
    norm_shift: float = 0.0

    def hf_name(self, gguf_name: str) -> str | None:
        """The mlx_lm parameter name for a GGUF tensor name, or None if unknown."""
        m = _LAYER_RE.match(gguf_name)
        if m:
            part = self.layer_names.get(m.group(2))
            return f"model.layers.{m.group(1)}.{part}.{m.group(3)}" if part else None
        m = _GLOBAL_RE.match(gguf_name)
        if m and m.group(1) in _GLOBAL:
            return f"{_GLOBAL[m.group(1)]}.{m.group(2)}"
        return None

    def gguf_name(self, hf_name: str) -> str:
        """Best-effort inverse of ``hf_name`` for error messages (falls back to the HF name)."""
        module, _, leaf = hf_name.rpartition(".")
        suffix = "weight" if leaf in ("scales", "biases") else leaf
        m = re.match(r"^model\.layers\.(\d+)\.(.+)$", module)
        if m:
            for g, h in self.layer_names.items():
                if h == m.group(2):
                    return f"blk.{m.group(1)}.{g}.{suffix}"
        for g, h in _GLOBAL.items():
            if h == module:
                return f"{g}.{suffix}"
        return hf_name


def _rope_scaling(meta: Meta) -> dict[str, Any] | None:
    kind = meta.get("rope.scaling.type")
    if kind in (None, "none"):
        return None
    if kind == "linear":
        return {"type": "linear", "factor": meta.float("rope.scaling.factor")}
    if kind == "yarn":
        return {
            "type": "yarn",
            "factor": meta.float("rope.scaling.factor"),
            "original_max_position_embeddings": meta.int("rope.scaling.original_context_length"),
        }
    raise ModelLoadError(f"{meta.path}: unsupported RoPE scaling type '{kind}'.")


def _common_args(meta: Meta, shapes: dict[str, tuple[int, ...]]) -> dict[str, Any]:
    embd = shapes.get("token_embd.weight")
    if embd is None:
        raise ModelLoadError(f"{meta.path}: missing tensor token_embd.weight.")
    hidden = meta.int("embedding_length")
    heads = meta.int("attention.head_count")
    return {
        "hidden_size": hidden,
        "num_hidden_layers": meta.int("block_count"),
        "intermediate_size": meta.int("feed_forward_length"),
        "num_attention_heads": heads,
        "num_key_value_heads": meta.int("attention.head_count_kv", heads),
        "rms_norm_eps": meta.float("attention.layer_norm_rms_epsilon"),
        "vocab_size": embd[0],
        "max_position_embeddings": meta.int("context_length"),
        "rope_scaling": _rope_scaling(meta),
        "tie_word_embeddings": "output.weight" not in shapes,
    }


def _llama_args(meta: Meta, shapes: dict[str, tuple[int, ...]]) -> dict[str, Any]:
    if "rope_freqs.weight" in shapes:
        raise ModelLoadError(
            f"{meta.path}: Llama-3 style rope_freqs scaling is not supported yet."
        )
    args = _common_args(meta, shapes)
    head_dim = meta.int("attention.key_length", args["hidden_size"] // args["num_attention_heads"])
    rope_dims = meta.int("rope.dimension_count", head_dim)
    if rope_dims != head_dim:
        raise ModelLoadError(f"{meta.path}: partial RoPE ({rope_dims} of {head_dim}) is not supported.")
    return {
        **args,
        "model_type": "llama",
        "head_dim": head_dim,
        "rope_theta": meta.float("rope.freq_base", 10000.0),
        "attention_bias": "blk.0.attn_q.bias" in shapes,
        "mlp_bias": "blk.0.ffn_up.bias" in shapes,
    }


def _qwen2_args(meta: Meta, shapes: dict[str, tuple[int, ...]]) -> dict[str, Any]:
    args = _common_args(meta, shapes)
    return {**args, "model_type": "qwen2", "rope_theta": meta.float("rope.freq_base", 1e6)}


def _gemma3_args(meta: Meta, shapes: dict[str, tuple[int, ...]]) -> dict[str, Any]:
    args = _common_args(meta, shapes)
    args.pop("tie_word_embeddings")  # gemma3_text ties itself when lm_head is absent
    head_dim = meta.int("attention.key_length", 256)
    # llama.cpp scales queries by 1/sqrt(head_dim), except Gemma-3 27B (62 layers), which
    # uses hidden/heads; an explicit `attention.scale` wins.
    scale = meta.get("attention.scale")
    if isinstance(scale, (int, float)) and scale > 0:
        qpas = 1.0 / float(scale) ** 2
    elif args["num_hidden_layers"] == 62:
        qpas = args["hidden_size"] / args["num_attention_heads"]
    else:
        qpas = head_dim
    return {
        **args,
        "model_type": "gemma3_text",
        "head_dim": head_dim,
        "rope_theta": meta.float("rope.freq_base", 1e6),
        "rope_local_base_freq": 10000.0,  # llama.cpp hard-codes the sliding layers' base
        "query_pre_attn_scalar": qpas,
        "sliding_window": meta.int("attention.sliding_window"),
        "sliding_window_pattern": _gemma3_pattern(meta, args["num_hidden_layers"]),
    }


def _gemma3_pattern(meta: Meta, n_layers: int) -> int:
    """Every Nth layer is global (full attention); llama.cpp uses 6 unless the file says."""
    pattern = meta.get("attention.sliding_window_pattern", 6)
    if isinstance(pattern, (list, np.ndarray)):  # per-layer "is sliding" flags
        flags = [bool(x) for x in pattern]
        globals_ = [i for i, sliding in enumerate(flags) if not sliding]
        n = globals_[0] + 1 if globals_ else n_layers + 1
        if all(sliding == ((i + 1) % n != 0) for i, sliding in enumerate(flags)):
            return n
        raise ModelLoadError(f"{meta.path}: irregular Gemma-3 sliding-window layout is not supported.")
    if not isinstance(pattern, int) or pattern < 1:
        raise ModelLoadError(f"{meta.path}: bad gemma3.attention.sliding_window_pattern {pattern!r}.")
    return pattern


ARCHS: dict[str, ArchSpec] = {
    "llama": ArchSpec("llama", "llama", _LLAMA_LAYER, _llama_args, permute_qk=True),
    "gemma3": ArchSpec("gemma3", "gemma3_text", _GEMMA3_LAYER, _gemma3_args, norm_shift=1.0),
    "qwen2": ArchSpec("qwen2", "qwen2", _LLAMA_LAYER, _qwen2_args),
}


def check_args(path: Path, args: dict[str, Any], shapes: dict[str, tuple[int, ...]]) -> None:
    """Metadata must agree with the tensors before a model is built from it (a corrupt
    block_count must not make us build millions of layers)."""
    for key in ("hidden_size", "num_hidden_layers", "intermediate_size", "num_attention_heads",
                "num_key_value_heads"):
        if args[key] <= 0:
            raise ModelLoadError(f"{path}: metadata gives {key} = {args[key]}.")
    blocks = {int(m.group(1)) for n in shapes if (m := _LAYER_RE.match(n))}
    if blocks != set(range(args["num_hidden_layers"])):
        raise ModelLoadError(
            f"{path}: metadata says {args['num_hidden_layers']} layers but the file has "
            f"tensors for {len(blocks)}."
        )
    heads, kv = args["num_attention_heads"], args["num_key_value_heads"]
    head_dim = args.get("head_dim") or args["hidden_size"] // heads
    want = {
        ("token_embd.weight", 1): args["hidden_size"],
        ("blk.0.attn_q.weight", 0): heads * head_dim,
        ("blk.0.attn_k.weight", 0): kv * head_dim,
        ("blk.0.ffn_up.weight", 0): args["intermediate_size"],
    }
    for (name, axis), n in want.items():
        shape = shapes.get(name)
        if shape is not None and (len(shape) != 2 or shape[axis] != n):
            raise ModelLoadError(
                f"{path}: tensor {name} has shape {shape}, which does not match the metadata."
            )
    if heads % kv:
        raise ModelLoadError(f"{path}: {heads} attention heads cannot share {kv} KV heads.")


def unpermute_rows(n_rows: int, n_heads: int) -> np.ndarray:
    """Row order that turns llama.cpp's rotary-permuted Q/K rows back into HF order.

    llama.cpp stores ``hf.reshape(h, 2, d/2, ...).swapaxes(1, 2)``; the inverse gathers
    rows ``arange.reshape(h, d/2, 2).swapaxes(1, 2)``. Row-wise, so it applies equally to
    packed quantized rows, their scales/biases and a bias vector.
    """
    head_dim = n_rows // n_heads
    return np.arange(n_rows).reshape(n_heads, head_dim // 2, 2).swapaxes(1, 2).reshape(-1)
