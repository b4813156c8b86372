"""A step's reply, as the loop handles it: its calls in reply order, its events, its handle.

``pending`` lists the calls and malformed calls of a parsed reply in the order the model wrote
them; ``pending_key`` says when two calls are the same (the loop refuses a repeat with nothing
changed since); ``event`` turns a parser event into the agent event the UI shows; ``Opened``
wraps a generation handle so its tokens start with the reply's forced opening.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from agents.events import AgentEvent, TextDelta, ToolCallForming, ToolCallMalformed, ToolCallParsed
from agents.parser import Forming, Malformed, Parsed, ParseEvent, Text, ToolCallParser, call_name
from agents.protocol import ToolCall


@dataclass
class Pending:
    """A call (or malformed call) waiting for its result, in reply order."""

    id: str
    name: str
    call: ToolCall | None = None
    error: str | None = None
    raw: str = ""


def pending_key(p: Pending) -> tuple[str, str]:
    """What makes two calls the same: name and arguments (a malformed one: its error and raw text;
    the 1.5B started the protected test file 20 times in a row, each stopped at its first line)."""
    if p.call is None and p.name in ("write_file", "edit_file"):
        # a file block cut off (by a loop or a protected path): how far it streamed before the
        # stop landed varies, and so does the note on the error; the file and the cause do not
        return f"malformed:{p.name}", (p.error or "").split(" (")[0]
    if p.call is None:
        return f"malformed:{p.name}", f"{p.error}\n{p.raw}"
    return p.call.name, json.dumps(p.call.arguments, sort_keys=True, ensure_ascii=False)


def pending(parser: ToolCallParser) -> list[Pending]:
    items = [Pending(c.id, c.name, call=c, raw=c.raw) for c in parser.calls]
    items += [Pending(b.id, b.name or call_name(b.raw) or "", error=b.error, raw=b.raw) for b in parser.malformed]
    items.sort(key=lambda p: int(p.id.rsplit("_", 1)[1]))  # reply order
    return items


def event(step: int, pe: ParseEvent) -> AgentEvent:
    if isinstance(pe, Text):
        return TextDelta(step, pe.text)
    if isinstance(pe, Forming):
        return ToolCallForming(step, pe.index, pe.text, pe.name)
    if isinstance(pe, Parsed):
        return ToolCallParsed(step, pe.call)
    assert isinstance(pe, Malformed)
    return ToolCallMalformed(step, pe.id, pe.raw, pe.error)


class Opened:
    """A generation handle whose ``token_ids`` start with the reply's forced opening, so a
    partial reply saved mid-stream holds the exact tokens that were fed."""

    def __init__(self, handle, opening_ids: list[int]):
        self._handle, self._opening = handle, opening_ids

    @property
    def token_ids(self) -> list[int]:
        return self._opening + list(self._handle.token_ids)

    def __getattr__(self, name: str):
        return getattr(self._handle, name)
