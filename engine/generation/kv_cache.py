"""KV caches that also run inside a compiled, shape-static decode step.

Both classes behave like mlx_lm's caches during prefill (Python-int offsets, growing
buffers). For decode, ``bind`` swaps in a position *array*, so the same traced graph serves
every step until the buffer must grow: keys are written with ``mx.slice_update`` at that
position and attention runs over the whole buffer under a validity mask.

``dtype`` (``make_cache(kv_dtype=...)``) stores K/V in another float type than the model
computes them in: float16 on the CPU halves the bytes the fused attention kernel
(engine/kernels/src/attention.cpp) streams per decode step at long context. Only the kernel's
routed attention reads mixed float32 queries / float16 K/V; it is the caller's choice.

``kv_dtype=Q8(group)`` stores each token's K and V per head as one 8-bit row, K rotated (the
live "q8" format: engine/kvrows.py).
"""

from __future__ import annotations

from dataclasses import dataclass

from engine import kernels, kvrows
from engine.kernels.hook import fused_active
from engine.kvrows import Q8_FORMAT, q8_group, q8_rotate, q8_unpack

import mlx.core as mx
from mlx_lm.models.cache import KVCache, QuantizedKVCache, create_causal_mask

# Prompt forwards write their new K/V rows with the kernels' in-place primitive (False:
# mlx_lm's astype + slice assignment, for A/B runs).
PROMPT_KV_WRITE = True


