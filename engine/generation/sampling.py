"""Token sampling as pure MLX functions, so the decode step can compile them with the model.

``make_sampler(params)`` returns ``sample(logits, key, recent, mask=None) -> (token, logprobs)``
where ``logits`` is (1, vocab), ``key`` a PRNG key (ignored when greedy), ``recent`` a
fixed-size int32 window of the most recent token ids (-1 = empty slot) for the repetition
penalty, and ``mask`` an optional additive (vocab,) mask from a constraint (0 or -inf).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace

from engine import kernels
from engine.kernels.hook import fused_active

import mlx.core as mx

SampleFn = Callable[..., tuple[mx.array, mx.array]]


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.7
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    repetition_context: int = 64
    seed: int | None = None
    max_tokens: int = 1024
    stop: tuple[str, ...] = field(default_factory=tuple)
    stop_token_ids: tuple[int, ...] = field(default_factory=tuple)
    logprobs: int = 0  # top-N logprobs per token to return (0 = none)
    # Go on past the tokenizer's end-of-sequence tokens to max_tokens (stop strings and
    # stop_token_ids still end a reply): fixed reply lengths, as throughput benchmarks want them.
    ignore_eos: bool = False

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0.0

    def with_overrides(self, **kw) -> SamplingParams:
        return replace(self, **{k: v for k, v in kw.items() if v is not None})


def make_sampler(params: SamplingParams) -> SampleFn:
    """Build the sampling function for ``params`` (only the parts that are switched on)."""
    penalty = params.repetition_penalty
    temp = params.temperature
    top_k, top_p, min_p = params.top_k, params.top_p, params.min_p

    def sample(
        logits: mx.array, key: mx.array, recent: mx.array, mask: mx.array | None = None
    ) -> tuple[mx.array, mx.array]:
        logits = logits.astype(mx.float32)
        if penalty != 1.0:
            logits = _apply_repetition_penalty(logits, recent, penalty)
        if mask is not None:
            logits = logits + mask
        logprobs = log_softmax(logits)
        if temp <= 0.0:
            return mx.argmax(logits, axis=-1), logprobs
        scaled = logprobs / temp
        if top_k > 0 and top_k < scaled.shape[-1]:
            scaled = _top_k(scaled, top_k)
        if 0.0 < min_p < 1.0:
            scaled = _min_p(scaled, min_p)
        if 0.0 < top_p < 1.0:
            scaled = top_p_filter(scaled, top_p)
        return mx.random.categorical(scaled, key=key), logprobs

    return sample


def greedy_tokens(logits: mx.array) -> mx.array:
    """Each row's argmax as int32 (``mx.argmax``'s index: the first of equal values): on the
    CPU kernels one vectorised primitive for all rows (MLX's CPU argmax is a scalar loop,
    ~0.4 ms for the 8 rows of a batched SmolLM2 step); elsewhere, or with
    ``hook.FUSED`` off, MLX's argmax."""
    logits = logits.astype(mx.float32)
    if fused_active():
        return kernels.argmax_rows(logits)
    return mx.argmax(logits, axis=-1).astype(mx.int32)


def log_softmax(logits: mx.array) -> mx.array:
    """``logits - logsumexp(logits)``: on the CPU kernels one primitive with a vectorised exp
    (MLX's CPU logsumexp is a scalar exp over the whole vocabulary, ~3% of a small model's
    decode step); elsewhere, or with ``hook.FUSED`` off, MLX's ops."""
    if logits.dtype == mx.float32 and fused_active():
        return kernels.log_softmax(logits)
    return logits - mx.logsumexp(logits, axis=-1, keepdims=True)


def _apply_repetition_penalty(logits: mx.array, recent: mx.array, penalty: float) -> mx.array:
    # Slots holding -1 are empty: point them at token 0 but leave its logit unchanged.
    valid = recent >= 0
    idx = mx.where(valid, recent, 0)[None, :]
    picked = mx.take_along_axis(logits, idx, axis=-1)
    penalised = mx.where(picked < 0, picked * penalty, picked / penalty)
    picked = mx.where(valid[None, :], penalised, picked)
    return mx.put_along_axis(logits, idx, picked, axis=-1)


def _top_k(logits: mx.array, k: int) -> mx.array:
    # The k-th largest value (with repeats) from a partition, not a sort of the vocabulary.
    kth = mx.min(mx.topk(logits, k, axis=-1), axis=-1, keepdims=True)
    return mx.where(logits < kth, -mx.inf, logits)


def _min_p(logprobs: mx.array, min_p: float) -> mx.array:
    # Keep tokens whose probability is at least min_p times the top token's.
    top = mx.max(logprobs, axis=-1, keepdims=True)
    return mx.where(logprobs < top + mx.log(mx.array(min_p, dtype=logprobs.dtype)), -mx.inf, logprobs)


def top_p_filter(logits: mx.array, top_p: float) -> mx.array:
    """``logits`` with every token outside each row's top-p nucleus at -inf: on the CPU kernels
    one O(vocab) primitive (src/topp.cpp: the same kept set as ``_top_p`` up to float rounding
    of the cumulative mass at top_p); elsewhere, with ``hook.FUSED`` off or an extension built
    before it, ``_top_p``'s sort (42-50 ms per 152k-token row on one AVX2 core)."""
    if logits.dtype == mx.float32 and fused_active() and kernels.has("top_p_filter"):
        return kernels.top_p_filter(logits, top_p)
    return _top_p(logits, top_p)


def _top_p(logits: mx.array, top_p: float) -> mx.array:
    """The reference top-p filter (MLX ops): a stable descending sort of the vocabulary."""
    order = mx.argsort(-logits, axis=-1)
    sorted_logits = mx.take_along_axis(logits, order, axis=-1)
    probs = mx.softmax(sorted_logits, axis=-1)
    cum = mx.cumsum(probs, axis=-1)
    # Keep the smallest prefix whose mass reaches top_p (the first token is always kept).
    keep_sorted = (cum - probs) < top_p
    filtered_sorted = mx.where(keep_sorted, sorted_logits, -mx.inf)
    # Scatter back through the sort's permutation (no inverse argsort: a second full sort).
    return mx.put_along_axis(logits, order, filtered_sorted, axis=-1)


def top_logprobs(logprobs: mx.array, n: int) -> list[tuple[int, float]]:
    """The ``n`` most likely tokens of a (vocab,) or (1, vocab) logprob vector."""
    flat = logprobs.reshape(-1)
    idx = mx.argsort(-flat)[:n]
    vals = flat[idx]
    return list(zip(idx.tolist(), vals.tolist(), strict=True))
