"""``mlxterm chat`` (also plain ``mlxterm``): the chat TUI, or a line REPL with ``--plain``."""

from __future__ import annotations


def register(sub) -> None:
    p = sub.add_parser("chat", help="chat with a model (the default command)",
                       description="Open the chat TUI. With --plain, or when stdin is not a "
                       "terminal, run a line-based REPL instead (reads prompts line by line).")
    p.add_argument("--profile", metavar="NAME|PATH",
                   help="profile name or YAML path (default: the session's, else smollm2-135m)")
    p.add_argument("--session", metavar="ID", help="open this session (an id or a unique prefix)")
    p.add_argument("--continue", dest="resume", action="store_true",
                   help="reopen the most recent session (chat or agent)")
    p.add_argument("--plain", action="store_true",
                   help="line REPL instead of the full-screen TUI (for pipes and scrollback)")
    p.set_defaults(func=run)


def run(args) -> int:
    import sys

    if args.resume and not args.session:
        from app.tui.controller import latest_session

        args.session = latest_session()
        if args.session is None:
            print("mlxterm: no session to continue yet; starting a new chat", file=sys.stderr)

    if args.plain or not sys.stdin.isatty() or not sys.stdout.isatty():
        from app.tui.plain import run_plain

        return run_plain(args.profile, args.session)
    from app.tui.app import run_tui

    return run_tui(args.profile, args.session)
