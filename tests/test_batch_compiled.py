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


@pytest.mark.parametrize("name", ["llama", "gemma"])
@pytest.mark.parametrize("kv_dtype", [None, mx.float16])
def test_a_burst_of_joiners_is_assembled_in_one_pass_with_every_row_in_place(
    tiny_llama_dir, tiny_gemma_dir, name, kv_dtype
):
    # Rows joining together are written into the batch buffers in one pass when the layers
    # are next read; the buffers must be exactly those of joins assembled one at a time, and
    # each row's slot its own history at its own positions (a row with no history: zeros),
    # sliding-window (Gemma) rings included.
    model = load_model(tiny_gemma_dir if name == "gemma" else tiny_llama_dir)[0]
    prompts = _prompts()
    caches = []
    for p in prompts:
        cache = make_cache(model, kv_dtype=kv_dtype)
        prefill(model, cache, p[:-1], logits=False)
        caches.append(cache)
    burst, one_by_one = BatchKV(), BatchKV()
    for cache in caches:
        burst.add(cache)
        one_by_one.add(cache)
        assert one_by_one.layers is not None  # reading the layers assembles this joiner now
    assert burst.positions == one_by_one.positions == [len(p) - 1 for p in prompts]
    for a, b in zip(burst.layers, one_by_one.layers, strict=True):
        assert a.keys.shape == b.keys.shape and a.keys.dtype == b.keys.dtype
        assert mx.array_equal(a.keys, b.keys) and mx.array_equal(a.values, b.values)
        assert a.offset.tolist() == burst.positions
    for i, cache in enumerate(caches):  # each row's history comes back out unchanged
        for mine, theirs in zip(burst.take(i), cache, strict=True):
            assert mine.offset == theirs.offset
            if theirs.offset:
                assert all(mx.array_equal(x, y) for x, y in zip(_history(mine), _history(theirs), strict=True))
    empty = LENGTHS.index(1)  # the one-token prompt joined with nothing: its slot is zeros
    assert all(not mx.any(layer.keys[empty]).item() for layer in burst.layers)
    # A joiner after steps lands in the same buffers as it would alone after them.
    for kv in (burst, one_by_one):
        mx.eval(batched_logits(model, [p[-1] for p in prompts], kv))
        kv.keep([0, 2, 3])
        kv.add(caches[4])
        kv.add(caches[1])
    for a, b in zip(burst.layers, one_by_one.layers, strict=True):
        assert mx.array_equal(a.keys, b.keys) and mx.array_equal(a.values, b.values)


def _history(c) -> tuple:
    """(keys, values) of the positions a layer cache holds, time-ordered."""
    if isinstance(c, StaticKVCache):
        return c.keys[..., : c.offset, :], c.values[..., : c.offset, :]
    return tuple(c.state)
