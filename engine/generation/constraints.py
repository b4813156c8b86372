"""Constrained decoding hook: a per-request object that limits which token may come next.

The decode loop asks ``allowed()`` before each sampled token; ``None`` means unconstrained
(decoding stays pipelined), otherwise a boolean ``(vocab,)`` mask of permitted ids. After a
token is chosen the loop calls ``advance(token)``. Speculative decoding also calls ``fork()``
(an independent copy of the state, when the constraint has it) to mask drafted positions
without advancing the real state past tokens that may be rejected. While a constraint is active each step
waits for the previous token (the mask depends on it), so keep ``allowed`` cheap.
"""

from __future__ import annotations

from typing import Protocol

import mlx.core as mx


class TokenConstraint(Protocol):
    def allowed(self) -> mx.array | None: ...

    def advance(self, token: int) -> None: ...


def additive_mask(allowed: mx.array | None, vocab: int) -> mx.array:
    """0 where allowed, -inf elsewhere; all zeros when unconstrained."""
    if allowed is None:
        return mx.zeros((vocab,), dtype=mx.float32)
    return mx.where(allowed, 0.0, -mx.inf).astype(mx.float32)
