"""``ApprovalScreen``: may the agent run this tool call? (once / always / deny)."""

from __future__ import annotations

import json
from collections.abc import Callable

from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical, VerticalScroll
from textual.screen import ModalScreen
from textual.widgets import Button, Label, Static

from app.tui.format import clean

DECISIONS = ("once", "always", "deny")


class ApprovalScreen(ModalScreen[str]):
    """Dismisses with "once", "always" (this tool, for the rest of the session) or "deny"."""

    BINDINGS = [
        Binding("y", "answer('once')", "Approve once"),
        Binding("a", "answer('always')", "Always allow this tool in this session"),
        Binding("n,escape", "answer('deny')", "Deny"),
    ]
    AUTO_FOCUS = "#approve-once"

    def __init__(self, tool: str, arguments: dict, workspace: str | None = None) -> None:
        super().__init__(classes="dialog-screen")
        self.tool = tool
        self.arguments = arguments
        self.workspace = workspace

    def compose(self) -> ComposeResult:
        with Vertical(classes="dialog -wide", id="approval-dialog"):
            yield Label(f"Allow the agent to run {self.tool}?", classes="dialog-title",
                        markup=False)
            if self.workspace:
                yield Label(f"in {self.workspace}", classes="dialog-hint", markup=False)
            with VerticalScroll(id="approval-call"):
                yield Static(self.call_text(), markup=False, id="approval-arguments")
            with Horizontal(classes="dialog-buttons"):
                yield Button("Approve once (y)", variant="primary", id="approve-once")
                yield Button("Always in this session (a)", id="approve-always")
                yield Button("Deny (n)", variant="error", id="approve-deny")

    def call_text(self) -> str:
        """The bash command as a shell line; other tools' arguments as JSON."""
        command = self.arguments.get("command")
        if self.tool == "bash" and isinstance(command, str):
            text = f"$ {command}"
            if "timeout_s" in self.arguments:
                text += f"\n(timeout {self.arguments['timeout_s']} s)"
        else:
            text = json.dumps(self.arguments, ensure_ascii=False, indent=2)
        return clean(text)

    def action_answer(self, decision: str) -> None:
        self.dismiss(decision if decision in DECISIONS else "deny")

    def on_button_pressed(self, event: Button.Pressed) -> None:
        event.stop()
        self.action_answer((event.button.id or "").removeprefix("approve-"))


def ask_approval(app, ev, workspace: str | None, on_close: Callable[[ApprovalScreen], None]) -> ApprovalScreen:
    """Show the dialog for ``ev`` (an agent's ``ApprovalNeeded``) and pass the user's answer to
    the waiting agent; ``on_close(screen)`` runs first, whatever the answer."""
    screen = ApprovalScreen(ev.call.name, ev.call.arguments, workspace)

    def answered(decision: str | None) -> None:
        on_close(screen)
        if decision == "once":
            ev.approve()
        elif decision == "always":
            ev.approve_always()
        else:
            ev.deny()

    app.push_screen(screen, answered)
    return screen
