"""Whisper encoder-decoder in MLX (fp32).

Parameter names follow mlx-examples' Whisper port (``encoder.blocks.0.attn.query.weight``,
``mlp1``/``mlp2``...), so a directory written by its converter loads as is.

On the CPU with the engine's kernels, the unmasked attentions -- the encoder's 1500 x 1500
self-attention and the decoder's cross-attention over the window -- run in the fused attention
kernel (engine/kernels/src/attention.cpp: no 1500 x 1500 score matrix, vectorised exp, every
head's K/V block read once per query tile); their keys are then kept in the natural
``(batch, heads, time, head_dim)`` layout the kernel reads. So does the decoder's causal
self-attention (its cache keeps natural keys; without the kernels, MLX's matmuls over
transposed ones). A decoder step's linears and output projection run on float16 copies of
weights that are float16 to begin with (``TextDecoder.use_half_weights``): a step is bound by
reading them.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import asdict, dataclass

from engine import kernels
from engine.speech.fastmath import gelu, softmax

import mlx.core as mx
import mlx.nn as nn
import numpy as np


@dataclass(frozen=True)
class WhisperDims:
    n_mels: int
    n_audio_ctx: int
    n_audio_state: int
    n_audio_head: int
    n_audio_layer: int
    n_vocab: int
    n_text_ctx: int
    n_text_state: int
    n_text_head: int
    n_text_layer: int

    def to_dict(self) -> dict:
        return asdict(self)


def sinusoids(length: int, channels: int, max_timescale: float = 10000.0) -> mx.array:
    """Whisper's fixed encoder position embedding: [sin | cos] of geometric timescales."""
    inc = math.log(max_timescale) / (channels // 2 - 1)
    inv = mx.exp(-inc * mx.arange(channels // 2, dtype=mx.float32))
    t = mx.arange(length, dtype=mx.float32)[:, None] * inv[None, :]
    return mx.concatenate([mx.sin(t), mx.cos(t)], axis=1)


# Rows up to which a linear with float16 weights runs in the half-weight kernel; more rows
# (a long prompt) go to MLX's float32 matmul, which reuses each weight across many rows.
HALF_ROWS_MAX = 32


class Linear(nn.Linear):
    """``nn.Linear`` that, once given a float16 copy of its weight (:meth:`use_half`), runs few
    rows in the kernels' float16-weight matmul: a decoder step reads half the bytes, converted
    in registers (MLX's CPU matmul would convert a float16 weight to a float32 copy per call)."""

    def use_half(self, weight: mx.array) -> None:
        self._half = weight  # "_": not a parameter (not saved, not updated)

    def __call__(self, x: mx.array) -> mx.array:
        half = getattr(self, "_half", None)
        if half is not None and x.size // x.shape[-1] <= HALF_ROWS_MAX:
            return kernels.half_matmul(x, half, self.get("bias"))
        return super().__call__(x)


class MultiHeadAttention(nn.Module):
    def __init__(self, n_state: int, n_head: int):
        super().__init__()
        self.n_head = n_head
        self.query = Linear(n_state, n_state)
        self.key = Linear(n_state, n_state, bias=False)
        self.value = Linear(n_state, n_state)
        self.out = Linear(n_state, n_state)

    @property
    def fused(self) -> bool:
        """True when unmasked attention runs in the engine's fused kernel (see the module doc)."""
        head_dim = self.query.weight.shape[0] // self.n_head
        return (kernels.available() and mx.default_device() == mx.cpu and head_dim % 16 == 0
                and self.query.weight.dtype == mx.float32)

    def kv(self, x: mx.array, natural: bool = False) -> tuple[mx.array, mx.array]:
        """Transposed keys ``(batch, heads, head_dim, time)`` (``natural``: ``(batch, heads,
        time, head_dim)``, as ``attend`` reads them) and values ``(batch, heads, time, head_dim)``.

        Both are made contiguous: a strided operand makes every decoder step copy them.
        """
        b, t, _ = x.shape
        k = self.key(x).reshape(b, t, self.n_head, -1)
        k = k.transpose(0, 2, 1, 3) if natural else k.transpose(0, 2, 3, 1)
        return mx.contiguous(k), mx.contiguous(self._heads(self.value(x)))

    def qkv(self, x: mx.array) -> tuple[mx.array, mx.array, mx.array]:
        """Queries, keys and values of ``x`` (batch, time, n_state) each: one float16-weight
        product for few rows once the decoder made the stacked copy (``use_half_weights``)."""
        stacked = getattr(self, "_qkv_half", None)
        if stacked is not None and x.size // x.shape[-1] <= HALF_ROWS_MAX:
            return tuple(mx.split(kernels.half_matmul(x, *stacked), 3, axis=-1))
        return self.query(x), self.key(x), self.value(x)

    def self_attend(self, x: mx.array, cache: tuple | None, mask: mx.array | None) -> tuple[mx.array, tuple]:
        """The decoder's causal self-attention of the new positions ``x`` over the cached ones and
        themselves; returns the output and the layer's new cache entry ``(keys, values)``. Fused:
        keys in the natural layout, the kernel's causal rule (``mask`` unused); else transposed
        keys and MLX's matmuls with ``mask``."""
        if not self.fused:
            k, v = self.kv(x)
            if cache:
                k, v = mx.concatenate([cache[0], k], axis=3), mx.concatenate([cache[1], v], axis=2)
            return self(x, k, v, mask), (k, v)
        b, t, d = x.shape
        q, k, v = self.qkv(x)
        k, v = self._heads(k), self._heads(v)
        offset = 0
        if cache:
            offset = cache[0].shape[2]
            k, v = mx.concatenate([cache[0], k], axis=2), mx.concatenate([cache[1], v], axis=2)
        else:
            k, v = mx.contiguous(k), mx.contiguous(v)
        out = kernels.flash_attention(self._heads(q), k, v, (d // self.n_head) ** -0.5,
                                      causal_offset=offset if t > 1 else None)
        return self.out(out.transpose(0, 2, 1, 3).reshape(b, t, d)), (k, v)

    def attend(self, x: mx.array, k: mx.array, v: mx.array) -> mx.array:
        """Unmasked attention of ``x`` over natural-layout ``k``/``v`` in the fused kernel; keys
        of batch 1 serve every row of ``x`` (beams share the window's cross-attention K/V)."""
        b, t, d = x.shape
        h = self.n_head
        q = self._heads(self.query(x))
        shared = k.shape[0] == 1 and b > 1
        if shared:  # the beams become more query rows of one problem
            q = q.transpose(1, 0, 2, 3).reshape(1, h, b * t, -1)
        out = kernels.flash_attention(q, k, v, (d // h) ** -0.5)
        if shared:
            out = out.reshape(h, b, t, -1).transpose(1, 0, 2, 3)
        return self.out(out.transpose(0, 2, 1, 3).reshape(b, t, d))

    def _heads(self, x: mx.array) -> mx.array:
        b, t, _ = x.shape
        return x.reshape(b, t, self.n_head, -1).transpose(0, 2, 1, 3)

    def __call__(self, x: mx.array, k_t: mx.array, v: mx.array, mask: mx.array | None = None):
        b, t, d = x.shape
        q = self._heads(self.query(x) * (d // self.n_head) ** -0.5)
        scores = q @ k_t
        if mask is not None:
            scores = scores + mask
        out = (softmax(scores) @ v).transpose(0, 2, 1, 3).reshape(b, t, d)
        return self.out(out)


class ResidualAttentionBlock(nn.Module):
    def __init__(self, n_state: int, n_head: int, cross_attention: bool = False):
        super().__init__()
        self.attn = MultiHeadAttention(n_state, n_head)
        self.attn_ln = nn.LayerNorm(n_state)
        if cross_attention:
            self.cross_attn = MultiHeadAttention(n_state, n_head)
            self.cross_attn_ln = nn.LayerNorm(n_state)
        self.mlp1 = Linear(n_state, 4 * n_state)
        self.mlp2 = Linear(4 * n_state, n_state)
        self.mlp_ln = nn.LayerNorm(n_state)

    def mlp(self, x: mx.array) -> mx.array:
        return self.mlp2(gelu(self.mlp1(self.mlp_ln(x))))


class AudioEncoder(nn.Module):
    def __init__(self, dims: WhisperDims):
        super().__init__()
        d = dims.n_audio_state
        self.conv1 = nn.Conv1d(dims.n_mels, d, kernel_size=3, padding=1)
        self.conv2 = nn.Conv1d(d, d, kernel_size=3, stride=2, padding=1)
        # Overwritten by the checkpoint's stored table when it has one (CTranslate2 does).
        self.positional_embedding = sinusoids(dims.n_audio_ctx, d)
        self.blocks = [ResidualAttentionBlock(d, dims.n_audio_head) for _ in range(dims.n_audio_layer)]
        self.ln_post = nn.LayerNorm(d)

    def __call__(self, mel: mx.array, between_layers: Callable[[], None] | None = None) -> mx.array:
        """``mel`` (batch, frames, n_mels) -> audio features (batch, frames // 2, n_state).

        A full window is 3000 frames (1500 positions); fewer frames (an even number) give
        a trimmed context: the positional embedding is sliced to the positions present,
        as whisper.cpp's ``audio_ctx`` does (see ``TranscribeOptions.context_margin_s``).
        ``between_layers()`` is called after each block (streaming uses it to abandon
        stale work by raising).
        """
        x = gelu(self.conv1(mel))
        x = gelu(self.conv2(x))
        n_ctx, d = self.positional_embedding.shape
        if mel.shape[1] % 2 or x.shape[1] > n_ctx or x.shape[2] != d:
            raise ValueError(f"encoder input gives {x.shape[1:]}, expected at most {(n_ctx, d)} from an even frame count")
        x = x + self.positional_embedding[:x.shape[1]]
        for block in self.blocks:
            h = block.attn_ln(x)
            if block.attn.fused:
                x = x + block.attn.attend(h, *block.attn.kv(h, natural=True))
            else:
                x = x + block.attn(h, *block.attn.kv(h))
            x = x + block.mlp(x)
            if between_layers is not None:
                between_layers()
        return self.ln_post(x)


def _exact_half(w) -> mx.array | None:
    """The float16 copy of float32 ``w`` when every value is a float16 one, else None (also for
    a quantized layer's packed weight)."""
    if not isinstance(w, mx.array) or w.dtype != mx.float32:
        return None
    half = w.astype(mx.float16)
    return half if mx.array_equal(half.astype(mx.float32), w).item() else None


class TextDecoder(nn.Module):
    def __init__(self, dims: WhisperDims):
        super().__init__()
        d = dims.n_text_state
        self.token_embedding = nn.Embedding(dims.n_vocab, d)
        self.positional_embedding = mx.zeros((dims.n_text_ctx, d))
        self.blocks = [
            ResidualAttentionBlock(d, dims.n_text_head, cross_attention=True)
            for _ in range(dims.n_text_layer)
        ]
        self.ln = nn.LayerNorm(d)
        self._embedding_t: mx.array | None = None
        self._embedding_half: mx.array | None = None

    def use_half_weights(self) -> bool:
        """Run decoder steps on float16 copies of the weights where that loses nothing: every
        linear of the blocks and the output projection whose float32 weight is exactly a float16
        one (a model converted from float16, as CTranslate2's tiny.en is), when the CPU kernels
        have ``half_matmul``. A step then streams half the bytes (the projection alone is 80 MB
        in float32). Returns whether they are used; the results differ from MLX's float32
        matmul in the last bits only (another summation order)."""
        if not (kernels.available() and kernels.has("half_matmul")):
            return False
        singles = [layer for block in self.blocks
                   for layer in (block.attn.out, block.cross_attn.query, block.cross_attn.out, block.mlp1, block.mlp2)]
        # The self-attention's q, k and v as one stacked product (MultiHeadAttention.qkv).
        stacked = [mx.concatenate([b.attn.query.weight, b.attn.key.weight, b.attn.value.weight]) for b in self.blocks]
        halves = [_exact_half(w) for w in [getattr(layer, "weight", None) for layer in singles]
                  + stacked + [self.token_embedding.weight]]
        if any(h is None for h in halves):
            return False
        mx.eval(halves)
        for layer, h in zip(singles, halves, strict=False):
            layer.use_half(h)
        for block, h in zip(self.blocks, halves[len(singles):], strict=False):
            a = block.attn
            a._qkv_half = (h, mx.concatenate([a.query.bias, mx.zeros_like(a.query.bias), a.value.bias]))
            mx.eval(a._qkv_half)
        self._embedding_half = halves[-1]
        return True

    def cache_prefix(self, cache: list, keep: int) -> list:
        """The self-attention cache of the first ``keep`` positions (keys natural or transposed,
        as ``MultiHeadAttention.self_attend`` keeps them)."""
        if self.blocks[0].attn.fused:
            return [(k[:, :, :keep], v[:, :, :keep]) for k, v in cache]
        return [(k[..., :keep], v[:, :, :keep]) for k, v in cache]

    def cross_kv(self, audio_features: mx.array) -> list[tuple[mx.array, mx.array]]:
        """Cross-attention keys/values of every layer, computed once per 30-s window (keys in
        the layout the layer's attention reads: see ``MultiHeadAttention.fused``)."""
        return [block.cross_attn.kv(audio_features, natural=block.cross_attn.fused) for block in self.blocks]

    def __call__(self, tokens: mx.array, cross: list, cache: list | None = None):
        """Final hidden states for ``tokens`` (batch, n) and the updated self-attention cache.

        ``cross`` is :meth:`cross_kv` of the window (batch 1 broadcasts over beams); ``cache``
        holds per-layer ``(k_t, v)`` of earlier positions, or is None for the first call.
        """
        offset = cache[0][1].shape[2] if cache else 0
        n = tokens.shape[1]
        x = self.token_embedding(tokens) + self.positional_embedding[offset:offset + n]
        mask = None
        if n > 1 and not self.blocks[0].attn.fused:  # causal within the new tokens; all cached positions are visible
            mask = mx.triu(mx.full((n, n), -1e9, dtype=x.dtype), k=1)
            if offset:
                mask = mx.concatenate([mx.zeros((n, offset), dtype=x.dtype), mask], axis=1)
        new_cache = []
        for i, block in enumerate(self.blocks):
            a, entry = block.attn.self_attend(block.attn_ln(x), cache[i] if cache else None, mask)
            new_cache.append(entry)
            x = x + a
            ca, hc = block.cross_attn, block.cross_attn_ln(x)
            x = x + (ca.attend(hc, *cross[i]) if ca.fused else ca(hc, *cross[i]))
            x = x + block.mlp(x)
        return self.ln(x), new_cache

    def logits(self, hidden: mx.array) -> np.ndarray:
        """Output projection (tied to the token embedding) of ``hidden (..., d)``, as float32 numpy.

        Few rows run on the embedding's float16 copy (:meth:`use_half_weights`). Otherwise it
        uses a contiguous ``(d, vocab)`` copy of the embedding: ``x @ W.T`` on the
        ``(vocab, d)`` matrix is ~2x slower on the CPU backend, and this product is most of a
        decoder step. (numpy's own BLAS is faster in isolation but its spinning threads slow
        the MLX work around it, so the product stays in MLX.)
        """
        if self._embedding_half is not None and hidden.size // hidden.shape[-1] <= HALF_ROWS_MAX:
            return np.array(kernels.half_matmul(hidden, self._embedding_half), dtype=np.float32)
        if self._embedding_t is None:  # built once, after the weights are loaded
            self._embedding_t = mx.contiguous(self.token_embedding.weight.T)
        return np.array(hidden @ self._embedding_t, dtype=np.float32)


class Whisper(nn.Module):
    def __init__(self, dims: WhisperDims):
        super().__init__()
        self.dims = dims
        self.encoder = AudioEncoder(dims)
        self.decoder = TextDecoder(dims)
