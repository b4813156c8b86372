"""Which weight format a model runs in, per backend (``model.weights: auto`` in a profile).

On Metal/CUDA the quantized kernels are fast and save memory bandwidth: keep quantized.
On the CPU it depends on the engine's kernel extension (engine/kernels):
  * with it (x86 with AVX2+FMA, module built): keep the GGUF's quantized weights; its matmul
    reads the packed weights once per call, multi-threaded, with int8 activations: SmolLM2
    decodes 2.9x faster than fp32 OpenBLAS and prefills 1.1x, in a quarter of the memory
    (docs/benchmarks.md, docs/kernels.md).
  * without it: MLX's own CPU quantized matmul is scalar and single-threaded, slower per byte
    than OpenBLAS sgemm (docs/benchmarks.md measured 14.8x slower prefill and 0.72x decode
    vs fp32), so dequantize to fp32 and say so once.
A profile's ``model.weights`` overrides this.
"""

from __future__ import annotations

from engine import blas, kernels

import mlx.core as mx


def backend() -> str:
    """"metal", "cuda" or "cpu"."""
    if mx.default_device() == mx.gpu:
        return "cuda" if getattr(mx, "cuda", None) and mx.cuda.is_available() else "metal"
    return "cpu"


def choose_weights(requested: str = "auto") -> str:
    """The concrete format for ``requested`` (one of auto, quantized, fp32, fp16, bf16)."""
    if requested != "auto":
        return requested
    if backend() != "cpu":
        return "quantized"
    return "quantized" if kernels.available() else "fp32"


def blas_note() -> str | None:
    """One line to show once when the CPU backend runs without OpenBLAS or without the engine's
    CPU kernels, else None."""
    if backend() != "cpu":
        return None
    notes = []
    st = blas.status()
    if not st["path"]:
        notes.append(f"running on MLX's reference BLAS ({st['reason']}); expect slow CPU inference")
    k = kernels.note()
    if k:
        notes.append(k)
    return "; ".join(notes) or None
