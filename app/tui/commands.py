"""Command-palette entries (each runs an action of the main screen) and the slash commands.

The slash-command table lives in ``app/tui/slash.py`` (no Textual import: the plain REPL
uses it too).
"""

from __future__ import annotations

from functools import partial

from textual.command import DiscoveryHit, Hit, Hits, Provider

from app.tui.slash import SLASH_COMMANDS, Command, UnknownCommand, literal, parse_slash

__all__ = ["SLASH_COMMANDS", "Command", "UnknownCommand", "literal", "parse_slash", "PALETTE",
           "ChatCommands"]

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
    ("Task board", "Agent tasks as cards: queue, run, review (/board, Ctrl+B)", "board"),
    ("Stop generating", "Stop the reply or cancel the agent (the partial text is kept)", "stop"),
    ("Toggle light/dark theme", "Switch between the light and dark theme", "app.toggle_theme"),
    ("Keys and commands", "Show the help screen", "app.help"),
)


class ChatCommands(Provider):
    """Palette entries for chat actions on the main screen."""

    async def _run(self, action: str) -> None:
        # The palette calls this with call_later, which awaits coroutines.
        await self.screen.run_action(action)

    async def discover(self) -> Hits:
        for title, help_text, action in PALETTE:
            yield DiscoveryHit(title, partial(self._run, action), help=help_text)

    async def search(self, query: str) -> Hits:
        matcher = self.matcher(query)
        for title, help_text, action in PALETTE:
            score = matcher.match(title)
            if score > 0:
                yield Hit(score, matcher.highlight(title), partial(self._run, action), help=help_text)


class SingleCommand(Provider):
    """A palette provider with one entry: subclasses set ``title``/``help`` and define ``_run``."""

    title = ""
    help = ""

    async def discover(self) -> Hits:
        yield DiscoveryHit(self.title, self._run, help=self.help)

    async def search(self, query: str) -> Hits:
        matcher = self.matcher(query)
        score = matcher.match(self.title)
        if score > 0:
            yield Hit(score, matcher.highlight(self.title), self._run, help=self.help)

