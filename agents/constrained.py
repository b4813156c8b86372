"""Constrained decoding of tool calls: the grammar in ``agents.grammar`` mapped onto a vocabulary.

``ToolCallMasks`` is built once per (tokenizer, tool set) and caches one boolean mask per
grammar state; ``ToolCallConstraint`` is the per-request object the engine's decode loop
drives (``allowed()`` before each token, ``advance(token)`` after; see
engine.generation.constraints). Why: a small model's tool call must parse and validate every
time. Free text gets no mask; once the text ends in enough of the open marker (or the reply's
first token opens a JSON object: a dropped marker) the call is committed and enforced token by
token, within the request's token budget (``tight_mask``, ``closing_mask``), so a budget never
cuts a call off. Masks: a first-byte test, then only survivors walked byte by byte through
interned states. Rules, budget and measurements: docs/agents.md, "Constrained decoding".
"""

from __future__ import annotations

import copy
import json
import threading
import time
import weakref
from collections.abc import Iterable
from typing import Any

import engine  # noqa: F401  (loads OpenBLAS before mlx)

import mlx.core as mx
import numpy as np

from agents.grammar import LIT, STR, State, ToolCallGrammar, is_plain_string_byte
from agents.protocol import CLOSE, OPEN

_UNKNOWN = -2
_DEAD = -1
_WS = b" \t\n\r"
_PLAIN = np.array([is_plain_string_byte(b) for b in range(256)], dtype=bool)


class TokenTable:
    """Each token id's bytes, plus vectors the mask computation gathers from."""

    def __init__(self, tokenizer, width: int):
        self.width = width
        limit = min(width, tokenizer.vocab_size)
        special = set(getattr(tokenizer, "special_ids", ()))
        pieces: list[bytes | None] = [None] * width
        for i in range(limit):
            if i in special:
                continue  # end-of-turn and friends are never part of a call's text
            p = tokenizer.piece(i)
            b = p if isinstance(p, bytes) else p.encode("utf-8")
            pieces[i] = b or None
        self.pieces = pieces
        self.first = np.full(width, 256, dtype=np.int32)  # 256 = no piece
        self.plain_prefix = np.zeros(width, dtype=np.int32)
        self.lengths = np.zeros(width, dtype=np.int32)
        for i, b in enumerate(pieces):
            if b is None:
                continue
            self.first[i] = b[0]
            self.lengths[i] = len(b)
            n = 0
            for byte in b:
                if not _PLAIN[byte]:
                    break
                n += 1
            self.plain_prefix[i] = n
        self.valid = self.first < 256
        self.fully_plain = self.valid & (self.plain_prefix == self.lengths)
        self.eos = sorted(i for i in getattr(tokenizer, "eos_ids", ()) if i < width)
        self.by_piece: dict[bytes, list[int]] = {}
        for i, b in enumerate(pieces):
            if b is not None:
                self.by_piece.setdefault(b, []).append(i)

        self.max_piece = max((len(b) for b in self.by_piece), default=1)
        # speculative drafts spell forced text as the model's tokenizer does (None: no drafts)
        self.encode = getattr(tokenizer, "encode", None)

    def prefix_ids(self, text: bytes) -> list[int]:
        """Ids of tokens whose bytes are a non-empty prefix of ``text``."""
        return [i for n in range(1, len(text) + 1) for i in self.by_piece.get(text[:n], ())]

    def spell(self, text: bytes) -> tuple[int, list[int]]:
        """Fewest tokens that spell ``text`` exactly, and the ids that can start such a spelling
        (dynamic programming over the vocabulary's pieces)."""
        n = len(text)
        far = n + 1  # more than any real count: "cannot spell"
        best = [far] * n + [0]
        for i in range(n - 1, -1, -1):
            for size in range(1, min(self.max_piece, n - i) + 1):
                if text[i:i + size] in self.by_piece and best[i + size] + 1 < best[i]:
                    best[i] = best[i + size] + 1
        if not n or best[0] >= far:
            return (0 if not n else n), []
        first = [i for size in range(1, min(self.max_piece, n) + 1)
                 if best[size] + 1 == best[0] for i in self.by_piece.get(text[:size], ())]
        return best[0], first


