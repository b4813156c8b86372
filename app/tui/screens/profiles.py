"""``ProfileScreen``: pick a profile; each is listed with the outcome of ``check_profile``."""

from __future__ import annotations

from textual import work
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Vertical
from textual.content import Content
from textual.screen import ModalScreen
from textual.widgets import Label, OptionList
from textual.widgets.option_list import Option

# Theme variables, so the marks read well in the light and the dark theme.
MARKS = {"ok": ("✓", "$success"), "warning": ("!", "$warning"), "invalid": ("✗", "$error")}


class ProfileScreen(ModalScreen[str | None]):
    """Dismisses with the chosen profile's spec (name or path), or None."""

    BINDINGS = [Binding("escape", "dismiss(None)", "Cancel")]

    def __init__(self, current: str | None) -> None:
        super().__init__(classes="dialog-screen")
        self.current = current
        self.choices: list = []

    def compose(self) -> ComposeResult:
        with Vertical(classes="dialog -wide", id="profile-dialog"):
            yield Label("Switch profile", classes="dialog-title")
            yield Label("Checking profiles…", id="profile-status", classes="dialog-hint")
            yield OptionList(id="profile-list")

    def on_mount(self) -> None:
        self.query_one("#profile-list", OptionList).loading = True
        self._check()

    @work(thread=True, exclusive=True)
    def _check(self) -> None:
        # check_profile reads files (and GGUF headers): keep it off the UI thread.
        choices = self.app.controller.list_profiles()
        self.app.call_from_thread(self._show, choices)

    def _show(self, choices: list) -> None:
        self.choices = choices
        options = self.query_one("#profile-list", OptionList)
        options.loading = False
        options.add_options([Option(_row(c, c.name == self.current), id=c.spec) for c in choices])
        for i, c in enumerate(choices):
            if c.name == self.current:
                options.highlighted = i
        self.query_one("#profile-status", Label).update(
            f"{len(choices)} profiles · ✓ ready  ! needs attention  ✗ cannot load")
        options.focus()

    def on_option_list_option_selected(self, event: OptionList.OptionSelected) -> None:
        event.stop()
        choice = self.choices[event.option_index]
        if choice.status == "invalid":
            self.notify(f"Profile {choice.name} cannot be used: {choice.note}", severity="error")
            return
        self.dismiss(choice.spec)


def _row(choice, current: bool) -> Content:
    mark, color = MARKS[choice.status]
    parts: list[tuple[str, str] | str] = [(f"{mark} ", f"bold {color}"), (choice.name, "bold")]
    if current:
        parts.append(("  (current)", "italic"))
    if choice.description:
        parts.append((f"\n  {choice.description}", "$text-muted"))
    if choice.note:
        parts.append((f"\n  {choice.note}", color))
    return Content.assemble(*parts)
