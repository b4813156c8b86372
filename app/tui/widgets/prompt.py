"""``PromptInput``: the multiline message box (Enter sends, Ctrl+J / Shift+Enter newline).

Up on the first line and Down on the last line walk through previous prompts, like a shell.
"""

from __future__ import annotations

from textual import events
from textual.binding import Binding
from textual.message import Message
from textual.widgets import TextArea

# Ctrl+J arrives as a plain line feed in every terminal; Shift/Alt+Enter only where the
# terminal reports modifiers (kitty keyboard protocol, or Esc-prefixed Alt).
NEWLINE_KEYS = ("ctrl+j", "shift+enter", "alt+enter")
PLACEHOLDER = "Message (Enter to send, Ctrl+J for a new line, F1 for help)"


class PromptInput(TextArea):
    """The message box. Posts ``PromptInput.Submitted`` with the text on Enter."""

    BINDINGS = [
        Binding("enter", "submit", "Send", key_display="⏎"),
        Binding("ctrl+j", "newline", "Newline", key_display="^j"),
        Binding("up", "history_previous", "Previous prompt", show=False),
        Binding("down", "history_next", "Next prompt", show=False),
    ]

    class Submitted(Message):
        def __init__(self, prompt: PromptInput, text: str) -> None:
            super().__init__()
            self.prompt = prompt
            self.text = text

    def __init__(self, prompts: list[str] | None = None, **kwargs) -> None:
        kwargs.setdefault("placeholder", PLACEHOLDER)
        super().__init__(soft_wrap=True, tab_behavior="focus", show_line_numbers=False,
                         highlight_cursor_line=False, **kwargs)
        self.prompts: list[str] = prompts if prompts is not None else []  # newest first
        self._index = -1  # -1: editing the draft, else a position in history
        self._draft = ""

    async def _on_key(self, event: events.Key) -> None:
        # TextArea turns Enter into a newline before bindings run, so intercept here.
        if event.key == "enter":
            event.stop()
            event.prevent_default()
            self.action_submit()
            return
        if event.key in NEWLINE_KEYS:
            event.stop()
            event.prevent_default()
            self.action_newline()
            return
        await super()._on_key(event)

    def action_submit(self) -> None:
        if self.read_only:
            return  # dictating: the text is not final yet
        if self.text.strip():
            self.post_message(self.Submitted(self, self.text))

    def action_newline(self) -> None:
        if self.read_only:
            return
        start, end = self.selection
        self.replace("\n", start, end, maintain_selection_offset=False)

    def sent(self, text: str) -> None:
        """The text was sent: remember it and empty the box."""
        if not self.prompts or self.prompts[0] != text:
            self.prompts.insert(0, text)
        self._index, self._draft = -1, ""
        self.load_text("")

    # -- history -------------------------------------------------------------------------------
    def action_history_previous(self) -> None:
        loc = self.cursor_location
        at_top = loc[0] == 0 and self.navigator.is_first_wrapped_line(loc)
        if not at_top or self.read_only or self._index + 1 >= len(self.prompts):
            self.action_cursor_up()
            return
        if self._index == -1:
            self._draft = self.text
        self._index += 1
        self._show(self.prompts[self._index])

    def action_history_next(self) -> None:
        loc = self.cursor_location
        at_bottom = loc[0] == self.document.line_count - 1 and self.navigator.is_last_wrapped_line(loc)
        if not at_bottom or self._index == -1 or self.read_only:
            self.action_cursor_down()
            return
        self._index -= 1
        self._show(self._draft if self._index == -1 else self.prompts[self._index])

    def _show(self, text: str) -> None:
        self.load_text(text)
        self.move_cursor(self.document.end)
