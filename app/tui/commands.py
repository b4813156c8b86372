"""Slash commands and command-palette entries: one table, two ways in.

A prompt starting with ``/`` runs a command; start it with ``//`` to send a literal slash.
Every palette entry runs an action of the main screen.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial

from textual.command import DiscoveryHit, Hit, Hits, Provider

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


# (palette title, help, main-screen action)
PALETTE: tuple[tuple[str, str, str], ...] = (
    ("New chat", "Start a new, empty chat", "new_chat"),
    ("Switch profile…", "Load another profile's model", "switch_profile"),
    ("Rename chat…", "Change the title of this chat", "rename"),
    ("Delete chat…", "Delete this chat and its messages", "delete"),
    ("Fork chat", "Copy this chat into a new one (its KV prefix is reused)", "fork"),
    ("Export as Markdown", "Write this chat to a .md file", "export('md')"),
    ("Export as JSON", "Write this chat to a .json file", "export('json')"),
    ("Retry last answer", "Generate the last reply again", "retry"),
    ("Set system prompt…", "System prompt of a new chat", "system"),
    ("Clear chat…", "Delete this chat's messages", "clear"),
    ("Stop generating", "Stop the reply (the partial text is kept)", "stop"),
    ("Toggle light/dark theme", "Switch between the light and dark theme", "app.toggle_theme"),
    ("Keys and commands", "Show the help screen", "app.help"),
)


class ChatCommands(Provider):
    """Palette entries for chat actions on the main screen."""

    def _run(self, action: str) -> None:
        self.screen.run_action(action)

    async def discover(self) -> Hits:
        for title, help_text, action in PALETTE:
            yield DiscoveryHit(title, partial(self._run, action), help=help_text)

    async def search(self, query: str) -> Hits:
        matcher = self.matcher(query)
        for title, help_text, action in PALETTE:
            score = matcher.match(title)
            if score > 0:
                yield Hit(score, matcher.highlight(title), partial(self._run, action), help=help_text)
