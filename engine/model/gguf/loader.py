"""Build an mlx_lm model from a GGUF file.

``weights`` picks how tensors become MLX arrays:
  * ``"quantized"``: ggml types that are exactly MLX-affine (Q4_0/Q4_1/Q5_0/Q5_1/Q8_0/Q4_K/
    Q5_K) stay packed (QuantizedLinear/QuantizedEmbedding, group 32, float32 scales so
    the values are bit-exact and activations run in float32); other matrices (Q6_K, F16)
    are dequantized to float16; 1-D tensors (norms, biases) stay float32.
    With the engine's CPU kernels active (engine/kernels) the CPU runs this format too:
    Q6_K output heads and FFN down projections keep their own blocks (engine.kernels.q6k), other
    Q6_K matrices are re-quantized to 8-bit affine, and other dense matrices are kept in
    float32 (MLX's CPU float16 matmul has no fast path), so every matmul is a kernel call.
  * ``"fp32"`` / ``"fp16"`` / ``"bf16"``: every tensor dequantized to that dtype.
"""

from __future__ import annotations

import dataclasses
import importlib
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from engine import kernels
from engine.errors import ModelLoadError
from engine.kernels import q6k
from engine.kernels.q6k import Q6KLinear
from engine.model.gguf import cache as gguf_cache
from engine.model.gguf.arch import ARCHS, ArchSpec, Meta, check_args, unpermute_rows
from engine.model.gguf.ggml_types import FILE_TYPES
from engine.model.gguf.quants import AFFINE_TYPES, SUPPORTED, dequantize, to_affine, to_affine8
from engine.model.gguf.reader import GGUFFile, TensorInfo, read_gguf

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx.utils import tree_flatten, tree_unflatten

WEIGHT_FORMATS = ("quantized", "fp32", "fp16", "bf16")


@dataclass
class LoadedModel:
    model: nn.Module  # an mlx_lm ``Model``; call it with ``cache=make_prompt_cache(model)``
    model_type: str  # mlx_lm module name: llama, qwen2, gemma3_text
    config: dict[str, Any]  # the ModelArgs fields
    metadata: dict[str, Any]  # GGUF metadata (tokenizer.*, general.*, ...)
    weight_format: str  # one of WEIGHT_FORMATS
    path: Path
    file_type: str  # quant name of the file, e.g. "Q4_K_M"
    n_params: int


def load_gguf(path: str | Path, weights: str = "quantized") -> LoadedModel:
    """Load a llama / qwen2 / gemma3 GGUF file into an mlx_lm model."""
    path = Path(path)
    if weights not in WEIGHT_FORMATS:
        raise ModelLoadError(
            f"{path}: unknown weight format '{weights}' (choose {', '.join(WEIGHT_FORMATS)})."
        )
    gg = read_gguf(path)
    spec = _spec(gg)
    for name, info in gg.tensors.items():
        if info.type_name not in SUPPORTED:
            raise ModelLoadError(
                f"{path}: tensor {name} has unsupported quant type {info.type_name}."
            )
    shapes = {name: t.shape for name, t in gg.tensors.items()}
    args = spec.build_args(Meta(path, spec.arch, gg.metadata), shapes)
    check_args(path, args, shapes)
    module = importlib.import_module(f"mlx_lm.models.{spec.model_type}")
    mode = gguf_cache.mode(weights)
    cached = gguf_cache.load(path, mode) if mode else None
    if cached is not None:
        try:
            model = _build(path, spec, module, args, *cached)
        except ModelLoadError as e:  # stale or damaged entry: the GGUF itself decides
            gguf_cache.discard(gguf_cache.entry_path(path, mode), f"unusable ({e})")
            cached = None
    if cached is None:
        converted = _convert(gg, spec, args, weights)
        model = _build(path, spec, module, args, *converted)
        if mode:
            gguf_cache.save(path, mode, converted)
    return LoadedModel(
        model=model,
        model_type=spec.model_type,
        config=dataclasses.asdict(model.args),
        metadata=gg.metadata,
        weight_format=weights,
        path=path,
        file_type=_file_type(gg),
        n_params=sum(t.n_values for t in gg.tensors.values()),
    )


def _build(path: Path, spec: ArchSpec, module, args: dict[str, Any],
           arrays: dict[str, mx.array], bits: dict[str, int]) -> nn.Module:
    """A fresh mlx_lm model of ``module`` holding ``arrays`` (packed where ``bits`` says)."""
    try:
        model = module.Model(module.ModelArgs.from_dict(args))
    except (ValueError, TypeError, ZeroDivisionError, AssertionError) as e:
        raise ModelLoadError(f"{path}: metadata gives an invalid model shape ({e}).") from None
    arrays = model.sanitize(dict(arrays))
    packed = {p: b for p, b in bits.items() if b != Q6KLinear.bits}
    nn.quantize(
        model,
        class_predicate=lambda p, m: {"group_size": 32, "bits": packed[p]} if p in packed else False,
    )
    _use_q6k(model, [p for p, b in bits.items() if b == Q6KLinear.bits], arrays)
    _check_names(path, spec, model, arrays)
    try:
        model.load_weights(list(arrays.items()), strict=True)
    except ValueError as e:
        raise ModelLoadError(f"{path}: tensors do not fit the model ({e}).") from None
    mx.eval(model.parameters())
    model.eval()
    return model


