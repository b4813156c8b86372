"""Speculative decoding on real weights: SmolLM2 lookup and draft model, Gemma past its window,
and (opt-in) the Qwen2.5-Coder 0.5B -> 1.5B pair. Same tokens as plain decoding every time."""

from __future__ import annotations

import engine  # noqa: F401  (loads OpenBLAS before mlx)

# isort: split
from engine.generation.generate import generate_step
from engine.generation.kv_cache import WindowKVCache, make_cache
from engine.generation.speculation.base import DraftPolicy, SpecStats, Speculation
from engine.generation.speculation.lookup import LookupDrafter
from engine.model.catalog import model_path
from engine.model.loader import load_bundle
from engine.runtime import Engine, GenerationRequest
from engine.sampling import SamplingParams

import mlx.core as mx
import pytest

from tests.test_speculation import assert_cache_is_fresh_prefill

pytestmark = pytest.mark.e2e

PASSAGE = ("It was the best of times, it was the worst of times, it was the age of wisdom, it was "
           "the age of foolishness, it was the epoch of belief, it was the epoch of incredulity.")


def _both(eng, ids, max_tokens):
    """(plain Done, speculative Done) for the same greedy request on one engine."""
    out = []
    for speculate in (False, True):
        params = eng.sampling(temperature=0.0, max_tokens=max_tokens)
        out.append(eng.submit(GenerationRequest(ids, params, extra={"speculation": speculate})).result())
    return out


def test_smollm2_lookup_preset_copies_a_quoted_passage(tmp_path):
    # the preset on fp32 weights: SmolLM2-135M in Q4 with int8 activations copies the passage
    # less faithfully, and this test is about the drafter, not the weights
    from engine.profiles import load_profile, profile_to_dict

    import yaml

    data = profile_to_dict(load_profile("smollm2-135m-lookup"))
    data["model"]["weights"] = "fp32"
    (tmp_path / "lookup.yaml").write_text(yaml.safe_dump(data))
    eng = Engine.load(str(tmp_path / "lookup.yaml"))
    try:
        ids = eng.chat_prompt([{"role": "user", "content": f"Repeat this exactly:\n\n{PASSAGE}"}])
        plain, spec = _both(eng, ids, 40)
    finally:
        eng.close()
    assert spec.completion_token_ids == plain.completion_token_ids and spec.text == plain.text
    s = spec.speculation
    assert s["mode"] == "lookup" and s["acceptance_rate"] > 0.5 and s["mean_accepted_length"] > 1.5, s
    assert s["rounds"] + s["plain_steps"] < len(spec.completion_token_ids)


def test_smollm2_real_draft_model_quantized_drafts_for_fp32(tmp_path):
    """A real draft model: SmolLM2 in MLX's packed Q4 weights drafts for SmolLM2 in fp32."""
    (tmp_path / "q4.yaml").write_text("model: {source: smollm2-135m, weights: quantized}\n")
    (tmp_path / "pair.yaml").write_text(
        "model: {source: smollm2-135m, weights: fp32}\n"
        "speculation: {mode: draft, draft_model: q4.yaml, num_draft_tokens: 4}\n")
    eng = Engine.load(str(tmp_path / "pair.yaml"))
    try:
        ids = eng.chat_prompt([{"role": "user", "content": "List three fruits and their colours."}])
        plain, spec = _both(eng, ids, 40)
    finally:
        eng.close()
    assert spec.completion_token_ids == plain.completion_token_ids
    s = spec.speculation
    assert s["mode"] == "draft" and s["rounds"] > 0 and s["acceptance_rate"] > 0.5, s


def test_smollm2_cache_after_lookup_equals_fresh_prefill():
    bundle = load_bundle(model_path("smollm2-135m"), "fp32")
    model, tok = bundle.model, bundle.tokenizer
    prompt = tok.encode(f"{PASSAGE}\n{PASSAGE}\n{PASSAGE[:40]}", add_special_tokens=True)
    params = SamplingParams(temperature=0.0, max_tokens=30)
    ref = [o.token for o in generate_step(model, prompt, make_cache(model), params)]
    cache = make_cache(model)
    spec = Speculation(LookupDrafter(2, 4), DraftPolicy(8, 1, True), SpecStats("lookup"))
    got = [o.token for o in generate_step(model, prompt, cache, params, speculation=spec)]
    assert got == ref and spec.stats.accepted > 10
    assert_cache_is_fresh_prefill(model, cache, prompt + got, tol=2e-3)


