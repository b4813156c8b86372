"""Live 8-bit KV on the CPU (``kv_cache.format: q8``: K rows hold Hadamard-rotated keys) on real
weights, vs float16 KV, for SmolLM2-135M and Qwen2.5-Coder-0.5B: a fixed text fed one token at
a time (the decode path: int8 q . k dots in the fused attention).

Two measures, because one of them is noise. On the shipped quantized weights the int8
activation path turns any change into another noise realisation: float32 KV already moves
SmolLM2's perplexity +0.51% from float16 KV's on this text, so that test prints the numbers and
bounds gross breakage only. On float32 weights the q8 error shows alone: the mean KL(fp16 KV ||
q8) per token and the perplexity change are what the gate holds (SmolLM2 meets it; Qwen 0.5B,
whose keys carry large k_proj biases, is bounded at its measured level: docs/benchmarks-log.md
"Long context, round 6"). Greedy tokens over 64 tokens on 3 prompts are compared with float16
KV's and the first divergence is reported, not asserted (near-ties flip).
"""

import math

from engine import kernels
from engine.generation.generate import generate_step
from engine.generation.kv_cache import Q8, make_cache
from engine.kernels import hook
from engine.model.catalog import CatalogError, model_path
from engine.model.loader import load_bundle
from engine.sampling import SamplingParams

import mlx.core as mx
import numpy as np
import pytest

from tests.test_e2e_attention import ppl_decode
from tests.test_e2e_kernels import PROMPTS, TEXT

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.skipif(
        not kernels.available(), reason=f"kernels off: {kernels.status()['reason']}"
    ),
]


def _bundle(name, weights="quantized"):
    try:
        path = model_path(name)
    except CatalogError as e:
        pytest.skip(f"{name} not available: {e}")
    bundle = load_bundle(path, weights)
    if weights != "quantized":
        hook.install(bundle.model)  # routes attention (nothing quantized to route)
    return bundle


def greedy(bundle, text, kv_dtype, n=64) -> list[int]:
    prompt = bundle.tokenizer.encode(text)
    steps = generate_step(
        bundle.model,
        prompt,
        make_cache(bundle.model, kv_dtype=kv_dtype),
        SamplingParams(temperature=0.0, max_tokens=n),
    )
    return [s.token for s in steps]


def divergence(a: list[int], b: list[int]) -> int | None:
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y), None)


def logprobs_decode(bundle, ids, kv_dtype) -> np.ndarray:
    """Log-probabilities (len(ids) - 1, vocab) of ``ids`` fed one token per call."""
    cache = make_cache(bundle.model, kv_dtype=kv_dtype)
    rows = []
    for i in range(len(ids) - 1):
        logits = bundle.model(mx.array([[ids[i]]]), cache=cache)[0, -1].astype(mx.float32)
        rows.append(np.array(logits - mx.logsumexp(logits)))
    return np.stack(rows)


@pytest.mark.parametrize("name", ["smollm2-135m", "qwen2.5-coder-0.5b"])
@pytest.mark.parametrize("group", [64])
def test_q8_kv_perplexity_close_to_fp16(name, group):
    bundle = _bundle(name)
    ids = bundle.tokenizer.encode(TEXT)
    p16 = ppl_decode(bundle, ids, mx.float16)
    p32 = ppl_decode(bundle, ids, None)  # the noise floor: float32 KV
    p8 = ppl_decode(bundle, ids, Q8(group))
    diverged = [
        divergence(greedy(bundle, t, mx.float16), greedy(bundle, t, Q8(group))) for t in PROMPTS
    ]
    print(
        f"{name} q8-g{group}: ppl fp16 KV {p16:.4f}, q8 {p8:.4f} ({(p8 / p16 - 1) * 100:+.3f}%), "
        f"fp32 KV {p32:.4f} ({(p32 / p16 - 1) * 100:+.3f}%: the noise floor); "
        f"first greedy divergence per prompt (None: all 64 equal): {diverged}"
    )
    assert abs(p8 / p16 - 1) < 0.0125


# (name, perplexity bound, KL bound). SmolLM2: the 0.5% gate, and a KL bound between the
# measured 0.35e-3 and unrotated rows' 1.23e-3, so losing the rotation fails it. Qwen 0.5B misses
# the gate (+0.88%, KL 4.07e-3 measured): these bounds only catch breakage beyond that level.
@pytest.mark.parametrize(
    "name, max_rel, max_kl",
    [("smollm2-135m", 0.005, 0.7e-3), ("qwen2.5-coder-0.5b", 0.0125, 6e-3)],
)
def test_q8_kv_on_fp32_weights_within_the_gate(name, max_rel, max_kl):
    """The quality gate on fp32 weights, where only the KV format differs: perplexity within
    ``max_rel`` of float16 KV's and mean per-token KL below ``max_kl`` (see the bounds)."""
    bundle = _bundle(name, "fp32")
    ids = bundle.tokenizer.encode(TEXT)
    target = np.array(ids[1:])
    ref = logprobs_decode(bundle, ids, mx.float16)
    q8 = logprobs_decode(bundle, ids, Q8(64))

    def ppl(lp):
        return math.exp(-lp[np.arange(len(target)), target].mean())

    kl = float((np.exp(ref) * (ref - q8)).sum(1).mean())
    rel = ppl(q8) / ppl(ref) - 1
    top1 = float((q8.argmax(1) == ref.argmax(1)).mean())
    print(
        f"{name} fp32 weights, q8-g64 vs fp16 KV: ppl {rel * 100:+.3f}%, KL {kl:.3e}, top-1 {top1:.3f}"
    )
    assert abs(rel) < max_rel
    assert kl < max_kl
