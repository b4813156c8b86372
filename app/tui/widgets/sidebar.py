"""``SessionSidebar``: saved chats with a filter box (titles and message text)."""

from __future__ import annotations

from collections.abc import Sequence

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
        yield Input(placeholder="Filter sessions…", id="session-filter")
        yield OptionList(id="session-list")

    @property
    def query_text(self) -> str:
        return self.query_one("#session-filter", Input).value

    def set_sessions(self, sessions: Sequence, current: str | None, now: float) -> None:
        """Show ``sessions`` (most recent first), highlighting the open one."""
        options = self.query_one("#session-list", OptionList)
        options.clear_options()
        options.add_options([Option(_row(s, now), id=s.id) for s in sessions])
        if current is not None:
            for i, s in enumerate(sessions):
                if s.id == current:
                    options.highlighted = i
                    break

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


def _row(s, now: float) -> Text:
    row = Text(s.title, style="bold", no_wrap=True, overflow="ellipsis")
    detail = f"{s.profile or '?'} · {ago(s.updated, now)} · {tokens(s.token_count)} tok"
    row.append("\n")
    row.append(detail, style="dim")
    return row
