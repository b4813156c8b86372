"""Constrained decoding of tool calls: the grammar in ``agents.grammar`` mapped onto a vocabulary.

The generic part (token table, a mask per grammar state, budget masks, forced drafts) is
engine.generation.vocab_masks; this module adds what is specific to tool calls. ``ToolCallMasks``
is built once per (tokenizer, tool set); ``ToolCallConstraint`` is the per-request object the
engine's decode loop drives (``allowed()`` before each token, ``advance(token)`` after; see
engine.generation.constraints). Why: a small model's tool call must parse and validate every
time. Free text gets no mask; once the text ends in enough of the open marker (or the reply's
first token opens a JSON object: a dropped marker) the call is committed and enforced token by
token, within the request's token budget, so a budget never cuts a call off. Rules, budget and
measurements: docs/agents.md, "Constrained decoding".
"""

from __future__ import annotations

import copy
import json
import time
import weakref
from typing import Any

from engine.generation.vocab_masks import DEAD, GrammarMasks, TokenTable, table_width

import mlx.core as mx
import numpy as np

from agents.grammar import LIT, ToolCallGrammar
from agents.protocol import CLOSE, OPEN

_WS = b" \t\n\r"


class ToolCallMasks(GrammarMasks):
    """Masks for one tool set, plus the open marker: marker, start and budget masks (cached)."""

    def __init__(self, grammar: ToolCallGrammar, table: TokenTable, open_marker: str = "<tool_call>"):
        super().__init__(grammar, table)
        self.open = open_marker.encode()
        self._marker_masks: dict[int, mx.array] = {}
        self._budget_masks: dict[tuple[int, int], mx.array] = {}
        self.commit_at = force_from(open_marker)
        pieces = table.pieces
        # tokens that can finish the marker (they hold its last byte) or start it
        self._marker_candidates = np.array(
            [i for i, b in enumerate(pieces) if b is not None and self.open[-1] in b], dtype=np.int64)
        self._opening_candidates = np.array(
            [i for i, b in enumerate(pieces) if b is not None and (self.open[0] in b or self.open[-1] in b)],
            dtype=np.int64)
        # Fewest tokens a whole call can take, marker included.
        self.min_call_tokens = self.need(self.committed(0))
        self.tight_margin = self._need_bound()
        self._brace_candidates = np.array(
            [i for i, b in enumerate(pieces) if b is not None and b.lstrip(_WS).startswith(b"{")], dtype=np.int64)
        self._start_masks: dict[int | None, mx.array] = {}
        self.end_token: int | None = None  # the end-of-turn token this model closed a call with

    def committed(self, matched: int) -> int:
        """The state of a call whose marker has ``matched`` bytes written (0: none yet)."""
        return self.intern(self.grammar.initial() + ((LIT, self.open, matched),))

    def after_marker_text(self, head: bytes, data: bytes) -> int | None:
        """Where free text ``head`` (a partial marker) plus a token's ``data`` leads: a call
        state when it completes or commits the marker, ``DEAD`` when it completes it into
        invalid JSON, None when it stays free text."""
        text = head + data
        at = text.find(self.open)
        if at >= 0:
            return self.walk(self.initial, text, at + len(self.open))
        matched = _partial_marker(text[-len(self.open):], self.open)
        return self.committed(matched) if matched >= self.commit_at else None

    def marker_mask(self, matched: int) -> mx.array:
        """Mask while free text ends in ``open[:matched]``: tokens that would finish the marker
        into invalid JSON are removed, everything else stays allowed."""
        cached = self._marker_masks.get(matched)
        if cached is not None:
            return cached
        with self._lock:
            t0 = time.perf_counter()
            allowed = self.table.valid.copy()
            head = self.open[:matched]
            for i in self._marker_candidates:
                if self.after_marker_text(head, self.table.pieces[i]) == DEAD:
                    allowed[i] = False
            cached = self._marker_masks[matched] = mx.array(allowed)
            self.mask_ms += (time.perf_counter() - t0) * 1000
        return cached

    def bare_start(self, data: bytes) -> int | None:
        """A reply whose first token opens a JSON object is a call without the open marker
        (small models drop it): the call state after ``data``, or None when it is not one."""
        return self.walk(self.initial, data) if data.lstrip(_WS).startswith(b"{") else None

    def start_mask(self, left: int | None) -> mx.array:
        """Mask for a reply's first token: a bare ``{`` must start a valid call (that fits in
        ``left`` tokens when the budget is tight); otherwise as before a marker."""
        cached = self._start_masks.get(left)
        if cached is not None:
            return cached
        with self._lock:
            base = self.budget_marker_mask(0, left) if left is not None else None
            allowed = self.table.valid.copy() if base is None else np.array(base)
            for i in self._brace_candidates:
                sid = self.bare_start(self.table.pieces[i])
                if sid == DEAD or (left is not None and self.need(sid) > left - 2):
                    allowed[i] = False
            cached = self._start_masks[left] = mx.array(allowed)
        return cached

    def budget_marker_mask(self, matched: int, left: int) -> mx.array:
        """Like ``marker_mask`` (``matched`` may be 0), but a token may only open a call that
        can still be closed with the ``left`` tokens (this one included)."""
        key = (matched, left)
        cached = self._budget_masks.get(key)
        if cached is not None:
            return cached
        with self._lock:
            allowed = self.table.valid.copy()
            head = self.open[:matched]
            candidates = np.union1d(self._opening_candidates, self.table.prefix_ids(self.open[matched:]))
            for i in candidates.astype(np.int64):
                sid = self.after_marker_text(head, self.table.pieces[i])
                if sid is not None and (sid == DEAD or self.need(sid) > left - 2):
                    allowed[i] = False
            cached = self._budget_masks[key] = mx.array(allowed)
        return cached

    def _need_bound(self) -> int:
        """An upper bound on ``need`` anywhere inside a call, hence on how much one token can
        raise it: the longest wind-up right after a tool name, plus one optional key with a
        minimal value, plus escapes and closers."""
        after_name = 0
        for name in self.grammar.tool_names:
            state = self.grammar.feed(self.grammar.initial(), b'{"name": ' + json.dumps(name).encode())
            after_name = max(after_name, self.table.spell(self.grammar.completion(state))[0])
        keys = [k for schema in self.grammar.schemas.values() for k in schema.get("properties", {})]
        longest_key = max((len(json.dumps(k)) for k in keys), default=0)
        return after_name + longest_key + 16


