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


def default_registry(workspace_root: str | os.PathLike, sandbox: Sandbox | None = None) -> ToolRegistry:
    """All six tools bound to ``workspace_root`` (which must be an existing directory);
    ``bash`` runs inside ``sandbox`` when it is given and active (agents always pass one)."""
    return ToolRegistry(Workspace(workspace_root, sandbox), [m.TOOL for m in _MODULES])


__all__ = ["TOOL_NAMES", "Tool", "ToolError", "ToolRegistry", "ToolResult", "Workspace", "default_registry"]
