"""Core types shared by every tool: results, tool definitions and the confined workspace.

``tools/`` is a leaf package (standard library only): agents call tools through
``ToolRegistry.run``, which never raises; tools report expected failures by raising
``ToolError`` and the registry turns that (and anything unexpected) into an error result.
"""

from __future__ import annotations

import errno
import os
import stat
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


_NOFOLLOW_DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


class Workspace:
    """A root directory that every tool path is confined to.

    ``resolve`` checks a path (symlinks followed) and ``open`` then opens the checked real
    path one component at a time from the root's directory descriptor with ``O_NOFOLLOW``,
    so a symlink swapped in between the check and the open makes the open fail instead of
    reaching outside. ``sandbox`` (a ``tools.sandbox.Sandbox`` or None) confines ``bash``.
    """

    def __init__(self, root: str | os.PathLike, sandbox: Any = None) -> None:
        real = Path(os.path.realpath(os.fspath(root)))
        if not real.is_dir():
            raise ValueError(f"workspace root {os.fspath(root)!r} is not a directory")
        self.root = real
        self.sandbox = sandbox

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
        # Compared by path components: a sibling such as "ws2" beside "ws" is not inside.
        return real == self.root or self.root in real.parents

    def open(self, real: Path, flags: int = os.O_RDONLY, mode: int = 0o666) -> int:
        """A file descriptor for ``real`` (from ``resolve``), opened without following any
        symlink on the way. ``flags`` may add O_CREAT etc.; raises ToolError on a swapped link."""
        parent, name = self.open_parent(real)
        try:
            return self._nofollow(lambda: os.open(name, flags | os.O_NOFOLLOW | os.O_CLOEXEC, mode,
                                                  dir_fd=parent), real)
        finally:
            os.close(parent)

    def read_bytes(self, real: Path, limit: int | None = None) -> bytes:
        """Up to ``limit`` bytes of the regular file ``real`` (opened without following links;
        O_NONBLOCK so a FIFO swapped in cannot block the call)."""
        fd = self.open(real, os.O_RDONLY | os.O_NONBLOCK)
        with os.fdopen(fd, "rb") as f:
            if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):
                raise ToolError(f"{self.display(real)} is not a regular file")
            return f.read() if limit is None else f.read(limit)

    def open_parent(self, real: Path, create: bool = False) -> tuple[int, str]:
        """(descriptor of ``real``'s directory, its last name); ``create`` makes missing
        directories on the way (each one inside the already-opened parent)."""
        try:
            rel = real.relative_to(self.root)
        except ValueError:
            raise ToolError(f"{real} is outside the workspace {self.root}") from None
        if not rel.parts:
            raise ToolError("the workspace root itself is a directory, not a file")
        fd = os.open(self.root, _NOFOLLOW_DIR)
        try:
            for part in rel.parts[:-1]:
                if create:
                    try:
                        os.mkdir(part, dir_fd=fd)
                    except FileExistsError:
                        pass
                nxt = self._nofollow(lambda part=part, fd=fd: os.open(part, _NOFOLLOW_DIR, dir_fd=fd), real)
                os.close(fd)
                fd = nxt
        except BaseException:
            os.close(fd)
            raise
        return fd, rel.parts[-1]

    def _nofollow(self, fn: Callable[[], int], real: Path) -> int:
        try:
            return fn()
        except OSError as exc:
            # O_NOFOLLOW on a symlink fails with ELOOP (EMLINK on some BSDs).
            if exc.errno in (errno.ELOOP, errno.EMLINK):
                raise ToolError(f"{self.display(real)} changed into a symlink while it was being opened; "
                                "nothing outside the workspace was touched") from None
            raise

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
