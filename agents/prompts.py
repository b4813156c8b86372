"""The default agent system prompts and the few-shot example turns that precede each task.

Two sets, by the profile's ``agent.edit_format``. "json" (the 135M default's toy tasks): files
are written with ``write_file`` calls. "whole" / "diff" (real coding work): files are written as
text (``agents.edits``) and the one example episode shows the work loop: read the file, write the
whole file, run the tests, read the failure, fix it, run them again, answer in one short
sentence. No example ends in a sentence that could stand in for the work.

Why examples: small models follow a demonstrated format far better than a described one, so a
new agent session starts with short exchanges in the real protocol (a call, the tool's actual
output, a final answer), stored as session messages marked ``meta.example = true``. Why
``content`` comes before ``path`` in them and the other deliberate choices: docs/agents.md.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import Any

from agents.protocol import format_call, tools_prompt_block

DEFAULT_SYSTEM_PROMPT = (
    "You are a coding agent. You work in a project folder and use tools to do the user's task. "
    "Call one tool at a time and wait for its result. "
    "Write file content exactly as the task gives it: same words, same lowercase letters, "
    "no extra punctuation."
)


WORK_SYSTEM_PROMPT = (
    "You are a coding agent working in a project folder. Do the user's task by changing the files "
    "yourself; never just describe a change or show code without writing it. "
    "Use the tools to look at files and run commands, one call at a time."
)

WHOLE_FILE_RULES = (
    "To write a file, put its path on a line of its own, then the complete file in one fenced code block:\n\n"
    "path/to/file.py\n```python\n(the whole file, every line)\n```\n\n"
    "The file is written when the block closes. Always write the whole file: no placeholders, "
    "no \"rest unchanged\"."
)

DIFF_RULES = (
    "To change part of an existing file, write its path on a line of its own, then a search/replace block:\n\n"
    "path/to/file.py\n<<<<<<< SEARCH\n(exact lines from the file)\n=======\n(the new lines)\n>>>>>>> REPLACE\n\n"
    "The SEARCH lines must match the file exactly, spaces included; keep them short but unique."
)

WORK_RULES = (
    "After writing, run the tests if the task has any, read the failures and fix the code. "
    "When the work is done and the tests pass, reply with one short sentence and no code."
)


def edit_rules(edit_format: str) -> str:
    """What the system prompt says about writing files in a text edit format."""
    parts = [WHOLE_FILE_RULES]
    if edit_format == "diff":
        parts.append(DIFF_RULES)
    parts.append(WORK_RULES)
    return "\n\n".join(parts)


def system_prompt(base: str | None, schemas: Sequence[Mapping[str, Any]], native_tools: bool,
                  edit_format: str = "json", work: bool = False) -> str:
    """The system message text: the base prompt, the edit rules for a text edit format (``work``:
    the work rules with JSON calls), plus the tools block unless the template renders tools itself."""
    if edit_format == "json" and work:
        text = f"{(base or WORK_SYSTEM_PROMPT).strip()}\n\n{WORK_RULES}"
    elif edit_format == "json":
        text = (base or DEFAULT_SYSTEM_PROMPT).strip()
    else:
        text = f"{(base or WORK_SYSTEM_PROMPT).strip()}\n\n{edit_rules(edit_format)}"
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


def _edit(path: str, content: str) -> dict[str, Any]:
    """An assistant turn that writes a whole file as text (``agents.edits``)."""
    return {"role": "assistant", "content": f"{path}\n```python\n{content}```",
            "call": ("write_file", {"path": path, "content": content})}


def _replace(path: str, old: str, new: str) -> dict[str, Any]:
    """An assistant turn that edits a file with a search/replace block."""
    return {"role": "assistant", "content": f"{path}\n<<<<<<< SEARCH\n{old}=======\n{new}>>>>>>> REPLACE",
            "call": ("edit_file", {"path": path, "old_text": old, "new_text": new})}


# The test output as the bash tool prints it; the traceback names the workspace, which the
# example keeps relative (tests/test_agent_prompts.py compares with paths and times normalised).
_PARITY_FAIL = (
    "exit code 1 (0.1 s)\nstderr:\n.F\n"
    "======================================================================\n"
    "FAIL: test_odd (parity_test.ParityTest.test_odd)\n"
    "----------------------------------------------------------------------\n"
    "Traceback (most recent call last):\n"
    "  File \"parity_test.py\", line 11, in test_odd\n"
    "    self.assertFalse(is_even(7))\n"
    "AssertionError: True is not false\n\n"
    "----------------------------------------------------------------------\n"
    "Ran 2 tests in 0.001s\n\nFAILED (failures=1)"
)
_PARITY_OK = ("exit code 0 (0.1 s)\nstderr:\n..\n"
              "----------------------------------------------------------------------\n"
              "Ran 2 tests in 0.000s\n\nOK")
PARITY_FILES = {  # the example's workspace (tests/test_agent_prompts.py replays the episode in it)
    "parity.py": "def is_even(n):\n    pass\n",
    "parity_test.py": ("import unittest\n\nfrom parity import is_even\n\n\nclass ParityTest(unittest.TestCase):\n"
                       "    def test_even(self):\n        self.assertTrue(is_even(4))\n\n"
                       "    def test_odd(self):\n        self.assertFalse(is_even(7))\n"),
}
_BUGGY = "def is_even(n):\n    return n % 2 == 0 or n > 5\n"
_FIXED = "def is_even(n):\n    return n % 2 == 0\n"


def _work_episode(edit_format: str) -> list[dict[str, Any]]:
    write = _edit if edit_format != "json" else (lambda path, text: _call("write_file", {"path": path, "content": text}))
    fix = (_replace("parity.py", "    return n % 2 == 0 or n > 5\n", "    return n % 2 == 0\n")
           if edit_format == "diff" else write("parity.py", _FIXED))
    fixed_note = ("Edited parity.py: 1 replacement, +1 -1 lines.\n--- a/parity.py\n+++ b/parity.py\n@@ -1,2 +1,2 @@\n"
                  " def is_even(n):\n-    return n % 2 == 0 or n > 5\n+    return n % 2 == 0"
                  if edit_format == "diff" else "Updated parity.py (38 bytes): +1 -1 lines.")
    return [
        {"role": "user", "content": "Implement is_even(n) in parity.py so that the tests in parity_test.py pass.\n"
                                    "Run the tests with: python3 -m unittest parity_test"},
        _call("read_file", {"path": "parity.py"}),
        {"role": "tool", "content": "parity.py lines 1-2 of 2:\ndef is_even(n):\n    pass\n"},
        write("parity.py", _BUGGY),
        {"role": "tool", "content": "Updated parity.py (47 bytes): +1 -1 lines."},
        _call("bash", {"command": "python3 -m unittest parity_test"}),
        {"role": "tool", "content": _PARITY_FAIL},
        fix,
        {"role": "tool", "content": fixed_note},
        _call("bash", {"command": "python3 -m unittest parity_test"}),
        {"role": "tool", "content": _PARITY_OK},
        {"role": "assistant", "content": "is_even now passes both tests."},
    ]


def example_messages(tool_names: Sequence[str], edit_format: str = "json", work: bool = False) -> list[dict[str, Any]]:
    """The example turns whose calls only use offered tools, as message dicts (``work``: the
    test-and-fix episode in JSON calls, where the text edit formats are not used).

    Assistant calls carry ``call = (name, arguments)``; tool messages carry ``name`` and
    ``tool_call_id`` (``example_<n>``) so they pair up like real calls. Text edits count as
    offered with the edit format (they run as write_file / edit_file).
    """
    out: list[dict[str, Any]] = []
    n = 0
    examples = EXAMPLES if edit_format == "json" and not work else [_work_episode(edit_format)]
    offered = set(tool_names) | ({"write_file", "edit_file"} if edit_format != "json" else set())
    for example in examples:
        if any("call" in m and m["call"][0] not in offered for m in example):
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


ASKS_FOR_CHANGES = re.compile(
    r"\b(create|write|implement|fix|add|change|update|edit|modify|make|refactor|rename|build|delete|remove|"
    r"replace|rewrite|complete|finish|save|generate)\b", re.IGNORECASE)
_CODE_BLOCK = re.compile(r"^\s*(`{3,}|~{3,})\s*([\w+#.-]*)[^\n]*\n(.*?)^\s*\1", re.MULTILINE | re.DOTALL)
_SHELL = ("sh", "bash", "shell", "console", "zsh", "text", "txt", "output")


def shows_code(reply: str) -> bool:
    """Whether a reply contains a fenced block of code (not a shell command or program output)."""
    return any(m.group(2).lower() not in _SHELL and m.group(3).strip() for m in _CODE_BLOCK.finditer(reply + "\n"))


def corrective_message(prompt: str, reply: str, changed: bool, edit_format: str) -> str | None:
    """The user turn that sends a final answer back when it did not do the work: it shows code
    without writing it, or the task asks for changes and nothing changed. None: the answer stands."""
    how = ("put the file's path on a line of its own right before the fenced block with the whole file"
           if edit_format != "json" else "call write_file with the path and the whole content")
    if shows_code(reply):
        return f"Nothing was written: your reply shows code, but no file changed. To write a file, {how}. Do it now."
    if not changed and ASKS_FOR_CHANGES.search(prompt):
        return f"Nothing was written: no file in the workspace changed yet. Do the task now; to write a file, {how}."
    return None
