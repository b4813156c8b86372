"""Prompt lookup: draft the continuation of the latest earlier occurrence of the last n tokens.

Copy-heavy replies (rewriting a file, an edit's old text, quoting) repeat long runs of the
context; the tokens that followed the same n-gram last time are a free draft. ``NgramIndex``
maps every n-gram (n from ``max_n`` down to ``min_n``) to the position just after its
latest occurrence, updated as tokens are committed, so a lookup is a few dict probes and
costs nothing measurable when there is no match. Once a draft is accepted the drafter keeps
copying from the same place (the whole run since is the match) while the target's tokens
follow it, and looks up n-grams again only when they part: code repeats near-identical
blocks, and the latest occurrence of a short n-gram is often the block just written rather
than the one being copied.

Design notes, measurements and history: docs/engine-notes.md (lookup.py).
"""

from __future__ import annotations

import json
from collections.abc import Callable

from engine.generation.speculation.base import SpecStats

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

    def lookup(self, recent: list[int], k: int, tail: list[int] = ()) -> tuple[int, list[int]]:
        """(n, up to ``k`` tokens) that followed the longest n-gram ending ``recent`` here.

        ``tail`` (the uncommitted end of ``recent``) continues a match that runs into it.
        """
        n, _, out = self.find(recent, k, tail)
        return n, out

    def find(self, recent: list[int], k: int, tail: list[int] = ()) -> tuple[int, int, list[int]]:
        """``lookup`` plus where the draft starts in ``tokens``."""
        recent = recent[-self.max_n :]
        for n in range(min(self.max_n, len(recent)), self.min_n - 1, -1):
            end = self._last.get(tuple(recent[-n:]))
            if end is None:
                continue
            out = self.tokens[end : end + k]
            if len(out) < k:
                out = out + list(tail[: k - len(out)])  # the match ran into the uncommitted tail
            if out:
                return n, end, out
        return 0, 0, []

    def continuation(self, tail: list[int], k: int) -> list[int]:
        """Up to ``k`` tokens that followed the longest n-gram ending ``tokens + tail`` before.

        Only occurrences ending inside the indexed tokens count, so the current suffix
        never matches itself.
        """
        return self.lookup(self.tokens[-self.max_n :] + tail, k, tail)[1]


def json_escaper(tokenizer) -> Callable[[list[int]], list[int]]:
    """Tokens of the JSON-string form of ``tokens``' text ([] when escaping changes nothing)."""

    def escaped(tokens: list[int]) -> list[int]:
        text = tokenizer.decode(tokens)
        esc = json.dumps(text, ensure_ascii=False)[1:-1]
        return tokenizer.encode(esc) if esc != text else []

    return escaped


class LookupDrafter:
    name = "lookup"
    needs_hidden = False

    def __init__(self, min_n: int, max_n: int, escaped: Callable[[list[int]], list[int]] | None = None):
        self.min_n, self.max_n = min_n, max_n
        self.escaped = escaped
        self.index = NgramIndex(min_n, max_n)
        self._context: list[int] = []
        self._escaped_index: NgramIndex | None = None
        self._drafted: tuple[NgramIndex, int] | None = None  # (index, position) of the last draft
        self._copy: tuple[NgramIndex, int] | None = None  # where the next pending token should be

    def reset(self, context: list[int]) -> None:
        self.index = NgramIndex(self.min_n, self.max_n)
        self.index.extend(context)
        self._context = context
        self._escaped_index = None
        self._drafted = self._copy = None

    def bind(self, stats: SpecStats) -> None:
        pass  # one index per request: nothing to count elsewhere

    def propose(self, pending: int, k: int, hidden: mx.array | None = None) -> list[int]:
        if self._copy is not None:
            # Still copying: the run so far matched the source up to here, a longer match than
            # any n-gram (code repeats near-identical blocks; the latest occurrence of a short
            # n-gram is often the block just written, not the one being copied).
            idx, p = self._copy
            if p < len(idx.tokens) and idx.tokens[p] == pending:
                draft = idx.tokens[p + 1 : p + 1 + k]
                if draft:
                    self._drafted = (idx, p + 1)
                    return draft
        recent = self.index.tokens[-self.max_n :] + [pending]
        n, start, draft = self.index.find(recent, k, [pending])
        src = (self.index, start)
        if self.escaped is not None and not (n == self.max_n and len(draft) == k):
            if self._escaped_index is None:  # once per request, at the first imperfect match
                self._escaped_index = NgramIndex(self.min_n, self.max_n)
                self._escaped_index.extend(self.escaped(self._context))
            en, estart, esc = self._escaped_index.find(recent, k)
            # the longer n-gram is the likelier copy; on a tie the longer draft
            if (en, len(esc)) > (n, len(draft)):
                draft, src = esc, (self._escaped_index, estart)
        self._drafted = src if draft else None
        return draft

    def commit(self, tokens: list[int]) -> None:
        # ``tokens`` = the pending token + the accepted drafts: the copy goes on where the
        # accepted drafts end (the next pending token must equal the source's token there)
        self._copy = None
        if self._drafted is not None:
            idx, start = self._drafted
            self._copy = (idx, start + len(tokens) - 1)
        self._drafted = None
        self.index.extend(tokens)
