"""The compiled batched decode step (engine.generation.batch) on quantized tiny models routed to
the CPU kernels: every row's greedy tokens are its serial-lane tokens bit for bit while rows
join and leave, float16 KV stays float16, and the step is traced once per (rows, buffer
length) shape, not once per step."""

from __future__ import annotations

import engine  # noqa: F401  (loads OpenBLAS before mlx)

# isort: split
from engine import kernels
from engine.generation.batch import BatchKV, batched_logits, forward_for
from engine.generation.generate import generate_step, prefill
from engine.generation.kv_cache import Q8, StaticKVCache, make_cache
from engine.kernels import hook
from engine.sampling import SamplingParams

import mlx.core as mx
import mlx.nn as nn
import pytest
from mlx_lm.utils import load_model

from tests.tiny_models import VOCAB, hooked_quantized

pytestmark = pytest.mark.skipif(not kernels.available(), reason="CPU kernels not built/available")

LENGTHS = (5, 37, 12, 70, 1, 23)  # one prompt of a single token: it joins with no history
TOKENS = 14


@pytest.fixture(scope="module")
def qmodels(tiny_llama_dir, tiny_qwen2_dir):
    return {"llama": hooked_quantized(tiny_llama_dir), "qwen2": hooked_quantized(tiny_qwen2_dir)}


def _prompts() -> list[list[int]]:
    return [[(37 * j + 11 * i) % (VOCAB - 3) + 3 for j in range(n)] for i, n in enumerate(LENGTHS)]


def _cache(model, kv_dtype):
    return make_cache(model, kv_dtype=kv_dtype)


def _serial(model, prompt: list[int], kv_dtype) -> list[int]:
    """The scheduler's serial lane: body prefilled without logits, then generate_step."""
    cache = _cache(model, kv_dtype)
    prefill(model, cache, prompt[:-1], logits=False)
    params = SamplingParams(temperature=0.0, max_tokens=TOKENS)
    return [o.token for o in generate_step(model, prompt[-1:], cache, params)]


@pytest.mark.parametrize("name", ["llama", "qwen2"])
# Q8(16): 8-bit rows with rotated K (the tiny models' head dim 16 is below the kernel's groups,
# so they are read through the MLX fallback: rotation and pack still run row by row).
@pytest.mark.parametrize("kv_dtype", [None, mx.float16, Q8(16)])
def test_rows_joining_and_leaving_get_their_serial_tokens(qmodels, name, kv_dtype):
    model = qmodels[name]
    prompts = _prompts()
    want = [_serial(model, p, kv_dtype) for p in prompts]
    kv = BatchKV()
    got: dict[int, list[int]] = {}
    pending: dict[int, int] = {}
    order: list[int] = []  # prompt index of each batch row

    def join(i: int) -> None:
        cache = _cache(model, kv_dtype)
        prefill(model, cache, prompts[i][:-1], logits=False)
        kv.add(cache)
        order.append(i)
        pending[i], got[i] = prompts[i][-1], []

    for i in (0, 1, 2):
        join(i)
    step = 0
    while order:
        if step == 3:
            join(3)  # joins mid-stream
        if step == 5:
            join(4)
            join(5)
        logits = batched_logits(model, [pending[i] for i in order], kv)
        ys = mx.argmax(logits, axis=-1).tolist()
        for i, y in zip(order, ys, strict=True):
            got[i].append(y)
            pending[i] = y
        if kv_dtype is not None:
            stored = mx.uint8 if isinstance(kv_dtype, Q8) else kv_dtype
            assert all(c.keys.dtype == stored for c in kv.layers)
        done = [r for r, i in enumerate(order) if len(got[i]) == TOKENS]
        if done:
            for r in done:
                caches = kv.take(r)  # what a checkpoint of the leaving row would hold
                assert all(isinstance(c, StaticKVCache) and c.dtype == kv_dtype for c in caches)
                assert caches[0].offset == len(prompts[order[r]]) - 1 + TOKENS
                if kv_dtype is not None:
                    assert caches[0].keys.dtype == stored
            keep = [r for r in range(len(order)) if r not in done]
            kv.keep(keep)
            order = [order[r] for r in keep]
        step += 1
    for i in range(len(prompts)):
        assert got[i] == want[i], (i, got[i], want[i])


def test_the_step_is_traced_once_per_shape_not_per_step(tiny_llama_dir):
    model = load_model(tiny_llama_dir)[0]  # its own model: no traces from other tests
    nn.quantize(model, group_size=32, bits=4)
    hook.install(model)
    prompts = _prompts()
    kv = BatchKV()
    for p in prompts[:3]:
        cache = make_cache(model)
        prefill(model, cache, p[:-1], logits=False)
        kv.add(cache)
    tokens = [p[-1] for p in prompts]

    def steps(n: int) -> None:
        for _ in range(n):
            mx.eval(batched_logits(model, tokens[: kv.rows], kv))

    steps(1)
    fwd = forward_for(model, kv.layers)
    assert fwd.traces == 1
    steps(10)
    assert fwd.traces == 1  # same rows, same buffer: no retrace
    kv.keep([0, 2])  # a row leaves: one new shape
    steps(5)
    assert fwd.traces == 2
    cache = make_cache(model)
    prefill(model, cache, prompts[3][:-1], logits=False)
    kv.add(cache)  # back to three rows: the first trace again
    steps(5)
    assert fwd.traces == 2
    kv.keep([0, 1])
    steps(3)
    assert fwd.traces == 2
