"""Incremental parsing of tool calls out of a model's streamed text.

``ToolCallParser.feed(delta)`` returns what the new text completes: plain ``Text`` outside
calls (a possible partial ``<tool_call>`` at the end is held back until it is decided),
``Forming`` with the raw text of the call so far, then ``Parsed`` or ``Malformed`` when its
close marker arrives (outside JSON strings: the grammar lets string values contain it).
``finish()`` reports a call the stream left open as malformed.

A reply whose first non-blank character is ``{`` is read as a call without its open marker
(small models drop it, e.g. Qwen2.5-Coder-0.5B): it ends at a close marker if one comes, else at
the end of the reply, where it counts as a call only if it parses.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from agents.edits import TextEditParser
from agents.parse_events import Forming, Malformed, Parsed, ParseEvent, Text
from agents.protocol import CLOSE, OPEN, CallFormatError, ToolCall, parse_call

__all__ = ["Forming", "Malformed", "Parsed", "ParseEvent", "Text", "ToolCallParser", "call_name"]

_NAME = re.compile(r'"name"\s*:\s*"([^"\\]*)"')




class ToolCallParser:
    def __init__(self, tools: Mapping[str, Mapping[str, Any]], id_prefix: str = "call", bare: bool = True,
                 text_edits: bool = False, infer_path=None):
        """``text_edits``: also read whole-file and search/replace edits out of the text outside
        calls (``agents.edits``); they become write_file / edit_file calls. ``infer_path``: see
        ``agents.edits.TextEditParser``."""
        self.tools = tools
        self.id_prefix = id_prefix
        self.bare = bare
        self._at_start = True
        self._implicit = False
        self._buf = ""
        self._inside = False
        self._scan = 0  # call text scanned so far for the close marker
        self._in_string = False
        self._escaped = False
        self.count = 0
        self.calls: list[ToolCall] = []
        self.malformed: list[Malformed] = []
        self.text_parts: list[str] = []
        self._edits = TextEditParser(self._reserve, infer_path) if text_edits else None

    @property
    def open_edit_path(self) -> str | None:
        """The path of a text edit block still streaming, if any."""
        return self._edits.open_path if self._edits is not None else None

    @property
    def visible_text(self) -> str:
        """Everything outside call blocks so far."""
        return "".join(self.text_parts)

    def feed(self, delta: str) -> list[ParseEvent]:
        self._buf += delta
        out: list[ParseEvent] = []
        if self._at_start and self.bare:
            head = self._buf.lstrip()
            if not head:
                return out  # only whitespace so far: undecided
            self._at_start = False
            if head.startswith("{"):  # a call without its open marker (see module docstring)
                self._buf, self._implicit = head, True
                self._inside, self._scan, self._in_string, self._escaped = True, 0, False, False
        while True:
            if self._inside:
                end = self._close_at()
                if end < 0:
                    if self._buf:
                        out.append(Forming(self.count, self._buf, call_name(self._buf)))
                    return out
                body, self._buf = self._buf[:end], self._buf[end + len(CLOSE):]
                out.append(self._complete(body))
                self._inside = False
                continue
            start = self._buf.find(OPEN)
            if start >= 0:
                self._text(self._buf[:start], out)
                self._buf = self._buf[start + len(OPEN):]
                self._inside, self._scan, self._in_string, self._escaped = True, 0, False, False
                continue
            keep = _partial_suffix(self._buf, OPEN)
            self._text(self._buf[: len(self._buf) - keep], out)
            self._buf = self._buf[len(self._buf) - keep:]
            return out

    def _close_at(self) -> int:
        """Position of the close marker in the call text, ignoring any inside JSON strings
        (a file's content may well contain "</tool_call>"); -1 until it has arrived."""
        buf = self._buf
        i = self._scan
        while i < len(buf):
            ch = buf[i]
            if self._in_string:
                if self._escaped:
                    self._escaped = False
                elif ch == "\\":
                    self._escaped = True
                elif ch == '"':
                    self._in_string = False
            elif ch == '"':
                self._in_string = True
            elif ch == "<":
                if buf.startswith(CLOSE, i):
                    return i
                if CLOSE.startswith(buf[i:]):
                    break  # maybe the marker, not complete yet: look again with more text
            i += 1
        self._scan = i
        return -1

    def finish(self) -> list[ParseEvent]:
        """End of stream: flush held text, report an unterminated call."""
        out: list[ParseEvent] = []
        if self._inside:
            raw, self._buf, self._inside = self._buf, "", False
            if self._implicit and self.count == 0:
                out.append(self._complete(raw))  # a bare JSON reply: a call if it parses
            else:
                out.append(self._malformed(raw, "the tool call was cut off before " + CLOSE))
        elif self._buf:
            self._text(self._buf, out)
            self._buf = ""
        if self._edits is not None:
            self._edit_events(self._edits.finish(), out)
        return out

    def _text(self, text: str, out: list[ParseEvent]) -> None:
        if not text:
            return
        if self._edits is not None:
            self._edit_events(self._edits.feed(text), out)
            return
        self.text_parts.append(text)
        out.append(Text(text))

    def _edit_events(self, events: list[ParseEvent], out: list[ParseEvent]) -> None:
        for ev in events:
            if isinstance(ev, Text):
                self.text_parts.append(ev.text)
            elif isinstance(ev, Parsed):
                self.calls.append(ev.call)
            elif isinstance(ev, Malformed):
                self.malformed.append(ev)
            out.append(ev)

    def _reserve(self) -> tuple[int, str]:
        index = self.count
        return index, self._next_id()

    def _next_id(self) -> str:
        cid = f"{self.id_prefix}_{self.count}"
        self.count += 1
        return cid

    def _complete(self, body: str) -> ParseEvent:
        try:
            name, args = parse_call(body, self.tools)
        except CallFormatError as e:
            return self._malformed(body, str(e))
        index = self.count
        call = ToolCall(self._next_id(), name, args, raw=body)
        self.calls.append(call)
        return Parsed(index, call)

    def _malformed(self, raw: str, error: str) -> Malformed:
        index = self.count
        bad = Malformed(index, self._next_id(), raw, error)
        self.malformed.append(bad)
        return bad


def call_name(partial: str) -> str | None:
    """The tool name in (possibly unfinished) call text, once it can be read."""
    m = _NAME.search(partial)
    return m.group(1) if m else None


def _partial_suffix(text: str, marker: str) -> int:
    for n in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0