class ToolCallMasks:
    """Grammar + vocabulary: interned states, transitions and a mask per state (cached)."""

    def __init__(self, grammar: ToolCallGrammar, table: TokenTable, open_marker: str = "<tool_call>"):
        self.grammar = grammar
        self.table = table
        self.open = open_marker.encode()
        self._lock = threading.RLock()  # tight_mask builds base masks under it
        self._ids: dict[State, int] = {}
        self._states: list[State] = []
        self._rows: list[list[int]] = []
        self._masks: dict[int, mx.array] = {}
        self._marker_masks: dict[int, mx.array] = {}
        self._budget_masks: dict[tuple[int, int], mx.array] = {}
        self._need: dict[int, int] = {}
        self._closing: dict[int, mx.array] = {}
        self._tight: dict[tuple[int, int], mx.array] = {}
        self.initial = self.intern(grammar.initial())
        self.accept = self.intern(())
        eos = np.zeros(table.width, dtype=bool)
        eos[table.eos] = True
        self.end_mask = mx.array(eos)
        self.mask_ms = 0.0  # time spent building masks (cache misses), for benchmarks
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
        self._forced: dict[tuple[int, bool], tuple[bytes, int]] = {}
        self.end_token: int | None = None  # the end-of-turn token this model closed a call with

    # -- states ----------------------------------------------------------------------------------
    def intern(self, state: State) -> int:
        sid = self._ids.get(state)
        if sid is None:
            with self._lock:  # agent threads build constraints while the engine thread decodes
                sid = self._ids.get(state)
                if sid is None:
                    sid = self._ids[state] = len(self._states)
                    self._states.append(state)
                    self._rows.append([_UNKNOWN] * 256)
        return sid

    def next_id(self, sid: int, b: int) -> int:
        row = self._rows[sid]
        nxt = row[b]
        if nxt == _UNKNOWN:  # filling a row twice from two threads gives the same value
            state = self.grammar.step(self._states[sid], b)
            nxt = row[b] = _DEAD if state is None else self.intern(state)
        return nxt

    def walk(self, sid: int, data: bytes, start: int = 0) -> int:
        for i in range(start, len(data)):
            if sid == self.accept:
                return _DEAD  # nothing follows the close marker
            sid = self.next_id(sid, data[i])
            if sid == _DEAD:
                return _DEAD
        return sid

    def state(self, sid: int) -> State:
        return self._states[sid]

    # -- masks -----------------------------------------------------------------------------------
    def mask(self, sid: int) -> mx.array:
        """Tokens that keep the call valid from state ``sid`` (computed once per state)."""
        cached = self._masks.get(sid)
        if cached is not None:
            return cached
        with self._lock:
            t0 = time.perf_counter()
            allowed = self._compute(sid)
            out = self._masks[sid] = mx.array(allowed)
            self.mask_ms += (time.perf_counter() - t0) * 1000
        return out

    def _compute(self, sid: int) -> np.ndarray:
        table = self.table
        first_ok = np.zeros(257, dtype=bool)
        if sid != self.accept:
            for b in range(256):
                first_ok[b] = self.next_id(sid, b) != _DEAD
        allowed = np.zeros(table.width, dtype=bool)
        candidates = first_ok[table.first]
        state = self._states[sid]
        in_string = bool(state) and state[-1][0] == STR
        if in_string:
            # Plain bytes loop on a string body: such tokens leave the state as it was.
            allowed |= table.fully_plain
            candidates &= ~table.fully_plain
        pieces = table.pieces
        for i in np.flatnonzero(candidates):
            data = pieces[i]
            start = int(table.plain_prefix[i]) if in_string else 0
            if self.walk(sid, data, start) != _DEAD:
                allowed[i] = True
        return allowed

    def committed(self, matched: int) -> int:
        """The state of a call whose marker has ``matched`` bytes written (0: none yet)."""
        return self.intern(self.grammar.initial() + ((LIT, self.open, matched),))

    def after_marker_text(self, head: bytes, data: bytes) -> int | None:
        """Where free text ``head`` (a partial marker) plus a token's ``data`` leads: a call
        state when it completes or commits the marker, ``_DEAD`` when it completes it into
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
                if self.after_marker_text(head, self.table.pieces[i]) == _DEAD:
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
                if sid == _DEAD or (left is not None and self.need(sid) > left - 2):
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
                if sid is not None and (sid == _DEAD or self.need(sid) > left - 2):
                    allowed[i] = False
            cached = self._budget_masks[key] = mx.array(allowed)
        return cached

    # -- the token budget -------------------------------------------------------------------
    def need(self, sid: int) -> int:
        """Fewest tokens that wind the call in state ``sid`` up (spelling the grammar's
        ``completion`` in the fewest vocabulary tokens); cached per state."""
        n = self._need.get(sid)
        if n is None:
            done = sid == self.accept
            n = self._need[sid] = 0 if done else self.table.spell(self.grammar.completion(self._states[sid]))[0]
        return n

    def forced(self, sid: int, after: int) -> tuple[bytes, int]:
        """The bytes the grammar dictates from state ``sid`` and the state they lead to.

        Followed while exactly one byte other than whitespace may come next; optional
        whitespace is left out, except one space after ``:`` or ``,`` (``after`` is the byte
        before ``sid``), which is how models write JSON (``"key": "v", "k2"``). Stops where the
        model has a choice (a string body, a value, which key next). For speculative drafts
        (``ToolCallConstraint.draft``): a guess at what comes next, verified like any draft.
        """
        key = (sid, after in b":,")
        hit = self._forced.get(key)
        if hit is not None:
            return hit
        start, out = sid, bytearray()
        while sid not in (self.accept, _DEAD) and len(out) < 64:
            options = [b for b in range(256) if self.next_id(sid, b) != _DEAD]
            solid = [b for b in options if b not in _WS]
            if len(solid) != 1:
                break
            if len(solid) < len(options) and (out[-1:] or bytes((after,))) in (b":", b",") and 0x20 in options:
                sid = self.next_id(sid, 0x20)
                out.append(0x20)
            sid = self.next_id(sid, solid[0])
            out.append(solid[0])
        self._forced[(start, after in b":,")] = hit = (bytes(out), sid)
        return hit

    def closing_mask(self, sid: int) -> mx.array:
        """Only tokens that start a shortest wind-up: used when the budget has no slack left."""
        cached = self._closing.get(sid)
        if cached is None:
            allowed = np.zeros(self.table.width, dtype=bool)
            allowed[self.table.spell(self.grammar.completion(self._states[sid]))[1]] = True
            cached = self._closing[sid] = mx.array(allowed)
        return cached

    def tight_mask(self, sid: int, slack: int) -> mx.array:
        """The state's mask without tokens that would raise ``need`` by ``slack`` or more
        (choosing a tool with more required arguments, opening another key...), so the call
        can still be closed before the budget ends."""
        key = (sid, slack)
        cached = self._tight.get(key)
        if cached is not None:
            return cached
        with self._lock:
            t0 = time.perf_counter()
            allowed = np.array(self.mask(sid))
            limit = self.need(sid) + slack - 1
            state = self._states[sid]
            in_string = bool(state) and state[-1][0] == STR
            # plain tokens leave a string body (and so ``need``) as it is
            candidates = np.flatnonzero(allowed & ~self.table.fully_plain) if in_string else np.flatnonzero(allowed)
            for i in candidates:
                start = int(self.table.plain_prefix[i]) if in_string else 0
                nxt = self.walk(sid, self.table.pieces[i], start)
                if nxt == _DEAD or self.need(nxt) > limit:
                    allowed[i] = False
            cached = self._tight[key] = mx.array(allowed)
            self.mask_ms += (time.perf_counter() - t0) * 1000
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
        sid = _DEAD if data is None else self.masks.walk(self.sid, data)
        if sid == _DEAD:
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
            if sid == _DEAD:
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


def table_width(engine_like) -> int:
    """Width of the model's logits (may exceed the tokenizer's vocabulary: padded embeddings)."""
    width = getattr(engine_like, "logits_width", None)
    if isinstance(width, int) and width > 0:
        return width
    return engine_like.tokenizer.vocab_size


def eos_ids(tokenizer) -> Iterable[int]:
    return sorted(getattr(tokenizer, "eos_ids", ()))


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
