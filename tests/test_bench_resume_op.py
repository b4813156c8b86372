"""bench resume's attention op table: the per-layer fused decode call, hot vs streamed.

A tiny random-shaped "model" (only ``args`` is read): the timing helper must run the fused
kernel on every layer's own K/V buffer for each stored format and report both medians."""

from types import SimpleNamespace

from engine import kernels
from engine.generation.kv_cache import Q8
from engine.kernels import attention

import mlx.core as mx
import pytest

from app.benches import resume


def _model(layers: int = 3) -> SimpleNamespace:
    return SimpleNamespace(args=SimpleNamespace(num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                                                hidden_size=128, num_hidden_layers=layers))


@pytest.mark.skipif(not kernels.available(), reason="CPU kernels not built on this machine")
@pytest.mark.parametrize("kv_dtype", [mx.float32, mx.float16, Q8(32)])
def test_decode_layers_times_hot_and_streamed_on_every_layer(monkeypatch, kv_dtype):
    seen = []
    real = kernels.flash_attention

    def spy(q, k, v, *a, **kw):
        seen.append(id(k))
        return real(q, k, v, *a, **kw)

    monkeypatch.setattr(kernels, "flash_attention", spy)
    prev = attention.impl
    res = resume._decode_layers(_model(3), 300, kv_dtype, 512, 32, rounds=2)
    assert attention.impl == prev and not attention._active.on  # restored
    assert res["layers"] == 3
    assert res["hot"] > 0 and res["streamed"] > 0
    # the fused kernel ran (not a fallback), and streamed visited 3 distinct K buffers
    assert len(set(seen)) == 3
    # warm + 2 rounds x (hot + streamed) x 3 calls per layer
    assert len(seen) == 1 + 2 * 2 * 9


@pytest.mark.skipif(not kernels.available(), reason="CPU kernels not built on this machine")
def test_attention_op_reports_decode_layers():
    out = resume._attention_op(_model(2), 200, mx.float16)
    assert set(out) == {"prefill_chunk", "decode_step", "decode_layers"}
    assert out["decode_layers"]["layers"] == 2
