"""The tool-call protocol: Hermes/Qwen-style ``<tool_call>{json}</tool_call>`` blocks.

The model calls a tool by writing::

    <tool_call>
    {"name": "write_file", "arguments": {"path": "hello.txt", "content": "hello world"}}
    </tool_call>

Tools are offered through the chat template when it renders ``tools`` (Qwen2.5 and other
Hermes-style templates write their own ``<tools>`` block); otherwise ("text" protocol, e.g.
SmolLM2's GGUF template) the system prompt carries ``tools_prompt_block``: the same format
described in plain text with one signature line per tool. Results go back as ``tool`` role
messages, which the template renders its own way (Qwen: ``<tool_response>`` in a user turn).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from tools.schema import ArgumentError, signature, validate_args

OPEN = "<tool_call>"
CLOSE = "</tool_call>"
_PROBE_TOOL = "zz_probe_tool_4711"


@dataclass(frozen=True)
class ToolCall:
    """One parsed call. ``arguments`` are as the model wrote them (validated, defaults not filled)."""

    id: str
    name: str
    arguments: dict[str, Any]
    raw: str = field(default="", compare=False)
    inferred_path: bool = field(default=False, compare=False)  # a text edit whose path the reply did not name

    def as_message_call(self) -> dict[str, Any]:
        """The OpenAI/HF shape stored in ``Message.tool_calls``."""
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


class CallFormatError(ValueError):
    """A tool call that could not be understood; the message says what was wrong."""


def format_call(name: str, arguments: Mapping[str, Any]) -> str:
    """A call written exactly as the model should write it."""
    return f"{OPEN}\n{json.dumps({'name': name, 'arguments': dict(arguments)}, ensure_ascii=False)}\n{CLOSE}"


def tool_map(schemas: Sequence[Mapping[str, Any]]) -> dict[str, dict[str, Any]]:
    """``name -> parameters`` from OpenAI-style tool definitions."""
    out = {}
    for s in schemas:
        fn = s.get("function", s)
        out[fn["name"]] = dict(fn.get("parameters") or {"type": "object", "properties": {}})
    return out


def parse_call(body: str, tools: Mapping[str, Mapping[str, Any]]) -> tuple[str, dict[str, Any]]:
    """``(name, arguments)`` from the text between the markers; raises CallFormatError.

    Lenient where models commonly differ without ambiguity: ``arguments`` given as a JSON
    string, or under the key ``parameters``. Arguments are validated against the tool schema.
    """
    text = body.strip()
    if not text:
        raise CallFormatError("the tool call is empty")
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        raise CallFormatError(f"the tool call is not valid JSON ({e.msg} at character {e.pos})") from None
    if not isinstance(data, dict):
        raise CallFormatError("the tool call must be a JSON object with \"name\" and \"arguments\"")
    name = data.get("name")
    if not isinstance(name, str) or not name:
        raise CallFormatError("the tool call has no \"name\" string")
    if name not in tools:
        raise CallFormatError(f"unknown tool {name!r}; available tools: {', '.join(tools)}")
    args = data.get("arguments", data.get("parameters", {}))
    if isinstance(args, str):
        try:
            args = json.loads(args) if args.strip() else {}
        except json.JSONDecodeError:
            raise CallFormatError("\"arguments\" is a string that is not a JSON object") from None
    if args is None:
        args = {}
    extra = set(data) - {"name", "arguments", "parameters"}
    if extra:
        raise CallFormatError(f"unexpected key {sorted(extra)[0]!r} next to \"name\" and \"arguments\"")
    try:
        validate_args(name, dict(tools[name]), args)
    except ArgumentError as e:
        raise CallFormatError(str(e)) from None
    return name, dict(args)


def format_help(tools: Mapping[str, Mapping[str, Any]]) -> str:
    """What a malformed call's error result tells the model."""
    example = format_call("tool_name", {"argument": "value"})
    sigs = "; ".join(signature(n, dict(s)) for n, s in tools.items())
    return f"Write one tool call exactly like this:\n{example}\nAvailable tools: {sigs}"


def malformed_result(error: str, tools: Mapping[str, Mapping[str, Any]]) -> str:
    return f"Error: {error}.\n{format_help(tools)}"


def tools_prompt_block(schemas: Sequence[Mapping[str, Any]]) -> str:
    """The system-prompt block for templates without tool support (the "text" protocol)."""
    lines = []
    for s in schemas:
        fn = s.get("function", s)
        lines.append(f"- {signature(fn['name'], fn.get('parameters') or {})}: {fn.get('description', '')}")
    return (
        "# Tools\n\nYou can call these tools:\n" + "\n".join(lines) + "\n\n"
        "To call a tool, reply with only this, and wait for the result:\n"
        f"{OPEN}\n{{\"name\": <tool name>, \"arguments\": <JSON object>}}\n{CLOSE}\n"
        "When the task is done, reply with a short answer and no tool call."
    )


def template_renders_tools(render) -> bool:
    """Whether a chat template writes the ``tools`` it is given (``render(messages, tools, agp)``)."""
    probe = [{"type": "function", "function": {"name": _PROBE_TOOL, "description": "probe",
                                                 "parameters": {"type": "object", "properties": {}}}}]
    try:
        text = render([{"role": "system", "content": "s"}, {"role": "user", "content": "u"}], probe, False)
    except Exception:  # a template that refuses tools or roles: treat as no tool support
        return False
    return _PROBE_TOOL in text
