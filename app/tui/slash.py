"""Slash commands shared by the TUI and the plain REPL.

A prompt starting with ``/`` runs a command; start it with ``//`` to send a literal slash.
"""

from __future__ import annotations

from dataclasses import dataclass

from engine.errors import MlxtermError


@dataclass(frozen=True)
class Command:
    name: str  # slash name without the slash
    usage: str
    help: str


SLASH_COMMANDS: dict[str, Command] = {c.name: c for c in (
    Command("new", "/new", "start a new chat"),
    Command("profile", "/profile [NAME]", "switch profile (no name: pick from a list)"),
    Command("system", "/system [TEXT]", "set the system prompt of a new chat (no text: edit it)"),
    Command("fork", "/fork [N]", "copy the first N messages (default: all) into a new chat"),
    Command("export", "/export [md|json] [PATH]", "write the chat to a file (default: Markdown "
            "under the data dir)"),
    Command("retry", "/retry", "answer the last message again"),
    Command("clear", "/clear", "delete this chat's messages (keeps its system prompt)"),
    Command("rename", "/rename [TITLE]", "rename this chat"),
    Command("delete", "/delete", "delete this chat"),
    Command("help", "/help", "show keys and commands"),
    Command("quit", "/quit", "leave mlxterm"),
)}


class UnknownCommand(MlxtermError):
    """A prompt that looks like a slash command but names none."""


def parse_slash(text: str) -> tuple[Command, str] | None:
    """``(command, argument text)`` for a slash command, None for an ordinary message."""
    stripped = text.strip()
    if not stripped.startswith("/") or stripped.startswith("//"):
        return None
    word, _, rest = stripped[1:].partition(" ")
    command = SLASH_COMMANDS.get(word.lower())
    if command is None:
        raise UnknownCommand(f"unknown command /{word}; type /help for the list "
                             "(start a message with // to send a literal slash)")
    return command, rest.strip()


def literal(text: str) -> str:
    """The message to send for ``text`` (``//x`` sends ``/x``)."""
    return text[1:] if text.lstrip().startswith("//") else text