def force_from(open_marker: str) -> int:
    """How much of the marker commits to a call (the rest is then forced): up to its first
    non-alphanumeric byte after the opening one (``<tool_``), so ``<table>`` stays free."""
    for i, ch in enumerate(open_marker[1:], start=1):
        if not ch.isalnum():
            return i + 1
    return len(open_marker)


class ToolCallConstraint:
    """Per-request TokenConstraint: free text, then (once committed) exactly one valid call.

    ``phase``: "free", "marker" (text ends in a partial marker, not committed), "call",
    "end" (call complete: only end-of-turn allowed) or "broken" (a token outside the grammar
    slipped in while unconstrained: free text from then on; the agent reports the call as
    malformed). ``force_call`` commits to a call from the first token (when the budget allows).
    ``max_tokens`` is the request's budget (see the module docstring). With ``bare_calls`` a
    reply that starts with ``{`` is a call whose open marker was left out (then it must be a
    valid call, closed with the close marker).
    """

    def __init__(self, masks: ToolCallMasks, *, force_call: bool = False, max_tokens: int | None = None,
                 bare_calls: bool = True):
        self.masks = masks
        self.bare_calls = bare_calls
        self.open = masks.open
        self.phase = "free"
        self.sid = masks.initial
        self.tail = b""  # last bytes of free text, enough to spot the marker
        self.matched = 0
        self.calls = 0
        self.tokens = 0
        self.overhead_s = 0.0  # time in allowed()/advance(), for the benchmark
        self.max_tokens = max_tokens
        self.wound_up = False  # the budget forced the call closed
        self.last_byte = 0  # the last byte of the text so far (forced drafts space JSON after : and ,)
        if force_call:
            sid = masks.committed(0)
            if max_tokens is None or masks.need(sid) + 1 <= max_tokens:
                self.phase, self.sid = "call", sid

    def fork(self) -> ToolCallConstraint:
        """An independent copy for speculative decoding (the state is scalars; masks are shared)."""
        return copy.copy(self)

    def draft(self, k: int) -> list[int]:
        """Up to ``k`` tokens for a speculative draft where the grammar leaves the model (almost)
        no choice: the rest of a key once only one fits, ``": "`` before a string, the close
        marker, and after it the end-of-turn token this model used to end a call before. The
        forced text is spelled by the tokenizer; the verifier keeps only what the model samples.
        """
        t0 = time.perf_counter()
        try:
            end = self.masks.end_token
            if self.phase == "end":
                return [end] if end is not None and k > 0 else []
            if self.phase != "call" or k <= 0 or self.masks.table.encode is None:
                return []
            text, sid = self.masks.forced(self.sid, self.last_byte)
            out = self.masks.table.encode(text.decode("utf-8", "replace"))[:k] if text else []
            if sid == self.masks.accept and end is not None and len(out) < k:
                out.append(end)
            return out
        finally:
            self.overhead_s += time.perf_counter() - t0

    def allowed(self) -> mx.array | None:
        t0 = time.perf_counter()
        try:
            left = self.max_tokens - self.tokens if self.max_tokens is not None else None
            if self.phase == "call":
                if left is not None:
                    # tokens to spare after closing the call and the end-of-turn token
                    slack = left - 1 - self.masks.need(self.sid)
                    if slack <= 0:
                        self.wound_up = True
                        return self.masks.closing_mask(self.sid)
                    if slack <= self.masks.tight_margin:
                        return self.masks.tight_mask(self.sid, slack)
                return self.masks.mask(self.sid)
            if self.phase == "end":
                return self.masks.end_mask
            if self.phase == "broken":
                return None
            tight = left is not None and left <= self.masks.min_call_tokens + len(self.open) + 1
            if self.tokens == 0 and self.bare_calls:
                return self.masks.start_mask(left if tight else None)
            if tight:
                return self.masks.budget_marker_mask(self.matched, left)
            return self.masks.marker_mask(self.matched) if self.phase == "marker" else None
        finally:
            self.overhead_s += time.perf_counter() - t0

    def advance(self, token: int) -> None:
        t0 = time.perf_counter()
        self.tokens += 1
        try:
            pieces = self.masks.table.pieces
            data = pieces[token] if 0 <= token < len(pieces) else None
            if data:
                self.last_byte = data[-1]
            if self.phase == "end" and token in self.masks.table.eos:
                self.masks.end_token = token  # what this model ends a call's turn with
            if self.phase == "call":
                self._advance_call(data)
            elif self.phase in ("free", "marker", "broken") and data is not None:
                self._advance_free(data)
        finally:
            self.overhead_s += time.perf_counter() - t0

    def _advance_call(self, data: bytes | None) -> None:
        sid = DEAD if data is None else self.masks.walk(self.sid, data)
        if sid == DEAD:
            self.phase, self.tail, self.matched = "broken", b"", 0
            return
        self.sid = sid
        if sid == self.masks.accept:
            self.calls += 1
            self.phase = "end"

    def _advance_free(self, data: bytes) -> None:
        if self.phase != "broken":
            sid = self.masks.bare_start(data) if self.tokens == 1 and self.bare_calls else None
            if sid is None:
                sid = self.masks.after_marker_text(self.tail, data)
            if sid == DEAD:
                self.phase = "broken"
            elif sid is not None:
                self.phase, self.sid = "call", sid
                if sid == self.masks.accept:
                    self.calls += 1
                    self.phase = "end"
                return
        self.tail = (self.tail + data)[-len(self.open):]
        self.matched = _partial_marker(self.tail, self.open)
        if self.phase != "broken":
            self.phase = "marker" if self.matched else "free"


def _partial_marker(tail: bytes, marker: bytes) -> int:
    """Length of the longest end of ``tail`` that begins ``marker`` (but is not all of it)."""
    for n in range(min(len(tail), len(marker) - 1), 0, -1):
        if marker.startswith(tail[-n:]):
            return n
    return 0


_MASK_CACHE: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def shared_masks(model_engine, schemas: list[dict[str, Any]]) -> ToolCallMasks:
    """One ToolCallMasks per (tokenizer, tool set): its mask cache outlives single runs."""
    tok = model_engine.tokenizer
    per_tok = _MASK_CACHE.setdefault(tok, {})
    key = tuple(sorted(s["function"]["name"] for s in schemas))
    masks = per_tok.get(key)
    if masks is None:
        grammar = ToolCallGrammar.from_schemas(schemas, close_marker=CLOSE)
        masks = per_tok[key] = ToolCallMasks(grammar, TokenTable(tok, table_width(model_engine)), OPEN)
    return masks
