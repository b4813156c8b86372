"""``ToolCard``: one tool call of an agent run; ``DiffView``; ``AgentNotice``.

A card appears while the model is still writing the call ("forming…"), shows the arguments
once the call parses, and fills in with the result, duration, exit code (bash), the approval
and, for ``write_file`` / ``edit_file``, the diff. The title line says the outcome, so a
collapsed card is still informative.
"""

from __future__ import annotations

import json
from typing import Any

from rich.text import Text
from textual.binding import Binding
from textual.markup import escape
from textual.reactive import reactive
from textual.widget import Widget
from textual.widgets import Collapsible, Label, Static

from app.tui.format import clean

SUBJECT_WIDTH = 60
FORMING_TAIL = 800  # characters of a forming call shown (a long file streams in as its tail)
STATE_LABELS = {
    "forming": "forming…",
    "parsed": "queued",
    "approval": "waiting for approval",
    "running": "running…",
}
APPROVAL_LABELS = {"once": "approved once", "always": "always allowed", "allow": "allowed"}


def diff_kind(line: str) -> str | None:
    """The style class of one unified-diff line (None: context)."""
    if line.startswith(("+++", "---")):
        return "diff--file"
    if line.startswith("@@"):
        return "diff--hunk"
    if line.startswith("+"):
        return "diff--added"
    if line.startswith("-"):
        return "diff--removed"
    return None


class DiffView(Widget):
    """A unified diff, coloured per line (theme colours from the stylesheet)."""

    COMPONENT_CLASSES = {"diff--added", "diff--removed", "diff--hunk", "diff--file"}

    diff: reactive[str] = reactive("", layout=True)

    def watch_diff(self, diff: str) -> None:
        self.display = bool(diff)

    def on_mount(self) -> None:
        self.display = bool(self.diff)

    def render(self) -> Text:
        text = Text(no_wrap=False)
        for line in clean(self.diff).rstrip("\n").splitlines():
            kind = diff_kind(line)
            text.append(line, style=self.get_component_rich_style(kind) if kind else "")
            text.append("\n")
        text.rstrip()
        return text


class AgentNotice(Static):
    """A one-line note in the transcript: malformed call, compaction, cancelled, error."""

    def __init__(self, text: str, kind: str) -> None:
        super().__init__(clean(text), markup=False, classes=f"agent-notice -{kind}")
        self.kind = kind
        self.text = clean(text)


