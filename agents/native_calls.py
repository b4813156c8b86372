"""A server's native tool calls read as the text protocol's blocks.

With ``model.remote.tool_calls: native`` the server parses the model's calls itself and streams
them as OpenAI ``delta.tool_calls`` (``engine.serving.events.ToolCallDelta``: the first piece of
a call has its id and name, the rest are pieces of its JSON arguments). ``NativeCalls`` turns
them into ``<tool_call>{"name": ..., "arguments": ...}</tool_call>`` text as they arrive, so the
agent's one parser reads them: the same forming and parsed events, tool cards, approvals and
malformed-call results as calls the model wrote in the text protocol.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator

from engine.serving.events import Done, ToolCallDelta
from engine.serving.events import TextDelta as EngineTextDelta

from agents.protocol import CLOSE, OPEN


class NativeCalls:
    def __init__(self) -> None:
        self._index: int | None = None  # the call being streamed
        self._has_args = False
        self.seen = False  # whether the reply had any native call
        self.text = ""  # the reply as the parser read it: content and the calls' blocks

    def as_text(self, events: Iterable) -> Iterator:
        """``events`` with each ``ToolCallDelta`` turned into text deltas of its block; a
        block is closed when the next call, content or the end arrives."""
        for ev in events:
            if isinstance(ev, ToolCallDelta):
                piece = self._piece(ev)
            elif self._index is not None and isinstance(ev, EngineTextDelta | Done):
                piece = self._close()
            else:
                piece = ""
            if piece:
                self.text += piece
                yield EngineTextDelta(piece)
            if isinstance(ev, EngineTextDelta):
                self.text += ev.text
            if not isinstance(ev, ToolCallDelta):
                yield ev

    def _piece(self, ev: ToolCallDelta) -> str:
        out = ""
        if self._index is not None and ev.index != self._index:
            out += self._close()
        if self._index is None:
            self._index, self._has_args, self.seen = ev.index, False, True
            out += f'{OPEN}\n{{"name": {json.dumps(ev.name or "", ensure_ascii=False)}, "arguments": '
        if ev.arguments:
            self._has_args = True
            out += ev.arguments
        return out

    def _close(self) -> str:
        out = ("" if self._has_args else "{}") + f"}}\n{CLOSE}\n"
        self._index = None
        return out


def remote_tool_calls(engine) -> str:
    """How a remote profile's agents call tools: "text" (the default) or "native"."""
    remote = getattr(getattr(getattr(engine, "profile", None), "model", None), "remote", None)
    return getattr(remote, "tool_calls", "text") or "text"
