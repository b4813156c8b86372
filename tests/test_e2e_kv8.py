"""Live 8-bit KV on the CPU (``kv_cache.format: q8``, engine.generation.kv_cache.Q8) on real
weights: perplexity of a fixed text fed one token at a time (the decode path: int8 q . k dots
in the fused attention) vs float16 KV's, for SmolLM2-135M and Qwen2.5-Coder-0.5B; greedy
tokens over 64 tokens on 3 prompts are compared with float16 KV's and the first divergence
(if any) is reported, not asserted (a different numeric path: near-ties flip).

Measured (round 4, group 64 / 32): SmolLM2 +0.88% / +0.73%, Qwen 0.5B +0.48% / -1.91%; greedy
divergence at tokens [5, 17, 16] / [5, 6, 26] (SmolLM2) and [-, -, 9] / [0, 47, -] (Qwen). The
issue's 0.5% gate is missed on SmolLM2, which is why q8 stays an opt-in preset
(``smollm2-135m-kv8``, group 64) and fp16 the default. The bound below guards the measured
level (a broken pack or kernel moves perplexity by far more than 1%).
"""


from engine import kernels
from engine.generation.generate import generate_step
from engine.generation.kv_cache import Q8, make_cache
from engine.model.catalog import CatalogError, model_path
from engine.model.loader import load_bundle
from engine.sampling import SamplingParams

import mlx.core as mx
import pytest

from tests.test_e2e_attention import ppl_decode
from tests.test_e2e_kernels import PROMPTS, TEXT

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.skipif(
        not kernels.available(), reason=f"kernels off: {kernels.status()['reason']}"
    ),
]


def _bundle(name):
    try:
        path = model_path(name)
    except CatalogError as e:
        pytest.skip(f"{name} not available: {e}")
    return load_bundle(path, "quantized")


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


@pytest.mark.parametrize("name", ["smollm2-135m", "qwen2.5-coder-0.5b"])
@pytest.mark.parametrize("group", [64])
def test_q8_kv_perplexity_close_to_fp16(name, group):
    bundle = _bundle(name)
    ids = bundle.tokenizer.encode(TEXT)
    p16 = ppl_decode(bundle, ids, mx.float16)
    p8 = ppl_decode(bundle, ids, Q8(group))
    diverged = [
        divergence(greedy(bundle, t, mx.float16), greedy(bundle, t, Q8(group))) for t in PROMPTS
    ]
    print(
        f"{name} q8-g{group}: ppl fp16 {p16:.4f}, q8 {p8:.4f} ({(p8 / p16 - 1) * 100:+.3f}%); "
        f"first greedy divergence per prompt (None: all 64 equal): {diverged}"
    )
    assert abs(p8 / p16 - 1) < 0.0125
