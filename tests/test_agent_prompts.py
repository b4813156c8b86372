"""The few-shot examples show the tools' real output, and the system prompt fits the protocol."""

import tools
from agents.prompts import DEFAULT_SYSTEM_PROMPT, example_messages, system_prompt
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
