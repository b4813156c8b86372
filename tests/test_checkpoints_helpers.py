"""Helpers shared by the checkpoint store tests (no tests here): tiny models, greedy runs."""

from __future__ import annotations

import engine  # noqa: F401  (loads OpenBLAS before mlx)

# isort: split
from pathlib import Path

from engine.checkpoints import CheckpointStore, make_fingerprint
from engine.generation.generate import generate_step, prefill
from engine.generation.kv_cache import StaticKVCache, make_cache
from engine.sampling import SamplingParams

import mlx.core as mx
import numpy as np

GREEDY = SamplingParams(temperature=0.0, max_tokens=6, repetition_context=0)


def tokens(n: int, seed: int = 0) -> list[int]:
    return np.random.default_rng(seed).integers(5, 380, n).tolist()


def make_store(model_dir: Path, model, ssd_dir: Path | None, **kw) -> CheckpointStore:
    fp = make_fingerprint(model_dir, kw.pop("weight_format", "fp32"),
                          checkpoint_format=kw.get("checkpoint_format", "same"))
    kw.setdefault("ram_bytes", 1 << 30)
    kw.setdefault("ssd_bytes", 1 << 30)
    return CheckpointStore(fp, lambda: make_cache(model), ssd_dir=ssd_dir, **kw)


def continuation(model, cache: list, new_tokens: list[int], history: list[int]):
    """Greedy tokens and their logprobs after feeding ``new_tokens`` into ``cache``."""
    out = list(generate_step(model, new_tokens, cache, GREEDY, history=history))
    return [o.token for o in out], np.stack([np.array(o.logprobs.reshape(-1)) for o in out])


def prefilled(model, toks: list[int]) -> list:
    cache = make_cache(model)
    prefill(model, cache, toks)
    return cache


def fake_static_cache(layers: int, heads: int, n: int, head_dim: int, seed: int = 0,
                      dtype=mx.float32) -> list:
    """Static caches holding random K/V for ``n`` tokens (capacity rounded up to ``step``)."""
    mx.random.seed(seed)
    caches = []
    cap = -(-n // StaticKVCache.step) * StaticKVCache.step
    for _ in range(layers):
        c = StaticKVCache()
        c.keys = mx.random.normal((1, heads, cap, head_dim)).astype(dtype)
        c.values = mx.random.normal((1, heads, cap, head_dim)).astype(dtype)
        c.offset = n
        mx.eval(c.keys, c.values)
        caches.append(c)
    return caches
