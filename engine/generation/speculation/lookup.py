"""Prompt lookup: draft the continuation of the latest earlier occurrence of the last n tokens.

Copy-heavy replies (rewriting a file, an edit's old text, quoting) repeat long runs of the
context; the tokens that followed the same n-gram last time are a free draft. ``NgramIndex``
maps every n-gram (n from ``max_n`` down to ``min_n``) to the position just after its
latest occurrence, updated as tokens are committed, so a lookup is a few dict probes and
costs nothing measurable when there is no match.
"""

from __future__ import annotations

import mlx.core as mx


class NgramIndex:
    """Incremental index of ``tokens``: n-gram -> index just past its latest occurrence."""

    def __init__(self, min_n: int, max_n: int):
        self.min_n, self.max_n = min_n, max_n
        self.tokens: list[int] = []
        self._last: dict[tuple[int, ...], int] = {}

    def extend(self, tokens: list[int]) -> None:
        for t in tokens:
            self.tokens.append(t)
            end = len(self.tokens)
            for n in range(self.min_n, min(self.max_n, end) + 1):
                self._last[tuple(self.tokens[end - n : end])] = end

    def continuation(self, tail: list[int], k: int) -> list[int]:
        """Up to ``k`` tokens that followed the longest n-gram ending ``tokens + tail`` before.

        Only occurrences ending inside the indexed tokens count, so the current suffix
        never matches itself.
        """
        full_tail = (self.tokens[-self.max_n :] + tail)[-self.max_n :]
        for n in range(min(self.max_n, len(full_tail)), self.min_n - 1, -1):
            end = self._last.get(tuple(full_tail[-n:]))
            if end is None:
                continue
            out = self.tokens[end : end + k]
            if len(out) < k:
                out = out + tail[: k - len(out)]  # the match ran into the uncommitted tail
            if out:
                return out
        return []


class LookupDrafter:
    name = "lookup"
    needs_hidden = False

    def __init__(self, min_n: int, max_n: int):
        self.min_n, self.max_n = min_n, max_n
        self.index = NgramIndex(min_n, max_n)

    def reset(self, context: list[int]) -> None:
        self.index = NgramIndex(self.min_n, self.max_n)
        self.index.extend(context)

    def propose(self, pending: int, k: int, hidden: mx.array | None = None) -> list[int]:
        return self.index.continuation([pending], k)

    def commit(self, tokens: list[int]) -> None:
        self.index.extend(tokens)
