"""Draft-model speculation: a small model with the target's tokenizer drafts greedily.

The drafter keeps its own KV cache for the whole context. Between requests it keeps what it
holds and reuses the longest common prefix with the next request's context (a chat turn or
an agent step extends the previous one), so only new tokens are fed. Drafting runs the
draft model's compiled greedy step ``k`` times as one lazy chain, then cuts the draft where
the draft model's top probability falls below ``min_prob`` (a guess it is unsure of will
most likely be rejected, and each rejected row still costs verification work).

Design notes, measurements and history: docs/engine-notes.md (draft_model.py).
"""

from __future__ import annotations

import logging
import math

from engine.generation.generate import decode_step_for, prefill
from engine.generation.kv_cache import WindowKVCache, make_cache
from engine.generation.sampling import SamplingParams
from engine.generation.speculation.base import SpecStats

import mlx.core as mx

log = logging.getLogger(__name__)
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
        self.store = None  # engine.checkpoints.CheckpointStore for the draft KV, if any
        self.fed = 0  # tokens prefilled through the draft model (its cost outside drafting)
        self._restore: tuple[list[int], str | None, int] | None = None  # acquire()'s, until the first draft
        self.stats: SpecStats | None = None  # the drafting request's (``bind``, before each draft)
        self._discarded = 0  # the store's discarded-file count at the last acquire

    def use_store(self, store) -> None:
        self.store = store

    def _common(self, tokens: list[int]) -> int:
        n = 0
        for a, b in zip(self.cached, tokens, strict=False):
            if a != b:
                break
            n += 1
        return n

    def acquire(self, prompt: list[int], session_id: str | None, target_cached: int) -> None:
        """A request for ``prompt`` starts; the target restored ``target_cached`` tokens of it.

        The draft KV is restored (from a checkpoint, when that covers more than the live cache)
        at the request's first draft, so a request that never drafts costs nothing here.
        """
        self._restore = (list(prompt), session_id, target_cached)

    def _restore_checkpoint(self) -> None:
        prompt, session_id, target_cached = self._restore
        self._restore = None
        if self.context[: len(prompt)] != prompt:  # another request's (batched rows do not draft)
            return
        live = self._common(prompt)
        if self.store is None or live >= target_cached or len(prompt) < 2:
            return
        found = self.store.acquire(prompt, session_id)
        if found.cached_tokens > live:
            self.cache, self.cached = found.cache, list(prompt[: found.cached_tokens])
            if self.stats is not None:
                self.stats.draft_restored = found.cached_tokens
        discarded = self.store.ssd.discarded if self.store.ssd is not None else 0
        have = max(live, found.cached_tokens)
        # The draft KV lags the target's by the few tokens it never fed (the last pending
        # token, plain steps); warn only when most of the restored context must be re-read,
        # and not twice for a corrupt file (the store warned when it discarded it).
        if 2 * have < target_cached and discarded == self._discarded:
            log.warning("speculation: no draft-model KV checkpoint for %d of the %d restored tokens; "
                        "the draft model re-reads them (output unchanged)", target_cached - have, target_cached)
        self._discarded = discarded

    def release(self, tokens: list[int], session_id: str | None) -> None:
        """The target checkpointed ``tokens``: checkpoint the draft KV for the same tokens."""
        if self.store is None:
            return
        n = self._common(tokens)
        if n < len(self.cached):  # drop rejected drafts' K/V: save exactly the committed tokens
            if any(isinstance(c, WindowKVCache) for c in self.cache):
                return  # a wrapped ring cannot be cut back
            for c in self.cache:
                c.offset = n
            self.cached = self.cached[:n]
        if n > 0:
            self.store.release(tokens[:n], self.cache, session_id)

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
        self.fed += len(target) - same
        if self.stats is not None:
            self.stats.draft_prefilled += len(target) - same
        self.cached = list(target)
        return logits

    def bind(self, stats: SpecStats) -> None:
        self.stats = stats

    def propose(self, pending: int, k: int, hidden: mx.array | None = None) -> list[int]:
        if k <= 0:
            return []
        if self._restore is not None:
            self._restore_checkpoint()
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
