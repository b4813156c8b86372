"""The top-p (nucleus) filter: the CPU kernel's O(vocab) primitive (engine/kernels/src/topp.cpp),
its scalar full-sort reference and the sampler's MLX reference (``sampling._top_p``) all keep
the smallest prefix of the stable descending sort (equal values: lower index first) whose mass
reaches top_p, checked against a float64 numpy definition. Float summation order may move the
boundary only at tokens whose cumulative mass is within rounding of top_p: float32 sums over V
terms (the MLX reference) within V * 2**-24, the kernel's double sums of its exp within 1e-6.
Also ``_top_k`` from ``mx.topk``, the sampler's routing and its fallbacks."""

from __future__ import annotations

from engine import kernels
from engine.generation import sampling
from engine.generation.sampling import SamplingParams, make_sampler
from engine.kernels import hook

import mlx.core as mx
import numpy as np
import pytest

from tests.kernel_checks import on_one_and_two_threads

needs_ext = pytest.mark.skipif(not kernels.available(), reason=f"kernels off: {kernels.status()['reason']}")

TOP_PS = (1e-6, 0.1, 0.5, 0.9, 0.95, 0.99)


def _rows(V: int, rows: int, kind: str, seed: int) -> mx.array:
    """Scaled log-probabilities as the sampler filters them: flat, peaked, or on a coarse grid
    (many equal values, so ties straddle the boundary)."""
    x = mx.random.normal((rows, V), key=mx.random.key(seed))
    if kind == "flat":
        x = x * 2.0
    elif kind == "peaked":
        x = x * 3.0
        x = mx.where(mx.arange(V) == (seed * 7919) % V, 25.0, x)  # one token holds most mass
    else:  # ties
        x = mx.round(x * 2.0) / 2.0
    lp = x - mx.logsumexp(x, axis=-1, keepdims=True)
    return lp / 0.7


def _definition(x: np.ndarray, top_p: float) -> tuple[np.ndarray, np.ndarray]:
    """(kept mask, each token's float64 mass before it in the stable descending sort)."""
    p32 = float(np.float32(top_p))  # the kernel and MLX compare against top_p as float32
    kept = np.zeros(x.shape, bool)
    before = np.zeros(x.shape)
    for r in range(x.shape[0]):
        row = x[r].astype(np.float64)
        order = np.argsort(-row, kind="stable")
        pr = np.exp(row[order] - row.max())
        pr /= pr.sum()
        cum = np.cumsum(pr) - pr
        before[r, order] = cum
        kept[r, order] = cum < p32
    return kept, before


def _assert_nucleus(got: mx.array, x: mx.array, top_p: float, tol: float) -> None:
    g, xs = np.array(got), np.array(x)
    keep = np.isfinite(g)
    assert np.array_equal(g[keep], xs[keep])  # kept logits unchanged, the rest -inf
    assert np.all(g[~keep] == -np.inf)
    want, before = _definition(xs, top_p)
    assert keep[np.arange(len(xs)), xs.argmax(-1)].all()  # the first token is always kept
    diff = keep != want
    near = np.abs(before - float(np.float32(top_p))) <= tol
    assert not (diff & ~near).any(), (top_p, np.nonzero(diff & ~near), before[diff & ~near])


@pytest.mark.parametrize("V", [7, 1000, 49152, 151936])
@pytest.mark.parametrize("kind", ["flat", "peaked", "ties"])
def test_mlx_reference_keeps_the_nucleus(V, kind):
    x = _rows(V, 2, kind, seed=V % 97)
    for p in TOP_PS:
        _assert_nucleus(sampling._top_p(x, p), x, p, tol=V * 2.0**-24)


@needs_ext
@pytest.mark.parametrize("V", [7, 1000, 49152, 151936])
@pytest.mark.parametrize("kind", ["flat", "peaked", "ties"])
def test_kernel_keeps_the_nucleus_as_the_references_do(V, kind):
    x = _rows(V, 3, kind, seed=V % 89 + 1)
    for p in TOP_PS:
        got, ref = kernels.top_p_filter(x, p), kernels.top_p_filter(x, p, reference=True)
        _assert_nucleus(got, x, p, tol=1e-6)
        _assert_nucleus(ref, x, p, tol=1e-9)
        # against the sampler's MLX path: different kept tokens only near the boundary
        mlx = np.isfinite(np.array(sampling._top_p(x, p)))
        _, before = _definition(np.array(x), p)
        diff = mlx != np.isfinite(np.array(got))
        assert (np.abs(before[diff] - float(np.float32(p))) <= V * 2.0**-24).all()


