"""Speculation on the CPU kernels (quantized weights, int8 activations): every verified row
computes, bit for bit, the logits the compiled one-token decode step computes, so greedy
speculative output is the plain output by construction, not by the absence of near-ties."""

from __future__ import annotations

import engine  # noqa: F401  (loads OpenBLAS before mlx)

# isort: split
from engine import kernels
from engine.generation.generate import decode_step_for, generate_step, prefill
from engine.generation.kv_cache import make_cache
from engine.generation.sampling import make_sampler
from engine.generation.speculation.exact_rows import kernel_rows, max_verify_rows, step_shaped
from engine.sampling import SamplingParams

import mlx.core as mx
import pytest

from tests.test_speculation import PROMPT, Oracle, _spec
from tests.tiny_models import VOCAB, hooked_quantized

pytestmark = pytest.mark.skipif(not kernels.available(), reason="CPU kernels not built/available")


@pytest.fixture(scope="module")
def qmodels(tiny_llama_dir, tiny_qwen2_dir):
    return {"llama": hooked_quantized(tiny_llama_dir), "qwen2": hooked_quantized(tiny_qwen2_dir)}


def test_int8_matmul_rows_do_not_depend_on_the_row_count_below_the_cap():
    """A verify forward of up to max_verify_rows() rows stays on the per-row int8 path."""
    assert max_verify_rows() < kernel_rows()
    mx.random.seed(3)
    wq, s, b = mx.quantize(mx.random.normal((96, 256)), group_size=32, bits=4)
    x = mx.random.normal((max_verify_rows(), 256))
    one = [kernels.quantized_matmul(x[i : i + 1], wq, s, b, 32, 4) for i in range(x.shape[0])]
    for m in range(2, x.shape[0] + 1):
        y = kernels.quantized_matmul(x[:m], wq, s, b, 32, 4)
        for i in range(m):
            assert mx.array_equal(y[i], one[i][0]), (m, i)


def _step_logprobs(model, cache, tokens):
    """Logprobs the compiled decode step gives after feeding each of ``tokens``."""
    params = SamplingParams(temperature=0.0)
    step = decode_step_for(model, cache, params, VOCAB)
    key, recent = mx.random.key(0), mx.full((8,), -1, dtype=mx.int32)
    out = []
    for t in tokens:
        _, lp, _, _ = step(cache, mx.array([t]), key, recent)
        out.append(lp[0])
    mx.eval(out)
    return out


def _verify_logprobs(model, cache, tokens, exact: bool):
    sample = make_sampler(SamplingParams(temperature=0.0))
    for c in cache:
        c.reserve(len(tokens))
    if exact:
        with step_shaped():
            logits = model(mx.array([tokens]), cache=cache)
    else:
        logits = model(mx.array([tokens]), cache=cache)
    out = [sample(logits[:, i, :], None, mx.full((8,), -1, dtype=mx.int32))[1][0] for i in range(len(tokens))]
    mx.eval(out)
    for c in cache:
        c.offset -= len(tokens)
    return out


@pytest.mark.parametrize("which", ["llama", "qwen2"])
def test_verify_rows_equal_the_compiled_step_bit_for_bit(qmodels, which):
    model = qmodels[which]
    cache = make_cache(model)
    prefill(model, cache, PROMPT)
    nxt = [(37 * i + 11) % 300 for i in range(max_verify_rows())]
    ref = _step_logprobs(model, cache, nxt)
    for c in cache:
        c.offset -= len(nxt)
    differs = 0
    for rows in range(2, max_verify_rows() + 1):
        got = _verify_logprobs(model, cache, nxt[:rows], exact=True)
        for i in range(rows):
            assert mx.array_equal(got[i], ref[i]), (rows, i, float(mx.abs(got[i] - ref[i]).max()))
        # A plain causal forward runs its attention per position with the step's bits too
        # (kernels.set_attn_rows, on by default: prefill = decode).
        plain = _verify_logprobs(model, cache, nxt[:rows], exact=False)
        for i in range(rows):
            assert mx.array_equal(plain[i], ref[i]), (rows, i)
        was = kernels.set_attn_rows(False)
        try:
            tiles = _verify_logprobs(model, cache, nxt[:rows], exact=False)
        finally:
            kernels.set_attn_rows(was)
        differs += sum(not mx.array_equal(tiles[i], ref[i]) for i in range(rows))
    # the control: the many-query attention tiles do not give the step's bits here
    assert differs > 0


@pytest.mark.parametrize("which", ["llama", "qwen2"])
@pytest.mark.parametrize("wrong", [None, 3, 13])
def test_long_drafts_on_the_kernels_keep_greedy_output_and_stay_under_the_cap(qmodels, which, wrong):
    """Drafts asked for 20 tokens are cut so a verify forward stays on the per-row path."""
    model = qmodels[which]
    params = SamplingParams(temperature=0.0, max_tokens=48)
    ref = [o.token for o in generate_step(model, PROMPT, make_cache(model), params)]
    spec = _spec(Oracle(ref, len(PROMPT), wrong), k=20, adaptive=False)
    got = [o.token for o in generate_step(model, PROMPT, make_cache(model), params, speculation=spec)]
    assert got == ref
    st = spec.stats
    assert st.rounds > 0 and st.drafted <= st.rounds * (max_verify_rows() - 1)
    if wrong is None:
        assert max(st.accepted_lengths) == max_verify_rows() - 1
