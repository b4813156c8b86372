"""Load a model + tokenizer from a GGUF file or an MLX/HF model directory."""

from __future__ import annotations

import copy
import json
import time
from dataclasses import dataclass
from pathlib import Path

from engine.errors import ModelLoadError
from engine.kernels import hook as kernel_hook
from engine.kernels.q6k import Q6KLinear
from engine.model.gguf import LoadedModel, load_gguf
from engine.model.tokenizer import Tokenizer

import mlx.core as mx
import mlx.nn as nn


@dataclass
class ModelBundle:
    loaded: LoadedModel
    tokenizer: Tokenizer
    load_ms: float
    prefill_model: nn.Module | None = None  # "hybrid": dense copy used for prompt processing

    @property
    def model(self) -> nn.Module:
        return self.loaded.model


def load_bundle(path: Path, weights: str) -> ModelBundle:
    """Load ``path`` (a .gguf file or a model directory) in weight format ``weights``.

    ``hybrid`` loads the quantized weights for decoding plus a dense fp32 copy for prefill
    (BLAS matmuls win for many tokens at once, packed weights for one token at a time).
    """
    t0 = time.perf_counter()
    path = Path(path).expanduser()
    if not path.exists():
        raise ModelLoadError(f"model not found at {path}")
    base = "quantized" if weights == "hybrid" else weights
    if path.is_dir():
        loaded = _load_mlx_dir(path, base)
        tokenizer = Tokenizer.from_hf_dir(path)
    else:
        loaded = load_gguf(path, base)
        tokenizer = Tokenizer.from_gguf_metadata(loaded.metadata, str(path))
    prefill_model = None
    if weights == "hybrid":
        prefill_model = copy.deepcopy(loaded.model)
        densify(prefill_model, mx.float32)
        mx.eval(prefill_model.parameters())
        # Decode runs dense float16/bf16 leftovers (e.g. Q6_K tensors) in fp32 as well: the CPU
        # half-precision matmul has no fast kernel.
        _upcast_dense(loaded.model)
        loaded.weight_format = "hybrid"
    if base == "quantized":
        # On a CPU with the engine's kernels, quantized layers run through them (else no-op),
        # on compact scale copies; the float32 arrays they replace go back to the system now
        # rather than wait in MLX's buffer cache.
        if kernel_hook.install(loaded.model):
            mx.clear_cache()
    return ModelBundle(loaded, tokenizer, (time.perf_counter() - t0) * 1000, prefill_model)


def _upcast_dense(model: nn.Module) -> None:
    def up(_, m):
        if isinstance(m, (nn.Linear, nn.Embedding)) and m.weight.dtype in (mx.float16, mx.bfloat16):
            m.update({k: v.astype(mx.float32) for k, v in m.parameters().items()})
        return m

    model.update_modules(_map_modules(model.leaf_modules(), up))


def _load_mlx_dir(path: Path, weights: str) -> LoadedModel:
    from mlx_lm.utils import load_model

    if not (path / "config.json").exists():
        raise ModelLoadError(f"{path}: not a model directory (no config.json)")
    try:
        model, config = load_model(path)
    except (ValueError, KeyError, FileNotFoundError) as e:
        raise ModelLoadError(f"{path}: cannot load model ({e})") from None
    quantized = "quantization" in config
    fmt = "quantized" if quantized else str(config.get("torch_dtype", "fp16"))
    if weights in ("fp32", "fp16", "bf16"):
        densify(model, {"fp32": mx.float32, "fp16": mx.float16, "bf16": mx.bfloat16}[weights])
        fmt = weights
    mx.eval(model.parameters())
    n_params = sum(v.size for _, v in _leaves(model.parameters()))
    return LoadedModel(
        model=model,
        model_type=config.get("model_type", "unknown"),
        config=config,
        metadata=json.loads((path / "config.json").read_text()),
        weight_format=fmt,
        path=path,
        file_type="mlx-" + fmt,
        n_params=n_params,
    )


def densify(model: nn.Module, dtype: mx.Dtype) -> None:
    """Replace quantized layers by dense ones and cast floating weights to ``dtype``."""
    def swap(_, m):
        if isinstance(m, Q6KLinear):
            return m.dense(dtype)
        if isinstance(m, nn.QuantizedLinear):
            w = mx.dequantize(m.weight, m.scales, m.biases, m.group_size, m.bits).astype(dtype)
            lin = nn.Linear(w.shape[1], w.shape[0], bias="bias" in m)
            lin.weight = w
            if "bias" in m:
                lin.bias = m.bias.astype(dtype)
            return lin
        if isinstance(m, nn.QuantizedEmbedding):
            w = mx.dequantize(m.weight, m.scales, m.biases, m.group_size, m.bits).astype(dtype)
            emb = nn.Embedding(w.shape[0], w.shape[1])
            emb.weight = w
            return emb
        return m

    leaves = model.leaf_modules()
    replaced = _map_modules(leaves, swap)
    model.update_modules(replaced)
    model.apply(lambda x: x.astype(dtype) if mx.issubdtype(x.dtype, mx.floating) else x)


def _map_modules(tree, fn, prefix=""):
    if isinstance(tree, nn.Module):
        return fn(prefix, tree)
    if isinstance(tree, dict):
        return {k: _map_modules(v, fn, f"{prefix}.{k}") for k, v in tree.items()}
    if isinstance(tree, list):
        return [_map_modules(v, fn, f"{prefix}.{i}") for i, v in enumerate(tree)]
    return tree


def _leaves(tree):
    from mlx.utils import tree_flatten

    return tree_flatten(tree)
