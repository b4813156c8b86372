"""Load a model + tokenizer from a GGUF file or an MLX/HF model directory."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path

from engine.errors import ModelLoadError
from engine.gguf import LoadedModel, load_gguf
from engine.tokenizer import Tokenizer

import mlx.core as mx
import mlx.nn as nn


@dataclass
class ModelBundle:
    loaded: LoadedModel
    tokenizer: Tokenizer
    load_ms: float

    @property
    def model(self) -> nn.Module:
        return self.loaded.model


def load_bundle(path: Path, weights: str) -> ModelBundle:
    """Load ``path`` (a .gguf file or a model directory) in weight format ``weights``."""
    t0 = time.perf_counter()
    path = Path(path).expanduser()
    if not path.exists():
        raise ModelLoadError(f"model not found at {path}")
    if path.is_dir():
        loaded = _load_mlx_dir(path, weights)
        tokenizer = Tokenizer.from_hf_dir(path)
    else:
        loaded = load_gguf(path, weights)
        tokenizer = Tokenizer.from_gguf_metadata(loaded.metadata, str(path))
    return ModelBundle(loaded, tokenizer, (time.perf_counter() - t0) * 1000)


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