@needs_ext
def test_kernel_ties_take_the_lower_index_first():
    # Twelve equal maxima and top_p below one of their shares: the lowest indices win.
    V = 4099
    x = mx.full((1, V), -30.0)
    tied = mx.array([5, 17, 300, 1024, 2048, 2049, 3000, 3001, 3333, 4000, 4097, 4098])
    x = mx.put_along_axis(x, tied[None], mx.zeros((1, 12)), axis=-1)
    for n in (1, 3, 7, 12):
        got = np.isfinite(np.array(kernels.top_p_filter(x, (n - 0.5) / 12)))[0]
        assert np.nonzero(got)[0].tolist() == tied[:n].tolist()
    # a constraint's -inf entries stay -inf; a fully masked row passes through
    masked = mx.where(mx.arange(V) % 3 == 0, -mx.inf, _rows(V, 1, "flat", 3))
    _assert_nucleus(kernels.top_p_filter(masked, 0.9), masked, 0.9, tol=1e-6)
    none = mx.full((1, 64), -mx.inf)
    assert mx.array_equal(kernels.top_p_filter(none, 0.9), none)
    assert mx.array_equal(kernels.top_p_filter(x, 1.0), x)


@needs_ext
def test_kernel_rows_threads_compile_and_bad_input():
    x = _rows(3000, 5, "flat", 21)
    one, two = on_one_and_two_threads(lambda: kernels.top_p_filter(x, 0.9))
    assert mx.array_equal(one, two)
    assert mx.array_equal(kernels.top_p_filter(x[2:3], 0.9), one[2:3])  # a row alone = that row of many
    assert mx.array_equal(mx.compile(lambda a: kernels.top_p_filter(a, 0.9))(x), one)
    assert mx.array_equal(kernels.top_p_filter(x.reshape(5, 1, 3000), 0.9), one.reshape(5, 1, 3000))
    with pytest.raises(ValueError):
        kernels.top_p_filter(x.astype(mx.float16), 0.9)
    with pytest.raises(ValueError):
        kernels.top_p_filter(x, 0.0)


@needs_ext
def test_sampler_routes_top_p_to_the_kernel_and_falls_back(monkeypatch):
    x = _rows(49152, 1, "flat", 5)
    monkeypatch.setattr(hook, "FUSED", True)
    assert mx.array_equal(sampling.top_p_filter(x, 0.9), kernels.top_p_filter(x, 0.9))
    monkeypatch.setattr(kernels, "has", lambda op: False)  # an extension built before the kernel
    assert mx.array_equal(sampling.top_p_filter(x, 0.9), sampling._top_p(x, 0.9))
    monkeypatch.undo()
    monkeypatch.setattr(hook, "FUSED", False)
    assert mx.array_equal(sampling.top_p_filter(x, 0.9), sampling._top_p(x, 0.9))


def test_seeded_draws_with_top_p_repeat_and_stay_in_the_nucleus():
    logits = _rows(1000, 1, "flat", 9) * 0.7
    sample = make_sampler(SamplingParams(temperature=0.7, top_p=0.5))
    recent = mx.full((4,), -1, mx.int32)
    keys = mx.random.split(mx.random.key(3), 200)
    toks = [int(sample(logits, keys[i], recent)[0].item()) for i in range(200)]
    assert toks == [int(sample(logits, keys[i], recent)[0].item()) for i in range(200)]
    kept, _ = _definition(np.array(logits / 0.7), 0.5)
    assert kept[0, toks].all() and len(set(toks)) > 1


@pytest.mark.parametrize("V", [7, 1000, 151936])
def test_top_k_keeps_values_from_the_kth_largest_up(V):
    x = _rows(V, 3, "ties", V)  # repeated values at the k-th place: all of them are kept
    xs = np.array(x)
    for k in (1, 2, 5, 50):
        if k >= V:
            continue
        got = np.array(sampling._top_k(x, k))
        kth = -np.sort(-xs, axis=-1)[:, k - 1 : k]
        want = np.where(xs < kth, -np.inf, xs)
        assert np.array_equal(got, want)
        assert (np.isfinite(got).sum(-1) >= k).all()
