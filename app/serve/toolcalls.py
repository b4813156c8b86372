"""Tools for the HTTP API: OpenAI ``tools``/``tool_choice`` in, ``message.tool_calls`` out.

The model is offered tools and writes calls exactly as the agents' models do (agents.protocol:
``<tool_call>{json}</tool_call>``; the chat template renders ``tools`` when it can, else the
system message carries the text protocol's tools block), its reply is read with the agents'
parser (agents.parser) and, where the schemas fit the agents' grammar, decoded under the
agents' tool-call constraint (agents.constrained): ``tool_choice: "required"`` or a named
function forces a call from the first token. Tools whose parameter types the agents' checks do
not cover (``number``, nested objects) are still offered and parsed, with their arguments
taken as the JSON object the model wrote.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from engine.generation.vocab_masks import TokenTable, table_width

from agents.constrained import ToolCallConstraint, ToolCallMasks
from agents.grammar import ToolCallGrammar
from agents.parser import Malformed, Parsed, Text, ToolCallParser
from agents.protocol import CLOSE, OPEN, format_call, template_renders_tools, tools_prompt_block
from app.serve.errors import bad_request

_SIMPLE = ("string", "integer", "boolean")
_MASKS: OrderedDict[tuple, ToolCallMasks] = OrderedDict()  # (tokenizer id, tool set) -> masks
_MASKS_LOCK = threading.Lock()
_MASKS_KEEP = 16


@dataclass
class ToolSetup:
    """The tools one request offers and how its reply is read."""

    schemas: list[dict[str, Any]]  # OpenAI function tools as offered
    choice: str  # "auto" | "none" | "required" | "function"
    forced_name: str | None = None  # tool_choice naming one function
    checked: dict[str, dict[str, Any]] = field(default_factory=dict)  # name -> params the agents check
    loose: set[str] = field(default_factory=set)  # names whose params only need to be a JSON object

    @property
    def parses(self) -> bool:
        return self.choice != "none"

    @property
    def forced(self) -> bool:
        return self.choice in ("required", "function")

    def callable_schemas(self) -> list[dict[str, Any]]:
        """The tools a call may name (one with a named tool_choice)."""
        if self.forced_name is None:
            return self.schemas
        return [s for s in self.schemas if s["function"]["name"] == self.forced_name]


def parse_tools(body: Mapping[str, Any]) -> ToolSetup | None:
    """``tools`` and ``tool_choice`` of a chat request; None when no tools are offered."""
    tools = body.get("tools")
    choice = body.get("tool_choice")
    if tools is None or tools == []:
        if choice not in (None, "none", "auto"):
            raise bad_request("tool_choice needs tools", "tool_choice")
        return None
    if not isinstance(tools, list):
        raise bad_request("tools must be a list of function tools", "tools")
    schemas = []
    for i, t in enumerate(tools):
        fn = t.get("function") if isinstance(t, dict) else None
        if not isinstance(t, dict) or t.get("type", "function") != "function" or not isinstance(fn, dict):
            raise bad_request(f"tools[{i}] must be {{\"type\": \"function\", \"function\": {{...}}}}", f"tools[{i}]")
        name = fn.get("name")
        if not isinstance(name, str) or not name:
            raise bad_request(f"tools[{i}].function.name must be a non-empty string", f"tools[{i}].function.name")
        params = fn.get("parameters") or {"type": "object", "properties": {}}
        if not isinstance(params, dict) or params.get("type", "object") != "object":
            raise bad_request(f"tools[{i}].function.parameters must be a JSON schema object",
                              f"tools[{i}].function.parameters")
        params = {"type": "object", "properties": {}, **params}
        schemas.append({"type": "function", "function": {**fn, "parameters": params}})
    names = [s["function"]["name"] for s in schemas]
    if len(set(names)) != len(names):
        raise bad_request("tool names must be unique", "tools")
    setup = ToolSetup(schemas, "auto")
    for s in schemas:
        fn = s["function"]
        if _checkable(fn["parameters"]):
            setup.checked[fn["name"]] = fn["parameters"]
        else:
            setup.loose.add(fn["name"])
    if choice is None or choice in ("auto", "none", "required"):
        setup.choice = choice or "auto"
    elif isinstance(choice, dict) and isinstance(choice.get("function"), dict):
        name = choice["function"].get("name")
        if name not in names:
            raise bad_request(f"tool_choice names {name!r}, which is not among the tools", "tool_choice")
        setup.choice, setup.forced_name = "function", name
    else:
        raise bad_request('tool_choice must be "none", "auto", "required" or '
                          '{"type": "function", "function": {"name": ...}}', "tool_choice")
    return setup


def _checkable(params: Mapping[str, Any]) -> bool:
    """Whether the agents' argument checks and grammar cover every property of ``params``."""
    props = params.get("properties", {})
    if not isinstance(props, dict) or not isinstance(params.get("required", []), list):
        return False
    return all(isinstance(p, dict) and _simple_value(p, allow_array=True) for p in props.values())


def _simple_value(prop: Mapping[str, Any], allow_array: bool) -> bool:
    kind = prop.get("type")
    if kind in _SIMPLE:
        return "enum" not in prop or isinstance(prop["enum"], list)
    if kind == "array" and allow_array and isinstance(prop.get("items"), dict):
        return _simple_value(prop["items"], allow_array=False)
    return False


