"""list_dir: entries of a directory (optionally a few levels deep) with type and size."""

from __future__ import annotations

import os
import stat
import threading
from pathlib import Path
from typing import Any

from tools.base import Tool, ToolError, ToolResult, Workspace

MAX_ENTRIES = 500
MAX_DEPTH = 5
# Listed but never expanded: version control internals and bulky generated trees.
SKIP_DIRS = {".git"}
NO_EXPAND = {".hg", ".svn", "node_modules", "__pycache__", ".venv", "venv", ".mypy_cache",
             ".pytest_cache", ".ruff_cache", ".tox"}


def run(ws: Workspace, args: dict[str, Any], cancel: threading.Event | None) -> ToolResult:
    top = ws.resolve(args["path"])
    name = ws.display(top)
    if not top.exists():
        raise ToolError(f"{name} does not exist")
    if not top.is_dir():
        raise ToolError(f"{name} is not a directory; use read_file to read a file")
    depth = args["depth"]

    entries: list[dict[str, Any]] = []
    capped = False
    level = [top]
    for current_depth in range(1, depth + 1):  # breadth-first: the cap drops deep entries first
        next_level: list[Path] = []
        for directory in level:
            if cancel is not None and cancel.is_set():
                raise ToolError("list_dir was cancelled")
            for entry in _scan(directory):
                if len(entries) >= MAX_ENTRIES:
                    capped = True
                    break
                info = _describe(ws, entry)
                entries.append(info)
                if info["type"] == "dir" and current_depth < depth and entry.name not in NO_EXPAND:
                    next_level.append(Path(entry.path))
            if capped:
                break
        if capped or not next_level:
            break
        level = next_level

    entries.sort(key=lambda e: e["path"])
    lines = [_format(e) for e in entries]
    header = f"{name}: {len(entries)} entries" + (f" (depth {depth})" if depth > 1 else "")
    if capped:
        header += f"; capped at {MAX_ENTRIES}, list a subdirectory or use a smaller depth for the rest"
    body = "\n".join(lines) if lines else "(empty directory)"
    return ToolResult.success(f"{header}\n{body}", path=name, entries=entries, truncated=capped)


def _scan(directory: Path) -> list[os.DirEntry]:
    try:
        with os.scandir(directory) as it:
            return sorted((e for e in it if e.name not in SKIP_DIRS), key=lambda e: e.name)
    except (PermissionError, FileNotFoundError):
        return []


def _describe(ws: Workspace, entry: os.DirEntry) -> dict[str, Any]:
    rel = ws.display(Path(entry.path))
    try:
        st = entry.stat(follow_symlinks=False)
    except OSError:
        return {"path": rel, "type": "other", "size": None}
    if stat.S_ISLNK(st.st_mode):  # never followed: the target may be outside the workspace
        return {"path": rel, "type": "symlink", "size": None, "target": _readlink(entry.path)}
    if stat.S_ISDIR(st.st_mode):
        return {"path": rel, "type": "dir", "size": None}
    if stat.S_ISREG(st.st_mode):
        return {"path": rel, "type": "file", "size": st.st_size}
    return {"path": rel, "type": "other", "size": None}


def _readlink(path: str) -> str:
    try:
        return os.readlink(path)
    except OSError:
        return "?"


def _format(entry: dict[str, Any]) -> str:
    kind = entry["type"]
    if kind == "dir":
        return f"{entry['path']}/"
    if kind == "file":
        return f"{entry['path']}  ({_human(entry['size'])})"
    if kind == "symlink":
        return f"{entry['path']} -> {entry['target']}"
    return f"{entry['path']}  (special file)"


def _human(size: int) -> str:
    if size < 1024:
        return f"{size} B"
    value = float(size)
    for unit in ("KB", "MB", "GB"):
        value /= 1024
        if value < 1024 or unit == "GB":
            break
    return f"{value:.1f} {unit}"


TOOL = Tool(
    name="list_dir",
    description=(
        "List a directory in the workspace: subdirectories end with '/', files show their size. "
        "depth > 1 also lists subdirectories (up to 500 entries; .git is skipped)."
    ),
    parameters={
        "type": "object",
        "properties": {
            "path": {"type": "string", "default": ".", "description": "Directory relative to the workspace root."},
            "depth": {
                "type": "integer", "minimum": 1, "maximum": MAX_DEPTH, "default": 1,
                "description": "How many levels to list (1 = only this directory).",
            },
        },
        "required": [],
        "additionalProperties": False,
    },
    fn=run,
)
