"""Agent tools: file reading/editing, search and shell, confined to one workspace directory
(the file tools by path checks and no-follow opens, ``bash`` by ``tools.sandbox``).

Standard library only; nothing here imports ``app``, ``agents`` or ``engine``.
"""

from __future__ import annotations

import os

from tools import bash, edit_file, grep, list_dir, read_file, write_file
from tools.base import Tool, ToolError, ToolResult, Workspace
from tools.registry import ToolRegistry
from tools.sandbox import Sandbox

_MODULES = (read_file, write_file, edit_file, list_dir, grep, bash)
TOOL_NAMES: tuple[str, ...] = tuple(m.TOOL.name for m in _MODULES)


def default_registry(workspace_root: str | os.PathLike, sandbox: Sandbox | None = None, *,
                     unconfined: bool = False) -> ToolRegistry:
    """All six tools bound to ``workspace_root`` (which must be an existing directory).

    ``bash`` runs inside ``sandbox``; without one, inside a ``Sandbox()`` with the default
    policy, which refuses to run commands where no sandbox works (instead of silently running
    them unconfined). Running ``bash`` with no sandbox at all takes ``unconfined=True`` -- the
    caller's explicit consent (tests of the tool's own mechanics, a human approving each call).
    Agents pass ``agents.checks.agent_sandbox()``."""
    if unconfined:
        if sandbox is not None:
            raise ValueError("default_registry: pass a sandbox or unconfined=True, not both")
        box = None
    else:
        box = sandbox if sandbox is not None else Sandbox()
    return ToolRegistry(Workspace(workspace_root, box), [m.TOOL for m in _MODULES])


__all__ = ["TOOL_NAMES", "Tool", "ToolError", "ToolRegistry", "ToolResult", "Workspace", "default_registry"]
