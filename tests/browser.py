"""Test helpers for the headless-browser tests: the kanban-app check module (it lives with its
task under assets/, not in a package) and the reason a browser session cannot start."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CHECK_PY = ROOT / "assets" / "tasks" / "kanban-app" / "check.py"
TASK_YAML = ROOT / "assets" / "tasks" / "kanban-app.yaml"
REFERENCE_APP = ROOT / "tests" / "fixtures" / "kanban_ref"


def kanban_check():
    """The assets/tasks/kanban-app/check.py module, imported once."""
    name = "kanban_check"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, CHECK_PY)
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]
