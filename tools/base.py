"""Core types shared by every tool: results, tool definitions and the confined workspace.

``tools/`` is a leaf package (standard library only): agents call tools through
``ToolRegistry.run``, which never raises; tools report expected failures by raising
``ToolError`` and the registry turns that (and anything unexpected) into an error result.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tools.schema import check_schema


class ToolError(Exception):
    """An expected failure (bad path, no match...) shown to the model as one readable message."""

    def __init__(self, message: str, **data: Any) -> None:
        super().__init__(message)
        self.message = message
        self.data = data


@dataclass
class ToolResult:
    """What a tool call produced.

    ``content`` is the text the model sees (already capped); ``data`` holds structured
    details for the UI and logs (paths, exit codes, truncation flags, durations...).
    """

    ok: bool
    content: str
    data: dict[str, Any] = field(default_factory=dict)
    error: str | None = None

    @classmethod
    def success(cls, content: str, **data: Any) -> ToolResult:
        return cls(ok=True, content=content, data=data)

    @classmethod
    def failure(cls, error: str, **data: Any) -> ToolResult:
        return cls(ok=False, content=f"Error: {error}", data=data, error=error)


class Workspace:
    """A root directory that every tool path is confined to."""

    def __init__(self, root: str | os.PathLike) -> None:
        real = Path(os.path.realpath(os.fspath(root)))
        if not real.is_dir():
            raise ValueError(f"workspace root {os.fspath(root)!r} is not a directory")
        self.root = real

    def resolve(self, path: str) -> Path:
        """Return the real path for ``path``, refusing anything that lands outside the root.

        Relative paths join the root; ``~`` means the root (bash runs with HOME set to it).
        Symlinks anywhere along the path are followed before the check, so a link pointing
        out of the workspace is refused just like ``..`` or an absolute outside path.
        Raises ``ToolError``; ``ToolRegistry.run`` turns it into an error result.
        """
        if not isinstance(path, str) or not path.strip():
            raise ToolError("path is empty; give a path relative to the workspace root")
        if "\x00" in path:
            raise ToolError("path contains a NUL byte")
        if path == "~" or path.startswith("~/"):
            path = "." + path[1:]
        candidate = Path(path) if os.path.isabs(path) else self.root / path
        try:
            real = Path(os.path.realpath(candidate))
        except (OSError, RuntimeError, ValueError) as exc:  # symlink loops, odd names
            raise ToolError(f"cannot resolve path {path!r}: {exc}") from exc
        if self.contains(real):
            return real
        lexical = Path(os.path.normpath(candidate))
        if self.contains(lexical):
            raise ToolError(
                f"path {path!r} goes through a symlink that points outside the workspace "
                f"({real}); only files under {self.root} are allowed"
            )
        raise ToolError(f"path {path!r} is outside the workspace; only files under {self.root} are allowed")

    def contains(self, real: Path) -> bool:
        return real == self.root or self.root in real.parents

    def display(self, real: Path) -> str:
        """The path as the model should write it next time: relative to the root."""
        try:
            rel = real.relative_to(self.root)
        except ValueError:
            return str(real)
        return rel.as_posix() or "."


ToolFn = Callable[[Workspace, dict[str, Any], "threading.Event | None"], ToolResult]


@dataclass(frozen=True)
class Tool:
    """A named operation with a JSON-schema for its arguments.

    ``fn(workspace, args, cancel)`` receives arguments already validated against
    ``parameters`` with defaults filled in.
    """

    name: str
    description: str
    parameters: dict[str, Any]
    fn: ToolFn

    def __post_init__(self) -> None:
        check_schema(self.name, self.parameters)

    def schema(self) -> dict[str, Any]:
        """The OpenAI/Hermes function-calling form of this tool."""
        return {
            "type": "function",
            "function": {
                "name": self.name,
                "description": self.description,
                "parameters": self.parameters,
            },
        }
