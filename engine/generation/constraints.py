"""Constrained decoding hook: a per-request object that limits which token may come next.

The decode loop asks ``allowed()`` before each sampled token; ``None`` means unconstrained
(decoding stays pipelined), otherwise a boolean ``(vocab,)`` mask of permitted ids. After a
token is chosen the loop calls ``advance(token)``. Speculative decoding also calls ``fork()``
(an independent copy of the state, when the constraint has it) to mask drafted positions
without advancing the real state past tokens that may be rejected. While a constraint is active each step
waits for the previous token (the mask depends on it), so keep ``allowed`` cheap.

A constraint may also offer ``draft(k)``: up to ``k`` tokens it expects next where its grammar
leaves the model (almost) no choice -- JSON punctuation, the rest of the only key that fits,
a close marker. Speculative decoding verifies them like any other draft (a wrong guess costs
a verified row, never a token), so the forced parts of a tool call take one forward together
instead of one forward each. See ``forced_draft``. Masks for a byte-level grammar (one per
grammar state, cached) are built by engine.generation.vocab_masks.
"""

from __future__ import annotations

from typing import Protocol

import mlx.core as mx


class TokenConstraint(Protocol):
    def allowed(self) -> mx.array | None: ...

    def advance(self, token: int) -> None: ...


def forced_draft(constraint, k: int) -> list[int]:
    """``constraint.draft(k)`` when the constraint has it, else no draft."""
    draft = getattr(constraint, "draft", None)
    return list(draft(k)) if callable(draft) and k > 0 else []


def additive_mask(allowed: mx.array | None, vocab: int) -> mx.array:
    """0 where allowed, -inf elsewhere; all zeros when unconstrained."""
    if allowed is None:
        return mx.zeros((vocab,), dtype=mx.float32)
    return mx.where(allowed, 0.0, -mx.inf).astype(mx.float32)
