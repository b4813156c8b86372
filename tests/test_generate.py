"""Decode loop: compiled static-cache decoding matches mlx_lm exactly on tiny models."""

import engine  # noqa: F401
from engine.generation.generate import generate_step
from engine.generation.kv_cache import StaticKVCache, WindowKVCache, make_cache
from engine.sampling import SamplingParams

import mlx.core as mx
import pytest
from mlx_lm.models.cache import make_prompt_cache
from mlx_lm.utils import load_model

from tests.kernel_checks import BLAS_ROWS_REASON, blas_rows_depend_on_count

PROMPT = [5, 40, 77, 101, 200, 13, 64, 90, 91, 92, 150, 151, 152, 153, 20, 21, 22, 23, 24, 25]


def _stock_greedy(model, prompt, n):
    cache = make_prompt_cache(model)
    logits = model(mx.array(prompt)[None], cache=cache)[:, -1, :]
    out = []
    for _ in range(n):
        tok = int(mx.argmax(logits, axis=-1).item())
        out.append(tok)
        logits = model(mx.array([[tok]]), cache=cache)[:, -1, :]
    return out


@pytest.fixture
def model_dirs(tiny_llama_dir, tiny_qwen2_dir, tiny_gemma_dir):
    return {"llama": tiny_llama_dir, "qwen2": tiny_qwen2_dir, "gemma3": tiny_gemma_dir}


@pytest.mark.parametrize("which", ["llama", "qwen2", "gemma3"])
@pytest.mark.parametrize("compiled", [True, False])
def test_greedy_matches_stock(which, compiled, model_dirs):
    model, _ = load_model(model_dirs[which])
    params = SamplingParams(temperature=0.0, max_tokens=40)
    cache = make_cache(model)
    if which == "gemma3":
        # window 8, pattern 2: even layers slide, odd layers see everything
        assert isinstance(cache[0], WindowKVCache) and isinstance(cache[1], StaticKVCache)
    ours = [o.token for o in generate_step(model, PROMPT, cache, params, compile_step=compiled)]
    assert ours == _stock_greedy(model, PROMPT, 40)


@pytest.mark.skipif(blas_rows_depend_on_count(), reason=BLAS_ROWS_REASON)
@pytest.mark.parametrize("which", ["llama", "qwen2", "gemma3"])
def test_teacher_forced_logits_bit_exact(which, model_dirs):
    """Feeding the same tokens one at a time, the compiled step's logits equal mlx_lm's."""
    from engine.generation.generate import DecodeStep, prefill
    from engine.generation.sampling import log_softmax

    model, _ = load_model(model_dirs[which])
    forced = [(7 * i + 3) % 300 for i in range(32)]
    ref_cache = make_prompt_cache(model)
    ref = [model(mx.array(PROMPT)[None], cache=ref_cache)[:, -1, :]]
    for t in forced:
        ref.append(model(mx.array([[t]]), cache=ref_cache)[:, -1, :])

    cache = make_cache(model)
    first = prefill(model, cache, PROMPT)
    params = SamplingParams(temperature=0.0)
    step = DecodeStep(model, cache, params, first.shape[-1])
    key, recent = mx.random.key(0), mx.full((8,), -1, mx.int32)
    ours_lp = []
    for t in forced:
        _, lp, _, _ = step(cache, mx.array([t]), key, recent)
        ours_lp.append(lp)
    for i in range(32):
        want = ref[i + 1].astype(mx.float32)
        want = log_softmax(want)  # the sampler's own (the CPU kernel's when available)
        if which == "gemma3":
            # Sliding-window layers keep keys in ring order, so attention sums the same terms in
            # another order than mlx_lm's time-ordered RotatingKVCache: equal up to rounding.
            err = mx.abs(ours_lp[i] - want).max().item()
            assert err < 1e-4, f"step {i} differs by {err}"
        else:
            assert mx.array_equal(ours_lp[i], want).item(), f"step {i} differs"
    assert mx.array_equal(first, ref[0]).item()


def test_seeded_sampling_is_reproducible(tiny_llama_dir):
    model, _ = load_model(tiny_llama_dir)
    params = SamplingParams(temperature=1.0, top_p=0.95, max_tokens=24, seed=123)
    a = [o.token for o in generate_step(model, PROMPT, make_cache(model), params)]
    b = [o.token for o in generate_step(model, PROMPT, make_cache(model), params)]
    c = [o.token for o in generate_step(model, PROMPT, make_cache(model), params.with_overrides(seed=124))]
    assert a == b
    assert a != c


def test_cache_grows_past_a_block(tiny_llama_dir):
    """Decoding across the static buffer's growth boundary keeps matching stock."""
    model, _ = load_model(tiny_llama_dir)
    prompt = [(i * 13) % 300 + 5 for i in range(StaticKVCache.step - 10)]
    params = SamplingParams(temperature=0.0, max_tokens=24)
    ours = [o.token for o in generate_step(model, prompt, make_cache(model), params)]
    assert ours == _stock_greedy(model, prompt, 24)


class _OnlyAfter:
    """Test constraint: after ``trigger`` appears, only ids in ``allowed_ids`` may follow."""

    def __init__(self, trigger, allowed_ids, vocab):
        self.trigger, self.vocab = trigger, vocab
        self.mask = mx.zeros((vocab,), dtype=mx.bool_)
        self.mask[mx.array(allowed_ids)] = True
        self.active = False
        self.seen = []

    def allowed(self):
        return self.mask if self.active else None

    def advance(self, token):
        self.seen.append(token)
        if token == self.trigger:
            self.active = True


def test_constraint_masks_tokens_after_trigger(tiny_llama_dir):
    model, _ = load_model(tiny_llama_dir)
    free = [o.token for o in generate_step(model, PROMPT, make_cache(model), SamplingParams(temperature=0.0, max_tokens=12))]
    trigger = free[2]
    c = _OnlyAfter(trigger, [7, 8, 9], model.args.vocab_size)
    got = [o.token for o in generate_step(model, PROMPT, make_cache(model), SamplingParams(temperature=0.0, max_tokens=12), constraint=c)]
    assert got[:3] == free[:3]  # unconstrained until the trigger
    assert all(t in (7, 8, 9) for t in got[3:])
    assert c.seen == got


@pytest.mark.parametrize("close_after_first", [False, True])
def test_first_token_streams_before_any_decode_step(tiny_llama_dir, monkeypatch, close_after_first):
    """The first token comes straight from the prompt's logits, before a decode step is queued
    (a step's async_eval blocks for most of the step on the CPU); the step that feeds it still
    runs, also when the caller stops at that token, so the cache covers the whole reply."""
    from engine.generation import generate as gen

    model, _ = load_model(tiny_llama_dir)
    calls = []
    real = gen.DecodeStep.__call__
    monkeypatch.setattr(gen.DecodeStep, "__call__", lambda self, *a, **k: calls.append(1) or real(self, *a, **k))
    cache = make_cache(model)
    steps = generate_step(model, PROMPT, cache, SamplingParams(temperature=0.0, max_tokens=5))
    first = next(steps).token
    assert calls == [] and cache[0].offset == len(PROMPT)
    if close_after_first:
        steps.close()
        rest = []
    else:
        rest = [o.token for o in steps]
    assert [first, *rest] == _stock_greedy(model, PROMPT, 5)[: 1 + len(rest)]
    assert cache[0].offset == len(PROMPT) + 1 + len(rest)
