"""Token generation: chunked prefill, then a compiled, pipelined decode loop.

``generate_step`` reads top to bottom: prefill the prompt into the caches, sample the first
token, then repeatedly build step n+1 while step n computes (``mx.async_eval``), yielding one
token id at a time. With static caches the whole decode step -- model, cache update,
repetition window, sampling -- is one ``mx.compile``d function traced once per buffer size.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from engine.generation.constraints import TokenConstraint, additive_mask
from engine.generation.kv_cache import StaticKVCache, WindowKVCache, is_static
from engine.generation.sampling import SamplingParams, make_sampler
from engine.generation.speculation.base import Speculation

import mlx.core as mx

PREFILL_CHUNK = 512


@dataclass
class StepOutput:
    token: int
    logprobs: mx.array | None  # (vocab,) log-probabilities the token was drawn from


def prefill(
    model,
    cache: list,
    tokens: list[int],
    chunk: int = PREFILL_CHUNK,
    progress: Callable[[int, int], None] | None = None,
    should_stop: Callable[[], bool] | None = None,
    logits: bool = True,
) -> mx.array | None:
    """Run ``tokens`` through the model into ``cache``; return the last position's logits
    (``logits=False``: only the caches are computed, for prompt bodies nobody reads the
    logits of -- the output head and the last layer's MLP never run; returns None)."""
    total = len(tokens)
    done = 0
    out = None
    while done < total:
        n = min(chunk, total - done)
        out = last_logits(model, mx.array(tokens[done : done + n])[None], cache)
        done += n
        # Only the final chunk's logits are used: evaluating just the caches of the others
        # leaves their output head (and last layer's MLP) uncomputed.
        mx.eval([c.state for c in cache], *([out] if done == total and logits else []))
        if progress:
            progress(done, total)
        if should_stop and should_stop() and done < total:
            break
    return out if logits else None


# Families whose forward is ``head(model.model(inputs, cache))`` with nothing after the head
# (no soft-capping or scaling in these mlx_lm versions): the head is ``lm_head`` when present,
# else the tied embedding (Gemma pops ``lm_head`` when the checkpoint ties it).
_SPLIT_HEAD = ("llama", "qwen2", "qwen3", "gemma3_text")

# The head runs on this many trailing rows, not one: matmul implementations pick their
# algorithm by row count (BLAS from gemv to gemm, the CPU kernels' float panels when their
# int8 paths are switched off), and each row of a gemm result does not depend on the others,
# so the last row comes out bit-identical to a head over every position at 16/L of the cost.
# Where the CPU kernels' int8 paths run the head, a row's bits do not depend on the row
# count at all (docs/kernels.md), so one row is enough (_head_rows).
HEAD_ROWS = 16


def _head_rows(head, hidden: int) -> int:
    from engine import kernels
    from engine.kernels import hook

    module = getattr(head, "__self__", head)  # a tied head is its embedding's as_linear
    if not hook.runs_on_kernels(module, hidden):
        return HEAD_ROWS
    return 1 if kernels.prefill_path(HEAD_ROWS) not in (None, "float panels") else HEAD_ROWS


def last_logits(model, inputs: mx.array, cache: list) -> mx.array:
    """Logits (B, vocab) at the last position of ``inputs``, run through ``model`` into ``cache``.

    mlx_lm models apply the output head to every position; prefill only needs the last one,
    and the head is a large part of the work (151,936 rows for Qwen2.5). For known families the
    backbone runs alone and the head sees the trailing rows only; others run whole.
    """
    if getattr(model, "model_type", None) not in _SPLIT_HEAD or not hasattr(model, "model"):
        return model(inputs, cache=cache)[:, -1, :]
    if "_routed_base" in type(model).__dict__:  # CPU kernels' attention is on for this model
        from engine.kernels.attention import routing

        with routing():
            h = model.model(inputs, cache)
    else:
        h = model.model(inputs, cache)
    head = model.lm_head if "lm_head" in model else model.model.embed_tokens.as_linear
    h = h[:, -_head_rows(head, h.shape[-1]) :, :]
    return head(h)[:, -1, :]


class DecodeStep:
    """One decode step ``(cache, token, key, recent, mask) -> (next_token, logprobs, key, recent)``.

    Compiled over static caches; falls back to plain calls for other caches (quantized KV).
    The trace runs on private scratch cache objects, so one compiled step serves every
    request with the same cache layout and sampler (see ``decode_step_for``).
    """

    def __init__(self, model, layout: list, params: SamplingParams, vocab: int, compile_step: bool = True):
        self.model = model
        self.sample = make_sampler(params)
        self.static = compile_step and is_static(layout)
        self._scratch = [_blank_like(c) for c in layout] if self.static else None
        self._compiled = mx.compile(self._traced) if self.static else None
        self._no_mask = mx.zeros((vocab,), dtype=mx.float32)

    def _traced(self, token, pos, key, recent, mask, kv):
        for c, (k, v) in zip(self._scratch, kv, strict=True):
            c.bind(k, v, pos)
        logits = self.model(token[None], cache=self._scratch)[:, -1, :]
        key, sub = mx.random.split(key)
        nxt, logprobs = self.sample(logits, sub, recent, mask)
        recent = mx.concatenate([recent[1:], nxt.astype(recent.dtype)])
        out = [(c.keys, c.values) for c in self._scratch]
        for c in self._scratch:
            c.unbind(None, None, 0)  # drop tracer arrays
        return nxt, logprobs, key, recent, out

    def __call__(self, cache: list, token: mx.array, key: mx.array, recent: mx.array, mask: mx.array | None = None):
        if mask is None:
            mask = self._no_mask
        if not self.static:
            logits = self.model(token[None], cache=cache)[:, -1, :]
            key, sub = mx.random.split(key)
            nxt, logprobs = self.sample(logits, sub, recent, mask)
            recent = mx.concatenate([recent[1:], nxt.astype(recent.dtype)])
            return nxt, logprobs, key, recent
        for c in cache:
            c.reserve(1)  # grows the buffer (and so re-traces) once per block of tokens
        offset = cache[0].offset
        kv = [(c.keys, c.values) for c in cache]
        nxt, logprobs, key, recent, kv = self._compiled(token, mx.array(offset), key, recent, mask, kv)
        for c, (k, v) in zip(cache, kv, strict=True):
            c.unbind(k, v, offset + 1)
        return nxt, logprobs, key, recent


def _blank_like(c):
    return WindowKVCache(c.window) if isinstance(c, WindowKVCache) else StaticKVCache()


# Compiled steps per live model (see per_model).
_steps: dict[int, dict] = {}


def per_model(store: dict[int, dict], model) -> dict:
    """``model``'s own dict in ``store`` (keyed by id: mlx Modules are dicts, so not
    hashable), made on first use and dropped when the model is collected."""
    mine = store.get(id(model))
    if mine is None:
        mine = store[id(model)] = {}
        weakref.finalize(model, store.pop, id(model), None)
    return mine


def decode_step_for(model, cache: list, params: SamplingParams, vocab: int, compile_step: bool = True) -> DecodeStep:
    """The (cached) decode step for ``model`` with this cache layout and sampler."""
    layout = tuple((type(c).__name__, getattr(c, "window", None)) for c in cache)
    key = (
        layout, vocab, compile_step, params.temperature, params.top_p, params.top_k,
        params.min_p, params.repetition_penalty, max(1, params.repetition_context),
    )
    steps = per_model(_steps, model)
    step = steps.get(key)
    if step is None:
        if len(steps) >= 8:  # a few sampler settings in use at once, not unbounded
            steps.pop(next(iter(steps)))
        step = steps[key] = DecodeStep(model, cache, params, vocab, compile_step)
    return step


def generate_step(
    model,
    prompt: list[int],
    cache: list,
    params: SamplingParams,
    *,
    history: list[int] | None = None,
    compile_step: bool = True,
    prefill_chunk: int = PREFILL_CHUNK,
    progress: Callable[[int, int], None] | None = None,
    should_stop: Callable[[], bool] | None = None,
    constraint: TokenConstraint | None = None,
    prefill_model=None,
    speculation: Speculation | None = None,
    key: mx.array | None = None,
    logits: mx.array | None = None,
) -> Iterator[StepOutput]:
    """Yield sampled tokens for ``prompt`` (the part of the context not yet in ``cache``).

    ``history`` is the full token context so far (for the repetition penalty window). The
    caller stops iterating to end generation; at most ``params.max_tokens`` are produced.
    With a ``constraint``, each token is drawn under its mask (see engine.generation.constraints).
    ``prefill_model`` (same architecture, other weight format) processes the prompt.
    With ``speculation`` the decode loop drafts and verifies several tokens per forward
    (engine.generation.speculation.verify); the tokens are the same, still yielded one by one.
    ``key``: the PRNG key to continue from instead of ``params.seed``'s (a request resuming
    mid-reply, e.g. a batched row returning to the serial lane, keeps its key schedule).
    ``logits``: the last prompt position's (1, vocab) logits when the caller has already fed the
    whole prompt into ``cache`` (``prompt`` then empty; the scheduler's chunked prefill).
    """
    if not prompt and logits is None:
        raise ValueError("generate_step needs at least one new prompt token")
    window = max(1, params.repetition_context)
    past = (history or prompt)[-window:]
    recent = mx.array([-1] * (window - len(past)) + list(past), dtype=mx.int32)
    if key is None:
        seed = params.seed if params.seed is not None else int.from_bytes(_urandom(4), "little")
        key = mx.random.key(seed)

    if logits is None:
        logits = prefill(prefill_model or model, cache, prompt, prefill_chunk, progress, should_stop)
        if should_stop and should_stop():
            return
    vocab = logits.shape[-1]

    def mask_now() -> mx.array | None:
        allowed = constraint.allowed() if constraint is not None else None
        return None if allowed is None else additive_mask(allowed, vocab)

    sample = make_sampler(params)
    key, sub = mx.random.split(key)
    y, logprobs = sample(logits, sub, recent, mask_now())
    recent = mx.concatenate([recent[1:], y.astype(mx.int32)])
    step = decode_step_for(model, cache, params, vocab, compile_step)
    mx.async_eval(y, logprobs)
    if speculation is not None and _speculation_ok(speculation, cache, constraint):
        from engine.generation.speculation.verify import speculative_decode

        yield from speculative_decode(
            model, cache, sample, step, speculation.drafter, speculation.policy, speculation.stats,
            context=list(history or prompt), y=y, logprobs=logprobs, key=key, recent=recent,
            max_tokens=params.max_tokens, should_stop=should_stop, constraint=constraint, vocab=vocab,
            output=StepOutput,
        )
        return

    n = 0
    early = constraint is None  # the first token streams before the step that feeds it
    if early:
        # The prompt's logits are evaluated, so the first token is ready: stream it before
        # queueing the step. On the CPU, async_eval returns only once most of a step's ops ran
        # (MLX bounds the tasks in flight), so queueing first would delay it by a step.
        try:
            yield StepOutput(int(y.item()), logprobs)
        except GeneratorExit:
            step(cache, y, key, recent, None)  # fed all the same (see below)
            mx.eval([c.state for c in cache])
            raise
        n = 1
    while True:
        token = None
        if constraint is not None:
            # The next mask depends on this token: resolve it before building the next step.
            token = int(y.item())
            constraint.advance(token)
        # Always feed the token just sampled, even the last one: the cache then covers the
        # whole reply and the next turn starts from its checkpoint without re-feeding it.
        next_y, next_logprobs, key, recent = step(cache, y, key, recent, mask_now())
        mx.async_eval(next_y, next_logprobs)
        if early:
            early = False  # y was streamed above
        else:
            yield StepOutput(int(y.item()) if token is None else token, logprobs)
            n += 1
        if n >= params.max_tokens:
            return
        y, logprobs = next_y, next_logprobs


def _speculation_ok(spec: Speculation, cache: list, constraint: TokenConstraint | None) -> bool:
    """Whether this request can decode speculatively; records why not in its stats."""
    from engine.generation.speculation.rollback import unsupported

    if constraint is not None and not callable(getattr(constraint, "fork", None)):
        # Drafted positions need the constraint's state after each draft token, without
        # advancing the real one past tokens that may be rejected.
        spec.stats.disabled = "grammar constraint without fork(): plain decoding"
    else:
        spec.stats.disabled = unsupported(cache)
    return spec.stats.disabled is None


def _urandom(n: int) -> bytes:
    import os

    return os.urandom(n)
