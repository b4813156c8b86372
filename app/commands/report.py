"""``mlxterm report FILE.json... --out report.html``: one standalone HTML report.

Inputs: task runs (``result.json``; its ``transcript.jsonl`` and ``quality.json`` are read from
the same directory), board-card exports, ``quality.json`` files and ``mlxterm bench`` JSONs.
"""

from __future__ import annotations

from pathlib import Path


def register(sub) -> None:
    p = sub.add_parser("report", help="render runs, board cards and bench JSONs as one HTML file")
    p.add_argument("inputs", type=Path, nargs="+", metavar="FILE.json",
                   help="result.json, board card export, quality.json or bench JSON")
    p.add_argument("--out", type=Path, default=Path("report.html"), help="where to write the HTML (default: report.html)")
    p.add_argument("--title", default="mlxterm report", help="the page title")
    p.set_defaults(func=run)


def run(args) -> int:
    from app.report import write_report

    out = write_report(args.inputs, args.out, title=args.title)
    print(f"report: {out} ({len(args.inputs)} input(s))")
    return 0
