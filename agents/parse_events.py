"""What parsing a streamed reply yields: text, calls forming, parsed calls, malformed calls.

Shared by the JSON call parser (``agents.parser``) and the text edit parser (``agents.edits``),
so one reply's events come in one vocabulary and one id sequence.
"""

from __future__ import annotations

from dataclasses import dataclass

from agents.protocol import ToolCall


@dataclass(frozen=True)
class Text:
    text: str


@dataclass(frozen=True)
class Forming:
    index: int  # 0-based position of the call in this reply
    text: str  # raw call text so far (after the open marker)
    name: str | None  # the tool name once it can be read


@dataclass(frozen=True)
class Parsed:
    index: int
    call: ToolCall


@dataclass(frozen=True)
class Malformed:
    index: int
    id: str
    raw: str
    error: str
    name: str | None = None  # known for text edits (their raw text is no JSON)


ParseEvent = Text | Forming | Parsed | Malformed
