"""``mlxterm profile list|show NAME|check NAME_OR_PATH [--json]``: inspect YAML profiles."""

from __future__ import annotations

import json
import sys


def register(sub) -> None:
    p = sub.add_parser("profile", help="list, show and check YAML profiles")
    psub = p.add_subparsers(dest="profile_command", metavar="ACTION", required=True)

    lp = psub.add_parser("list", help="list shipped and user profiles")
    lp.add_argument("--json", action="store_true", help="print JSON")
    lp.set_defaults(func=_list)

    sp = psub.add_parser("show", help="print a profile with every default filled in")
    sp.add_argument("name", metavar="NAME_OR_PATH")
    sp.add_argument("--json", action="store_true", help="print JSON instead of YAML")
    sp.set_defaults(func=_show)

    cp = psub.add_parser("check", help="validate a profile and check its model exists (exit 1 if not)")
    cp.add_argument("name", metavar="NAME_OR_PATH")
    cp.add_argument("--json", action="store_true", help="print JSON")
    cp.set_defaults(func=_check)


def _list(args) -> int:
    from engine.profiles import DEFAULT_PROFILE, list_profiles

    infos = list_profiles()
    if args.json:
        print(json.dumps([{"name": i.name, "path": str(i.path), "source": i.source,
                           "description": i.description, "overrides_shipped": i.overrides_shipped,
                           "default": i.name == DEFAULT_PROFILE} for i in infos], indent=2))
        return 0
    width = max((len(i.name) for i in infos), default=4)
    for i in infos:
        mark = "*" if i.name == DEFAULT_PROFILE else " "
        origin = "user (overrides shipped)" if i.overrides_shipped else i.source
        print(f"{mark} {i.name:<{width}}  {origin:<8}  {i.description}")
    return 0


def _show(args) -> int:
    from engine.profiles import load_profile, profile_to_dict

    profile = load_profile(args.name)
    if args.json:
        print(json.dumps({"path": str(profile.path), **profile_to_dict(profile)}, indent=2))
        return 0
    import yaml

    print(f"# {profile.path}")
    print(yaml.safe_dump(profile_to_dict(profile, sizes_as_text=True), sort_keys=False,
                         allow_unicode=True), end="")
    return 0


def _check(args) -> int:
    from engine.profiles import check_profile

    result = check_profile(args.name)
    if args.json:
        print(json.dumps({
            "target": result.target,
            "valid": result.valid,
            "path": str(result.profile.path) if result.profile else None,
            "model_path": str(result.model_path) if result.model_path else None,
            "problems": list(result.problems),
            "warnings": list(result.warnings),
        }, indent=2))
    else:
        for w in result.warnings:
            print(f"warning: {w}", file=sys.stderr)
        for p in result.problems:
            print(p, file=sys.stderr)
        if result.valid:
            print(f"ok: {result.profile.path}" + (f" (model: {result.model_path})" if result.model_path else ""))
        else:
            print(f"invalid: {len(result.problems)} problem(s) in {args.name}", file=sys.stderr)
    return 0 if result.valid else 1
