"""Vocabulary masks for a byte-level grammar: which token ids keep the text inside the language.

A ``ByteGrammar`` supplies hashable states and ``step(state, byte)``; ``GrammarMasks`` maps it
onto a tokenizer's ``TokenTable``: states are interned to ids, transitions cached per byte, and
one boolean mask per state computed once (a first-byte test, then only the survivors walked
byte by byte). Budget helpers (``need``, ``closing_mask``, ``tight_mask``) keep a text closable
within a token budget; ``forced`` gives the bytes the grammar dictates, for speculative drafts.
What a constraint does with the masks (when to apply them) is up to its owner: see
engine.generation.constraints for the decode loop's side, agents.constrained for tool calls.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Hashable
from typing import Protocol

import mlx.core as mx
import numpy as np

UNKNOWN = -2  # transition not computed yet
DEAD = -1  # no state: the byte (or token) leaves the language


class ByteGrammar(Protocol):
    """A language over bytes. States are immutable and hashable; ``final()`` is the one
    accepting state and takes no further byte. ``plain_loop(state)`` says that every byte in
    ``plain_bytes`` leaves ``state`` unchanged (a string body, say): such tokens skip the walk."""

    plain_bytes: bytes

    def initial(self) -> Hashable: ...

    def final(self) -> Hashable: ...

    def step(self, state: Hashable, b: int) -> Hashable | None: ...

    def completion(self, state: Hashable) -> bytes: ...

    def plain_loop(self, state: Hashable) -> bool: ...


class TokenTable:
    """Each token id's bytes, plus vectors the mask computation gathers from."""

    def __init__(self, tokenizer, width: int):
        self.width = width
        limit = min(width, tokenizer.vocab_size)
        special = set(getattr(tokenizer, "special_ids", ()))
        pieces: list[bytes | None] = [None] * width
        for i in range(limit):
            if i in special:
                continue  # end-of-turn and friends are never part of a constrained text
            p = tokenizer.piece(i)
            b = p if isinstance(p, bytes) else p.encode("utf-8")
            pieces[i] = b or None
        self.pieces = pieces
        self.first = np.full(width, 256, dtype=np.int32)  # 256 = no piece
        self.lengths = np.zeros(width, dtype=np.int32)
        for i, b in enumerate(pieces):
            if b is not None:
                self.first[i] = b[0]
                self.lengths[i] = len(b)
        self.valid = self.first < 256
        self.eos = sorted(i for i in getattr(tokenizer, "eos_ids", ()) if i < width)
        self.by_piece: dict[bytes, list[int]] = {}
        for i, b in enumerate(pieces):
            if b is not None:
                self.by_piece.setdefault(b, []).append(i)
        self.max_piece = max((len(b) for b in self.by_piece), default=1)
        # speculative drafts spell forced text as the model's tokenizer does (None: no drafts)
        self.encode = getattr(tokenizer, "encode", None)
        self._plain: dict[bytes, tuple[np.ndarray, np.ndarray]] = {}

    def plain_runs(self, plain: bytes) -> tuple[np.ndarray, np.ndarray]:
        """Per token: how many leading bytes are in ``plain``, and whether all are (cached)."""
        hit = self._plain.get(plain)
        if hit is None:
            is_plain = np.zeros(256, dtype=bool)
            is_plain[list(plain)] = True
            prefix = np.zeros(self.width, dtype=np.int32)
            for i, b in enumerate(self.pieces):
                if b is None:
                    continue
                n = 0
                for byte in b:
                    if not is_plain[byte]:
                        break
                    n += 1
                prefix[i] = n
            hit = self._plain[plain] = (prefix, self.valid & (prefix == self.lengths))
        return hit

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


