"""read_file: a window of a text file's lines, capped so a huge file never floods the context."""

from __future__ import annotations

import os
import stat
import threading
from pathlib import Path
from typing import Any, BinaryIO

from tools.base import Tool, ToolError, ToolResult, Workspace
from tools.textio import SNIFF_BYTES, guess_type, looks_binary

MAX_WINDOW_BYTES = 256 * 1024  # bytes read for the returned window
MAX_CHARS = 20_000  # characters returned to the model
_SKIP_CHUNK = 1 << 20  # lines before start_line are skipped in bounded blocks


def run(ws: Workspace, args: dict[str, Any], cancel: threading.Event | None) -> ToolResult:
    path = ws.resolve(args["path"])
    name = ws.display(path)
    start = args.get("start_line") or 1
    end = args.get("end_line")
    if end is not None and end < start:
        raise ToolError(f"end_line ({end}) is before start_line ({start})")
    size = _regular_file_size(path, name)
    with os.fdopen(ws.open(path, os.O_RDONLY | os.O_NONBLOCK), "rb") as f:
        if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):  # swapped since the check above
            raise ToolError(f"{name} is not a regular file")
        sample = f.read(SNIFF_BYTES)
        if looks_binary(sample, complete=len(sample) == size):
            what = guess_type(sample, path)
            return ToolResult.success(
                f"{name}: binary file, {size} bytes, {what}; not shown as text.",
                path=name, binary=True, size_bytes=size, type_guess=what,
            )
        f.seek(0)
        return _read_window(f, name, size, start, end)


def _regular_file_size(path: Path, name: str) -> int:
    try:
        st = path.stat()
    except FileNotFoundError:
        raise ToolError(f"{name} does not exist") from None
    if stat.S_ISDIR(st.st_mode):
        raise ToolError(f"{name} is a directory; use list_dir to see its entries")
    if not stat.S_ISREG(st.st_mode):  # a FIFO or device would block or never end
        raise ToolError(f"{name} is not a regular file")
    return st.st_size


def _read_window(f: BinaryIO, name: str, size: int, start: int, end: int | None) -> ToolResult:
    line_no = _skip_to(f, name, start)
    lines: list[str] = []
    chars = used = 0
    cut = pending = False
    while (end is None or line_no <= end) and used < MAX_WINDOW_BYTES:
        raw = f.readline(MAX_WINDOW_BYTES - used)
        if not raw:
            break
        used += len(raw)
        text = raw.decode("utf-8", errors="replace")
        cut = not raw.endswith(b"\n") and bool(f.peek(1))  # byte budget ended mid-line
        if chars + len(text) > MAX_CHARS:
            if lines:  # this line goes to the next call
                pending, cut = True, False
                break
            text, cut = text[:MAX_CHARS], True  # one giant line: show its start
        lines.append(text)
        chars += len(text)
        line_no += 1
        if cut:
            break

    data: dict[str, Any] = {"path": name, "size_bytes": size, "binary": False, "truncated": False}
    if not lines:
        return ToolResult.success(f"{name} is empty (0 bytes).", **data)
    last = start + len(lines) - 1
    data.update(start_line=start, end_line=last)
    more = cut or pending or (bool(f.peek(1)) and (end is None or last < end))
    header = f"{name} lines {start}-{last}"
    note = ""
    if not more and not f.peek(1):
        header += f" of {last}"
        data["total_lines"] = last
    if more:
        data.update(truncated=True, next_start_line=last + 1)
        note = f"\n[output capped at {MAX_CHARS} characters of a {size}-byte file; read more with start_line={last + 1}]"
    if cut:
        note = (
            f"\n[line {last} is too long and was cut; use bash (e.g. cut -c or head -c) for the rest"
            f" of it, or start_line={last + 1} for the following lines]"
        )
    body = "".join(lines)
    if not body.endswith("\n"):
        body += "\n"
    return ToolResult.success(f"{header}:\n{body}{note}", **data)


def _skip_to(f: BinaryIO, name: str, start: int) -> int:
    """Move ``f`` to the beginning of line ``start``, scanning fixed-size blocks for newlines."""
    need = start - 1  # newlines to pass
    seen = pos = 0
    last = b""
    while seen < need:
        block = f.read(_SKIP_CHUNK)
        if not block:
            break
        count = block.count(b"\n")
        if seen + count >= need:
            idx = -1
            for _ in range(need - seen):
                idx = block.index(b"\n", idx + 1)
            f.seek(pos + idx + 1)
            seen = need
            break
        seen += count
        pos += len(block)
        last = block[-1:]
    if seen < need or (start > 1 and not f.peek(1)):
        total = seen + (last not in (b"", b"\n"))  # a final line without newline counts
        raise ToolError(f"start_line {start} is past the end of {name}, which has {total} lines")
    return start


TOOL = Tool(
    name="read_file",
    description=(
        "Read a text file in the workspace. Returns up to ~20000 characters; for long files "
        "pass start_line/end_line (1-based, inclusive) to read further. Binary files are "
        "only summarised."
    ),
    parameters={
        "type": "object",
        "properties": {
            "path": {"type": "string", "description": "File path relative to the workspace root."},
            "start_line": {"type": "integer", "minimum": 1, "description": "First line to return (1-based)."},
            "end_line": {"type": "integer", "minimum": 1, "description": "Last line to return (inclusive)."},
        },
        "required": ["path"],
        "additionalProperties": False,
    },
    fn=run,
)