def test_gemma_lookup_past_the_sliding_window():
    """Gemma-3-270M's 512-token window has wrapped: rollback of the ring stays exact."""
    bundle = load_bundle(model_path("gemma3-270m"), "fp32")
    model, tok = bundle.model, bundle.tokenizer
    prompt = tok.encode((PASSAGE + " ") * 16, add_special_tokens=True)[:560]
    params = SamplingParams(temperature=0.0, max_tokens=24)
    ref = [o.token for o in generate_step(model, prompt, make_cache(model), params)]
    cache = make_cache(model)
    assert any(isinstance(c, WindowKVCache) and c.window == 512 for c in cache)
    spec = Speculation(LookupDrafter(2, 4), DraftPolicy(8, 1, True), SpecStats("lookup"))
    got = [o.token for o in generate_step(model, prompt, cache, params, speculation=spec)]
    assert got == ref and spec.stats.accepted > 5
    assert_cache_is_fresh_prefill(model, cache, prompt + got, tol=2e-3)


@pytest.mark.optin
def test_qwen_coder_05b_drafts_for_15b():
    eng = Engine.load("qwen2.5-coder-1.5b-draft")
    try:
        ids = eng.chat_prompt([{"role": "user", "content": "Write a Python function that reverses a string."}])
        plain, spec = _both(eng, ids, 32)
    finally:
        eng.close()
    assert spec.completion_token_ids == plain.completion_token_ids
    s = spec.speculation
    assert s["mode"] == "draft" and s["acceptance_rate"] > 0.3, s


@pytest.mark.parametrize("wrong", [None, 2])
def test_smollm2_on_the_kernels_speculation_gives_the_step_bits(wrong):
    """Default weights (quantized, int8-activation kernels): tokens AND logprobs of every
    position equal plain decoding's exactly, through full and partial accepts."""
    from engine.model.weight_policy import choose_weights

    from tests.test_speculation import Oracle

    bundle = load_bundle(model_path("smollm2-135m"), choose_weights("auto"))
    model, tok = bundle.model, bundle.tokenizer
    prompt = tok.encode(f"{PASSAGE}\n{PASSAGE}\n{PASSAGE[:40]}", add_special_tokens=True)
    params = SamplingParams(temperature=0.0, max_tokens=40)
    ref = list(generate_step(model, prompt, make_cache(model), params))
    spec = Speculation(Oracle([o.token for o in ref], len(prompt), wrong), DraftPolicy(8, 1, False),
                       SpecStats("oracle"))
    got = list(generate_step(model, prompt, make_cache(model), params, speculation=spec))
    assert [o.token for o in got] == [o.token for o in ref]
    for g, r in zip(got, ref, strict=True):
        assert mx.array_equal(g.logprobs, r.logprobs)
    assert spec.stats.rounds > 3


def test_qwen_coder_05b_edit_file_step_under_the_tool_call_grammar():
    """The agent's edit_file step as an agent generates it (the tool-call constraint): lookup
    plus the grammar's forced tokens give plain constrained decoding's tokens, the forced
    tokens are drafted and kept, and the call takes under half as many forwards as tokens."""
    from app.benches.spec import edit_step_constraint, edit_step_prompt

    eng = Engine.load("qwen2.5-coder-0.5b-lookup")
    try:
        prompt = edit_step_prompt(eng, "def compute_total_3(")
        make = edit_step_constraint(eng, prompt, 64)
        out = []
        for speculate in (False, True):
            params = eng.sampling(temperature=0.0, max_tokens=64, repetition_penalty=1.0)
            out.append(eng.submit(GenerationRequest(prompt, params, constraint=make(),
                                                    extra={"speculation": speculate})).result())
    finally:
        eng.close()
    plain, spec = out
    assert spec.completion_token_ids == plain.completion_token_ids
    assert plain.text.rstrip().endswith("</tool_call>")
    s = spec.speculation
    assert s["forced_drafted"] > 0 and s["accepted"] > s["drafted"] // 2, s
    assert s["rounds"] + s["plain_steps"] < len(plain.completion_token_ids) / 2, s
