"""Syntax check of a file the agent just wrote, reported in the tool's result.

A small model's file that does not parse (a duplicate ``const``, an unclosed bracket) fails
every check at once, and the checks run only when the agent says it is done; told right after
the write, with the line, it fixes the file in the next step (aider lints after each edit for
the same reason). Python and JSON are parsed in-process; JavaScript (``.js``/``.mjs``/``.cjs``
and an HTML file's inline scripts) with ``node --check`` when Node.js is installed (it parses
and never runs the code). Other files, or no Node.js, are not checked.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from html.parser import HTMLParser

NODE_TIMEOUT_S = 10
_MODULE = re.compile(r"^\s*(import\s|import\{|export\s)", re.MULTILINE)
_NODE_LOCATION = re.compile(r"^\[stdin\]:(\d+)\s*$", re.MULTILINE)
_NODE_ERROR = re.compile(r"^(\w*Error): (.+)$", re.MULTILINE)
_JS_TYPES = ("", "text/javascript", "application/javascript", "module")


def syntax_problem(name: str, text: str) -> str | None:
    """One line (plus the offending source line) naming the first syntax error in ``text``,
    the content of the file ``name``; None when it parses or its kind is not checked."""
    lower = name.lower()
    if lower.endswith(".py"):
        return _python(name, text)
    if lower.endswith(".json"):
        return _json(name, text)
    if lower.endswith((".js", ".mjs", ".cjs")):
        return _javascript(name, text, module=lower.endswith(".mjs") or bool(_MODULE.search(text)), offset=0)
    if lower.endswith((".html", ".htm")):
        for script, line, module in inline_scripts(text):
            problem = _javascript(name, script, module=module, offset=line - 1)
            if problem:
                return problem
    return None


def _with_line(name: str, lineno: int, text: str, message: str) -> str:
    lines = text.splitlines()
    source = lines[lineno - 1].strip() if 0 < lineno <= len(lines) else ""
    return f"{name}:{lineno}: {message}" + (f"\n    {source[:200]}" if source else "")


def _python(name: str, text: str) -> str | None:
    try:
        compile(text, name, "exec", dont_inherit=True)
    except SyntaxError as e:  # IndentationError and TabError included
        return _with_line(name, e.lineno or 0, text, f"{type(e).__name__}: {e.msg}")
    except ValueError as e:  # null bytes
        return f"{name}: {e}"
    return None


def _json(name: str, text: str) -> str | None:
    try:
        json.loads(text)
    except json.JSONDecodeError as e:
        return _with_line(name, e.lineno, text, f"invalid JSON: {e.msg} (column {e.colno})")
    return None


def _javascript(name: str, script: str, *, module: bool, offset: int) -> str | None:
    node = shutil.which("node") or shutil.which("nodejs")
    if node is None:
        return None
    cmd = [node, "--check", "-"] if not module else [node, "--input-type=module", "--check", "-"]
    try:
        done = subprocess.run(cmd, input=script, capture_output=True, text=True, timeout=NODE_TIMEOUT_S,
                              env={"PATH": "/usr/bin:/bin", "NODE_OPTIONS": ""})
    except (OSError, subprocess.TimeoutExpired):
        return None  # a checker that cannot run says nothing; the task's checks still judge
    if done.returncode == 0:
        return None
    where = _NODE_LOCATION.search(done.stderr)
    error = _NODE_ERROR.search(done.stderr)
    if where is None or error is None:
        return None
    lineno = int(where.group(1))
    return _with_line(name, lineno + offset, "\n" * offset + script, f"{error.group(1)}: {error.group(2)}")


class _Scripts(HTMLParser):
    def __init__(self) -> None:
        super().__init__(convert_charrefs=False)
        self.found: list[tuple[str, int, bool]] = []
        self._open: tuple[int, bool] | None = None
        self._parts: list[str] = []

    def handle_starttag(self, tag, attrs) -> None:
        if tag != "script":
            return
        a = {k.lower(): (v or "").strip().lower() for k, v in attrs}
        if "src" not in a and a.get("type", "") in _JS_TYPES:
            # the script's text starts on the start tag's line, after the tag
            self._open, self._parts = (self.getpos()[0], a.get("type") == "module"), []

    def handle_data(self, data) -> None:
        if self._open is not None:
            self._parts.append(data)

    def handle_endtag(self, tag) -> None:
        if tag == "script" and self._open is not None:
            self.found.append(("".join(self._parts), *self._open))
            self._open = None


def inline_scripts(html: str) -> list[tuple[str, int, bool]]:
    """Each inline JavaScript ``<script>`` of ``html``: (text, the line it starts on, is a module)."""
    parser = _Scripts()
    try:
        parser.feed(html)
        parser.close()
    except Exception:  # noqa: BLE001 (html.parser is lenient; a broken page is the checks' business)
        return []
    return parser.found
