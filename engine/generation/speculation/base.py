"""What every speculation method provides, and what a speculative request reports.

A drafter sees the committed context (``reset``, then ``commit`` after every round) and
proposes up to ``k`` tokens that continue it plus one pending token (``propose``). The
verification core in ``verify`` decides how many of them the target keeps. A method that
needs the target's hidden state (a multi-token-prediction head) sets ``needs_hidden``; the
core then passes the last verified position's hidden state to ``propose``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import mlx.core as mx


class Drafter(Protocol):
    name: str
    needs_hidden: bool

    def reset(self, context: list[int]) -> None:
        """Start a request whose committed context (everything in the target's cache) is ``context``."""

    def propose(self, pending: int, k: int, hidden: mx.array | None = None) -> list[int]:
        """Up to ``k`` tokens likely to follow ``context + [pending]``; [] when there is no guess."""

    def commit(self, tokens: list[int]) -> None:
        """``tokens`` (the pending token and the accepted drafts) joined the committed context."""

    def bind(self, stats: SpecStats) -> None:
        """``stats`` belong to the request drafting next (a drafter shared by requests counts its
        restores and prefills there); a drafter without such work ignores it."""


@dataclass(frozen=True)
class DraftPolicy:
    """Draft length: start at ``start``, grow after full accepts, shrink after rejections."""

    max_tokens: int = 8
    min_tokens: int = 1
    adaptive: bool = True

    def first(self) -> int:
        return self.max_tokens if not self.adaptive else max(self.min_tokens, min(4, self.max_tokens))

    def next(self, k: int, proposed: int, accepted: int) -> int:
        if not self.adaptive:
            return self.max_tokens
        if accepted == proposed:
            return min(self.max_tokens, k + 2)
        return max(self.min_tokens, min(k - 1, accepted + 1))


@dataclass
class SpecStats:
    """Per-request counters; ``as_dict`` is the ``speculation`` block of ``Done``."""

    mode: str
    drafted: int = 0  # draft tokens sent to verification
    accepted: int = 0  # of those, kept
    rounds: int = 0  # verification forwards (with at least one draft token)
    plain_steps: int = 0  # single-token steps (no draft for that position)
    forced: int = 0  # of ``drafted``, tokens a grammar constraint dictated (TokenConstraint.draft)
    disabled: str | None = None  # why speculation did not run for this request, if it did not
    accepted_lengths: list[int] = field(default_factory=list, repr=False)
    # draft model only: tokens its KV was restored with from a checkpoint at the request's
    # start, and tokens it had to read (prefill) itself during the request
    draft_restored: int | None = None
    draft_prefilled: int | None = None

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def mean_accepted(self) -> float:
        return self.accepted / self.rounds if self.rounds else 0.0

    def as_dict(self) -> dict:
        return {
            "mode": self.mode,
            "drafted": self.drafted,
            "accepted": self.accepted,
            "acceptance_rate": round(self.acceptance_rate, 4),
            "mean_accepted_length": round(self.mean_accepted, 3),
            "rounds": self.rounds,
            "plain_steps": self.plain_steps,
            **({"forced_drafted": self.forced} if self.forced else {}),
            "disabled": self.disabled,
            **({"draft_restored": self.draft_restored, "draft_prefilled": self.draft_prefilled}
               if self.draft_restored is not None else {}),
        }


@dataclass
class Speculation:
    """What a request needs to decode speculatively: the method, its draft lengths, its counters."""

    drafter: Drafter
    policy: DraftPolicy
    stats: SpecStats
