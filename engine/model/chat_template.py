"""Chat templates: the Jinja programs that turn a conversation into a model's prompt text.

Rendered the way Hugging Face ``apply_chat_template`` does, so templates shipped in GGUF metadata
or ``tokenizer_config.json`` behave as their authors tested them: a sandboxed environment with
``trim_blocks``/``lstrip_blocks``, loop controls, ``raise_exception``, ``strftime_now`` and a
``tojson`` that keeps non-ASCII text and key order.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Any

from engine.errors import MlxtermError, ModelLoadError

import jinja2
from jinja2 import nodes
from jinja2.ext import Extension, loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment

# For models that ship no template. Tool results are shown as their own "tool" turn.
CHATML_FALLBACK = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' }}"
    "{%- if message['content'] is string %}{{- message['content'] }}{%- endif %}"
    "{%- for call in message.get('tool_calls') or [] %}"
    "{%- set fn = call['function'] if call['function'] is defined else call %}"
    "{{- '\\n<tool_call>\\n' + {'name': fn['name'], 'arguments': fn['arguments']} | tojson + '\\n</tool_call>' }}"
    "{%- endfor %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


class ChatTemplateError(MlxtermError):
    """A chat template could not render the conversation it was given."""


class _TemplateRaised(Exception):
    """What ``raise_exception`` throws inside a template; turned into ChatTemplateError."""


def _raise_exception(message: str) -> None:
    raise _TemplateRaised(message)


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    # Jinja's own tojson escapes HTML and sorts keys; HF templates expect plain json.dumps.
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


class _GenerationBlock(Extension):
    """``{% generation %}...{% endgeneration %}`` marks assistant text for training masks in
    HF; for rendering it is a no-op wrapper, but templates that use it must still parse."""

    tags = {"generation"}

    def parse(self, parser: Any) -> list[nodes.Node]:
        next(parser.stream)
        return parser.parse_statements(("name:endgeneration",), drop_needle=True)


def _environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols, _GenerationBlock]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


class ChatTemplate:
    """A compiled chat template.

    ``special_tokens`` (e.g. ``{"bos_token": "<bos>", "eos_token": "<eos>"}``) are passed to
    every render as HF does; many templates write ``{{ bos_token }}`` themselves, so prompts
    rendered here must be encoded without adding another BOS. ``origin`` names where the
    template came from in error messages.
    """

    def __init__(
        self,
        source: str,
        *,
        special_tokens: Mapping[str, str] | None = None,
        origin: str = "chat template",
    ) -> None:
        if not isinstance(source, str) or not source.strip():
            raise ModelLoadError(f"{origin}: the chat template is empty.")
        self.source = source
        self.origin = origin
        self.special_tokens = dict(special_tokens or {})
        try:
            self._template = _environment().from_string(source)
        except jinja2.TemplateSyntaxError as e:
            raise ModelLoadError(
                f"{origin}: the chat template is not valid Jinja (line {e.lineno}: {e.message})."
            ) from None

    def render(
        self,
        messages: Sequence[Mapping[str, Any]],
        tools: Sequence[Mapping[str, Any]] | None = None,
        add_generation_prompt: bool = True,
        **extra: Any,
    ) -> str:
        """The prompt text for ``messages`` (dicts with ``role``, ``content`` and, on assistant
        turns, optional ``tool_calls``). ``tools`` are JSON-schema function specs; ``extra``
        reaches the template as variables (e.g. ``enable_thinking=False``)."""
        _check_messages(messages, self.origin)
        variables = {**self.special_tokens, **extra}
        try:
            return self._template.render(
                messages=[dict(m) for m in messages],
                tools=None if tools is None else list(tools),
                add_generation_prompt=add_generation_prompt,
                **variables,
            )
        except _TemplateRaised as e:
            raise ChatTemplateError(f"{self.origin} refused the conversation: {e}") from None
        except (
            jinja2.TemplateError,
            TypeError,
            ValueError,
            KeyError,
            IndexError,
            AttributeError,
        ) as e:
            raise ChatTemplateError(
                f"{self.origin} failed to render the conversation: {type(e).__name__}: {e}."
            ) from None


def _check_messages(messages: Any, origin: str) -> None:
    if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence):
        raise ChatTemplateError(f"{origin}: messages must be a list of role/content mappings.")
    for i, m in enumerate(messages):
        if not isinstance(m, Mapping) or not isinstance(m.get("role"), str):
            raise ChatTemplateError(f"{origin}: message {i} has no 'role' string.")
