"""The set of tools an agent may call, bound to one workspace. ``run`` never raises."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterable
from typing import Any

from tools.base import Tool, ToolError, ToolResult, Workspace
from tools.schema import ArgumentError, validate_args
from tools.textio import cap_text

log = logging.getLogger(__name__)

# Safety net above every tool's own caps, so one misbehaving tool cannot flood the context.
MAX_CONTENT_CHARS = 48_000


class ToolRegistry:
    def __init__(self, workspace: Workspace, tools: Iterable[Tool] = ()) -> None:
        self.workspace = workspace
        self._tools: dict[str, Tool] = {}
        for tool in tools:
            self.register(tool)

    def register(self, tool: Tool) -> None:
        if tool.name in self._tools:
            raise ValueError(f"tool {tool.name!r} is already registered")
        self._tools[tool.name] = tool

    def names(self) -> list[str]:
        return list(self._tools)

    def get(self, name: str) -> Tool | None:
        return self._tools.get(name)

    def schemas(self) -> list[dict[str, Any]]:
        """Tool definitions as OpenAI/Hermes chat templates expect them (``tools=[...]``)."""
        return [tool.schema() for tool in self._tools.values()]

    def run(
        self, name: str, args: dict[str, Any] | None, cancel: threading.Event | None = None
    ) -> ToolResult:
        """Validate ``args`` and run tool ``name``; every failure comes back as an error result.

        ``args`` is whatever the model produced (a non-dict is reported, not raised). ``cancel``
        is polled by long-running tools (bash, grep, list_dir) to stop early.
        """
        started = time.monotonic()
        result = self._run(name, args, cancel)
        result.data.setdefault("tool", name)
        result.data.setdefault("duration_ms", round((time.monotonic() - started) * 1000))
        capped, truncated = cap_text(result.content, MAX_CONTENT_CHARS)
        if truncated:
            result.content = capped
            result.data["content_truncated"] = True
        return result

    def _run(self, name: str, args: dict[str, Any] | None, cancel: threading.Event | None) -> ToolResult:
        tool = self._tools.get(name)
        if tool is None:
            known = ", ".join(self._tools) or "none"
            return ToolResult.failure(f"unknown tool {name!r}; available tools: {known}")
        try:
            clean = validate_args(name, tool.parameters, args)
        except ArgumentError as exc:
            return ToolResult.failure(str(exc))
        if cancel is not None and cancel.is_set():
            return ToolResult.failure(f"{name} was cancelled before it started", cancelled=True)
        try:
            return tool.fn(self.workspace, clean, cancel)
        except ToolError as exc:
            return ToolResult.failure(exc.message, **exc.data)
        except OSError as exc:  # permission denied, disk full... one line for the model
            where = f" ({exc.filename})" if exc.filename else ""
            return ToolResult.failure(f"{name}: {exc.strerror or exc}{where}")
        except Exception as exc:  # a tool bug must not kill the agent loop
            log.exception("tool %s failed", name)
            return ToolResult.failure(f"{name} failed unexpectedly: {type(exc).__name__}: {exc}")
