"""Route a model's quantized linears (and tied quantized output heads) to the CPU kernels,
and mlx_lm's attention to engine.kernels.attention.

``install(model)`` swaps the class of every ``nn.QuantizedLinear`` / ``nn.QuantizedEmbedding``
whose format the kernel reads (affine, 4/5/8 bits, group 32/64/128) for a subclass whose
forward pass calls ``engine.kernels.quantized_matmul``. The decision is re-made on every call,
so a model moved to another device, or traced under ``mx.compile`` on one, keeps working:
anything the kernel does not handle goes to MLX's own op. Parameters keep their values, so
``densify``, ``deepcopy`` and MLX's ops see ordinary modules; where compact copies of the
scales exist, the float32 scales and biases are unevaluated expressions of them
(``kernels.release_float_scales``: their memory is spent only if something reads them).

Design notes, measurements and history: docs/engine-notes.md (hook.py).
"""

from __future__ import annotations

import sys

from engine import kernels
from engine.kernels import q6k
from engine.kernels.q6k import Q6KLinear

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_unflatten


def _fits(m: nn.Module, K: int) -> bool:
    return (
        getattr(m, "mode", "affine") == "affine"
        and "biases" in m
        and kernels.supports_qmm(m.bits, m.group_size, K)
        and mx.default_device() == mx.cpu
    )


def runs_on_kernels(m: nn.Module, K: int) -> bool:
    """Whether ``m`` (a quantized linear or embedding-as-linear) runs its matmul of ``K``
    input features on the kernels now."""
    return type(m) in (KernelQuantizedLinear, KernelQuantizedEmbedding) and _fits(m, K)


def _matmul(m: nn.Module, x: mx.array) -> mx.array:
    y = kernels.quantized_matmul(
        x, *kernels.qparams(m), m.group_size, m.bits, symmetric=kernels.symmetric(m)
    )
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
    def __call__(self, x: mx.array) -> mx.array:
        # The looked-up rows' scales from the compact copies: indexing the module's arrays
        # would evaluate all of them where release_float_scales left expressions.
        rows = kernels.expand_scales(self, x)
        if rows is None:
            return super().__call__(x)
        return mx.dequantize(self["weight"][x], scales=rows[0], biases=rows[1],
                             group_size=self.group_size, bits=self.bits, mode=self.mode)

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


# mlx_lm TransformerBlock classes whose forward pass is exactly
# h = x + o(attn(rope(q(n1(x))), rope(k(n1(x))), v(n1(x)))); h + mlp(n2(h)).
_BLOCKS = _SWIGLU_MLPS
_block_classes: dict[type, type] = {}


# Prefill-sized layer inputs run the decoder primitives too (False: op by op, for A/B runs).
PREFILL_LAYERS = True


