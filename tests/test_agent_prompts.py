"""The few-shot examples show the tools' real output, and the system prompt fits the protocol."""

import re

import pytest

import tools
from agents.parser import ToolCallParser
from agents.prompts import DEFAULT_SYSTEM_PROMPT, PARITY_FILES, example_messages, system_prompt
from agents.protocol import parse_call, tool_map


def test_example_tool_results_are_what_the_tools_print(tmp_path):
    registry = tools.default_registry(tmp_path)
    params = tool_map(registry.schemas())
    messages = example_messages(registry.names())
    assert messages, "no examples"
    pending = None
    for m in messages:
        if m["role"] == "assistant" and "call" in m:
            body = m["content"][len("<tool_call>"):-len("</tool_call>")]
            name, args = parse_call(body, params)  # the example itself is a valid call
            assert (name, args) == m["call"]
            pending = registry.run(name, args)
        elif m["role"] == "tool":
            real = pending.content
            if m["name"] == "bash":  # timing varies: compare with the duration normalised
                real = real.replace(real.split("(", 1)[1].split(")", 1)[0], "0.0 s")
            assert m["content"] == real
            pending = None


def test_examples_only_use_offered_tools():
    assert example_messages(["read_file"]) == []
    only_write = example_messages(["write_file"])
    assert only_write and all(m.get("call", ("write_file",))[0] == "write_file" for m in only_write)
    calls = [m["call_id"] for m in example_messages(["write_file", "bash"]) if "call" in m]
    assert calls == [f"example_{i}" for i in range(len(calls))]


def test_system_prompt_has_the_tools_block_only_for_text_protocol():
    schemas = tools.default_registry(".").schemas()
    text = system_prompt(None, schemas, native_tools=False)
    assert text.startswith(DEFAULT_SYSTEM_PROMPT) and "<tool_call>" in text and "- bash(" in text
    assert system_prompt("Custom.", schemas, native_tools=True) == "Custom."


@pytest.mark.parametrize("edit_format", ["whole", "diff"])
def test_work_episode_replays_with_the_real_tools(tmp_path, edit_format):
    # The text-edit example: each assistant turn parses (text edits or a JSON call) to exactly
    # the call it claims, and each tool result is what the tool prints in the example workspace.
    for name, text in PARITY_FILES.items():
        (tmp_path / name).write_text(text)
    registry = tools.default_registry(tmp_path)
    params = tool_map(registry.schemas())
    messages = example_messages(["bash", "read_file", "write_file", "edit_file"], edit_format)
    assert [m["role"] for m in messages][-1] == "assistant" and "call" not in messages[-1]
    result = None
    for m in messages:
        if m["role"] == "assistant" and "call" in m:
            parser = ToolCallParser(params, text_edits=True)
            parser.feed(m["content"])
            parser.finish()
            assert [(c.name, c.arguments) for c in parser.calls] == [m["call"]] and not parser.malformed
            result = registry.run(*m["call"])
        elif m["role"] == "tool":
            assert _normal(m["content"], tmp_path) == _normal(result.content, tmp_path)
    assert (tmp_path / "parity.py").read_text() == "def is_even(n):\n    return n % 2 == 0\n"


def _normal(text, ws):
    text = re.sub(r"\(\d+\.\d s\)", "(0.0 s)", text.replace(f'"{ws}/', '"'))
    return re.sub(r"Ran (\d+) tests? in [\d.]+s", r"Ran \1 tests", text)


def test_work_prompt_teaches_the_edit_format():
    schemas = tools.default_registry(".").schemas()
    whole = system_prompt(None, schemas, native_tools=True, edit_format="whole")
    assert "```python" in whole and "SEARCH" not in whole and "<tool_call>" not in whole
    diff = system_prompt(None, schemas, native_tools=False, edit_format="diff")
    assert "<<<<<<< SEARCH" in diff and "- bash(" in diff
