"""``mlxterm`` command line. With no subcommand it opens the TUI on the default profile."""

from __future__ import annotations

import argparse
import logging
import sys

from app.commands import register_all


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="mlxterm",
        description="Chat, agents and dictation with LLMs running in-process on MLX.",
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="log debug details to stderr")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    register_all(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    from engine.errors import MlxtermError

    from tools.settings import SettingsError as ToolSettingsError

    if argv is None:  # the mlxterm command itself (tests call main with a list)
        from engine import hugepages

        try:
            hugepages.ensure()  # may replace the process once, before any model is loaded
        except MlxtermError as e:  # an unreadable MLXTERM_HUGEPAGES
            print(f"mlxterm: {e}", file=sys.stderr)
            return 2
    parser = build_parser()
    args = parser.parse_args(_default_command(list(sys.argv[1:] if argv is None else argv)))
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.WARNING,
        format="%(levelname)s %(name)s: %(message)s",
    )
    if args.command is None:
        args = parser.parse_args(["chat", *(argv or sys.argv[1:])])
    try:
        return int(args.func(args) or 0)
    except (MlxtermError, ToolSettingsError) as e:  # an unreadable MLXTERM_* value among them
        print(f"mlxterm: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


def _default_command(argv: list[str]) -> list[str]:
    """``mlxterm --continue`` / ``mlxterm --profile P``: chat options without the word chat."""
    i = 0
    while i < len(argv) and argv[i] in ("-v", "--verbose"):
        i += 1
    if i < len(argv) and argv[i].startswith("-") and argv[i] not in ("-h", "--help"):
        return [*argv[:i], "chat", *argv[i:]]
    return argv


if __name__ == "__main__":  # python -m app.cli, as python -m app
    raise SystemExit(main())
