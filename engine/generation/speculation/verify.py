"""The verification loop every speculation method shares.

Each round feeds ``[pending, d1..dk]`` through the target in one forward and samples every
position with the request's own sampler, PRNG key schedule and repetition window, exactly as
plain decoding would have sampled that position. Drafts are kept while they equal the
target's sample; the target's sample at the first mismatch (or after the last draft) becomes
the new pending token. Because each position is drawn as plain decoding would draw it, the
output is the plain output -- token for token under greedy decoding, and for a given seed
at temperature > 0 (so the output distribution is exactly the model's).

Design notes, measurements and history: docs/engine-notes.md (verify.py).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from engine.generation.constraints import TokenConstraint, additive_mask, forced_draft
from engine.generation.speculation.base import Drafter, DraftPolicy, SpecStats
from engine.generation.speculation.exact_rows import max_verify_rows, step_shaped
from engine.generation.speculation.rollback import Round, max_rows

import mlx.core as mx


def speculative_decode(
    model,
    cache: list,
    sample: Callable,
    step,
    drafter: Drafter,
    policy: DraftPolicy,
    stats: SpecStats,
    *,
    context: list[int],
    y: mx.array,
    logprobs: mx.array,
    key: mx.array,
    recent: mx.array,
    max_tokens: int,
    should_stop: Callable[[], bool] | None = None,
    constraint: TokenConstraint | None = None,
    vocab: int = 0,
    output: type,
) -> Iterator:
    """Yield ``output(token, logprobs)`` for up to ``max_tokens`` tokens.

    ``context`` is what the caches hold; ``y`` / ``logprobs`` the first sampled (pending)
    token; ``key`` / ``recent`` the sampler state after drawing it; ``step`` the plain decode
    step (``engine.generation.generate.DecodeStep``) used where there is no draft.
    """
    drafter.reset(list(context))
    # rows per forward: below the window (rollback) and on the kernels' per-row matmul path
    limit = min(max_verify_rows(), max_rows(cache) or max_verify_rows())
    k_cap = min(policy.max_tokens, limit - 1)
    k = min(policy.first(), k_cap)
    n = 0
    pending = int(y.item())

    while True:
        mask = allowed = None
        if constraint is not None:
            constraint.advance(pending)  # as plain decoding does before building the next step
            allowed = constraint.allowed()
            mask = _mask_of(allowed, vocab)
        room = min(k_cap, max_tokens - n - 1)  # drafts this round may hold at most
        drafter.bind(stats)  # a shared drafter (the draft model) counts into this request
        draft = drafter.propose(pending, min(k, room)) if room > 0 else []
        masks = [mask]
        if constraint is not None and room > 0:
            # Each drafted position gets the mask of the state after the drafts before it; a
            # draft token its own mask forbids could never be accepted, so the draft ends there.
            # Where the drafter's guess ends (or it has none) the constraint's own forced tokens
            # (JSON punctuation, the only key left, a close marker) go on, up to the ceiling:
            # their acceptance is near certain, so the adaptive length does not limit them.
            fork, kept = constraint.fork(), []
            allowed = _take(kept, draft, room, fork, allowed, masks, vocab)
            ours = len(kept)
            _take(kept, forced_draft(fork, room - ours), room, fork, allowed, masks, vocab)
            stats.forced += len(kept) - ours
            draft = kept
        if not draft:
            stats.plain_steps += 1
            next_y, next_lp, key, recent = step(cache, y, key, recent, mask)
            mx.async_eval(next_y, next_lp)
            drafter.commit([pending])
            yield output(pending, logprobs)
            n += 1
            if n >= max_tokens or (should_stop and should_stop()):
                return
            y, logprobs, pending = next_y, next_lp, int(next_y.item())
            continue

        rnd = Round(cache)
        for c in cache:  # grow static buffers as the step would, so rows see its layout
            if hasattr(c, "reserve"):
                c.reserve(len(draft) + 1)
        with step_shaped():
            logits = model(mx.array([pending, *draft])[None], cache=cache)
        rnd.written()
        samples, lps, keys, recents = [], [], [], []
        window = recent
        for j in range(len(draft) + 1):
            key, sub = mx.random.split(key)
            tok, lp = sample(logits[:, j, :], sub, window, masks[j] if constraint is not None else None)
            samples.append(tok)
            lps.append(lp)
            keys.append(key)
            # the sampler state if this sample becomes the pending token ...
            recents.append(mx.concatenate([window[1:], tok.astype(window.dtype)]))
            if j < len(draft):  # ... and the window the next position sees (the draft token)
                window = mx.concatenate([window[1:], mx.array([draft[j]], dtype=window.dtype)])
        mx.eval(samples)
        got = [int(s.item()) for s in samples]
        a = 0
        while a < len(draft) and got[a] == draft[a]:
            a += 1
        stats.rounds += 1
        stats.drafted += len(draft)
        stats.accepted += a
        stats.accepted_lengths.append(a)
        k = min(policy.next(k, len(draft), a), k_cap)

        emitted = [(pending, logprobs)] + [(draft[j], lps[j]) for j in range(a)]
        rnd.keep(len(emitted))
        drafter.commit([t for t, _ in emitted])
        if constraint is not None:
            for d in draft[:a]:
                constraint.advance(d)
        for i, (tok, lp) in enumerate(emitted):
            rnd.keep(i + 1)  # the caches hold exactly what has been yielded
            yield output(tok, lp)
            n += 1
            if n >= max_tokens or (should_stop and should_stop()):
                return
        rnd.keep(len(emitted))
        y, logprobs, key, recent = samples[a], lps[a], keys[a], recents[a]
        pending = got[a]


def _mask_of(allowed: mx.array | None, vocab: int) -> mx.array | None:
    return None if allowed is None else additive_mask(allowed, vocab)


def _take(kept: list[int], tokens: list[int], room: int, fork, allowed, masks: list, vocab: int):
    """Append ``tokens`` to the draft ``kept`` (at most ``room``) while each is allowed by its
    own mask, advancing ``fork`` and adding the next position's mask; returns that ``allowed``."""
    for d in tokens:
        if len(kept) >= room or (allowed is not None and not bool(allowed[d].item())):
            break
        kept.append(d)
        fork.advance(d)
        allowed = fork.allowed()
        masks.append(_mask_of(allowed, vocab))
    return allowed
