"""Draft-model speculation: a small model with the target's tokenizer drafts greedily.

The drafter keeps its own KV cache for the whole context. Between requests it keeps what it
holds and reuses the longest common prefix with the next request's context (a chat turn or
an agent step extends the previous one), so only new tokens are fed. Drafting runs the
draft model's compiled greedy step ``k`` times as one lazy chain, then cuts the draft where
the draft model's top probability falls below ``min_prob`` (a guess it is unsure of will
most likely be rejected, and each rejected row still costs verification work).
"""

from __future__ import annotations

import math

from engine.generation.generate import decode_step_for, prefill
from engine.generation.kv_cache import WindowKVCache, make_cache
from engine.generation.sampling import SamplingParams

import mlx.core as mx

_GREEDY = SamplingParams(temperature=0.0, repetition_penalty=1.0, repetition_context=1)


class DraftModelDrafter:
    name = "draft"
    needs_hidden = False

    def __init__(self, model, vocab: int, min_prob: float = 0.0):
        self.model = model
        self.vocab = vocab
        self.min_logprob = math.log(min_prob) if min_prob > 0 else -math.inf
        self.cache = make_cache(model)
        self.cached: list[int] = []  # the tokens whose K/V the draft cache holds, in order
        self.context: list[int] = []  # the target's committed context

    def reset(self, context: list[int]) -> None:
        self.context = list(context)

    def commit(self, tokens: list[int]) -> None:
        self.context.extend(tokens)

    def _sync(self, target: list[int]) -> mx.array:
        """Make the cache hold ``target``; return the logits after its last token."""
        same = 0
        limit = min(len(self.cached), len(target) - 1)  # always re-feed >= 1 token for logits
        while same < limit and self.cached[same] == target[same]:
            same += 1
        if same < len(self.cached) and any(isinstance(c, WindowKVCache) for c in self.cache):
            same = 0  # a wrapped ring cannot be cut back by offset alone
        for c in self.cache:
            c.offset = same
        if same == 0:
            self.cache = make_cache(self.model)
        logits = prefill(self.model, self.cache, target[same:])
        self.cached = list(target)
        return logits

    def propose(self, pending: int, k: int, hidden: mx.array | None = None) -> list[int]:
        if k <= 0:
            return []
        logits = self._sync(self.context + [pending])
        step = decode_step_for(self.model, self.cache, _GREEDY, self.vocab)
        logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        tok = mx.argmax(logits, axis=-1)
        toks, tops = [tok], [mx.max(logprobs, axis=-1)]
        key, recent = mx.random.key(0), mx.array([-1], dtype=mx.int32)
        for _ in range(k - 1):  # the last draft token is never fed: verification feeds it
            tok, lp, key, recent = step(self.cache, tok, key, recent)
            toks.append(tok)
            tops.append(mx.max(lp, axis=-1))
        mx.eval(toks, tops)
        draft: list[int] = []
        for t, p in zip(toks, tops, strict=True):
            if float(p.item()) < self.min_logprob:
                break
            draft.append(int(t.item()))
        self.cached.extend(int(t.item()) for t in toks[:-1])
        return draft
