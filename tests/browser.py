"""Test helpers for the headless-browser tests: the web-app tasks' check modules (they live with
their tasks under assets/, not in a package) and the reason a browser session cannot start."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TASKS = ROOT / "assets" / "tasks"
CHECK_PY = TASKS / "kanban-app" / "check.py"
TASK_YAML = TASKS / "kanban-app.yaml"
REFERENCE_APP = ROOT / "tests" / "fixtures" / "kanban_ref"
EXPENSE_CHECK_PY = TASKS / "expense-app" / "check.py"
EXPENSE_TASK_YAML = TASKS / "expense-app.yaml"
EXPENSE_REFERENCE_APP = ROOT / "tests" / "fixtures" / "expense_ref"


def _load(name: str, path: Path):
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


def kanban_check():
    """The assets/tasks/kanban-app/check.py module, imported once."""
    return _load("kanban_check", CHECK_PY)


def expense_check():
    """The assets/tasks/expense-app/check.py module, imported once."""
    return _load("expense_check", EXPENSE_CHECK_PY)
