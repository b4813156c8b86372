"""``ErrorScreen``: one readable sentence about what went wrong and what to do next."""

from __future__ import annotations

from pathlib import Path

from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical
from textual.screen import ModalScreen
from textual.widgets import Button, Label


class ErrorScreen(ModalScreen[str]):
    """Dismisses with the id of the button pressed: "profiles", "quit" or "close"."""

    BINDINGS = [Binding("escape", "dismiss('close')", "Close")]
    AUTO_FOCUS = "Button"

    def __init__(self, title: str, message: str, log_path: Path | None = None,
                 offer_profiles: bool = False) -> None:
        super().__init__(classes="dialog-screen")
        self.title_text = title
        self.message = message
        self.log_path = log_path
        self.offer_profiles = offer_profiles

    def compose(self) -> ComposeResult:
        with Vertical(classes="dialog -error", id="error-dialog"):
            yield Label(self.title_text, classes="dialog-title")
            yield Label(_sentence(self.message), classes="dialog-text", id="error-message")
            if self.log_path is not None:
                yield Label(f"Details are logged in {self.log_path}", classes="dialog-hint")
            with Horizontal(classes="dialog-buttons"):
                if self.offer_profiles:
                    yield Button("Choose a profile", variant="primary", id="profiles")
                yield Button("Close", id="close")
                yield Button("Quit", variant="error", id="quit")

    def on_button_pressed(self, event: Button.Pressed) -> None:
        self.dismiss(event.button.id or "close")


def _sentence(text: str) -> str:
    text = text.strip() or "Something went wrong."
    text = text[0].upper() + text[1:]
    return text if text.endswith((".", "!", "?")) else text + "."
