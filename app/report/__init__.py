"""Standalone HTML report of task runs, board cards and benchmark JSONs.

``write_report(inputs, out)`` loads each input (a path to ``result.json``, ``quality.json``,
a board-card export or a ``mlxterm bench`` JSON, or an already-loaded dict), normalises task
runs and board attempts to one record shape (``inputs.Attempt``), and writes one HTML file
with inline CSS, JS and SVG: it opens offline, from anywhere, without network.

Unknown numbers stay unknown (shown as "unknown", never 0); runs that did not pass get no
throughput figure; every string that came from a model or a file is HTML-escaped.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from engine.atomic import atomic_write_text

from app.report.html import render_report
from app.report.inputs import ReportError, load_input

__all__ = ["ReportError", "build_report", "write_report"]


def build_report(inputs: list[Path | str | dict[str, Any]], title: str = "mlxterm report") -> str:
    """The report's HTML text for ``inputs`` (paths or loaded dicts)."""
    items = [load_input(x) for x in inputs]
    return render_report(items, title=title)


def write_report(inputs: list[Path | str | dict[str, Any]], out: Path | str, title: str = "mlxterm report") -> Path:
    """Write the report for ``inputs`` to ``out`` (atomically) and return its path."""
    out = Path(out)
    atomic_write_text(out, build_report(inputs, title=title))
    return out