def _block_fits(block: nn.Module, x: mx.array, cache) -> bool:
    attn, mlp = block.self_attn, block.mlp
    q, k, v, o = attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj
    qkv = (q, k, v)
    return (
        x.ndim == 3
        and x.dtype == mx.float32
        and (PREFILL_LAYERS or x.shape[0] * x.shape[1] < kernels.dense_rows())
        and mx.default_device() == mx.cpu
        and not hasattr(cache, "bits")  # quantized KV: mlx_lm's own path
        and type(block.input_layernorm) is KernelRMSNorm
        and type(block.post_attention_layernorm) is KernelRMSNorm
        and type(attn.rope) is KernelRoPE
        and attn.rope.dims <= q["weight"].shape[0] // attn.n_heads
        and all(type(m) is KernelQuantizedLinear and _fits(m, x.shape[-1]) for m in qkv)
        and len({m.group_size for m in qkv}) == 1
        and len({"bias" in m for m in qkv}) == 1
        and type(o) is KernelQuantizedLinear
        and "bias" not in o
        and _fits(o, o["weight"].shape[1] * 32 // o.bits)
        and type(mlp) in _mlp_classes.values()
        and _swiglu_fits(mlp, x)
        and _down_fits(mlp.down_proj, mlp.gate_proj["weight"].shape[0])
    )


def _down_fits(down: nn.Module, K: int) -> bool:
    if "bias" in down:
        return False
    if type(down) is Q6KLinear:  # GGUF Q6_K blocks: the primitive runs their own kernel
        return down.input_dims == K and q6k.runs_on_kernels(down)
    return type(down) is KernelQuantizedLinear and _fits(down, K)


def _routed_block(base: type) -> type:
    cls = _block_classes.get(base)
    if cls is None:
        module = sys.modules[base.__module__]

        def __call__(self, x: mx.array, mask=None, cache=None) -> mx.array:
            if not _block_fits(self, x, cache):
                return base.__call__(self, x, mask, cache)
            attn, rope, n1 = self.self_attn, self.self_attn.rope, self.input_layernorm
            q, k, v = kernels.norm_qkv_rope(
                x, n1["weight"], n1.eps, attn.q_proj, attn.k_proj, attn.v_proj,
                cache.offset if cache is not None else 0, attn.n_heads, attn.n_kv_heads,
                rope_dims=rope.dims, traditional=rope.traditional, base=rope.base, scale=rope.scale,
            )
            if cache is not None:
                k, v = cache.update_and_fetch(k, v)
            # Looked up per call: engine.kernels.attention and speculation's row-exact
            # attention are installed into the model module by name.
            a = module.scaled_dot_product_attention(q, k, v, cache=cache, scale=attn.scale, mask=mask)
            mlp, n2 = self.mlp, self.post_attention_layernorm
            return kernels.attn_out_mlp(
                a, x, attn.o_proj, n2["weight"], n2.eps, mlp.gate_proj, mlp.up_proj, mlp.down_proj
            )

        cls = _block_classes[base] = type("Kernel" + base.__name__, (base,), {"__call__": __call__})
    return cls


# The fused norm, RoPE, SwiGLU and decoder-layer primitives (False: MLX's own ops, A/B runs).
FUSED = True
# Drop the float32 scales and biases that compact copies stand for (release_float_scales;
# False keeps both, for A/B runs).
RELEASE_FLOAT_SCALES = True


def fused_enabled() -> bool:
    """False when ``FUSED`` is off: MLX's own norm and RoPE ops."""
    return FUSED


def fused_active() -> bool:
    """Whether the kernels' fused primitives run here: the kernels serve the default device
    (the CPU) and ``FUSED`` is on."""
    return kernels.available() and fused_enabled()


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
        if type(m) in (nn.QuantizedLinear, nn.QuantizedEmbedding):
            m.__class__ = KernelQuantizedLinear if type(m) is nn.QuantizedLinear else KernelQuantizedEmbedding
            if kernels.compact_scales(m) and RELEASE_FLOAT_SCALES:
                kernels.release_float_scales(m)
            n += 1
        elif fused and type(m) in _FUSED:  # exact types: subclasses (Gemma's norm) differ
            m.__class__ = _FUSED[type(m)]
        elif fused and type(m).__name__ == "MLP" and type(m).__module__ in _SWIGLU_MLPS:
            m.__class__ = _routed_mlp(type(m))
        elif fused and type(m).__name__ == "TransformerBlock" and type(m).__module__ in _BLOCKS:
            m.__class__ = _routed_block(type(m))
    return n


def remove_fused(model: nn.Module) -> None:
    """Back to MLX's own RMSNorm, RoPE, MLP and decoder-layer forward passes; the quantized
    linears and attention stay routed (the decode-fusion A/B arm of ``bench engine``)."""
    for _, m in model.named_modules():
        if (type(m) in (KernelRMSNorm, KernelRoPE) or type(m) in _mlp_classes.values()
                or type(m) in _block_classes.values()):
            m.__class__ = type(m).__bases__[0]


def remove_blocks(model: nn.Module) -> None:
    """Back to the layer-by-layer forward pass with the single fused ops (norm, RoPE, SwiGLU)
    still routed: the decoder-layer A/B arm of ``bench engine`` (``engine_ops``)."""
    for _, m in model.named_modules():
        if type(m) in _block_classes.values():
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
    # MLX has no Q6_K layer: its own 8-bit one of the same weights.
    q6k_layers = [(name, m.to_quantized()) for name, m in model.named_modules() if type(m) is Q6KLinear]
    if q6k_layers:
        model.update_modules(tree_unflatten(q6k_layers))
    remove_fused(model)
