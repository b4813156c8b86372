"""``HelpScreen``: every key binding (read from the widgets themselves) and slash command."""

from __future__ import annotations

from rich.table import Table
from rich.text import Text
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import VerticalScroll
from textual.screen import ModalScreen
from textual.widgets import Label, Static

from app.tui.agent_mode import AGENT_SLASH
from app.tui.dictation import DICTATE_SLASH
from app.tui.slash import SLASH_COMMANDS

TIPS = (
    "Ctrl+J always inserts a new line (Shift+Enter and Alt+Enter too, where the terminal "
    "reports them). Start a message with // to send a literal /. Ctrl+P opens the command "
    "palette. Opening an older chat and sending a message restores its saved context; the "
    "status bar says how many tokens came back and from where (RAM or SSD). F5 dictates into "
    "the message box (press it again to stop, or pause when the profile's speech.auto_stop "
    "is on); edit the text, then send it. /agent starts agent mode: the model works in a "
    "workspace with tools, each call is a card, bash asks first (y once, a always, n deny), "
    "Esc cancels the run. Open another chat while a reply or an agent run streams and it "
    "keeps going in its own view (marked streaming in the list); Esc stops the one on screen."
)


def binding_rows(app, sections: list[tuple[str, type]]) -> list[tuple[str, str, str]]:
    """``(section, keys, description)`` for each binding with a description."""
    rows = []
    for section, cls in sections:
        for b in cls.BINDINGS:
            binding = b if isinstance(b, Binding) else Binding(*b)
            if not binding.description:
                continue
            keys = ", ".join(app.get_key_display(Binding(k.strip(), binding.action))
                             for k in binding.key.split(","))
            rows.append((section, keys, binding.description))
    return rows


def _table(rows: list[tuple[str, str]]) -> Table:
    table = Table.grid(padding=(0, 2))
    table.add_column(style="bold", min_width=14, no_wrap=True)
    table.add_column()
    for left, right in rows:
        table.add_row(left, right)
    return table


class HelpScreen(ModalScreen[None]):
    BINDINGS = [Binding("escape,f1,q", "dismiss", "Close help")]

    def __init__(self, sections: list[tuple[str, type]]) -> None:
        super().__init__(classes="dialog-screen")
        self.sections = sections

    def compose(self) -> ComposeResult:
        rows = binding_rows(self.app, self.sections)
        with VerticalScroll(classes="dialog -wide -tall", id="help-dialog"):
            yield Label("Keys and commands  (Esc closes)", classes="dialog-title")
            for section, _ in self.sections:
                keys = [(k, d) for s, k, d in rows if s == section]
                if keys:
                    yield Label(section, classes="help-section")
                    yield Static(_table(keys), classes="help-table")
            yield Label("Slash commands", classes="help-section")
            commands = [*SLASH_COMMANDS.values(), DICTATE_SLASH, AGENT_SLASH]
            yield Static(_table([(c.usage, c.help) for c in commands]),
                         classes="help-table")
            yield Label("Tips", classes="help-section")
            yield Static(Text(TIPS), classes="help-table")
