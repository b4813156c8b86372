import engine  # noqa: F401
from engine.generation.sampling import SamplingParams, make_sampler

import mlx.core as mx
import numpy as np

LOGITS = mx.array([[1.0, 3.0, 2.0, 0.5, -1.0, 2.9]])
EMPTY = mx.full((4,), -1, mx.int32)


def _draw(params, n=2000, recent=EMPTY, logits=LOGITS):
    sample = make_sampler(params)
    keys = mx.random.split(mx.random.key(7), n)
    toks = [int(sample(logits, keys[i], recent)[0].item()) for i in range(n)]
    return np.bincount(toks, minlength=logits.shape[-1]) / n


def test_greedy_is_argmax():
    tok, lp = make_sampler(SamplingParams(temperature=0))(LOGITS, mx.random.key(0), EMPTY)
    assert tok.item() == 1
    assert abs(float(mx.logsumexp(lp).item())) < 1e-6  # log-probabilities are normalised


def test_temperature_sampling_follows_softmax():
    freq = _draw(SamplingParams(temperature=1.0))
    probs = np.array(mx.softmax(LOGITS[0]).tolist())
    assert np.abs(freq - probs).max() < 0.04


def test_top_k_keeps_exactly_the_k_most_likely():
    # the two largest logits are tokens 1 (3.0) and 5 (2.9): both are drawn, nothing else is,
    # in the proportions of their renormalised softmax (e^0.1 : 1 -> 0.525 : 0.475)
    freq = _draw(SamplingParams(temperature=1.0, top_k=2), n=2000)
    assert set(np.nonzero(freq)[0]) == {1, 5}
    assert abs(freq[1] - 1 / (1 + np.exp(-0.1))) < 0.04
    assert set(np.nonzero(_draw(SamplingParams(temperature=1.0, top_k=1), n=200))[0]) == {1}
    assert set(np.nonzero(_draw(SamplingParams(temperature=1.0, top_k=3), n=2000))[0]) == {1, 2, 5}


def test_top_p_keeps_smallest_nucleus():
    # p(1)≈0.40, p(5)≈0.36, p(2)≈0.15 ... top_p=0.7 keeps tokens 1 and 5 only
    freq = _draw(SamplingParams(temperature=1.0, top_p=0.7), n=500)
    assert set(np.nonzero(freq)[0]) == {1, 5}


def test_min_p_drops_unlikely_tokens():
    # min_p=0.3: keep tokens with p >= 0.3 * p_max -> 1, 5, 2 (p2/p1 = e^-1 ≈ 0.37)
    freq = _draw(SamplingParams(temperature=1.0, min_p=0.3), n=500)
    assert set(np.nonzero(freq)[0]) == {1, 2, 5}


def test_repetition_penalty_discourages_recent_tokens():
    recent = mx.array([-1, -1, 1, 1], dtype=mx.int32)
    tok, _ = make_sampler(SamplingParams(temperature=0, repetition_penalty=1.5))(
        LOGITS, mx.random.key(0), recent
    )
    assert tok.item() == 5  # 3.0/1.5 = 2.0 < 2.9


def test_same_key_same_token():
    s = make_sampler(SamplingParams(temperature=1.5))
    k = mx.random.key(42)
    assert all(s(LOGITS, k, EMPTY)[0].item() == s(LOGITS, k, EMPTY)[0].item() for _ in range(5))
