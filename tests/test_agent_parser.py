"""Incremental tool-call parsing, call validation and the protocol helpers."""

import json

import pytest

import tools
from agents.parser import Forming, Malformed, Parsed, Text, ToolCallParser
from agents.protocol import (
    CallFormatError,
    format_call,
    malformed_result,
    parse_call,
    template_renders_tools,
    tool_map,
    tools_prompt_block,
)
from agents.scripted import CHATML_NO_TOOLS, CHATML_TOOLS, ScriptedEngine

TOOLS = tool_map(tools.default_registry(".").schemas())

REPLY = ("Let me write it.\n" + format_call("write_file", {"path": "a.txt", "content": "x </tool_call> y"})
         + "\nand then " + format_call("bash", {"command": "ls"}) + " done")


def feed_all(text: str, chunks: list[int]) -> tuple[ToolCallParser, list]:
    parser, events, pos = ToolCallParser(TOOLS), [], 0
    for size in chunks:
        events += parser.feed(text[pos:pos + size])
        pos += size
    events += parser.feed(text[pos:])
    events += parser.finish()
    return parser, events


@pytest.mark.parametrize("split", [1, 2, 3, 5, 7, 11, 1000])
def test_same_result_whatever_the_chunking(split):
    parser, events = feed_all(REPLY, [split] * (len(REPLY) // split + 1))
    assert [c.name for c in parser.calls] == ["write_file", "bash"]
    assert parser.calls[0].arguments == {"path": "a.txt", "content": "x </tool_call> y"}
    assert [c.id for c in parser.calls] == ["call_0", "call_1"]
    assert "".join(e.text for e in events if isinstance(e, Text)) == "Let me write it.\n\nand then  done"
    assert parser.visible_text == "Let me write it.\n\nand then  done"
    parsed = [e for e in events if isinstance(e, Parsed)]
    assert [p.index for p in parsed] == [0, 1]
    forming = [e for e in events if isinstance(e, Forming)]
    if split < 20:
        assert forming and forming[-1].name in ("write_file", "bash")
        assert any(f.name is None for f in forming)  # before the name arrives


def test_partial_marker_is_held_back_then_released():
    parser = ToolCallParser(TOOLS)
    assert parser.feed("a <tool") == [Text("a ")]
    assert parser.feed("box> b") == [Text("<toolbox> b")]


def test_malformed_calls_are_reported_with_the_problem():
    text = ("<tool_call>{not json}</tool_call>"
            '<tool_call>{"name": "nope", "arguments": {}}</tool_call>'
            '<tool_call>{"name": "bash", "arguments": {"timeout_s": 5}}</tool_call>'
            '<tool_call>["bash"]</tool_call>'
            '<tool_call>{"name": "bash", "arguments": "{\\"command\\": \\"ls\\"}"}</tool_call>'
            '<tool_call>{"name": "bash", "parameters": {"command": "pwd"}}</tool_call>'
            '<tool_call>{"name": "list_dir", "arguments": {}')
    parser, events = feed_all(text, [9] * 100)
    bad = [e for e in events if isinstance(e, Malformed)]
    assert [b.id for b in bad] == ["call_0", "call_1", "call_2", "call_3", "call_6"]
    assert "not valid JSON" in bad[0].error
    assert "unknown tool 'nope'" in bad[1].error and "bash" in bad[1].error
    assert "missing required argument 'command'" in bad[2].error
    assert "JSON object" in bad[3].error
    assert "cut off" in bad[4].error
    # arguments as a JSON string and "parameters" are understood
    assert [(c.id, c.arguments) for c in parser.calls] == [("call_4", {"command": "ls"}), ("call_5", {"command": "pwd"})]


def test_parse_call_validates_types_and_keys():
    with pytest.raises(CallFormatError, match="must be integer"):
        parse_call('{"name": "bash", "arguments": {"command": "ls", "timeout_s": "5"}}', TOOLS)
    with pytest.raises(CallFormatError, match="unknown argument"):
        parse_call('{"name": "bash", "arguments": {"command": "ls", "cwd": "/"}}', TOOLS)
    with pytest.raises(CallFormatError, match="unexpected key"):
        parse_call('{"name": "bash", "arguments": {"command": "ls"}, "id": 3}', TOOLS)
    assert parse_call('{"name": "bash", "arguments": {"command": "ls"}}', TOOLS) == ("bash", {"command": "ls"})


def test_malformed_result_explains_the_format():
    text = malformed_result("the tool call is not valid JSON", TOOLS)
    assert text.startswith("Error: the tool call is not valid JSON.")
    assert "<tool_call>" in text and "</tool_call>" in text
    assert "bash(command: string" in text and "write_file(path: string, content: string)" in text


def test_format_call_round_trips():
    text = format_call("write_file", {"path": "é.txt", "content": 'a "b"\n'})
    body = text[len("<tool_call>"):-len("</tool_call>")]
    assert json.loads(body) == {"name": "write_file", "arguments": {"path": "é.txt", "content": 'a "b"\n'}}


def test_tools_block_lists_every_tool():
    block = tools_prompt_block(tools.default_registry(".").schemas())
    for name in TOOLS:
        assert f"- {name}(" in block
    assert "<tool_call>" in block


def test_template_tool_support_detection():
    assert template_renders_tools(ScriptedEngine([], template=CHATML_TOOLS).render)
    assert not template_renders_tools(ScriptedEngine([], template=CHATML_NO_TOOLS).render)


def test_bare_json_reply_is_a_call():
    parser, events = feed_all('\n{"name": "list_dir", "arguments": {"depth": 2}}\n', [3] * 30)
    assert [(c.name, c.arguments) for c in parser.calls] == [("list_dir", {"depth": 2})]
    parser, _ = feed_all('{"name": "list_dir", "arguments": {}}\n</tool_call>', [5] * 30)
    assert parser.calls[0].name == "list_dir" and not parser.malformed
    parser, _ = feed_all('{"just": "json"}', [4] * 10)
    assert not parser.calls and "no \"name\"" in parser.malformed[0].error
    parser, _ = feed_all("Answer: {not a call}", [4] * 10)
    assert not parser.calls and not parser.malformed and parser.visible_text == "Answer: {not a call}"
    strict = ToolCallParser(TOOLS, bare=False)
    strict.feed('{"name": "list_dir", "arguments": {}}')
    strict.finish()
    assert not strict.calls and strict.visible_text.startswith("{")
