"""Resume and cold replay agree on the real SmolLM2 model (issue 30, item 4): the K/V a live
decode wrote are what a cold prefill of the same tokens writes, bit for bit, on this CPU's
instruction set -- so a session resumed from its checkpoint and the same messages replayed with
no checkpoint give the same greedy reply."""

import shutil
from pathlib import Path

import pytest

from tests.test_e2e_resume import _checkpoint_files, _turn

pytestmark = pytest.mark.e2e

SESSION = [
    "Hi! I am planning a trip to Japan next spring with two friends.",
    "We like food, old temples and long walks. Which cities should we visit?",
    "How many days would you spend in Kyoto, and why?",
    "Suggest a simple plan for our first day in Tokyo.",
    "What should we pack for the weather in April?",
    "Give me three polite phrases in Japanese with their meaning.",
    "How do we travel between Tokyo and Kyoto?",
    "Summarise our whole plan in a short list.",
]


def test_resumed_session_and_cold_replay_give_the_same_reply(tmp_path):
    home = tmp_path / "warm"
    for q in SESSION[:-1]:
        _turn(home, "trip", q, "--max-tokens", "96")
    cold_home = tmp_path / "cold"
    shutil.copytree(home, cold_home, symlinks=True)
    assert _checkpoint_files(cold_home)
    shutil.rmtree(cold_home / "data" / "checkpoints")
    warm, _ = _turn(home, "trip", SESSION[-1], "--max-tokens", "96")
    cold, _ = _turn(cold_home, "trip", SESSION[-1], "--max-tokens", "96")
    assert warm["cache"]["source"] == "ssd" and cold["cache"]["source"] == "none"
    assert warm["usage"]["prompt_tokens"] == cold["usage"]["prompt_tokens"] > 600
    assert warm["text"] == cold["text"]


@pytest.mark.parametrize("kv", ["fp16", "q8"])
def test_decoded_kv_equal_cold_prefill_kv(kv, smollm2_path: Path):
    """The same claim one level down, on every layer: 400 tokens (four key blocks) decoded by the
    compiled step after a 20-token prompt, then prefilled cold in 128-token chunks."""
    _check_decoded_kv_equal_cold_prefill(smollm2_path, kv)


def test_decoded_kv_equal_cold_prefill_kv_with_q6k_blocks():
    """The same on Qwen2.5-Coder-0.5B, whose Q4_K_M file keeps half its FFN down projections in
    Q6_K: those run on their own blocks (engine.kernels.q6k) in decode and prefill alike."""
    from engine.model.catalog import CatalogError, model_path

    try:
        path = model_path("qwen2.5-coder-0.5b")
    except CatalogError as e:
        pytest.skip(f"Qwen2.5-Coder-0.5B not installed: {e}")
    _check_decoded_kv_equal_cold_prefill(path, "fp16", q6k_layers=12)


def _check_decoded_kv_equal_cold_prefill(path: Path, kv: str, q6k_layers: int = 0) -> None:
    from engine import kernels
    from engine.generation.generate import DecodeStep, prefill
    from engine.generation.kv_cache import Q8, make_cache
    from engine.generation.sampling import SamplingParams
    from engine.kernels.q6k import Q6KLinear
    from engine.model.loader import load_bundle

    import mlx.core as mx

    if not kernels.available():
        pytest.skip(f"kernels off: {kernels.status()['reason']}")
    model = load_bundle(path, "quantized").model
    assert sum(type(m) is Q6KLinear for _, m in model.named_modules()) == q6k_layers
    kv_dtype = mx.float16 if kv == "fp16" else Q8(64)
    tokens = [(37 * i + 11) % 4000 + 100 for i in range(400)]
    live = make_cache(model, kv_dtype=kv_dtype)
    prefill(model, live, tokens[:20], logits=False)
    step = DecodeStep(model, live, SamplingParams(temperature=0.0), model.args.vocab_size)
    key, recent = mx.random.key(0), mx.full((16,), -1, mx.int32)
    for t in tokens[20:]:
        step(live, mx.array([t]), key, recent)
    cold = make_cache(model, kv_dtype=kv_dtype)
    prefill(model, cold, tokens, chunk=128, logits=False)
    n = len(tokens)
    bad = [i for i, (a, b) in enumerate(zip(live, cold, strict=True))
           if not (mx.array_equal(a.keys[..., :n, :], b.keys[..., :n, :]).item()
                   and mx.array_equal(a.values[..., :n, :], b.values[..., :n, :]).item())]
    assert bad == [], f"layers {bad} differ ({kernels.status()['isa']}, prefill {kernels.prefill_path()})"
