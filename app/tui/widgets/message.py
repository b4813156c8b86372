"""``MessageView``: one message of the conversation (a header, optional reasoning, the body).

Assistant replies stream into a ``Markdown`` widget through ``MarkdownStream``, which appends
to the last block instead of re-rendering the whole document per token. Reasoning streams
into a collapsible block that starts collapsed. Focus a message (click or Tab) to copy it,
copy one of its code blocks, or fork the session there.
"""

from __future__ import annotations

import re

from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Vertical
from textual.message import Message
from textual.widgets import Collapsible, Label, Markdown, Static

from app.tui.format import clean

ROLE_LABELS = {"user": "You", "assistant": "Assistant", "system": "System", "tool": "Tool"}

# A fenced code block; an unclosed fence at the end (a stopped reply) still counts.
_FENCE = re.compile(r"^ {0,3}(`{3,}|~{3,})[^\n]*\n(.*?)(?:^ {0,3}\1[ \t]*$|\Z)", re.M | re.S)


def code_blocks(markdown: str) -> list[str]:
    return [m.group(2).rstrip("\n") for m in _FENCE.finditer(markdown)]


class MessageView(Vertical, can_focus=True):
    """A message. ``number`` is its 1-based position in the session (None while unsaved)."""

    BINDINGS = [
        Binding("c", "copy", "Copy message"),
        Binding("y", "copy_code", "Copy code"),
        Binding("f", "fork", "Fork here"),
    ]

    class ForkRequested(Message):
        def __init__(self, view: MessageView) -> None:
            super().__init__()
            self.view = view

    class CopyCodeRequested(Message):
        """Several code blocks: the screen lets the user pick one."""

        def __init__(self, view: MessageView, blocks: list[str]) -> None:
            super().__init__()
            self.view = view
            self.blocks = blocks

    def __init__(self, role: str, content: str = "", *, reasoning: str | None = None,
                 number: int | None = None, state: str = "done", note: str = "") -> None:
        super().__init__(classes=f"message -{role}")
        self.role = role
        self.content = clean(content)
        self.reasoning = clean(reasoning or "")
        self.number = number
        self.state = state  # "done" | "streaming" | "stopped" | "error"
        self.note = note
        self._stream = None
        self._reasoning_stream = None

    def compose(self) -> ComposeResult:
        yield Label(self._header_text(), classes="message-header")
        if self.role == "assistant":
            if self.reasoning:
                yield self._reasoning_block(self.reasoning)
            yield Markdown(self.content, classes="message-body")
        else:
            yield Static(self.content, markup=False, classes="message-body")

    def _reasoning_block(self, text: str) -> Collapsible:
        return Collapsible(Markdown(text, classes="reasoning-body"), title="Reasoning",
                           collapsed=True, classes="reasoning")

    def _header_text(self) -> str:
        parts = [ROLE_LABELS.get(self.role, self.role.title())]
        if self.number is not None:
            parts.append(f"#{self.number}")
        if self.state == "streaming":
            parts.append("…")
        elif self.state == "stopped":
            parts.append("· stopped")
        elif self.state == "error":
            parts.append(f"· error: {self.note}" if self.note else "· error")
        return " ".join(parts)

    def _refresh_header(self) -> None:
        self.set_class(self.state == "stopped", "-stopped")
        self.set_class(self.state == "error", "-error")
        if self.is_mounted:
            self.query_one(".message-header", Label).update(self._header_text())

    def set_number(self, number: int | None) -> None:
        self.number = number
        self._refresh_header()

    # -- streaming -----------------------------------------------------------------------------
    async def write(self, text: str) -> None:
        """Append reply text (streamed: consecutive writes are batched by MarkdownStream)."""
        text = clean(text)
        if not text:
            return
        self.content += text
        if self._stream is None:
            self._stream = Markdown.get_stream(self.query_one(".message-body", Markdown))
        await self._stream.write(text)

    async def write_reasoning(self, text: str) -> None:
        text = clean(text)
        if not text:
            return
        self.reasoning += text
        if self._reasoning_stream is None:
            blocks = self.query(".reasoning")
            if not blocks:
                block = self._reasoning_block("")
                await self.mount(block, before=self.query_one(".message-body"))
            body = self.query_one(".reasoning-body", Markdown)
            self._reasoning_stream = Markdown.get_stream(body)
        await self._reasoning_stream.write(text)

    async def finish(self, state: str = "done", note: str = "") -> None:
        """Flush the streams and mark the reply done, stopped (Esc) or failed."""
        for stream in (self._stream, self._reasoning_stream):
            if stream is not None:
                await stream.stop()
        self._stream = self._reasoning_stream = None
        self.state, self.note = state, note
        self._refresh_header()

    # -- actions -------------------------------------------------------------------------------
    def action_copy(self) -> None:
        self.app.copy_to_clipboard(self.content)
        self.notify("Copied the message to the clipboard.")

    def action_copy_code(self) -> None:
        blocks = code_blocks(self.content)
        if not blocks:
            self.notify("This message has no code block.", severity="warning")
        elif len(blocks) == 1:
            self.app.copy_to_clipboard(blocks[0])
            self.notify("Copied the code block to the clipboard.")
        else:
            self.post_message(self.CopyCodeRequested(self, blocks))

    def action_fork(self) -> None:
        self.post_message(self.ForkRequested(self))