def _spec(gg: GGUFFile) -> ArchSpec:
    arch = gg.architecture
    if arch not in ARCHS:
        raise ModelLoadError(
            f"{gg.path}: unknown architecture '{arch}' (supported: {', '.join(ARCHS)})."
        )
    return ARCHS[arch]


def _convert(
    gg: GGUFFile, spec: ArchSpec, args: dict[str, Any], weights: str
) -> tuple[dict[str, mx.array], dict[str, int]]:
    """GGUF tensors -> {mlx_lm name: array}, plus {module path: bits} for packed ones."""
    arrays: dict[str, mx.array] = {}
    bits: dict[str, int] = {}
    on_kernels = weights == "quantized" and kernels.available()
    for name, info in gg.tensors.items():
        hf = spec.hf_name(name)
        if hf is None:
            raise ModelLoadError(
                f"{gg.path}: unexpected tensor {name} for architecture '{spec.arch}'."
            )
        rows = _row_order(spec, args, name, info)
        raw = gg.tensor_bytes(name)
        matrix = weights == "quantized" and len(info.shape) == 2
        requant = matrix and on_kernels and info.type_name == "Q6_K"
        module_path = hf.rsplit(".", 1)[0]
        if requant and _keeps_q6k(module_path, info):
            arrays[hf] = mx.array(_rows(raw.reshape(info.shape[0], -1), rows))
            bits[module_path] = Q6KLinear.bits
            continue
        if (matrix and info.type_name in AFFINE_TYPES) or requant:
            conv = to_affine8 if requant else to_affine
            a = conv(raw, info.ggml_type, info.shape)
            for suffix, arr in (("weight", a.weight), ("scales", a.scales), ("biases", a.biases)):
                arrays[f"{module_path}.{suffix}"] = mx.array(_rows(arr, rows))
            bits[module_path] = a.bits
            continue
        dense = dequantize(raw, info.ggml_type, info.shape, np.float32)
        if spec.norm_shift and name.endswith("norm.weight"):
            dense -= spec.norm_shift
        fmt = "fp32" if on_kernels else weights
        arrays[hf] = _to_mx(_rows(dense, rows), fmt, len(info.shape))
    return arrays, bits


# Q6_K matrices the kernels run in their own blocks (engine.kernels.q6k): those that run as a
# plain linear or as the decoder primitive's down projection. The others (attention inputs,
# gate/up, embeddings: the kernels' shared-activation paths read 4/5/8 bits only) are
# re-quantized to 8 bits.
_Q6K_MODULES = ("lm_head", "mlp.down_proj")


def _keeps_q6k(module_path: str, info: TensorInfo) -> bool:
    return (
        module_path.endswith(_Q6K_MODULES)
        and info.shape[-1] % q6k.BLOCK_VALUES == 0
        and kernels.has("q6k_matmul")
    )


def _use_q6k(model: nn.Module, paths: list[str], arrays: dict[str, mx.array]) -> None:
    """Swap the linears at ``paths`` for Q6KLinear layers of the same shape."""
    modules = dict(model.named_modules())
    swaps = []
    for p in paths:
        m = modules.get(p)
        if not isinstance(m, nn.Linear):
            continue  # _check_names reports what does not fit
        N, K = m.weight.shape
        swaps.append((p, Q6KLinear(K, N, bias=f"{p}.bias" in arrays)))
    if swaps:
        model.update_modules(tree_unflatten(swaps))


def _row_order(spec: ArchSpec, args: dict[str, Any], name: str, info: TensorInfo) -> np.ndarray | None:
    if not spec.permute_qk:
        return None
    if ".attn_q." in name:
        return unpermute_rows(info.shape[0], args["num_attention_heads"])
    if ".attn_k." in name:
        return unpermute_rows(info.shape[0], args["num_key_value_heads"])
    return None


def _rows(arr: np.ndarray, order: np.ndarray | None) -> np.ndarray:
    return arr if order is None else arr[order]


def _to_mx(dense: np.ndarray, weights: str, ndim: int) -> mx.array:
    if weights == "fp32" or (weights == "quantized" and ndim == 1):
        return mx.array(dense)
    if weights == "bf16":
        return mx.array(dense).astype(mx.bfloat16)
    return mx.array(dense.astype(np.float16))


def _check_names(path: Path, spec: ArchSpec, model: nn.Module, arrays: dict[str, mx.array]) -> None:
    expected = {k for k, _ in tree_flatten(model.parameters())}
    missing = sorted(expected - arrays.keys())
    if missing:
        shown = ", ".join(spec.gguf_name(m) for m in missing[:3])
        more = f" and {len(missing) - 3} more" if len(missing) > 3 else ""
        raise ModelLoadError(f"{path}: missing tensor {shown}{more}.")
    extra = sorted(arrays.keys() - expected)
    if extra:
        raise ModelLoadError(
            f"{path}: tensor {spec.gguf_name(extra[0])} does not fit a '{spec.arch}' model."
        )


def _file_type(gg: GGUFFile) -> str:
    ft = gg.metadata.get("general.file_type")
    if isinstance(ft, int) and ft in FILE_TYPES:
        return FILE_TYPES[ft]
    counts = Counter(t.type_name for t in gg.tensors.values() if len(t.shape) == 2)
    return counts.most_common(1)[0][0] if counts else "unknown"
