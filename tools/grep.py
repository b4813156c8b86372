"""grep: regex search over workspace files, with line numbers and a result cap."""

from __future__ import annotations

import fnmatch
import io
import os
import re
import stat
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any, BinaryIO

from tools.base import Tool, ToolError, ToolResult, Workspace
from tools.list_dir import NO_EXPAND, SKIP_DIRS
from tools.textio import SNIFF_BYTES, looks_binary

MAX_MATCHES = 200
MAX_LINE_CHARS = 300
MAX_OUTPUT_CHARS = 20_000  # long paths x 200 matches must still fit the model's context
MAX_FILE_BYTES = 8 * 1024 * 1024  # larger files are skipped (and counted)
MAX_FILES = 20_000


def run(ws: Workspace, args: dict[str, Any], cancel: threading.Event | None) -> ToolResult:
    flags = re.IGNORECASE if args["case_insensitive"] else 0
    try:
        regex = re.compile(args["pattern"], flags)
    except re.error as exc:
        raise ToolError(f"invalid regular expression {args['pattern']!r}: {exc} (Python re syntax)") from None
    top = ws.resolve(args["path"])
    name = ws.display(top)
    if not top.exists():
        raise ToolError(f"{name} does not exist")
    globs = _expand_braces(args["include"]) if args.get("include") else []

    matches: list[str] = []
    stats = {"files_searched": 0, "files_with_matches": 0, "skipped_binary": 0, "skipped_large": 0}
    capped = False
    for path in _candidates(ws, top, globs):
        if cancel is not None and cancel.is_set():
            raise ToolError("grep was cancelled")
        if stats["files_searched"] >= MAX_FILES:
            capped = True
            break
        try:  # opened without following links: a link swapped in since the walk is skipped
            f = os.fdopen(ws.open(path, os.O_RDONLY | os.O_NONBLOCK), "rb")
        except (OSError, ToolError):
            stats["skipped_binary"] += 1
            continue
        with f:
            reason = _skip_reason(f)
            if reason:
                stats[reason] += 1
                continue
            stats["files_searched"] += 1
            found = _search_file(f, ws.display(path), regex, matches)
        stats["files_with_matches"] += found > 0
        if len(matches) >= MAX_MATCHES:
            capped = True
            break

    kept = _fit(matches, MAX_OUTPUT_CHARS)
    if kept < len(matches):
        matches, capped = matches[:kept], True
    files = stats["files_with_matches"]
    data = {"path": name, "matches": len(matches), "truncated": capped, **stats}
    skipped = ""
    if stats["skipped_binary"] or stats["skipped_large"]:
        skipped = f"; skipped {stats['skipped_binary']} binary and {stats['skipped_large']} files over {MAX_FILE_BYTES // 2**20} MB"
    if not matches:
        return ToolResult.success(
            f"No matches for /{args['pattern']}/ in {name} ({stats['files_searched']} files searched{skipped}).", **data
        )
    header = f"{len(matches)} matching lines in {files} files ({stats['files_searched']} files searched{skipped})"
    if capped:
        header += f"; stopped at the cap ({MAX_MATCHES} matches / {MAX_OUTPUT_CHARS} characters), narrow the pattern, path or include"
    return ToolResult.success(header + "\n" + "\n".join(matches), **data)


def _fit(lines: list[str], budget: int) -> int:
    """How many leading lines fit in ``budget`` characters (newlines included)."""
    used = 0
    for i, line in enumerate(lines):
        used += len(line) + 1
        if used > budget:
            return i
    return len(lines)


def _candidates(ws: Workspace, top: Path, globs: list[str]) -> Iterator[Path]:
    if top.is_file():
        yield top  # an explicit file is searched whatever the include glob says
        return
    for dirpath, dirnames, filenames in os.walk(top):  # never follows directory symlinks
        dirnames[:] = sorted(d for d in dirnames if d not in SKIP_DIRS and d not in NO_EXPAND)
        for filename in sorted(filenames):
            path = Path(dirpath) / filename
            if globs and not _glob_match(ws.display(path), filename, globs):
                continue
            real = Path(os.path.realpath(path))
            if ws.contains(real):  # a symlinked file may point outside the workspace
                yield real


def _glob_match(rel: str, filename: str, globs: list[str]) -> bool:
    # "*.py" matches by file name; a glob with "/" (e.g. "src/*.py") matches the relative path.
    return any(fnmatch.fnmatchcase(rel if "/" in g else filename, g) for g in globs)


def _expand_braces(glob: str) -> list[str]:
    """``*.{py,md}`` -> ``["*.py", "*.md"]`` (one level, as shells and ripgrep allow)."""
    m = re.search(r"\{([^{}]*)\}", glob)
    if not m:
        return [glob]
    return [g for alt in m.group(1).split(",") for g in _expand_braces(glob[: m.start()] + alt + glob[m.end() :])]


def _skip_reason(f: BinaryIO) -> str | None:
    try:
        st = os.fstat(f.fileno())
        if not stat.S_ISREG(st.st_mode):  # reading a FIFO would block
            return "skipped_binary"
        if st.st_size > MAX_FILE_BYTES:
            return "skipped_large"
        sample = f.read(SNIFF_BYTES)
    except OSError:
        return "skipped_binary"
    if looks_binary(sample, complete=len(sample) == st.st_size):
        return "skipped_binary"
    return None


def _search_file(f: BinaryIO, rel: str, regex: re.Pattern[str], out: list[str]) -> int:
    """Append ``rel:line:text`` per matching line until the cap; return how many were added."""
    found = 0
    f.seek(0)
    with io.TextIOWrapper(f, encoding="utf-8", errors="replace", newline="") as text:
        for number, raw in enumerate(text, 1):
            line = raw.rstrip("\r\n")  # so "$" works on CRLF files too
            m = regex.search(line)
            if not m:
                continue
            out.append(f"{rel}:{number}:{_clip(line, m.start())}")
            found += 1
            if len(out) >= MAX_MATCHES:
                break
    return found


def _clip(line: str, at: int) -> str:
    if len(line) <= MAX_LINE_CHARS:
        return line
    start = 0 if at < MAX_LINE_CHARS - 60 else at - 60  # keep the match visible
    return ("…" if start else "") + line[start : start + MAX_LINE_CHARS] + "…"


TOOL = Tool(
    name="grep",
    description=(
        "Search files for a regular expression (Python re syntax). Returns path:line:text for "
        f"up to {MAX_MATCHES} matching lines; binary files, .git, node_modules and virtualenvs are skipped."
    ),
    parameters={
        "type": "object",
        "properties": {
            "pattern": {"type": "string", "description": "Regular expression to search for."},
            "path": {"type": "string", "default": ".", "description": "File or directory to search (default: whole workspace)."},
            "include": {"type": "string", "description": "Only search files matching this glob, e.g. \"*.py\" or \"*.{js,ts}\"."},
            "case_insensitive": {"type": "boolean", "default": False, "description": "Ignore letter case."},
        },
        "required": ["pattern"],
        "additionalProperties": False,
    },
    fn=run,
)
