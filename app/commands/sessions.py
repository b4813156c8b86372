"""``mlxterm sessions list|show|export|delete|fork|rename``: the persistent session store."""

from __future__ import annotations

import json
import sys


def register(sub) -> None:
    p = sub.add_parser("sessions", help="list, show, export, fork, rename and delete sessions")
    ssub = p.add_subparsers(dest="sessions_command", metavar="ACTION", required=True)

    lp = ssub.add_parser("list", help="list sessions, most recently updated first")
    lp.add_argument("--query", "-q", metavar="Q", help="only sessions whose title or messages match")
    lp.add_argument("--kind", choices=("chat", "agent"), help="only chat or agent sessions")
    lp.add_argument("--limit", type=int, default=200, metavar="N", help="at most N (default 200)")
    lp.add_argument("--json", action="store_true", help="print JSON")
    lp.set_defaults(func=_list)

    sp = ssub.add_parser("show", help="print a session's details and messages")
    sp.add_argument("id", metavar="ID", help="session id or a unique prefix of it")
    sp.add_argument("--json", action="store_true", help="print JSON (the export format)")
    sp.set_defaults(func=_show)

    ep = ssub.add_parser("export", help="write a session transcript as Markdown or JSON")
    ep.add_argument("id", metavar="ID")
    ep.add_argument("--format", "-f", choices=("md", "json"), default="md")
    ep.add_argument("--output", "-o", metavar="FILE", help="write to FILE instead of stdout")
    ep.add_argument("--tokens", action="store_true", help="JSON: include each message's token ids")
    ep.set_defaults(func=_export)

    dp = ssub.add_parser("delete", help="delete a session and its messages")
    dp.add_argument("id", metavar="ID")
    dp.add_argument("--yes", "-y", action="store_true", help="do not ask for confirmation")
    dp.set_defaults(func=_delete)

    fp = ssub.add_parser("fork", help="copy a session's first N messages into a new session")
    fp.add_argument("id", metavar="ID")
    fp.add_argument("--at", type=int, required=True, metavar="N", help="number of messages to keep")
    fp.add_argument("--title", metavar="T", help="title of the new session")
    fp.add_argument("--json", action="store_true", help="print the new session as JSON")
    fp.set_defaults(func=_fork)

    rp = ssub.add_parser("rename", help="change a session's title")
    rp.add_argument("id", metavar="ID")
    rp.add_argument("title", metavar="TITLE")
    rp.set_defaults(func=_rename)


def _store():
    from engine.sessions import SessionStore

    return SessionStore()


def _when(ts: float) -> str:
    from datetime import datetime

    return datetime.fromtimestamp(ts).strftime("%Y-%m-%d %H:%M")


def _summary_dict(s) -> dict:
    from engine.sessions.export import iso_time

    return {"id": s.id, "title": s.title, "profile": s.profile, "kind": s.kind,
            "created": iso_time(s.created), "updated": iso_time(s.updated),
            "message_count": s.message_count, "token_count": s.token_count,
            "preview": s.preview}


def _list(args) -> int:
    with _store() as store:
        rows = store.list(args.query, limit=args.limit, kind=args.kind)
    if args.json:
        print(json.dumps([_summary_dict(s) for s in rows], indent=2, ensure_ascii=False))
        return 0
    if not rows:
        print("no sessions" + (f" match {args.query!r}" if args.query else ""), file=sys.stderr)
        return 0
    print(f"{'ID':<12}  {'UPDATED':<16}  {'KIND':<5}  {'MSGS':>4}  {'TOKENS':>7}  TITLE")
    for s in rows:
        print(f"{s.id:<12}  {_when(s.updated):<16}  {s.kind:<5}  {s.message_count:>4}  "
              f"{s.token_count:>7}  {s.title}")
    return 0


def _show(args) -> int:
    with _store() as store:
        if args.json:
            print(store.export(args.id, "json"), end="")
            return 0
        s = store.get(args.id)
        msgs = store.messages(s.id, tokens=False)
    print(f"{s.title}")
    print(f"  id       {s.id}  ({s.kind})")
    print(f"  profile  {s.profile or '(none)'}")
    if s.workspace:
        print(f"  workspace {s.workspace}")
    print(f"  created  {_when(s.created)}   updated {_when(s.updated)}")
    if s.parent_id or s.fork_at is not None:
        print(f"  forked   from {s.parent_id or '(deleted session)'} at message {s.fork_at}")
    print(f"  {s.message_count} messages, {s.token_count} tokens")
    for m in msgs:
        text = " ".join((m.content or "").split())
        if not text and m.tool_calls:
            text = "[tool calls] " + ", ".join(_call_name(c) for c in m.tool_calls)
        if len(text) > 100:
            text = text[:99] + "…"
        print(f"{m.index:>4}  {m.role:<9}  {m.token_count:>6} tok  {text}")
    return 0


def _call_name(call) -> str:
    # OpenAI-style {"function": {"name": ...}} or flat {"name": ...}
    if not isinstance(call, dict):
        return "?"
    fn = call.get("function")
    return str((fn.get("name") if isinstance(fn, dict) else None) or call.get("name") or "?")


def _export(args) -> int:
    with _store() as store:
        text = store.export(args.id, args.format, include_tokens=args.tokens)
    if args.output:
        from engine.atomic import atomic_write_text

        path = atomic_write_text(args.output, text)
        print(f"wrote {path}", file=sys.stderr)
    else:
        sys.stdout.write(text)
    return 0


def _delete(args) -> int:
    from engine.sessions import SessionError

    with _store() as store:
        s = store.get(args.id)
        if not args.yes:
            if not sys.stdin.isatty():
                raise SessionError(f"not deleting session {s.id} without --yes "
                                   "(standard input is not a terminal to ask).")
            answer = input(f"Delete session {s.id} \"{s.title}\" ({s.message_count} messages)? [y/N] ")
            if answer.strip().lower() not in ("y", "yes"):
                print("not deleted", file=sys.stderr)
                return 1
        store.delete(s.id)
    print(f"deleted {s.id}")
    return 0


def _fork(args) -> int:
    with _store() as store:
        new = store.fork(args.id, args.at, title=args.title)
    if args.json:
        from engine.sessions.export import session_dict

        print(json.dumps(session_dict(new), indent=2, ensure_ascii=False))
    else:
        print(f"forked {new.parent_id} at message {new.fork_at} -> {new.id} \"{new.title}\"")
    return 0


def _rename(args) -> int:
    with _store() as store:
        s = store.rename(args.id, args.title)
    print(f"renamed {s.id} -> \"{s.title}\"")
    return 0
