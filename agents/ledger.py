"""Exact token ids for each message an agent adds to its session.

Same rule as ``engine.sessions.chat.ChatService``: a session's context is the concatenation of its
messages' token ids and is never re-tokenized. A new message stores only the tokens it adds:
the template's closing tail after the tokens already fed (``junction_tail``), the message as
the template renders it, and, when the model answers next, the generation prompt. Assistant
messages store exactly the generated ids; for rendering they are given back to the template
as their raw generated text, so the rendered history keeps extending what was fed.
"""

from __future__ import annotations

import json
import logging
import os
import re
from collections.abc import Mapping, Sequence
from typing import Any

from engine.sessions import Message
from engine.sessions.chat import junction_tail

from agents.protocol import CLOSE, OPEN

log = logging.getLogger(__name__)
_CALL_BLOCK = re.compile(rf"{re.escape(OPEN)}.*?{re.escape(CLOSE)}", re.DOTALL)


def render_dict(m: Message) -> dict[str, Any]:
    """A stored message as chat-template input (assistant turns: their raw generated text)."""
    d: dict[str, Any] = {"role": m.role, "content": m.meta.get("raw_text", m.content)}
    if m.role == "tool":
        if m.tool_call_id:
            d["tool_call_id"] = m.tool_call_id
        if m.name:
            d["name"] = m.name
    return d


class TokenLedger:
    """Renders with the engine's template (and ``tools`` when the template writes them)."""

    def __init__(self, engine, tools: Sequence[Mapping[str, Any]] | None):
        self.engine = engine
        self.tools = list(tools) if tools else None

    def render(self, dicts: Sequence[Mapping[str, Any]], add_generation_prompt: bool) -> str:
        if not dicts:
            return ""
        return self.engine.render(list(dicts), self.tools, add_generation_prompt)

    def tokens_for(
        self,
        history: Sequence[Mapping[str, Any]],
        fed_ids: Sequence[int],
        new: Sequence[Mapping[str, Any]],
        generation_prompt: bool,
        history_prompted: bool | None = None,
    ) -> list[list[int]]:
        """Token ids for each message of ``new`` appended after ``history`` (already fed as
        ``fed_ids``); the last one ends with the generation prompt when ``generation_prompt``.
        ``history_prompted``: whether the fed history ends in a generation prompt (None: when
        its last message is a user or tool turn)."""
        tok = self.engine.tokenizer
        if history_prompted is None:
            history_prompted = bool(history) and history[-1]["role"] in ("user", "tool")
        prev_gp = bool(history) and history_prompted
        before = self.render(history, prev_gp)
        tail = junction_tail(before, tok.decode(list(fed_ids))) if fed_ids else ""
        out: list[list[int]] = []
        done = list(history)
        for i, message in enumerate(new):
            last = i == len(new) - 1
            after = self.render([*done, dict(message)], generation_prompt and last)
            if not after.startswith(before):
                log.warning("chat template renders history differently once a message is added")
                before = os.path.commonprefix([before, after])
            out.append(tok.encode(tail + after[len(before):]))
            tail = ""
            done.append(dict(message))
            before = self.render(done, False) if not last else after
        return out


class MessageLedger:
    """For an engine without a tokenizer (a remote server applies its own template): messages
    are stored with no tokens; the server is sent the messages themselves (``messages_for``)."""

    def tokens_for(self, history, fed_ids, new, generation_prompt, history_prompted=None) -> list[list[int]]:
        return [[] for _ in new]


def messages_for(history: Sequence[Message], native: bool = False) -> list[dict[str, Any]]:
    """The stored messages as an OpenAI-style request's ``messages``: assistant turns as the text
    they were generated as (tool calls in the text protocol), tool results as ``tool`` turns.
    ``native``: assistant calls go as ``tool_calls`` (arguments as a JSON string), their text
    without the call blocks, so the server renders them in its model's own format."""
    if not native:
        return [render_dict(m) for m in history]
    out = []
    for m in history:
        d = render_dict(m)
        if m.role == "assistant" and m.tool_calls:
            d["content"] = _CALL_BLOCK.sub("", m.content).strip()
            d["tool_calls"] = [{"id": c["id"], "type": "function",
                                "function": {"name": c["function"]["name"],
                                             "arguments": json.dumps(c["function"].get("arguments") or {},
                                                                     ensure_ascii=False)}}
                               for c in m.tool_calls]
        out.append(d)
    return out
