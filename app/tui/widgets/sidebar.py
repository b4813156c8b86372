"""``SessionSidebar``: saved chats with a filter box (titles and message text).

Agent sessions are marked with ``AGENT_MARK`` before their title and "agent" in the detail line."""

from __future__ import annotations

from collections.abc import Sequence, Set

from rich.text import Text
from textual.app import ComposeResult
from textual.containers import Vertical
from textual.message import Message
from textual.widgets import Input, OptionList
from textual.widgets.option_list import Option

from app.tui.format import ago, tokens


class SessionSidebar(Vertical):
    """Lists ``SessionSummary`` records; posts ``Opened`` and ``FilterChanged``."""

    class Opened(Message):
        def __init__(self, session_id: str) -> None:
            super().__init__()
            self.session_id = session_id

    class FilterChanged(Message):
        def __init__(self, query: str) -> None:
            super().__init__()
            self.query = query

    def compose(self) -> ComposeResult:
        yield Input(placeholder="Filter chats (Ctrl+F)", id="session-filter", compact=True)
        yield OptionList(id="session-list")

    @property
    def query_text(self) -> str:
        return self.query_one("#session-filter", Input).value

    def set_sessions(self, sessions: Sequence, current: str | None, now: float,
                     running: Set[str] = frozenset()) -> None:
        """Show ``sessions`` (most recent first), highlighting the open one; ``running``:
        sessions with a reply or an agent run streaming (marked, open or not)."""
        options = self.query_one("#session-list", OptionList)
        options.clear_options()
        options.add_options([Option(_row(s, now, s.id in running), id=s.id) for s in sessions])
        ids = [s.id for s in sessions]
        if ids:
            options.highlighted = ids.index(current) if current in ids else 0

    def on_input_changed(self, event: Input.Changed) -> None:
        event.stop()
        self.post_message(self.FilterChanged(event.value))

    def on_input_submitted(self, event: Input.Submitted) -> None:
        event.stop()
        self.query_one("#session-list", OptionList).focus()

    def on_option_list_option_selected(self, event: OptionList.OptionSelected) -> None:
        event.stop()
        if event.option.id:
            self.post_message(self.Opened(event.option.id))


ROW_WIDTH = 28  # the option width (sidebar 34 - border - padding): cut lines, do not wrap
AGENT_MARK = "◆ "
RUNNING = "streaming · "  # leads the detail line of a session whose reply or run is streaming


def _row(s, now: float, running: bool = False) -> Text:
    detail = f"{ago(s.updated, now)} · {tokens(s.token_count)} tok · {s.profile or '?'}"
    title = s.title
    if s.kind == "agent":
        title, detail = AGENT_MARK + title, "agent · " + detail
    if running:
        detail = RUNNING + detail
    row = Text(_cut(title), style="bold")
    row.append("\n")
    row.append(_cut(detail), style="dim")
    return row


def _cut(text: str) -> str:
    return text if len(text) <= ROW_WIDTH else text[: ROW_WIDTH - 1] + "…"
