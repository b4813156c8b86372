"""Which weight format a model runs in, per backend (``model.weights: auto`` in a profile).

Measured with ``mlxterm bench engine`` (docs/benchmarks.md, SmolLM2 on a 2-core x86 CPU):
dense fp32 through OpenBLAS prefills 14.8x faster than MLX's CPU quantized matmul and decodes
1.32x faster; "hybrid" (fp32 prefill, packed decode) decodes at 0.72x of fp32. So the CPU
backend runs fp32. On Metal/CUDA the quantized kernels are fast and save memory bandwidth,
so keep quantized. A profile's ``model.weights`` overrides this.
"""

from __future__ import annotations

from engine import blas

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
    return "fp32" if backend() == "cpu" else "quantized"


def blas_note() -> str | None:
    """One line to show once when the CPU backend runs without OpenBLAS, else None."""
    if backend() != "cpu":
        return None
    st = blas.status()
    if st["path"]:
        return None
    return f"running on MLX's reference BLAS ({st['reason']}); expect slow CPU inference"
