"""``mlxterm cache stats|flush|clear [--json] [--profile P]``: the SSD checkpoint tier of a profile's model.

A new process has an empty RAM tier, so these act on the files of the profile's model
fingerprint (weights, weight/KV format, engine version) in its ``cache.ssd_dir``.
"""

from __future__ import annotations

import dataclasses
import json


def register(sub) -> None:
    p = sub.add_parser("cache", help="inspect, flush or clear saved KV checkpoints")
    csub = p.add_subparsers(dest="cache_command", metavar="ACTION", required=True)
    for name, func, text in (
        ("stats", _stats, "show checkpoint files, bytes and budget for the profile's model"),
        ("flush", _flush, "wait for pending checkpoint writes and print the durability report"),
        ("clear", _clear, "delete the profile model's checkpoint files"),
    ):
        sp = csub.add_parser(name, help=text)
        sp.add_argument("--profile", help="profile name or path (default: smollm2-135m)")
        sp.add_argument("--json", action="store_true", help="print JSON")
        sp.set_defaults(func=func)


def _open(args):
    from engine.checkpoints import open_store
    from engine.profiles import DEFAULT_PROFILE, load_profile

    profile = load_profile(args.profile or DEFAULT_PROFILE)
    return profile, open_store(profile, new_cache=None)


def _stats(args) -> int:
    profile, store = _open(args)
    try:
        s = store.stats()
    finally:
        store.close(0)
    ssd = s["ssd"]
    if args.json:
        print(json.dumps({"profile": profile.name, **s}, indent=2))
        return 0
    print(f"profile {profile.name}: fingerprint {s['fingerprint']} ({s['checkpoint_format']} format)")
    print(f"  dir:      {ssd['dir']}")
    print(f"  files:    {ssd['entries']} ({_mb(ssd['bytes'])} of a {_mb(ssd['budget'])} budget)")
    print(f"  sessions: {s['sessions']}")
    if s["discarded"]:
        print(f"  discarded {s['discarded']} corrupt file(s)")
    if s["ssd_disabled_reason"]:
        print(f"  SSD tier disabled: {s['ssd_disabled_reason']}")
    return 0


def _flush(args) -> int:
    _, store = _open(args)
    report = store.close()
    if args.json:
        print(json.dumps(dataclasses.asdict(report), indent=2))
        return 0
    state = "durable" if report.durable else "NOT durable"
    print(f"{state}: {report.written} written, {report.pending} pending, "
          f"{len(report.dropped)} dropped, {len(report.failed)} failed, {len(report.missing)} missing")
    if report.ssd_disabled_reason:
        print(f"  SSD tier disabled: {report.ssd_disabled_reason}")
    return 0 if report.durable else 1


def _clear(args) -> int:
    profile, store = _open(args)
    try:
        directory = store.stats()["ssd"]["dir"]
        n = store.clear()
    finally:
        store.close(0)
    if args.json:
        print(json.dumps({"profile": profile.name, "deleted": n, "dir": directory}))
    else:
        print(f"deleted {n} checkpoint file(s) from {directory}")
    return 0


def _mb(n: int) -> str:
    return f"{n / 1e9:.1f} GB" if n >= 1e9 else f"{n / 1e6:.1f} MB"
