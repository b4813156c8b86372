"""edit_file: replace an exact snippet in a text file; on a miss, point at the closest text."""

from __future__ import annotations

import difflib
import heapq
import stat
import threading
from pathlib import Path
from typing import Any

from tools.atomic import atomic_write_bytes
from tools.base import Tool, ToolError, ToolResult, Workspace
from tools.lint import syntax_problem
from tools.textio import cap_text, diff_stats, unified_diff

MAX_EDIT_BYTES = 8 * 1024 * 1024
MAX_DIFF_CHARS = 8_000  # in the model's content; data["diff"] keeps more
MAX_DATA_DIFF_CHARS = 256 * 1024
NEAR_MIN_RATIO = 0.6
NEAR_LIMIT = 3
NEAR_SNIPPET_CHARS = 1_500
_CANDIDATES = 60  # anchored windows scored with difflib


def run(ws: Workspace, args: dict[str, Any], cancel: threading.Event | None) -> ToolResult:
    path = ws.resolve(args["path"])
    name = ws.display(path)
    old_text, new_text = args["old_text"], args["new_text"]
    if not old_text:
        raise ToolError("old_text is empty; give the exact text to replace (use write_file for new files)")
    if old_text == new_text:
        raise ToolError("old_text and new_text are identical; nothing to change")
    text = _read_text(ws, path, name)

    count = text.count(old_text)
    if count == 0 and "\r\n" in text and "\r\n" not in old_text:
        # The model almost always writes "\n"; match a CRLF file in its own line endings.
        old_text, new_text = old_text.replace("\n", "\r\n"), new_text.replace("\n", "\r\n")
        count = text.count(old_text)
    if count == 0:
        raise ToolError(_no_match_message(text, old_text, name), matches=0)
    if count > 1 and not args["replace_all"]:
        where = ", ".join(str(n) for n in _match_lines(text, old_text)[:20])
        raise ToolError(
            f"old_text matches {count} times in {name} (at lines {where}); include more "
            "surrounding lines to make it unique, or set replace_all=true to replace every one",
            matches=count,
        )

    updated = text.replace(old_text, new_text) if args["replace_all"] else text.replace(old_text, new_text, 1)
    atomic_write_bytes(ws, path, updated.encode("utf-8"))
    diff = unified_diff(text, updated, name)
    added, removed = diff_stats(diff)
    shown, _ = cap_text(diff, MAX_DIFF_CHARS)
    kept, truncated = cap_text(diff, MAX_DATA_DIFF_CHARS)
    times = f"{count} replacements" if count > 1 else "1 replacement"
    message = f"Edited {name}: {times}, +{added} -{removed} lines.\n{shown.rstrip()}"
    extra = {}
    problem = syntax_problem(name, updated)
    if problem:
        extra["syntax_error"] = problem
        message += f"\nThe file does not parse now: {problem}\nFix it."
    return ToolResult.success(
        message, path=name, replacements=count, diff=kept, diff_truncated=truncated,
        lines_added=added, lines_removed=removed, **extra,
    )


def _read_text(ws: Workspace, path: Path, name: str) -> str:
    try:
        st = path.stat()
    except FileNotFoundError:
        raise ToolError(f"{name} does not exist; use write_file to create it") from None
    if not stat.S_ISREG(st.st_mode):
        raise ToolError(f"{name} is not a regular file")
    if st.st_size > MAX_EDIT_BYTES:
        raise ToolError(f"{name} is {st.st_size} bytes; edit_file handles files up to {MAX_EDIT_BYTES} bytes")
    raw = ws.read_bytes(path, MAX_EDIT_BYTES + 1)
    if len(raw) > MAX_EDIT_BYTES:  # it grew since the stat
        raise ToolError(f"{name} is larger than {MAX_EDIT_BYTES} bytes; edit_file cannot edit it")
    if b"\x00" in raw:
        raise ToolError(f"{name} is a binary file; edit_file only edits UTF-8 text")
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        raise ToolError(f"{name} is not UTF-8 text; edit_file only edits UTF-8 text") from None