class StaticKVCache(KVCache):
    """Full-attention cache. ``step`` is the growth block (tokens) of the buffer."""

    checkpoint_kind = "StaticKVCache"  # engine.checkpoints.snapshot.CheckpointCache
    step = 512

    def __init__(self, dtype: mx.Dtype | None = None) -> None:
        super().__init__()
        self._pos: mx.array | None = None
        self.dtype = dtype

    @property
    def capacity(self) -> int:
        return 0 if self.keys is None else self.keys.shape[2]

    def reserve(self, n: int) -> bool:
        """Make room for ``n`` more tokens; True if the buffer was (re)allocated."""
        if self.keys is None or self.offset + n <= self.capacity:
            return False
        size = ((self.offset + n + self.step - 1) // self.step) * self.step
        pad = size - self.capacity
        B, H, _, Dk = self.keys.shape
        Dv = self.values.shape[3]
        self.keys = mx.concatenate([self.keys, mx.zeros((B, H, pad, Dk), self.keys.dtype)], axis=2)
        self.values = mx.concatenate(
            [self.values, mx.zeros((B, H, pad, Dv), self.values.dtype)], axis=2
        )
        return True

    # -- compiled decode ---------------------------------------------------------------
    def bind(self, keys: mx.array, values: mx.array, pos: mx.array) -> None:
        self.keys, self.values, self.offset, self._pos = keys, values, pos, pos

    def unbind(self, keys: mx.array, values: mx.array, offset: int) -> None:
        self.keys, self.values, self.offset, self._pos = keys, values, offset, None

    def update_and_fetch(self, keys, values):
        stored = _storage(self.dtype, self.keys, keys)
        if self._pos is None and self._writes_rows(stored, keys, values):
            return self._write_rows(stored or keys.dtype, keys, values)
        keys, values = _stored(stored, keys, values)
        if self._pos is None:
            return super().update_and_fetch(keys, values)
        self.keys = mx.slice_update(self.keys, keys, self._pos, axes=(2,))
        self.values = mx.slice_update(self.values, values, self._pos, axes=(2,))
        return self.keys, self.values

    def make_mask(self, N, return_array=False, window_size=None):
        if self._pos is None:
            return super().make_mask(N, return_array=return_array, window_size=window_size)
        return mx.arange(self.capacity) <= self._pos

    # -- prompt forwards on the CPU kernels --------------------------------------------
    def _writes_rows(self, stored, keys: mx.array, values: mx.array) -> bool:
        """Whether ``kernels.kv_write_rows`` can store these rows: float K/V kept as computed or
        float32 ones cast to a float16 / bfloat16 buffer, the buffer (if any) of that dtype."""
        if not (PROMPT_KV_WRITE and fused_active()) or isinstance(stored, Q8):
            return False
        dtype = stored or keys.dtype
        casts = keys.dtype == mx.float32 and dtype in (mx.float16, mx.bfloat16)
        return (
            keys.dtype == values.dtype
            and (keys.dtype == dtype or casts)
            and dtype in (mx.float32, mx.float16, mx.bfloat16)
            and (self.keys is None or (self.keys.dtype == dtype and self.values.dtype == dtype))
        )

    def _write_rows(self, dtype: mx.Dtype, keys: mx.array, values: mx.array):
        """mlx_lm's ``KVCache.update_and_fetch`` (the buffer grows by whole steps) with the rows
        written by one in-place primitive per buffer: no astype and slice_update nodes, the
        float16 cast vectorised, the buffer not copied when MLX can donate it."""
        prev, n = self.offset, keys.shape[2]
        if self.keys is None or prev + n > self.keys.shape[2]:
            B, H, _, Dk = keys.shape
            size = ((self.step + n - 1) // self.step) * self.step
            new_k = mx.zeros((B, H, size, Dk), dtype)
            new_v = mx.zeros((B, H, size, values.shape[3]), dtype)
            if self.keys is not None:
                if prev % self.step != 0:
                    self.keys, self.values = self.keys[..., :prev, :], self.values[..., :prev, :]
                new_k = mx.concatenate([self.keys, new_k], axis=2)
                new_v = mx.concatenate([self.values, new_v], axis=2)
            self.keys, self.values = new_k, new_v
        at = mx.full((keys.shape[0],), prev, mx.int32)
        self.keys = kernels.kv_write_rows(self.keys, keys, at)
        self.values = kernels.kv_write_rows(self.values, values, at)
        self.offset = prev + n
        return self.keys_and_values()


class WindowKVCache(KVCache):
    """Sliding-window cache kept as a ring of ``window`` slots.

    Slot ``p % window`` holds position ``p`` for the last ``window`` positions. RoPE is applied
    before keys are stored, so attention does not care about slot order; prefill reorders the
    ring into time order once per call. Not trimmable: checkpoints go at turn boundaries.
    """

    checkpoint_kind = "WindowKVCache"  # engine.checkpoints.snapshot.CheckpointCache

    def __init__(self, window: int, dtype: mx.Dtype | None = None) -> None:
        super().__init__()
        self.window = window
        self._pos: mx.array | None = None
        self.dtype = dtype

    @property
    def capacity(self) -> int:
        return self.window

    def reserve(self, n: int) -> bool:
        return False

    def is_trimmable(self) -> bool:
        return False

    def _ordered(self) -> tuple[mx.array, mx.array] | None:
        if self.keys is None or self.offset == 0:
            return None
        if self.offset < self.window:
            return self.keys[..., : self.offset, :], self.values[..., : self.offset, :]
        shift = -(self.offset % self.window)
        return mx.roll(self.keys, shift, axis=2), mx.roll(self.values, shift, axis=2)

    def update_and_fetch(self, keys, values):
        keys, values = _stored(_storage(self.dtype, self.keys, keys), keys, values)
        if self._pos is not None:
            slot = self._pos % self.window
            self.keys = mx.slice_update(self.keys, keys, slot, axes=(2,))
            self.values = mx.slice_update(self.values, values, slot, axes=(2,))
            return self.keys, self.values
        prev = self._ordered()
        if prev is not None:
            all_k = mx.concatenate([prev[0], keys], axis=2)
            all_v = mx.concatenate([prev[1], values], axis=2)
        else:
            all_k, all_v = keys, values
        self.offset += keys.shape[2]
        self._store(all_k, all_v)
        return all_k, all_v

    def _store(self, ordered_k: mx.array, ordered_v: mx.array) -> None:
        """Keep the last ``window`` positions of time-ordered K/V as a ring."""
        W = self.window
        m = min(W, ordered_k.shape[2])
        k, v = ordered_k[..., -m:, :], ordered_v[..., -m:, :]
        if m < W:  # fewer than W positions so far: they start at position 0, slot 0
            B, H, _, Dk = k.shape
            pad_k = mx.zeros((B, H, W - m, Dk), k.dtype)
            pad_v = mx.zeros((B, H, W - m, v.shape[3]), v.dtype)
            self.keys, self.values = mx.concatenate([k, pad_k], 2), mx.concatenate([v, pad_v], 2)
        else:
            start = self.offset - W
            self.keys = mx.roll(k, start % W, axis=2)
            self.values = mx.roll(v, start % W, axis=2)

    def make_mask(self, N, return_array=False, window_size=None):
        if self._pos is not None:
            return mx.arange(self.window) <= self._pos
        n_prev = min(self.offset, self.window)
        q_pos = mx.arange(self.offset, self.offset + N)[:, None]
        k_pos = mx.arange(self.offset - n_prev, self.offset + N)[None]
        return (k_pos <= q_pos) & (k_pos > q_pos - self.window)

    def bind(self, keys: mx.array, values: mx.array, pos: mx.array) -> None:
        self.keys, self.values, self.offset, self._pos = keys, values, pos, pos

    def unbind(self, keys: mx.array, values: mx.array, offset: int) -> None:
        self.keys, self.values, self.offset, self._pos = keys, values, offset, None

    @property
    def state(self):
        ordered = self._ordered()
        if ordered is None:
            return []
        return list(ordered)

    @state.setter
    def state(self, v):
        raise NotImplementedError("restore a WindowKVCache with restore_ordered()")

    def restore_ordered(self, keys: mx.array, values: mx.array, offset: int) -> None:
        """Rebuild from time-ordered K/V of the last ``min(offset, window)`` positions."""
        self.offset = offset
        self._store(keys, values)

    @property
    def meta_state(self):
        return (str(self.window), str(self.offset))

    @meta_state.setter
    def meta_state(self, v):
        self.window, self.offset = int(v[0]), int(v[1])


@dataclass(frozen=True)
class Q8:
    """The 8-bit live KV format (module docstring): ``group`` dims share one scale."""

    group: int = 32

    @property
    def name(self) -> str:
        return f"q8-g{self.group}"

    def pack(self, x: mx.array) -> mx.array:
        return q8_pack(x, self.group)

    def pack_kv(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        """The stored rows of float K/V: K rotated (``q8_rotate``), V as is."""
        return self.pack(q8_rotate(keys)), self.pack(values)


def q8_pack(x: mx.array, group: int, use_kernel: bool = True) -> mx.array:
    """``engine.kvrows.q8_pack``: on the CPU with the kernels built as one op
    (engine.kernels.q8_pack, the same bytes), else its MLX ops."""
    if use_kernel and mx.default_device() == mx.cpu and kernels.available():
        return kernels.q8_pack(x, group)
    return kvrows.q8_pack(x, group)


def live_kv_dtype(kv_format: str) -> mx.Dtype | Q8 | None:
    """The ``kv_dtype`` of live caches in the CPU format ``kv_format`` (as
    engine.checkpoints.fingerprint.live_kv_format names it): float16 for "fp16", ``Q8`` for
    "q8hrows-g<group>", None (K/V as computed) otherwise."""
    if kv_format == "fp16":
        return mx.float16
    if kv_format.startswith(f"{Q8_FORMAT}-g"):
        return Q8(int(kv_format.removeprefix(f"{Q8_FORMAT}-g")))
    return None


def _storage(dtype, buffer: mx.array | None, keys: mx.array):
    """How new K/V are stored: the cache's setting, else like the buffer it holds (the compiled
    step's scratch caches are bound to the live buffers and have no setting of their own)."""
    if dtype is not None or buffer is None or buffer.dtype == keys.dtype:
        return dtype
    if buffer.dtype == mx.uint8:
        return Q8(q8_group(keys.shape[-1], buffer.shape[-1]))
    return buffer.dtype


def _stored(dtype, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
    if isinstance(dtype, Q8):
        if keys.dtype == mx.uint8:  # already 8-bit rows
            return keys, values
        return dtype.pack_kv(keys, values)
    if dtype is None or keys.dtype == dtype:
        return keys, values
    return keys.astype(dtype), values.astype(dtype)


def make_cache(model, kv_bits: int | None = None, kv_group_size: int = 64,
               kv_dtype: mx.Dtype | Q8 | None = None) -> list:
    """Per-layer caches for ``model``: static full/window caches (K/V stored as ``kv_dtype``,
    default: as computed), or quantized KV when asked."""
    n_layers = len(model.layers)
    if kv_bits:
        return [QuantizedKVCache(group_size=kv_group_size, bits=kv_bits) for _ in range(n_layers)]
    window, pattern = _sliding_layout(model)
    caches: list = []
    for i in range(n_layers):
        if window and pattern and (i % pattern != pattern - 1):
            caches.append(WindowKVCache(window, kv_dtype))
        else:
            caches.append(StaticKVCache(kv_dtype))
    return caches


def _sliding_layout(model) -> tuple[int | None, int | None]:
    args = getattr(model, "args", None)
    window = getattr(args, "sliding_window", None)
    pattern = getattr(args, "sliding_window_pattern", None)
    if getattr(args, "model_type", "") in ("gemma3_text", "gemma3") and window and pattern:
        return int(window), int(pattern)
    return None, None


def is_static(caches: list) -> bool:
    """True when every layer cache can run in the compiled decode step."""
    return all(isinstance(c, (StaticKVCache, WindowKVCache)) for c in caches)


__all__ = [
    "StaticKVCache",
    "WindowKVCache",
    "Q8",
    "q8_pack",
    "q8_unpack",
    "q8_rotate",
    "Q8_FORMAT",
    "live_kv_dtype",
    "make_cache",
    "is_static",
    "create_causal_mask",
]
