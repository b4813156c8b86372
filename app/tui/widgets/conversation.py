"""``Conversation``: the scrolling list of messages of the open session."""

from __future__ import annotations

from collections.abc import Iterable
from typing import TypeVar

from textual.containers import VerticalScroll
from textual.widget import Widget
from textual.widgets import Static

from app.tui.widgets.message import MessageView

W = TypeVar("W", bound=Widget)

WELCOME = (
    "Type a message and press Enter. Ctrl+J adds a new line; Esc stops a reply.\n"
    "Type /help or press F1 for keys and commands; F3 reopens your most recent session."
)


class Conversation(VerticalScroll):
    """Messages, oldest first. Stays scrolled to the bottom while a reply streams in."""

    session_id: str | None = None  # the session shown (None: a new chat not yet sent)

    def compose(self):
        yield Static(WELCOME, classes="welcome")

    async def show(self, messages: Iterable, *, agent: bool = False,
                   workspace: str | None = None, plan: dict | None = None) -> None:
        """Replace the view with stored messages (``engine.sessions.Message`` records); an
        agent session's tool calls and results become cards (``plan``: its stored plan)."""
        if agent:
            from app.tui.agent_view import stored_widgets

            views: list[Widget] = stored_widgets(messages, workspace, plan)
        else:
            views = [_view(m) for m in messages]
        async with self.batch():
            await self.remove_children()
            await self.mount_all(views or [Static(WELCOME, classes="welcome")])
        self.scroll_end(animate=False)

    async def add(self, view: W) -> W:
        for welcome in self.query(".welcome"):
            await welcome.remove()
        await self.mount(view)
        self.anchor()  # follow the bottom as the view grows
        self.scroll_end(animate=False)
        return view

    def views(self) -> list[MessageView]:
        return list(self.query(MessageView))

    def last(self) -> MessageView | None:
        views = self.views()
        return views[-1] if views else None


def _view(m) -> MessageView:
    meta = m.meta or {}
    finish = meta.get("finish_reason")
    state, note = "done", ""
    if finish == "cancelled":
        state = "stopped"
    elif meta.get("error"):
        state, note = "error", str(meta["error"])
    return MessageView(m.role, m.content, reasoning=m.reasoning, number=m.index + 1,
                       state=state, note=note)
