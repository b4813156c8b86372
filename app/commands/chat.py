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

    return _exit_after_teardown(run_tui(args.profile, args.session))


def _exit_after_teardown(code: int) -> int:
    """End the process once the TUI has shut down: engine threads closed, stores committed,
    checkpoints flushed (``MlxtermApp.on_unmount``), then the atexit handlers. The C++ static
    teardown that would follow can abort the process ("terminate called without an active
    exception", exit 134) when a thread that ran MLX work is still alive -- seen under load on
    quit -- so it is skipped: nothing is left for it to save."""
    import atexit
    import logging
    import os
    import sys

    atexit._run_exitfuncs()
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
