"""Make each row of a verify forward compute exactly what a one-token decode step computes.

Greedy speculation is only identical to plain decoding if the target's logits for a drafted
position are the ones plain decoding would have produced there. On the CPU kernels that takes
two things (checked bit for bit in tests/test_speculation_kernels.py):

Design notes, measurements and history: docs/engine-notes.md (exact_rows.py).
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager

from engine import kernels, mlx_patches
from engine.generation.kv_cache import StaticKVCache

import mlx.core as mx

_local = threading.local()
_lock = threading.Lock()


def kernel_rows() -> int:
    """Rows at which the CPU kernels' quantized matmul leaves the per-row int8 path."""
    return max(2, kernels.dense_rows())


def max_verify_rows() -> int:
    """Most rows (pending token + drafts) one verify forward may have."""
    return kernel_rows() - 1


def _step_attention(inner):
    def attention(queries, keys, values, cache, scale, mask, sinks=None):
        if not (getattr(_local, "on", False) and type(cache) is StaticKVCache and cache.keys is not None
                and sinks is None and queries.ndim == 4 and queries.shape[0] == 1):
            return inner(queries, keys, values, cache, scale, mask, sinks)
        L = queries.shape[2]
        K, V = cache.keys, cache.values  # the whole buffer, as the compiled step sees it
        first = cache.offset - L  # position of row 0 (the cache already holds all L rows)
        masks = _local.masks.get((K.shape[2], first, L))
        if masks is None:  # built once per forward, shared by its layers
            keys = mx.arange(K.shape[2])
            masks = _local.masks[(K.shape[2], first, L)] = [keys <= first + i for i in range(L)]
        # One single-query call per row with the step's own key-validity mask: the step's
        # problem exactly, on the buffer as it is (a batch of L rows would need L copies of K/V).
        rows = [inner(queries[:, :, i : i + 1], K, V, cache, scale, masks[i], sinks) for i in range(L)]
        return mx.concatenate(rows, axis=2)

    attention._step_inner = inner
    return attention


@contextmanager
def step_shaped() -> Iterator[None]:
    """Within this block, forwards on this thread attend row by row as the decode step does."""
    with _lock:
        # wrap whatever is installed now (engine.kernels.attention re-installs on load)
        mlx_patches.wrap_attention(_step_attention, lambda f: hasattr(f, "_step_inner"))
    prev, prev_masks = getattr(_local, "on", False), getattr(_local, "masks", None)
    _local.on, _local.masks = True, {}
    try:
        yield
    finally:
        _local.on, _local.masks = prev, prev_masks
