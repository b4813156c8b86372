"""Route a model's quantized linears (and tied quantized output heads) to the CPU kernels,
and mlx_lm's attention to engine.kernels.attention.

``install(model)`` swaps the class of every ``nn.QuantizedLinear`` / ``nn.QuantizedEmbedding``
whose format the kernel reads (affine, 4/5/8 bits, group 32/64/128) for a subclass whose
forward pass calls ``engine.kernels.quantized_matmul``. The decision is re-made on every call,
so a model moved to another device, or traced under ``mx.compile`` on one, keeps working:
anything the kernel does not handle goes to MLX's own op. Parameters are untouched, so
checkpoints, ``densify`` and ``deepcopy`` see ordinary modules.

The same goes for ``nn.RMSNorm`` and ``nn.RoPE``: on the CPU they run as one fused primitive
each (``engine.kernels.rms_norm`` / ``rope``) instead of MLX's multi-op fallbacks, which cost
more in dispatch than in arithmetic at decode; a SwiGLU MLP (mlx_lm's llama/qwen2 ``MLP``) runs
its gate and up projections and the activation as one primitive. ``MLXTERM_NO_FUSED=1`` keeps MLX's ops for
them (A/B benchmarks).
"""

from __future__ import annotations

import os

from engine import kernels

import mlx.core as mx
import mlx.nn as nn


def _fits(m: nn.Module, K: int) -> bool:
    return (
        getattr(m, "mode", "affine") == "affine"
        and "biases" in m
        and kernels.supports_qmm(m.bits, m.group_size, K)
        and mx.default_device() == mx.cpu
    )


def _matmul(m: nn.Module, x: mx.array) -> mx.array:
    y = kernels.quantized_matmul(x, m["weight"], m["scales"], m["biases"], m.group_size, m.bits)
    return y if x.dtype == mx.float32 else y.astype(x.dtype)


class KernelQuantizedLinear(nn.QuantizedLinear):
    def __call__(self, x: mx.array) -> mx.array:
        if not _fits(self, x.shape[-1]):
            return super().__call__(x)
        y = _matmul(self, x)
        if "bias" in self:
            y = y + self["bias"]
        return y


class KernelQuantizedEmbedding(nn.QuantizedEmbedding):
    def as_linear(self, x: mx.array) -> mx.array:
        if not _fits(self, x.shape[-1]):
            return super().as_linear(x)
        return _matmul(self, x)


class KernelRMSNorm(nn.RMSNorm):
    def __call__(self, x: mx.array) -> mx.array:
        if x.dtype != mx.float32 or mx.default_device() != mx.cpu:
            return super().__call__(x)
        return kernels.rms_norm(x, self["weight"], self.eps)


class KernelRoPE(nn.RoPE):
    def __call__(self, x: mx.array, offset: int | mx.array = 0) -> mx.array:
        if x.ndim != 4 or x.dtype != mx.float32 or mx.default_device() != mx.cpu:
            return super().__call__(x, offset)
        return kernels.rope(
            x, self.dims, traditional=self.traditional, base=self.base, scale=self.scale, offset=offset
        )


_FUSED = {nn.RMSNorm: KernelRMSNorm, nn.RoPE: KernelRoPE}

# mlx_lm MLP classes whose forward pass is exactly down(swiglu(gate(x), up(x))).
_SWIGLU_MLPS = ("mlx_lm.models.llama", "mlx_lm.models.qwen2")
_mlp_classes: dict[type, type] = {}


def _swiglu_fits(mlp: nn.Module, x: mx.array) -> bool:
    g, u = mlp.gate_proj, mlp.up_proj
    return (
        type(g) is KernelQuantizedLinear
        and type(u) is KernelQuantizedLinear
        and "bias" not in g
        and "bias" not in u
        and (g.bits, g.group_size) == (u.bits, u.group_size)
        and g["weight"].shape == u["weight"].shape
        and _fits(g, x.shape[-1])
        and _fits(u, x.shape[-1])
    )


def _routed_mlp(base: type) -> type:
    cls = _mlp_classes.get(base)
    if cls is None:

        def __call__(self, x: mx.array) -> mx.array:
            if not _swiglu_fits(self, x):
                return base.__call__(self, x)
            h = kernels.quantized_swiglu(x, self.gate_proj, self.up_proj)
            return self.down_proj(h if x.dtype == mx.float32 else h.astype(x.dtype))

        cls = _mlp_classes[base] = type("Kernel" + base.__name__, (base,), {"__call__": __call__})
    return cls


def fused_enabled() -> bool:
    """False when ``MLXTERM_NO_FUSED`` asks for MLX's own norm and RoPE ops."""
    return not os.environ.get("MLXTERM_NO_FUSED")


def install(model: nn.Module) -> int:
    """Route ``model``'s quantized layers to the kernels; return how many were routed."""
    if not kernels.available():
        return 0
    from engine.kernels import attention

    attention.install()
    if "_routed_base" not in type(model).__dict__:
        model.__class__ = attention.routed(type(model))
    n = 0
    fused = fused_enabled()
    for _, m in model.named_modules():
        if type(m) is nn.QuantizedLinear:
            m.__class__ = KernelQuantizedLinear
            n += 1
        elif type(m) is nn.QuantizedEmbedding:
            m.__class__ = KernelQuantizedEmbedding
            n += 1
        elif fused and type(m) in _FUSED:  # exact types: subclasses (Gemma's norm) differ
            m.__class__ = _FUSED[type(m)]
        elif fused and type(m).__name__ == "MLP" and type(m).__module__ in _SWIGLU_MLPS:
            m.__class__ = _routed_mlp(type(m))
    return n


def remove_fused(model: nn.Module) -> None:
    """Back to MLX's own RMSNorm, RoPE and MLP forward passes; the quantized linears and
    attention stay routed (the decode-fusion A/B arm of ``bench engine``)."""
    for _, m in model.named_modules():
        if type(m) in (KernelRMSNorm, KernelRoPE) or type(m) in _mlp_classes.values():
            m.__class__ = type(m).__bases__[0]


def uninstall(model: nn.Module) -> None:
    """Back to MLX's own quantized ops and attention (for A/B benchmarks and tests)."""
    base = type(model).__dict__.get("_routed_base")
    if base is not None:
        model.__class__ = base
    for _, m in model.named_modules():
        if type(m) is KernelQuantizedLinear:
            m.__class__ = nn.QuantizedLinear
        elif type(m) is KernelQuantizedEmbedding:
            m.__class__ = nn.QuantizedEmbedding
    remove_fused(model)
