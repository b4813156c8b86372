"""The default agent system prompt and the few-shot example turns that precede each task.

Small models (the 135M default) follow a demonstrated format far better than a described one,
so a new agent session starts with short example exchanges in the real protocol: a call, the
tool's actual output format, and a final answer without a call. They are stored as ordinary
session messages marked ``meta.example = true`` (the TUI can fold them away).

Two choices in the examples are deliberate: ``write_file`` arguments put ``content`` before
``path`` (a file name such as ``hello.txt`` primes a 135M model towards "Hello, World!" when
the content comes after it), and contents are lowercase phrases copied verbatim from the task.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from agents.protocol import format_call, tools_prompt_block

DEFAULT_SYSTEM_PROMPT = (
    "You are a coding agent. You work in a project folder and use tools to do the user's task. "
    "Call one tool at a time and wait for its result. "
    "Write file content exactly as the task gives it: same words, same lowercase letters, "
    "no extra punctuation."
)


def system_prompt(base: str | None, schemas: Sequence[Mapping[str, Any]], native_tools: bool) -> str:
    """The system message text: the base prompt, plus the tools block unless the template
    renders tools itself."""
    text = (base or DEFAULT_SYSTEM_PROMPT).strip()
    if native_tools or not schemas:
        return text
    return f"{text}\n\n{tools_prompt_block(schemas)}"


def _call(name: str, arguments: dict[str, Any]) -> dict[str, Any]:
    return {"role": "assistant", "content": format_call(name, arguments), "call": (name, arguments)}


def _write_only(path: str, content: str) -> list[dict[str, Any]]:
    return [
        {"role": "user", "content": f"create {path} containing exactly: {content}"},
        _call("write_file", {"content": content, "path": path}),
        {"role": "tool", "content": f"Created {path} ({len(content.encode())} bytes): +1 -0 lines."},
        {"role": "assistant", "content": f"The file {path} now contains: {content}"},
    ]


def _write_and_run(path: str, what: str, code: str, output: str) -> list[dict[str, Any]]:
    return [
        {"role": "user", "content": f"create {path} that prints {what}, run it with bash, and tell me its output"},
        _call("write_file", {"content": code, "path": path}),
        {"role": "tool", "content": f"Created {path} ({len(code.encode())} bytes): +1 -0 lines."},
        _call("bash", {"command": f"python3 {path}"}),
        {"role": "tool", "content": f"exit code 0 (0.0 s)\nstdout:\n{output}"},
        {"role": "assistant", "content": f"It printed: {output}"},
    ]


# Each example: a task, the calls with the output the tools really give (checked by
# tests/test_agent_prompts.py), and the final answer. Write-only and write-then-run tasks
# alternate so that after a tool result the model keys on the task ("run it") to decide
# between another call and the answer; the run examples report the printed value, not the
# expression from the task.
EXAMPLES: list[list[dict[str, Any]]] = [
    _write_only("notes.txt", "buy milk"),
    _write_and_run("mul.py", "6*7", "print(6*7)\n", "42"),
    _write_only("todo.txt", "call the bank"),
    _write_and_run("hi.py", "the word hi", "print('hi')\n", "hi"),
]


def example_messages(tool_names: Sequence[str]) -> list[dict[str, Any]]:
    """The example turns whose calls only use offered tools, as message dicts.

    Assistant calls carry ``call = (name, arguments)``; tool messages carry ``name`` and
    ``tool_call_id`` (``example_<n>``) so they pair up like real calls.
    """
    out: list[dict[str, Any]] = []
    n = 0
    for example in EXAMPLES:
        if any("call" in m and m["call"][0] not in tool_names for m in example):
            continue
        pending = None
        for m in example:
            m = dict(m)
            if "call" in m:
                pending = (f"example_{n}", m["call"][0])
                m["call_id"] = pending[0]
                n += 1
            elif m["role"] == "tool" and pending:
                m["tool_call_id"], m["name"] = pending
            out.append(m)
    return out
