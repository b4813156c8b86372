"""write_file: create or replace a text file atomically and report the diff."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

from tools.atomic import atomic_write_bytes
from tools.base import Tool, ToolError, ToolResult, Workspace
from tools.lint import syntax_problem
from tools.textio import cap_text, diff_stats, looks_binary, unified_diff

MAX_DIFF_SOURCE_BYTES = 2 * 1024 * 1024  # larger old/new files are written without a diff
MAX_DIFF_CHARS = 256 * 1024  # kept in data["diff"] for the UI


def run(ws: Workspace, args: dict[str, Any], cancel: threading.Event | None) -> ToolResult:
    path = ws.resolve(args["path"])
    name = ws.display(path)
    if path.is_dir():
        raise ToolError(f"{name} is a directory; give a file path")
    if path.exists() and not path.is_file():
        raise ToolError(f"{name} is not a regular file")
    new = args["content"].encode("utf-8")
    old = _previous_text(ws, path)
    created = not path.exists()
    atomic_write_bytes(ws, path, new)

    data: dict[str, Any] = {"path": name, "bytes_written": len(new), "created": created}
    if old is None or len(new) > MAX_DIFF_SOURCE_BYTES:
        data.update(diff="", diff_truncated=False, diff_skipped=True)
        summary = "" if created else " (previous content was binary or too large to diff)"
    else:
        diff, truncated = cap_text(unified_diff(old, args["content"], name), MAX_DIFF_CHARS)
        added, removed = diff_stats(diff)
        data.update(diff=diff, diff_truncated=truncated, lines_added=added, lines_removed=removed)
        summary = f": +{added} -{removed} lines" if diff else ": content unchanged"
    verb = "Created" if created else "Updated"
    message = f"{verb} {name} ({len(new)} bytes){summary}."
    problem = syntax_problem(name, args["content"])
    if problem:
        data["syntax_error"] = problem
        message += f"\nThe file does not parse: {problem}\nFix it."
    return ToolResult.success(message, **data)


def _previous_text(ws: Workspace, path: Path) -> str | None:
    """Old content to diff against: "" for a new file, None when binary or too large."""
    try:
        raw = ws.read_bytes(path, MAX_DIFF_SOURCE_BYTES + 1)
    except FileNotFoundError:
        return ""
    if len(raw) > MAX_DIFF_SOURCE_BYTES:
        return None
    if looks_binary(raw, complete=True):
        return None
    return raw.decode("utf-8")


TOOL = Tool(
    name="write_file",
    description=(
        "Create a file or replace its whole content (parent directories are created). "
        "Prefer edit_file to change part of an existing file."
    ),
    parameters={
        "type": "object",
        "properties": {
            "path": {"type": "string", "description": "File path relative to the workspace root."},
            "content": {"type": "string", "description": "The complete new file content."},
        },
        "required": ["path", "content"],
        "additionalProperties": False,
    },
    fn=run,
)
