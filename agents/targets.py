"""Which workspace files a task is about, and which writes to them the agent refuses.

A task prompt names its files (``named_in``: where a fenced block with no path line may go); a
task's ``protected`` globs (its tests) may not be written (``protected``); a block with no path
line is written over its inferred file only when it looks like the whole file (``not_whole``:
an excerpt in an explanation would otherwise replace the solution).
"""

from __future__ import annotations

import fnmatch
import re

from agents.edits import PATH_TOKEN
from agents.protocol import ToolCall
from tools.base import Workspace


class TaskFiles:
    """A workspace's task files and protected paths, for one agent session."""

    def __init__(self, workspace: Workspace, protected: tuple[str, ...] = ()):
        self.workspace = workspace
        self.protected_globs = tuple(protected)

    def named_in(self, prompt: str) -> list[str]:
        """Existing, unprotected workspace files the task prompt names: where a fenced block
        with no path line may go (``AgentSession.infer_path``)."""
        ws = self.workspace
        out = []
        for token in dict.fromkeys(PATH_TOKEN.findall(prompt)):
            try:
                real = ws.resolve(token)
            except Exception:  # noqa: BLE001 (outside the workspace or malformed: not a target)
                continue
            name = ws.display(real)
            if real.is_file() and not self.protected_path(name):
                out.append(name)
        return out

    def not_whole(self, call: ToolCall) -> str | None:
        """Why a block with no path line is not written over its inferred file (it does not look
        like the whole file: an excerpt in an explanation), or None."""
        path = call.arguments["path"]
        try:
            old = self.workspace.resolve(path).read_text(encoding="utf-8", errors="replace")
        except OSError:
            return None
        new = call.arguments["content"]
        if path.endswith(".py"):
            missing = [n for n in _top_level_names(old) if n not in _top_level_names(new)]
            if not missing:
                return None
            what = f"it lacks {', '.join(missing[:5])} of {path}"
        elif len(new.splitlines()) * 2 >= len(old.splitlines()):
            return None
        else:
            what = f"it is much shorter than {path}"
        return (f"Not written: the code block has no path line and does not look like the whole file ({what}). "
                f"To write {path}, put its path on the line before the block and give the whole file.")

    def protected(self, call: ToolCall) -> str | None:
        """Why a write to a protected path (a task's tests) is refused, or None."""
        if call.name not in ("write_file", "edit_file"):
            return None
        return self.protected_path(call.arguments.get("path", ""))

    def protected_path(self, path: str) -> str | None:
        if not self.protected_globs:
            return None
        try:
            rel = self.workspace.display(self.workspace.resolve(path))
        except Exception:  # noqa: BLE001 (an invalid path: the tool itself says why)
            return None
        if any(fnmatch.fnmatch(rel, pattern) for pattern in self.protected_globs):
            return (f"{rel} is protected by the task (it holds the tests): it cannot be changed. "
                    "Change the solution instead.")
        return None


_TOP_LEVEL = re.compile(r"^(?:async\s+)?(?:def|class)\s+(\w+)", re.MULTILINE)


def _top_level_names(source: str) -> list[str]:
    """Top-level function and class names of Python source (by line, so broken code still counts)."""
    return list(dict.fromkeys(_TOP_LEVEL.findall(source)))
