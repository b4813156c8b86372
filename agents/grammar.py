"""A byte-level state machine for one tool call's JSON, driven by the tools' schemas.

It accepts exactly::

    {"name": <one tool name>, "arguments": {<that tool's arguments>}}</tool_call>

with bounded whitespace between JSON tokens, only known argument keys (each at most once, every
required key before ``}``) and each value of its schema's type: string (or one of its ``enum``),
integer (within ``minimum``/``maximum``), boolean, or an array of those. The close marker is
part of the language, so a finished match means "the call is complete". A state is an
immutable tuple of frames (hashable: it keys mask caches); ``step(state, byte)`` returns the
next state or ``None``. ``ToolCallGrammar`` is an engine.generation.vocab_masks ``ByteGrammar``. Bytes, not characters: byte-level vocabularies split UTF-8 characters
across tokens, so any byte >= 0x80 is allowed inside strings (the detokenizer turns stray bytes
into U+FFFD, still a valid JSON string character).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

State = tuple  # tuple of frames; () is the accepting state
WHITESPACE = frozenset(b" \n\t\r")
MAX_WS = 4  # whitespace bytes allowed in a row: enough for "\n  ", never an endless run
MAX_INT_DIGITS = 18
_ESCAPES = frozenset(b'"\\/bfnrt')
_HEX = frozenset(b"0123456789abcdefABCDEF")
_DIGITS = frozenset(b"0123456789")

# Frame kinds (first element of each frame tuple).
LIT, WS, STR, ESC, HEX, CHOICE, INT, OBJ_FIRST, OBJ_NEXT, ARR_FIRST, ARR_NEXT = range(11)
# What a completed CHOICE continues with.
THEN_NAME, THEN_KEY, THEN_VALUE = range(3)


def is_plain_string_byte(b: int) -> bool:
    """Bytes a JSON string body takes as they are (no quote, backslash or control char)."""
    return b >= 0x20 and b not in (0x22, 0x5C)


def _seq(*frames: tuple) -> State:
    """Frames in the order they are matched, as a stack (next frame last)."""
    return tuple(reversed(frames))


def _ws() -> tuple:
    return (WS, 0)


def _lit(text: bytes) -> tuple:
    return (LIT, text, 0)


class ToolCallGrammar:
    """The language of tool calls for a set of tools (``name -> JSON schema`` of arguments)."""

    def __init__(self, tools: Mapping[str, Mapping[str, Any]], close_marker: str = "</tool_call>"):
        if not tools:
            raise ValueError("a tool-call grammar needs at least one tool")
        self.tool_names: tuple[str, ...] = tuple(tools)
        self.schemas = {name: dict(schema) for name, schema in tools.items()}
        self.close = close_marker.encode()
        self._name_options = tuple(json.dumps(n).encode() for n in self.tool_names)
        self._props: dict[int, tuple[str, ...]] = {}
        self._required_mask: dict[int, int] = {}
        for t, name in enumerate(self.tool_names):
            props = tuple(self.schemas[name].get("properties", {}))
            self._props[t] = props
            req = set(self.schemas[name].get("required", []))
            self._required_mask[t] = sum(1 << i for i, k in enumerate(props) if k in req)
        self._items: dict[str, Mapping[str, Any]] = {}  # array item schemas by JSON text
        self._key_options: dict[int, tuple[bytes, ...]] = {
            t: tuple(json.dumps(k).encode() for k in props) for t, props in self._props.items()
        }

    @classmethod
    def from_schemas(cls, schemas: Sequence[Mapping[str, Any]], close_marker: str = "</tool_call>") -> ToolCallGrammar:
        """From OpenAI-style tool definitions (``{"type": "function", "function": {...}}``)."""
        tools = {}
        for s in schemas:
            fn = s.get("function", s)
            tools[fn["name"]] = fn.get("parameters") or {"type": "object", "properties": {}}
        return cls(tools, close_marker)

    # -- states --------------------------------------------------------------------------------
    def initial(self) -> State:
        """Right after the open marker: ``{"name": `` then a tool name."""
        return _seq(_ws(), _lit(b"{"), _ws(), _lit(b'"name"'), _ws(), _lit(b":"), _ws(),
                    (CHOICE, self._name_options, b"", (THEN_NAME,)))

    @staticmethod
    def final() -> State:
        """The accepting state: the close marker is written, nothing may follow."""
        return ()

    @staticmethod
    def accepted(state: State) -> bool:
        return state == ()

    plain_bytes = bytes(b for b in range(256) if is_plain_string_byte(b))

    @staticmethod
    def plain_loop(state: State) -> bool:
        """Whether ``state`` is inside a string body, where each of ``plain_bytes`` loops."""
        return bool(state) and state[-1][0] == STR

    def step(self, state: State | None, b: int) -> State | None:
        """The state after byte ``b``, or None when ``b`` cannot come next."""
        if state is None:
            return None
        while state:
            top = state[-1]
            result = self._frame(top, b)
            if result is None:
                return None
            consumed, replacement = result
            state = state[:-1] + replacement
            if consumed:
                return state
        return None  # nothing may follow the close marker

    def feed(self, state: State | None, data: bytes) -> State | None:
        for b in data:
            state = self.step(state, b)
            if state is None:
                return None
        return state

    def completion(self, state: State) -> bytes:
        """A short byte string that completes ``state`` to the close marker.

        Greedy and structural, not a global search: close open strings, take the shortest
        option of a choice (required keys first), end objects and arrays as soon as allowed.
        Used to wind a call up when the token budget is about to run out.
        """
        out = bytearray()
        while state:
            b = self._closing_byte(state)
            state = self.step(state, b)
            if state is None:  # cannot happen for states the grammar produced
                raise AssertionError("completion left the grammar")
            out.append(b)
        return bytes(out)

    def _closing_byte(self, state: State) -> int:
        for f in reversed(state):
            kind = f[0]
            if kind == WS or (kind == INT and f[3] not in (b"", b"-") and f[1] <= int(f[3]) <= f[2]):
                continue  # finished (or optional) here: the byte belongs to a frame below
            if kind == LIT:
                return f[1][f[2]]
            if kind == STR:
                return 0x22
            if kind == ESC:
                return ord("n")
            if kind == HEX:
                return ord("0")
            if kind == INT:
                return next(d for d in b"0123456789" if _int_reachable(f[3] + bytes((d,)), f[1], f[2]))
            if kind == CHOICE:
                return self._choice_byte(f)
            if kind == OBJ_FIRST:
                return ord("}") if self._required_mask[f[1]] == 0 else 0x22
            if kind == OBJ_NEXT:
                req = self._required_mask[f[1]]
                return ord("}") if f[2] & req == req else ord(",")
            if kind in (ARR_FIRST, ARR_NEXT):
                return ord("]")
        raise AssertionError("no frame to close")

    def _choice_byte(self, f: tuple) -> int:
        _, options, prefix, then = f
        live = [o for o in options if o.startswith(prefix) and len(o) > len(prefix)]
        if then[0] == THEN_KEY:
            t, seen = then[1], then[2]
            req = self._required_mask[t]
            wanted = [o for i, o in enumerate(self._key_options[t]) if req & (1 << i) and not seen & (1 << i)]
            live = [o for o in live if o in wanted] or live
        return min(live, key=len)[len(prefix)]

    # -- one frame -----------------------------------------------------------------------------
    def _frame(self, f: tuple, b: int) -> tuple[bool, State] | None:
        """``(consumed, frames replacing f)`` or None (reject). Not consumed: retry ``b`` below."""
        kind = f[0]
        if kind == LIT:
            text, i = f[1], f[2]
            if b != text[i]:
                return None
            return True, ((LIT, text, i + 1),) if i + 1 < len(text) else ()
        if kind == WS:
            if b in WHITESPACE and f[1] < MAX_WS:
                return True, ((WS, f[1] + 1),)
            return False, ()
        if kind == STR:
            if b == 0x22:
                return True, ()
            if b == 0x5C:
                return True, ((ESC,),)
            return (True, (f,)) if b >= 0x20 else None
        if kind == ESC:
            if b == ord("u"):
                return True, ((HEX, 4),)
            return (True, ((STR,),)) if b in _ESCAPES else None
        if kind == HEX:
            if b not in _HEX:
                return None
            return True, ((HEX, f[1] - 1),) if f[1] > 1 else ((STR,),)
        if kind == CHOICE:
            return self._choice(f, b)
        if kind == INT:
            return _int_step(f, b)
        if kind == OBJ_FIRST:
            return self._obj_first(f, b)
        if kind == OBJ_NEXT:
            return self._obj_next(f, b)
        if kind == ARR_FIRST:
            if b == ord("]"):
                return True, ()
            return False, _seq(*self._value_frames(self._items[f[1]]), _ws(), (ARR_NEXT, f[1]))
        if kind == ARR_NEXT:
            if b == ord("]"):
                return True, ()
            if b == ord(","):
                return True, _seq(_ws(), *self._value_frames(self._items[f[1]]), _ws(), (ARR_NEXT, f[1]))
            return None
        raise AssertionError(f"unknown frame {f!r}")

    def _choice(self, f: tuple, b: int) -> tuple[bool, State] | None:
        _, options, prefix, then = f
        longer = prefix + bytes((b,))
        matches = [o for o in options if o.startswith(longer)]
        if matches:
            if len(matches) == 1 and matches[0] == longer:
                return True, self._then(then, longer)
            return True, ((CHOICE, options, longer, then),)
        if prefix in options:  # e.g. integer enum 1 vs 10: the shorter one ended here
            return False, self._then(then, prefix)
        return None

    def _then(self, then: tuple, chosen: bytes) -> State:
        if then[0] == THEN_VALUE:
            return ()
        if then[0] == THEN_NAME:
            t = self._name_options.index(chosen)
            return _seq(_ws(), _lit(b","), _ws(), _lit(b'"arguments"'), _ws(), _lit(b":"), _ws(),
                        _lit(b"{"), _ws(), (OBJ_FIRST, t), _ws(), _lit(b"}"), _ws(), _lit(self.close))
        _, t, seen = then
        i = self._key_options[t].index(chosen)
        prop = self.schemas[self.tool_names[t]]["properties"][self._props[t][i]]
        return _seq(_ws(), _lit(b":"), _ws(), *self._value_frames(prop), _ws(), (OBJ_NEXT, t, seen | (1 << i)))

    def _key_choice(self, t: int, seen: int) -> tuple | None:
        options = tuple(o for i, o in enumerate(self._key_options[t]) if not seen & (1 << i))
        return (CHOICE, options, b"", (THEN_KEY, t, seen)) if options else None

    def _obj_first(self, f: tuple, b: int) -> tuple[bool, State] | None:
        t = f[1]
        if b == ord("}"):
            return (True, ()) if self._required_mask[t] == 0 else None
        choice = self._key_choice(t, 0)
        return (False, (choice,)) if choice is not None and b == 0x22 else None

    def _obj_next(self, f: tuple, b: int) -> tuple[bool, State] | None:
        _, t, seen = f
        if b == ord("}"):
            req = self._required_mask[t]
            return (True, ()) if seen & req == req else None
        if b == ord(","):
            choice = self._key_choice(t, seen)
            return (True, _seq(_ws(), choice)) if choice is not None else None
        return None

    def _value_frames(self, prop: Mapping[str, Any]) -> tuple[tuple, ...]:
        """Frames (in match order) for one value of schema ``prop``."""
        kind = prop.get("type")
        if "enum" in prop:
            options = tuple(json.dumps(v, ensure_ascii=False).encode() for v in prop["enum"])
            return ((CHOICE, options, b"", (THEN_VALUE,)),)
        if kind == "string":
            return (_lit(b'"'), (STR,))
        if kind == "integer":
            lo = prop.get("minimum", -(10**MAX_INT_DIGITS) + 1)
            hi = prop.get("maximum", 10**MAX_INT_DIGITS - 1)
            return ((INT, int(lo), int(hi), b""),)
        if kind == "boolean":
            return ((CHOICE, (b"true", b"false"), b"", (THEN_VALUE,)),)
        if kind == "array":
            key = json.dumps(prop["items"], sort_keys=True)  # frames must stay hashable
            self._items[key] = prop["items"]
            return (_lit(b"["), _ws(), (ARR_FIRST, key))
        raise ValueError(f"unsupported schema type {kind!r}")


def _int_step(f: tuple, b: int) -> tuple[bool, State] | None:
    _, lo, hi, text = f
    if b == ord("-") and text == b"" and lo < 0:
        return True, ((INT, lo, hi, b"-"),)
    if b in _DIGITS:
        digits = text.lstrip(b"-")
        if digits == b"0" or len(digits) >= MAX_INT_DIGITS:
            return None
        longer = text + bytes((b,))
        return (True, ((INT, lo, hi, longer),)) if _int_reachable(longer, lo, hi) else None
    if text not in (b"", b"-") and lo <= int(text) <= hi:
        return False, ()  # the number ended; the byte belongs to what follows
    return None


def _int_reachable(text: bytes, lo: int, hi: int) -> bool:
    """Whether some integer written as ``text`` + more digits lies in [lo, hi]."""
    negative = text.startswith(b"-")
    m = int(text.lstrip(b"-"))
    width = len(text.lstrip(b"-"))
    for extra in range(0, MAX_INT_DIGITS - width + 1):
        if m == 0 and extra:
            break  # "0" takes no more digits
        first, last = m * 10**extra, m * 10**extra + 10**extra - 1
        a, z = (-last, -first) if negative else (first, last)
        if a <= hi and z >= lo:
            return True
        if first > max(abs(lo), abs(hi)):
            break
    return False