class ToolCard(Collapsible):
    """One call, keyed by its id (``call_<step>_<n>``)."""

    BINDINGS = [
        Binding("c", "copy", "Copy the tool output"),
        Binding("d", "copy_diff", "Copy the diff"),
    ]

    def __init__(self, call_id: str, tool: str | None = None, *, collapsed: bool = False) -> None:
        self.call_id = call_id
        self.tool = tool or ""
        self.arguments: dict[str, Any] | None = None
        self.raw = ""  # the call text while it forms
        self.state = "forming"  # forming, parsed, approval, running, done, failed, denied, cancelled
        self.output = ""
        self.exit_code: int | None = None
        self.duration_ms: int | None = None
        self.diff: str | None = None
        self.approval: str | None = None
        self.sandboxed: bool | None = None  # bash: whether it ran inside the sandbox
        self._args = Static("", markup=False, classes="tool-args")
        self._diff = DiffView(classes="tool-diff")
        self._output = Static("", markup=False, classes="tool-output")
        self._meta = Label("", markup=False, classes="tool-meta")
        super().__init__(self._args, self._diff, self._output, self._meta, title=self._title_text(),
                         collapsed=collapsed, classes="tool-card")
        self._refresh()

    # -- filling in ----------------------------------------------------------------------------
    def forming(self, name: str | None, raw: str) -> None:
        self.tool = name or self.tool
        self.raw = raw
        self._refresh()

    def set_call(self, name: str, arguments: dict[str, Any]) -> None:
        self.tool, self.arguments = name, dict(arguments)
        if self.state == "forming":
            self.state = "parsed"
        self._refresh()

    def set_state(self, state: str) -> None:
        self.state = state
        self._refresh()

    def finish(self, *, ok: bool, output: str, approval: str | None, duration_ms: int | None,
               exit_code: int | None = None, diff: str | None = None, cancelled: bool = False,
               sandboxed: bool | None = None) -> None:
        """``cancelled``: the run was cancelled while the tool ran (bash was killed);
        ``sandboxed``: bash ran inside the sandbox (False: unconfined; None: not a shell)."""
        self.sandboxed = sandboxed
        self.output = clean(output)
        self.approval, self.duration_ms, self.exit_code, self.diff = approval, duration_ms, exit_code, diff
        if approval == "cancelled" or cancelled or (approval == "deny" and "was cancelled" in self.output):
            self.state = "cancelled"
        elif approval == "deny":
            self.state = "denied"
        else:
            self.state = "done" if ok else "failed"
        self._refresh()

    # -- display -------------------------------------------------------------------------------
    def subject(self) -> str:
        args = self.arguments or {}
        if self.tool == "bash" and "command" in args:
            text = "$ " + (str(args["command"]).strip().splitlines() or [""])[0]
        elif "path" in args:
            text = str(args["path"])
        elif args:
            text = json.dumps(args, ensure_ascii=False)
        else:
            text = ""
        text = clean(text)
        return text if len(text) <= SUBJECT_WIDTH else text[: SUBJECT_WIDTH - 1] + "…"

    def status(self) -> str:
        if self.state in STATE_LABELS:
            return STATE_LABELS[self.state]
        parts = []
        if self.state in ("denied", "cancelled"):
            parts.append(self.state)
        elif self.exit_code is not None:
            parts.append(f"exit {self.exit_code}")
        elif self.state == "failed":
            parts.append("failed")
        if self.diff:
            added, removed = diff_counts(self.diff)
            parts.append(f"+{added} -{removed}")
        if self.duration_ms is not None and self.state not in ("denied",):
            parts.append(f"{self.duration_ms} ms")
        if self.sandboxed is False:
            parts.append("unsandboxed")
        return " · ".join(parts) or "ok"

    def _title_text(self) -> str:
        head = " ".join(p for p in (self.tool or "tool call", self.subject()) if p)
        return escape(f"{head} · {self.status()}")

    def _args_text(self) -> str:
        args = self.arguments
        if args is None:
            raw = self.raw if len(self.raw) <= FORMING_TAIL else "…" + self.raw[-FORMING_TAIL:]
            return clean(raw)
        if self.tool == "bash" and set(args) <= {"command", "timeout_s"}:
            timeout = f"   (timeout {args['timeout_s']} s)" if "timeout_s" in args else ""
            return clean(f"$ {args.get('command', '')}{timeout}")
        return clean(json.dumps(args, ensure_ascii=False, indent=2))

    def meta_text(self) -> str:
        if self.state in STATE_LABELS:
            return STATE_LABELS[self.state]
        parts = []
        if self.exit_code is not None:
            parts.append(f"exit code {self.exit_code}")
        if self.duration_ms is not None:
            parts.append(f"{self.duration_ms} ms")
        if self.sandboxed is not None:
            parts.append("sandboxed" if self.sandboxed else "NOT sandboxed")
        parts.append(APPROVAL_LABELS.get(self.approval or "", self.state))
        return " · ".join(parts)

    def _refresh(self) -> None:
        self.title = self._title_text()
        for state in ("forming", "failed", "denied", "cancelled", "running", "approval"):
            self.set_class(self.state == state, f"-{state}")
        self._args.update(self._args_text())
        self._diff.diff = self.diff or ""
        output = self.output
        if self.diff:  # the diff is shown above: keep the one-line summary
            output = (output.splitlines() or [""])[0]
        self._output.update(output)
        self._output.display = bool(output)
        self._meta.update(self.meta_text())

    # -- actions -------------------------------------------------------------------------------
    def action_copy(self) -> None:
        self.app.copy_to_clipboard(self.output)
        self.notify("Copied the tool output to the clipboard.")

    def action_copy_diff(self) -> None:
        if not self.diff:
            self.notify("This tool call has no diff.", severity="warning")
            return
        self.app.copy_to_clipboard(self.diff)
        self.notify("Copied the diff to the clipboard.")


def diff_counts(diff: str) -> tuple[int, int]:
    lines = diff.splitlines()
    added = sum(1 for line in lines if diff_kind(line) == "diff--added")
    removed = sum(1 for line in lines if diff_kind(line) == "diff--removed")
    return added, removed
