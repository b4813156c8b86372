"""GGUF Q6_K weights kept as the file stores them, as a linear layer.

A Q4_K_M file keeps its output head and half its FFN down projections in Q6_K: 210 bytes per
256 weights (6.56 bits). The kernels' other formats have no exact form of its 16-value
sub-blocks, so these tensors used to be re-quantized to 8 bits (8.5 bits a weight, ~10% more
bytes per decoded token on Qwen2.5-Coder-1.5B). ``Q6KLinear`` holds the raw blocks and runs
``kernels.q6k_matmul`` on them (src/q6k.h: int8 activations per 256 values, exact integer
block sums, the same bits for any row count); anywhere else (another device, no kernels) it
dequantizes with MLX ops, and ``dense`` / ``to_quantized`` give MLX's own layers for
``densify`` and the stock-MLX benchmark arm.
"""

from __future__ import annotations

from engine import kernels

import mlx.core as mx
import mlx.nn as nn

BLOCK_VALUES = 256
BLOCK_BYTES = 210


def row_bytes(K: int) -> int:
    return K // BLOCK_VALUES * BLOCK_BYTES


def dequantize(w: mx.array, dtype: mx.Dtype = mx.float32) -> mx.array:
    """Raw Q6_K blocks (N, K / 256 * 210) uint8 -> (N, K) weights, as ggml dequantizes them:
    (d * scale) * (q - 32), in float32 then cast."""
    N, nsb = w.shape[0], w.shape[1] // BLOCK_BYTES
    b = w.reshape(N, nsb, BLOCK_BYTES)
    ql = b[..., :128].reshape(N, nsb, 2, 64)
    qh = b[..., 128:192].reshape(N, nsb, 2, 32)
    lo, hi = ql[..., :32], ql[..., 32:]
    q = mx.stack(
        [
            (lo & 15) | ((qh & 3) << 4),
            (hi & 15) | (((qh >> 2) & 3) << 4),
            (lo >> 4) | (((qh >> 4) & 3) << 4),
            (hi >> 4) | (((qh >> 6) & 3) << 4),
        ],
        axis=3,
    ).reshape(N, nsb, 16, 16)
    sc = mx.contiguous(b[..., 192:208]).view(mx.int8).astype(mx.float32)
    d = mx.contiguous(b[..., 208:210]).view(mx.float16).astype(mx.float32)
    dense = (d * sc)[..., None] * (q.astype(mx.float32) - 32.0)
    return dense.reshape(N, nsb * BLOCK_VALUES).astype(dtype)


class Q6KLinear(nn.Module):
    """``x @ W.T (+ bias)`` with W in GGUF Q6_K blocks (``weight``: uint8 (N, K / 256 * 210))."""

    # The kernels' name of this layout (QmmProblem::bits, kernels._weights, kernels.qparams).
    bits = 6
    group_size = BLOCK_VALUES
    q6k_blocks = True

    def __init__(self, input_dims: int, output_dims: int, bias: bool = False):
        super().__init__()
        if input_dims % BLOCK_VALUES:
            raise ValueError(f"Q6_K needs input features in multiples of 256, not {input_dims}")
        self.weight = mx.zeros((output_dims, row_bytes(input_dims)), dtype=mx.uint8)
        if bias:
            self.bias = mx.zeros((output_dims,))

    @property
    def input_dims(self) -> int:
        return self["weight"].shape[1] // BLOCK_BYTES * BLOCK_VALUES

    def __call__(self, x: mx.array) -> mx.array:
        if runs_on_kernels(self):
            y = kernels.q6k_matmul(x if x.dtype == mx.float32 else x.astype(mx.float32), self["weight"])
            y = y if x.dtype == mx.float32 else y.astype(x.dtype)
        else:
            y = x @ dequantize(self["weight"], x.dtype).T
        if "bias" in self:
            y = y + self["bias"]
        return y

    def dense(self, dtype: mx.Dtype = mx.float32) -> nn.Linear:
        """The same layer as a dense ``nn.Linear`` (``densify``)."""
        lin = nn.Linear(self.input_dims, self["weight"].shape[0], bias="bias" in self)
        lin.weight = dequantize(self["weight"], dtype)
        if "bias" in self:
            lin.bias = self["bias"].astype(dtype)
        return lin

    def to_quantized(self, group_size: int = 32, bits: int = 8) -> nn.QuantizedLinear:
        """MLX's own quantized layer of these weights (the stock-MLX arm of ``bench engine``)."""
        return nn.QuantizedLinear.from_linear(self.dense(), group_size=group_size, bits=bits)


def runs_on_kernels(m: nn.Module) -> bool:
    """Whether Q6_K layer ``m`` runs its matmul on the kernels now (the CPU, kernels built)."""
    return kernels.has("q6k_matmul") and mx.default_device() == mx.cpu
