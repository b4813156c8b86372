"""``mlxterm bench NAME [--json] [--out FILE]``: run a benchmark script and write its JSON."""

from __future__ import annotations

import importlib
import json
import sys
from pathlib import Path

BENCHES = ("engine", "resume", "speech", "spec", "batch", "sandbox", "board", "qmm", "hugepages", "agent", "serve", "sampling")


def register(sub) -> None:
    p = sub.add_parser("bench", help="run a benchmark (writes JSON)")
    bsub = p.add_subparsers(dest="bench", metavar="NAME", required=True)
    for name in BENCHES:
        try:
            module = importlib.import_module(f"app.benches.{name}")
        except ModuleNotFoundError as e:
            if e.name == f"app.benches.{name}":
                continue
            raise
        bp = bsub.add_parser(name, help=(module.__doc__ or "").strip().splitlines()[0])
        bp.add_argument("--json", action="store_true", help="print the JSON result to stdout")
        bp.add_argument("--out", type=Path, help="also write the JSON result to this file")
        module.add_arguments(bp)
        bp.set_defaults(func=_runner(module))


def _runner(module):
    def run(args) -> int:
        result = module.run(args)
        text = json.dumps(result, indent=2)
        if args.out:
            from engine.atomic import atomic_write_text

            atomic_write_text(args.out, text + "\n")
        if args.json:
            print(text)
        else:
            print(result.get("summary", text), file=sys.stdout)
        return 0

    return run
