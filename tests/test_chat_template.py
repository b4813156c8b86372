"""Chat templates rendered like HF apply_chat_template: tools, tool calls, tool turns, helpers."""

from __future__ import annotations

import json
from datetime import datetime

from engine.errors import MlxtermError, ModelLoadError
from engine.model.chat_template import CHATML_FALLBACK, ChatTemplate, ChatTemplateError

import pytest

# Qwen2.5-Instruct's chat template (tool-calling ChatML), as shipped in its tokenizer_config.json.
QWEN25_TEMPLATE = r"""{%- if tools %}
    {{- '<|im_start|>system\n' }}
    {%- if messages[0]['role'] == 'system' %}
        {{- messages[0]['content'] }}
    {%- else %}
        {{- 'You are Qwen, created by Alibaba Cloud. You are a helpful assistant.' }}
    {%- endif %}
    {{- "\n\n# Tools\n\nYou may call one or more functions to assist with the user query.\n\nYou are provided with function signatures within <tools></tools> XML tags:\n<tools>" }}
    {%- for tool in tools %}
        {{- "\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\n</tools>\n\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": <args-json-object>}\n</tool_call><|im_end|>\n" }}
{%- else %}
    {%- if messages[0]['role'] == 'system' %}
        {{- '<|im_start|>system\n' + messages[0]['content'] + '<|im_end|>\n' }}
    {%- else %}
        {{- '<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\n' }}
    {%- endif %}
{%- endif %}
{%- for message in messages %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) or (message.role == "assistant" and not message.tool_calls) %}
        {{- '<|im_start|>' + message.role + '\n' + message.content + '<|im_end|>' + '\n' }}
    {%- elif message.role == "assistant" %}
        {{- '<|im_start|>' + message.role }}
        {%- if message.content %}
            {{- '\n' + message.content }}
        {%- endif %}
        {%- for tool_call in message.tool_calls %}
            {%- if tool_call.function is defined %}
                {%- set tool_call = tool_call.function %}
            {%- endif %}
            {{- '\n<tool_call>\n{"name": "' }}
            {{- tool_call.name }}
            {{- '", "arguments": ' }}
            {{- tool_call.arguments | tojson }}
            {{- '}\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\n' }}
    {%- elif message.role == "tool" %}
        {%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\n<tool_response>\n' }}
        {{- message.content }}
        {{- '\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\n' }}
{%- endif %}
"""

WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather for a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "description": "City name, e.g. Zürich"}},
            "required": ["city"],
        },
    },
}

TOOL_CONVERSATION = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Weather in Zürich?"},
    {
        "role": "assistant",
        "content": "",
        "tool_calls": [
            {
                "type": "function",
                "function": {"name": "get_weather", "arguments": {"city": "Zürich"}},
            }
        ],
    },
    {"role": "tool", "content": '{"temp_c": 21}'},
    {"role": "tool", "content": "humidity 40%"},
    {"role": "assistant", "content": "21 °C, humid."},
    {"role": "user", "content": "Thanks"},
]


def test_qwen25_template_with_tools_tool_calls_and_tool_turns() -> None:
    prompt = ChatTemplate(QWEN25_TEMPLATE).render(TOOL_CONVERSATION, tools=[WEATHER_TOOL])
    assert prompt == (
        "<|im_start|>system\nYou are terse.\n\n# Tools\n\n"
        "You may call one or more functions to assist with the user query.\n\n"
        "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n"
        '{"type": "function", "function": {"name": "get_weather", "description": "Current weather '
        'for a city.", "parameters": {"type": "object", "properties": {"city": {"type": "string", '
        '"description": "City name, e.g. Zürich"}}, "required": ["city"]}}}\n</tools>\n\n'
        "For each function call, return a json object with function name and arguments within "
        "<tool_call></tool_call> XML tags:\n<tool_call>\n"
        '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call><|im_end|>\n'
        "<|im_start|>user\nWeather in Zürich?<|im_end|>\n"
        "<|im_start|>assistant\n<tool_call>\n"
        '{"name": "get_weather", "arguments": {"city": "Zürich"}}\n</tool_call><|im_end|>\n'
        "<|im_start|>user\n<tool_response>\n"
        '{"temp_c": 21}\n</tool_response>\n<tool_response>\nhumidity 40%\n</tool_response>'
        "<|im_end|>\n"
        "<|im_start|>assistant\n21 °C, humid.<|im_end|>\n"
        "<|im_start|>user\nThanks<|im_end|>\n"
        "<|im_start|>assistant\n"
    )


