"""``HelpScreen``: every key binding (read from the widgets themselves) and slash command."""

from __future__ import annotations

from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import VerticalScroll
from textual.screen import ModalScreen
from textual.widgets import Label, Markdown

from app.tui.commands import SLASH_COMMANDS

TIPS = """\
**Tips.** Ctrl+J always inserts a new line (Shift+Enter and Alt+Enter too, where the
terminal reports them). Start a message with `//` to send a literal `/`. Ctrl+P opens the
command palette. Selecting an older chat and sending a message restores its saved context,
and the status bar reports how many tokens came back and from where (RAM or SSD).
"""


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


def help_markdown(app, sections: list[tuple[str, type]]) -> str:
    lines = ["# Keys", ""]
    current = None
    for section, keys, description in binding_rows(app, sections):
        if section != current:
            lines += ["", f"**{section}**", "", "| Key | Action |", "|---|---|"]
            current = section
        lines.append(f"| `{keys}` | {description} |")
    lines += ["", "# Slash commands", "", "| Command | What it does |", "|---|---|"]
    lines += [f"| `{c.usage}` | {c.help} |" for c in SLASH_COMMANDS.values()]
    lines += ["", TIPS]
    return "\n".join(lines)


class HelpScreen(ModalScreen[None]):
    BINDINGS = [Binding("escape,f1,q", "dismiss", "Close help")]

    def __init__(self, sections: list[tuple[str, type]]) -> None:
        super().__init__(classes="dialog-screen")
        self.sections = sections

    def compose(self) -> ComposeResult:
        with VerticalScroll(classes="dialog -wide -tall", id="help-dialog"):
            yield Label("mlxterm help  (Esc to close)", classes="dialog-title")
            yield Markdown(help_markdown(self.app, self.sections), id="help-text")