# -- prompt -----------------------------------------------------------------------------------
def prompt_messages(messages: list[dict[str, Any]], setup: ToolSetup | None, engine) -> tuple[list[dict], list | None]:
    """Messages for the chat template and the ``tools`` it renders (None: the text protocol's
    block went into the system message, or no tools). Assistant turns with ``tool_calls`` are
    written back as the model writes calls, so a follow-up turn matches the cached tokens."""
    out = []
    for m in messages:
        calls = m.get("tool_calls")
        if m["role"] == "assistant" and calls:
            text = m.get("content") or ""
            written = "\n".join(format_call(c["name"], c["arguments"]) for c in calls)
            m = {"role": "assistant", "content": f"{text}\n{written}" if text else written}
        out.append(m)
    if setup is None:
        return out, None
    if native_tools(engine):
        return out, setup.schemas
    block = tools_prompt_block(setup.schemas)
    if out and out[0]["role"] == "system":
        out[0] = {**out[0], "content": f"{out[0]['content']}\n\n{block}"}
    else:
        base = engine.profile.chat.system_prompt
        out.insert(0, {"role": "system", "content": f"{base}\n\n{block}" if base else block})
    return out, None


_NATIVE: dict[int, bool] = {}


def native_tools(engine) -> bool:
    """Whether the profile's chat template renders ``tools`` itself (asked once per engine)."""
    key = id(engine)
    if key not in _NATIVE:
        _NATIVE[key] = template_renders_tools(engine.render)
    return _NATIVE[key]


# -- constrained decoding -------------------------------------------------------------------------
def constraint_for(setup: ToolSetup | None, engine, max_tokens: int) -> ToolCallConstraint | None:
    """The agents' tool-call constraint for this request, or None (no parsing, or schemas the
    grammar does not cover)."""
    if setup is None or not setup.parses:
        return None
    schemas = setup.callable_schemas()
    if any(s["function"]["name"] in setup.loose for s in schemas):
        return None
    masks = _masks(engine, schemas)
    return ToolCallConstraint(masks, force_call=setup.forced, max_tokens=max_tokens)


def _masks(engine, schemas: Sequence[Mapping[str, Any]]) -> ToolCallMasks:
    key = (id(engine.tokenizer), json.dumps(schemas, sort_keys=True))
    with _MASKS_LOCK:
        masks = _MASKS.get(key)
        if masks is not None:
            _MASKS.move_to_end(key)
            return masks
    grammar = ToolCallGrammar.from_schemas(schemas, close_marker=CLOSE)
    masks = ToolCallMasks(grammar, TokenTable(engine.tokenizer, table_width(engine)), OPEN)
    with _MASKS_LOCK:
        _MASKS[key] = masks
        while len(_MASKS) > _MASKS_KEEP:
            _MASKS.popitem(last=False)
    return masks


# -- reading the reply --------------------------------------------------------------------------
class ReplyReader:
    """Splits streamed reply text into content and OpenAI tool calls (``feed`` / ``finish``
    return ``("content", text)`` and ``("tool_call", call_dict)`` items in order)."""

    def __init__(self, setup: ToolSetup | None, id_prefix: str):
        self.setup = setup
        self.parser = (ToolCallParser(setup.checked, id_prefix=id_prefix)
                       if setup is not None and setup.parses else None)
        self.calls: list[dict[str, Any]] = []

    def feed(self, text: str) -> list[tuple[str, Any]]:
        if self.parser is None:
            return [("content", text)] if text else []
        return self._items(self.parser.feed(text))

    def finish(self) -> list[tuple[str, Any]]:
        return self._items(self.parser.finish()) if self.parser is not None else []

    def _items(self, events) -> list[tuple[str, Any]]:
        out: list[tuple[str, Any]] = []
        for ev in events:
            if isinstance(ev, Text):
                out.append(("content", ev.text))
            elif isinstance(ev, Parsed):
                out.append(("tool_call", self._call(ev.call.id, ev.call.name, ev.call.arguments)))
            elif isinstance(ev, Malformed):
                loose = _loose_call(ev.raw, self.setup.loose)
                if loose is not None:
                    out.append(("tool_call", self._call(ev.id, *loose)))
                else:  # not a call after all: the client sees the text the model wrote
                    out.append(("content", ev.raw))
        return out

    def _call(self, call_id: str, name: str, arguments: dict[str, Any]) -> dict[str, Any]:
        call = {"index": len(self.calls), "id": call_id, "type": "function",
                "function": {"name": name, "arguments": json.dumps(arguments, ensure_ascii=False)}}
        self.calls.append(call)
        return call


def _loose_call(raw: str, loose: set[str]) -> tuple[str, dict[str, Any]] | None:
    """``(name, arguments)`` of a call to a tool whose parameters the agents do not check."""
    try:
        data = json.loads(raw.strip())
    except json.JSONDecodeError:
        return None
    if not isinstance(data, dict) or data.get("name") not in loose:
        return None
    args = data.get("arguments", data.get("parameters", {}))
    if isinstance(args, str):
        try:
            args = json.loads(args) if args.strip() else {}
        except json.JSONDecodeError:
            return None
    return (data["name"], args) if isinstance(args, dict) else None