class GrammarMasks:
    """Grammar + vocabulary: interned states, transitions and a mask per state (cached).

    Thread-safe: agent threads build constraints while the engine thread decodes. ``mask_ms``
    is the time spent building masks (cache misses), for benchmarks. ``skip_bytes`` and
    ``space_after`` tune ``forced`` (JSON-style: optional whitespace, one space after ``:``/``,``).
    """

    skip_bytes = b" \t\n\r"
    space_after = b":,"

    def __init__(self, grammar: ByteGrammar, table: TokenTable):
        self.grammar = grammar
        self.table = table
        self._lock = threading.RLock()  # tight_mask builds base masks under it
        self._ids: dict[Hashable, int] = {}
        self._states: list[Hashable] = []
        self._rows: list[list[int]] = []
        self._masks: dict[int, mx.array] = {}
        self._need: dict[int, int] = {}
        self._closing: dict[int, mx.array] = {}
        self._tight: dict[tuple[int, int], mx.array] = {}
        self._forced: dict[tuple[int, bool], tuple[bytes, int]] = {}
        self.plain_prefix, self.fully_plain = table.plain_runs(grammar.plain_bytes)
        self.initial = self.intern(grammar.initial())
        self.accept = self.intern(grammar.final())
        eos = np.zeros(table.width, dtype=bool)
        eos[table.eos] = True
        self.end_mask = mx.array(eos)
        self.mask_ms = 0.0

    # -- states ----------------------------------------------------------------------------------
    def intern(self, state: Hashable) -> int:
        sid = self._ids.get(state)
        if sid is None:
            with self._lock:
                sid = self._ids.get(state)
                if sid is None:
                    sid = self._ids[state] = len(self._states)
                    self._states.append(state)
                    self._rows.append([UNKNOWN] * 256)
        return sid

    def next_id(self, sid: int, b: int) -> int:
        row = self._rows[sid]
        nxt = row[b]
        if nxt == UNKNOWN:  # filling a row twice from two threads gives the same value
            state = self.grammar.step(self._states[sid], b)
            nxt = row[b] = DEAD if state is None else self.intern(state)
        return nxt

    def walk(self, sid: int, data: bytes, start: int = 0) -> int:
        for i in range(start, len(data)):
            if sid == self.accept:
                return DEAD  # nothing follows the final state
            sid = self.next_id(sid, data[i])
            if sid == DEAD:
                return DEAD
        return sid

    def state(self, sid: int) -> Hashable:
        return self._states[sid]

    # -- masks -----------------------------------------------------------------------------------
    def mask(self, sid: int) -> mx.array:
        """Tokens that keep the text valid from state ``sid`` (computed once per state)."""
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
                first_ok[b] = self.next_id(sid, b) != DEAD
        allowed = np.zeros(table.width, dtype=bool)
        candidates = first_ok[table.first]
        plain_loop = self.grammar.plain_loop(self._states[sid])
        if plain_loop:
            # plain tokens leave the state as it was
            allowed |= self.fully_plain
            candidates &= ~self.fully_plain
        pieces = table.pieces
        for i in np.flatnonzero(candidates):
            start = int(self.plain_prefix[i]) if plain_loop else 0
            if self.walk(sid, pieces[i], start) != DEAD:
                allowed[i] = True
        return allowed

    # -- the token budget ------------------------------------------------------------------------
    def need(self, sid: int) -> int:
        """Fewest tokens that reach the final state from ``sid`` (spelling the grammar's
        ``completion`` in the fewest vocabulary tokens); cached per state."""
        n = self._need.get(sid)
        if n is None:
            done = sid == self.accept
            n = self._need[sid] = 0 if done else self.table.spell(self.grammar.completion(self._states[sid]))[0]
        return n

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
        (in a tool call: choosing a tool with more required arguments, opening another key...),
        so the text can still be closed before the budget ends."""
        key = (sid, slack)
        cached = self._tight.get(key)
        if cached is not None:
            return cached
        with self._lock:
            t0 = time.perf_counter()
            allowed = np.array(self.mask(sid))
            limit = self.need(sid) + slack - 1
            plain_loop = self.grammar.plain_loop(self._states[sid])
            # plain tokens leave the state (and so ``need``) as it is
            candidates = np.flatnonzero(allowed & ~self.fully_plain) if plain_loop else np.flatnonzero(allowed)
            for i in candidates:
                start = int(self.plain_prefix[i]) if plain_loop else 0
                nxt = self.walk(sid, self.table.pieces[i], start)
                if nxt == DEAD or self.need(nxt) > limit:
                    allowed[i] = False
            cached = self._tight[key] = mx.array(allowed)
            self.mask_ms += (time.perf_counter() - t0) * 1000
        return cached

    # -- forced text (speculative drafts) --------------------------------------------------------
    def forced(self, sid: int, after: int) -> tuple[bytes, int]:
        """The bytes the grammar dictates from state ``sid`` and the state they lead to.

        Followed while exactly one byte outside ``skip_bytes`` may come next; optional
        ``skip_bytes`` are left out, except one space after a ``space_after`` byte (``after``
        is the byte before ``sid``), which is how models write JSON (``"key": "v", "k2"``).
        Stops where the model has a choice. A guess at what comes next, verified like any
        draft (engine.generation.constraints.forced_draft).
        """
        spaced = after in self.space_after
        key = (sid, spaced)
        hit = self._forced.get(key)
        if hit is not None:
            return hit
        out = bytearray()
        while sid not in (self.accept, DEAD) and len(out) < 64:
            options = [b for b in range(256) if self.next_id(sid, b) != DEAD]
            solid = [b for b in options if b not in self.skip_bytes]
            if len(solid) != 1:
                break
            last = out[-1] if out else after
            if len(solid) < len(options) and last in self.space_after and 0x20 in options:
                sid = self.next_id(sid, 0x20)
                out.append(0x20)
            sid = self.next_id(sid, solid[0])
            out.append(solid[0])
        self._forced[key] = hit = (bytes(out), sid)
        return hit


def table_width(engine_like) -> int:
    """Width of the model's logits (may exceed the tokenizer's vocabulary: padded embeddings)."""
    width = getattr(engine_like, "logits_width", None)
    if isinstance(width, int) and width > 0:
        return width
    return engine_like.tokenizer.vocab_size