def _match_lines(text: str, needle: str) -> list[int]:
    lines, pos = [], text.find(needle)
    while pos != -1:
        lines.append(text.count("\n", 0, pos) + 1)
        pos = text.find(needle, pos + len(needle))
    return lines


def _no_match_message(text: str, old_text: str, name: str) -> str:
    near = near_matches(text, old_text)
    if not near:
        return (
            f"old_text was not found in {name} and nothing similar exists; "
            "read_file it to see the current content"
        )
    parts = [f"old_text was not found in {name}. Closest text in the file:"]
    for first, last, ratio, snippet in near:
        hint = ""
        if _squash(snippet) == _squash(old_text):
            hint = ", differs only in whitespace/indentation"
        parts.append(f"--- lines {first}-{last} (similarity {ratio:.0%}{hint}):\n{snippet}")
    parts.append("Copy the exact text (including indentation) into old_text and retry.")
    return "\n".join(parts)


def near_matches(text: str, needle: str) -> list[tuple[int, int, float, str]]:
    """Up to NEAR_LIMIT windows of lines most similar to ``needle``: (first, last, ratio, text).

    difflib on every window of a big file is slow, so windows are first anchored on file lines
    sharing the most character trigrams with one of the needle's longest lines; only those
    candidates are scored with difflib.
    """
    lines = text.splitlines()
    want = needle.strip("\r\n").splitlines() or [needle]
    width = min(len(want), len(lines))
    anchors = sorted(
        {(i, s.strip()) for i, s in enumerate(want) if s.strip()}, key=lambda a: -len(a[1])
    )[:3]
    grams = [(offset, _trigrams(anchor)) for offset, anchor in anchors]
    best: list[tuple[float, int]] = []  # min-heap of (trigram similarity, window start)
    for j, line in enumerate(lines):
        line_grams = _trigrams(line.strip())
        for offset, anchor_grams in grams:
            union = len(anchor_grams | line_grams)
            score = len(anchor_grams & line_grams) / union if union else 0.0
            if score > 0:
                item = (score, max(0, min(j - offset, len(lines) - width)))
                if len(best) < _CANDIDATES:
                    heapq.heappush(best, item)
                elif item > best[0]:
                    heapq.heapreplace(best, item)

    matcher = difflib.SequenceMatcher(autojunk=False)
    matcher.set_seq2("\n".join(want))
    scored = []
    for start in {start for _, start in best}:
        window = "\n".join(lines[start : start + width])
        matcher.set_seq1(window)
        ratio = matcher.ratio()
        if ratio >= NEAR_MIN_RATIO:
            scored.append((ratio, start, window))
    scored.sort(key=lambda s: (-s[0], s[1]))
    picked: list[tuple[int, int, float, str]] = []
    for ratio, start, window in scored:
        if any(abs(start - (p[0] - 1)) < width for p in picked):  # skip overlapping windows
            continue
        snippet, _ = cap_text(window, NEAR_SNIPPET_CHARS)
        picked.append((start + 1, start + width, ratio, snippet))
        if len(picked) == NEAR_LIMIT:
            break
    return picked


def _trigrams(text: str) -> set[str]:
    return {text[i : i + 3] for i in range(len(text) - 2)} if len(text) > 2 else {text}


def _squash(text: str) -> str:
    return " ".join(text.split())


TOOL = Tool(
    name="edit_file",
    description=(
        "Replace old_text with new_text in a file. old_text must match the file exactly "
        "(including indentation) and exactly once unless replace_all is true; include enough "
        "surrounding lines to make it unique."
    ),
    parameters={
        "type": "object",
        "properties": {
            "path": {"type": "string", "description": "File path relative to the workspace root."},
            "old_text": {"type": "string", "description": "Exact text currently in the file."},
            "new_text": {"type": "string", "description": "Text to put in its place."},
            "replace_all": {
                "type": "boolean",
                "default": False,
                "description": "Replace every occurrence instead of requiring exactly one.",
            },
        },
        "required": ["path", "old_text", "new_text"],
        "additionalProperties": False,
    },
    fn=run,
)