def test_qwen25_template_without_tools_uses_plain_system_turn() -> None:
    prompt = ChatTemplate(QWEN25_TEMPLATE).render(
        [{"role": "user", "content": "Hi"}], add_generation_prompt=False
    )
    assert prompt == (
        "<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful "
        "assistant.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"
    )


def test_chatml_fallback_renders_every_role() -> None:
    prompt = ChatTemplate(CHATML_FALLBACK).render(TOOL_CONVERSATION[:5])
    assert prompt == (
        "<|im_start|>system\nYou are terse.<|im_end|>\n"
        "<|im_start|>user\nWeather in Zürich?<|im_end|>\n"
        "<|im_start|>assistant\n\n<tool_call>\n"
        '{"name": "get_weather", "arguments": {"city": "Zürich"}}\n</tool_call><|im_end|>\n'
        '<|im_start|>tool\n{"temp_c": 21}<|im_end|>\n'
        "<|im_start|>tool\nhumidity 40%<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    no_prompt = ChatTemplate(CHATML_FALLBACK).render(
        TOOL_CONVERSATION[:2], add_generation_prompt=False
    )
    assert no_prompt.endswith("Weather in Zürich?<|im_end|>\n")


def test_hf_helpers_and_whitespace_control() -> None:
    source = (
        "{% for m in messages %}\n"
        "    {% if m.role == 'skip' %}{% continue %}{% endif %}\n"
        "{{ bos_token }}{{ m | tojson }}|{{ {'b': 1, 'a': 'é'} | tojson(indent=1) }}\n"
        "    {% if loop.index == 3 %}{% break %}{% endif %}\n"
        "{% endfor %}"
        "{% generation %}[{{ strftime_now('%Y') }}]{% endgeneration %}"
        "{{ enable_thinking }}"
    )
    template = ChatTemplate(source, special_tokens={"bos_token": "<s>"})
    messages = [
        {"role": "user", "content": "ü"},
        {"role": "skip", "content": "x"},
        {"role": "user", "content": "b"},
        {"role": "user", "content": "never reached"},
    ]
    year = datetime.now().strftime("%Y")
    # trim_blocks/lstrip_blocks: block lines leave no stray indentation or newlines
    assert template.render(messages, enable_thinking=False) == (
        '<s>{"role": "user", "content": "ü"}|{\n "b": 1,\n "a": "é"\n}\n'
        '<s>{"role": "user", "content": "b"}|{\n "b": 1,\n "a": "é"\n}\n'
        f"[{year}]False"
    )


def test_raise_exception_becomes_a_clear_error() -> None:
    source = "{% if messages[0].role == 'system' %}{{ raise_exception('System role not supported') }}{% endif %}ok"
    template = ChatTemplate(source, origin="gemma chat template")
    assert template.render([{"role": "user", "content": "x"}]) == "ok"
    with pytest.raises(
        ChatTemplateError,
        match="gemma chat template refused the conversation: System role not supported",
    ):
        template.render([{"role": "system", "content": "x"}])


def test_render_failures_are_one_sentence_mlxterm_errors() -> None:
    # SmolLM2-style string concatenation with a missing content fails inside the template
    template = ChatTemplate("{% for m in messages %}{{ m['role'] + m['content'] }}{% endfor %}")
    with pytest.raises(MlxtermError, match="failed to render") as err:
        template.render([{"role": "user", "content": None}])
    assert "\n" not in str(err.value)
    with pytest.raises(ChatTemplateError, match="message 0 has no 'role'"):
        template.render([{"content": "x"}])
    with pytest.raises(ChatTemplateError, match="must be a list"):
        template.render("hello")  # type: ignore[arg-type]


def test_sandbox_blocks_unsafe_access() -> None:
    template = ChatTemplate("{{ messages.__class__.__mro__ }}{{ messages.append(1) }}")
    with pytest.raises(ChatTemplateError):
        template.render([{"role": "user", "content": "x"}])


@pytest.mark.parametrize("source", ["{% for m in messages %}", "{{ }", "   "])
def test_invalid_template_is_a_model_load_error(source: str) -> None:
    with pytest.raises(ModelLoadError, match="model.gguf chat template") as err:
        ChatTemplate(source, origin="model.gguf chat template")
    assert "\n" not in str(err.value)


def test_messages_are_not_mutated() -> None:
    messages = json.loads(json.dumps(TOOL_CONVERSATION))
    ChatTemplate(QWEN25_TEMPLATE).render(messages, tools=[WEATHER_TOOL])
    assert messages == TOOL_CONVERSATION
