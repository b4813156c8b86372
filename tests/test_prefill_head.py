"""Prefill's output head on the last rows only: logits bit-identical to the full forward's last
row for every family (tied and untied heads), weight format (fp32, MLX-quantized, CPU kernels)
and prompt length (shorter and longer than the head's row window, several chunks)."""

import engine  # noqa: F401
from engine import kernels
from engine.generation.generate import HEAD_ROWS, last_logits, prefill
from engine.generation.kv_cache import make_cache

import mlx.core as mx
import mlx.nn as nn
import pytest
from mlx_lm.utils import load_model

from tests.kernel_checks import BLAS_ROWS_REASON, blas_rows_depend_on_count

PROMPT = [(11 * i + 5) % 380 for i in range(70)]


@pytest.fixture
def model_dirs(tiny_llama_dir, tiny_qwen2_dir, tiny_gemma_dir):
    return {"llama": tiny_llama_dir, "qwen2": tiny_qwen2_dir, "gemma3": tiny_gemma_dir}


def _model(path, fmt: str):
    model, _ = load_model(path)
    if fmt != "fp32":
        nn.quantize(model, group_size=32, bits=4)
        mx.eval(model.parameters())
    if fmt == "kernels":
        from engine.kernels import hook

        assert hook.install(model) > 0
    return model


FORMATS = ["fp32", "mlx-q4", pytest.param("kernels", marks=pytest.mark.skipif(
    not kernels.available(), reason="CPU kernels not built"))]


@pytest.mark.parametrize("which", ["llama", "qwen2", "gemma3"])
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("n", [5, HEAD_ROWS, 70])
def test_last_logits_bit_identical(which, fmt, n, model_dirs):
    if n > HEAD_ROWS and fmt == "fp32" and blas_rows_depend_on_count():
        pytest.skip(BLAS_ROWS_REASON)
    model = _model(model_dirs[which], fmt)
    tokens = mx.array(PROMPT[:n])[None]
    ref_cache = make_cache(model)
    want = model(tokens, cache=ref_cache)[:, -1, :]
    cache = make_cache(model)
    got = last_logits(model, tokens, cache)
    mx.eval(want, got)
    assert got.shape == want.shape
    assert mx.array_equal(got, want).item()
    # The caches hold the same keys/values as the full forward's.
    for a, b in zip(cache, ref_cache, strict=True):
        assert a.offset == b.offset
        for x, y in zip(a.state, b.state, strict=True):
            assert mx.array_equal(x, y).item()


@pytest.mark.parametrize("which", ["llama", "qwen2", "gemma3"])
def test_chunked_prefill_matches_one_forward(which, model_dirs):
    """Chunks that skip the head entirely still leave the cache and final logits as one pass."""
    model = _model(model_dirs[which], "fp32")
    want = model(mx.array(PROMPT)[None], cache=make_cache(model))[:, -1, :]
    seen = []
    got = prefill(model, make_cache(model), PROMPT, chunk=16, progress=lambda d, t: seen.append(d))
    assert seen == [16, 32, 48, 64, 70]
    assert mx.allclose(got, want, atol=1e-4).item()  # chunking reorders sums (Gemma rings)
    # The same chunking through the full forward gives exactly these logits.
    cache = make_cache(model)
    for i in range(0, 70, 16):
        ref = model(mx.array(PROMPT[i : i + 16])[None], cache=cache)[:, -1, :]
    assert mx.array_equal(got, ref).item()


def test_unknown_family_runs_whole_model(model_dirs):
    model = _model(model_dirs["llama"], "fp32")
    calls = []

    class Wrapper(nn.Module):  # no model_type: the helper must not guess its head
        def __init__(self, inner):
            super().__init__()
            self.inner = inner

        def __call__(self, inputs, cache=None):
            calls.append(inputs.shape)
            return self.inner(inputs, cache=cache)

    tokens = mx.array(PROMPT[:30])[None]
    got = last_logits(Wrapper(model), tokens, make_cache(model))
    want = model(tokens, cache=make_cache(model))[:, -1, :]
    assert calls == [(1, 30)]
    assert mx.array_equal(got, want).item()
