"""The task board screen (``/board``, Ctrl+B, the palette), the card screen and the new-card form.

Keyboard first: arrows or hjkl move the cursor, Shift+Left/Right move the selected card to the
neighbouring column (moves the transitions table forbids are refused with its reason; moving
into queued starts the card when a slot is free), ``n`` new card, ``s`` start, ``x`` cancel,
``r`` retry, ``a`` archive, Enter opens the card: its attempts, the live agent view (the same
tool cards as agent mode), and a review tab with the workspace diff and the check output,
where ``y`` approves and ``n`` rejects with a comment. The board reads the store; the app's
``BoardService`` runs the cards, so they keep running when you go back to the chat.
"""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path

from engine.errors import MlxtermError

from textual import work
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical, VerticalScroll
from textual.screen import ModalScreen, Screen
from textual.widgets import Button, Footer, Input, Label, Static, TabbedContent, TabPane, TextArea

from agents.board import actions
from agents.board.model import Card, CheckSpec
from agents.events import AgentDone, AgentEventHandler, ApprovalNeeded, StepStart, ToolFinished
from app.tui.agent_view import AgentRunView
from app.tui.format import clean
from app.tui.screens.approval import ApprovalScreen, ask_approval
from app.tui.screens.dialogs import TextScreen
from app.tui.widgets.board_card import BoardCard
from app.tui.widgets.conversation import Conversation
from app.tui.widgets.tool_card import DiffView

log = logging.getLogger(__name__)
COLUMNS = ("backlog", "queued", "running", "review", "done", "failed", "blocked")
HELP = ("←→↑↓/hjkl select · Shift+←/→ move · n new · s start · x cancel · r retry · a archive · "
        "Enter open · Esc back")


class BoardScreen(Screen):
    BINDINGS = [
        Binding("left,h", "cursor(-1, 0)", "Left", show=False),
        Binding("right,l", "cursor(1, 0)", "Right", show=False),
        Binding("up,k", "cursor(0, -1)", "Up", show=False),
        Binding("down,j", "cursor(0, 1)", "Down", show=False),
        Binding("shift+left", "shift(-1)", "Move left"),
        Binding("shift+right", "shift(1)", "Move right"),
        Binding("n", "new_card", "New card"),
        Binding("s", "start", "Start"),
        Binding("x", "cancel", "Cancel"),
        Binding("r", "retry", "Retry"),
        Binding("a", "archive", "Archive"),
        Binding("enter", "open", "Open"),
        Binding("escape", "back", "Back to chat"),
    ]

    def __init__(self) -> None:
        super().__init__()
        self.col = 0
        self.row = 0
        self.columns: dict[str, list[Card]] = {s: [] for s in COLUMNS}
        self._refresh_pending = False
        self._refresh_lock = asyncio.Lock()

    @property
    def service(self):
        return self.app.board

    @property
    def board(self):
        return self.service.board

    def compose(self) -> ComposeResult:
        with Horizontal(id="board-columns"):
            for state in COLUMNS:
                col = VerticalScroll(id=f"col-{state}", classes="board-column")
                col.border_title = state
                col.can_focus = False
                yield col
        yield Label(HELP, id="board-help")
        yield Footer()

    async def on_mount(self) -> None:
        self.service.on_change.append(self._changed_from_thread)
        self.set_interval(1.0, self._tick)
        await self.refresh_board()
        try:
            await asyncio.to_thread(self.service.start)
        except MlxtermError as e:
            self.notify(str(e), severity="error")

    def on_unmount(self) -> None:
        if self._changed_from_thread in self.service.on_change:
            self.service.on_change.remove(self._changed_from_thread)

    def _changed_from_thread(self, card_id: int) -> None:
        try:
            self.app.call_from_thread(self._schedule_refresh)
        except RuntimeError:  # called on the UI thread itself (a UI action moved the card)
            self._schedule_refresh()

    def _schedule_refresh(self) -> None:
        if not self._refresh_pending:
            self._refresh_pending = True
            self.call_later(self.refresh_board)

    async def _tick(self) -> None:
        if self.columns["running"]:
            await self.refresh_board()

    # -- drawing --------------------------------------------------------------------------------
    async def refresh_board(self) -> None:
        async with self._refresh_lock:  # one redraw at a time (they await mounts)
            await self._redraw()

    async def _redraw(self) -> None:
        self._refresh_pending = False
        selected = self.selected()
        cards = self.board.cards(COLUMNS)
        self.columns = {s: [c for c in cards if c.state == s] for s in COLUMNS}
        if selected is not None:  # the cursor follows the card it was on
            for ci, state in enumerate(COLUMNS):
                for ri, c in enumerate(self.columns[state]):
                    if c.id == selected.id:
                        self.col, self.row = ci, ri
        for state in COLUMNS:
            column = self.query_one(f"#col-{state}", VerticalScroll)
            column.border_title = f"{state} ({len(self.columns[state])})"
            have = [w.card_id for w in column.query(BoardCard)]
            want = [c.id for c in self.columns[state]]
            if have != want:
                await column.remove_children()
                await column.mount_all([BoardCard(cid) for cid in want])
            for widget, card in zip(column.query(BoardCard), self.columns[state], strict=False):
                run = self.service.running(card.id) if card.state == "running" else None
                widget.show(card, self.board.last_attempt(card.id), run)
        self._clamp()
        self._draw_cursor()

    def _clamp(self) -> None:
        self.col = max(0, min(self.col, len(COLUMNS) - 1))
        n = len(self.columns[COLUMNS[self.col]])
        self.row = max(0, min(self.row, n - 1)) if n else 0

    def _draw_cursor(self) -> None:
        for ci, state in enumerate(COLUMNS):
            column = self.query_one(f"#col-{state}", VerticalScroll)
            column.set_class(ci == self.col, "-current")
            for ri, widget in enumerate(column.query(BoardCard)):
                on = ci == self.col and ri == self.row
                widget.set_class(on, "-selected")
                if on:
                    column.scroll_to_widget(widget, animate=False)

    def selected(self) -> Card | None:
        cards = self.columns.get(COLUMNS[self.col], [])
        return cards[self.row] if 0 <= self.row < len(cards) else None

    def select(self, card_id: int) -> None:
        for ci, state in enumerate(COLUMNS):
            for ri, c in enumerate(self.columns[state]):
                if c.id == card_id:
                    self.col, self.row = ci, ri
        self._draw_cursor()

    # -- actions --------------------------------------------------------------------------------
    def action_cursor(self, dx: int, dy: int) -> None:
        if dx:
            self.col = (self.col + dx) % len(COLUMNS)
        self.row += dy
        self._clamp()
        self._draw_cursor()

    async def _do(self, fn, *args) -> Card | None:
        try:
            card = await asyncio.to_thread(fn, *args)
        except MlxtermError as e:
            self.notify(str(e), severity="warning")
            return None
        self.service.wake()
        await self.refresh_board()
        return card

    async def action_shift(self, step: int) -> None:
        card = self.selected()
        if card is None:
            return
        i = COLUMNS.index(card.state) + step
        if not 0 <= i < len(COLUMNS):
            return
        target = COLUMNS[i]
        if target == "running":  # only the dispatcher starts a card: skip over the column
            i += step
            target = COLUMNS[i] if 0 <= i < len(COLUMNS) else card.state
        moved = await self._do(actions.move_by_hand, self.board, card.id, target)
        if moved is not None:
            self.select(moved.id)

    async def action_start(self) -> None:
        card = self.selected()
        if card is not None:
            await self._do(actions.start, self.board, card.id)

    async def action_cancel(self) -> None:
        card = self.selected()
        if card is not None:
            await self._do(self.service.cancel, card.id)

    async def action_retry(self) -> None:
        card = self.selected()
        if card is not None:
            await self._do(actions.retry, self.board, card.id)

    async def action_archive(self) -> None:
        card = self.selected()
        if card is not None:
            await self._do(actions.archive, self.board, card.id)

    def action_new_card(self) -> None:
        default = ""
        try:
            default = self.service.default_profile()
        except MlxtermError:
            pass

        async def made(values: dict | None) -> None:
            if values:
                card = await self._do(self._add, values)
                if card is not None:
                    self.select(card.id)
                    self.notify(f"Card {card.id} queued: {card.title}")

        self.app.push_screen(NewCardScreen(default), made)

    def _add(self, values: dict) -> Card:
        workspace = actions.workspace_spec(values["workspace"] or None)
        checks = [CheckSpec(f"check {i + 1}", line) for i, line in enumerate(values["checks"])]
        card = Card(id=0, title=values["title"], prompt=values["prompt"], state="queued",
                    profile=values["profile"] or None, workspace=workspace, checks=checks)
        return self.board.add(card)

    def action_open(self) -> None:
        card = self.selected()
        if card is not None:
            self.app.push_screen(CardScreen(card.id))

    def action_back(self) -> None:
        self.app.pop_screen()


class NewCardScreen(ModalScreen[dict | None]):
    """The new-card form: title, prompt, workspace (a directory copied for the card; empty
    for a new one), profile (empty: the best agent-capable one) and checks (one per line)."""

    BINDINGS = [Binding("escape", "dismiss(None)", "Cancel"), Binding("ctrl+s", "add", "Add card")]
    AUTO_FOCUS = "#card-title"

    def __init__(self, default_profile: str = "") -> None:
        super().__init__(classes="dialog-screen")
        self.default_profile = default_profile

    def compose(self) -> ComposeResult:
        with Vertical(classes="dialog -wide", id="card-form"):
            yield Label("New card", classes="dialog-title")
            yield Input(placeholder="Title", id="card-title")
            yield Input(placeholder="Prompt: what the agent should do", id="card-prompt")
            yield Input(placeholder="Workspace template directory (empty: a new directory)", id="card-workspace")
            yield Input(placeholder=f"Profile (default: {self.default_profile or 'best agent-capable'})",
                        id="card-profile")
            yield TextArea(id="card-checks", soft_wrap=True)
            yield Label("Checks: one shell command per line, run in the workspace. Ctrl+S adds the card.",
                        classes="dialog-hint")
            with Horizontal(classes="dialog-buttons"):
                yield Button("Add card (Ctrl+S)", variant="primary", id="card-add")
                yield Button("Cancel", id="card-cancel")

    def values(self) -> dict:
        get = lambda wid: self.query_one(wid, Input).value.strip()  # noqa: E731
        checks = [ln.strip() for ln in self.query_one("#card-checks", TextArea).text.splitlines() if ln.strip()]
        prompt = get("#card-prompt")
        return {"title": get("#card-title") or prompt[:60], "prompt": prompt, "workspace": get("#card-workspace"),
                "profile": get("#card-profile"), "checks": checks}

    def action_add(self) -> None:
        values = self.values()
        if not values["prompt"]:
            self.notify("The card needs a prompt.", severity="warning")
            self.query_one("#card-prompt").focus()
            return
        ws = values["workspace"]
        if ws and not Path(ws).expanduser().is_dir():
            self.notify(f"{ws} is not a directory.", severity="warning")
            return
        self.dismiss(values)

    def on_input_submitted(self, event: Input.Submitted) -> None:
        event.stop()
        self.focus_next()

    def on_button_pressed(self, event: Button.Pressed) -> None:
        event.stop()
        if event.button.id == "card-add":
            self.action_add()
        else:
            self.dismiss(None)


class _CardRunEvents(AgentEventHandler):
    """The card screen's own part of a live run's events (its ``AgentRunView`` renders them):
    the repair-round notice, approvals. Runs before the view sees the event."""

    def __init__(self, screen: CardScreen) -> None:
        self.screen = screen
        self.attempt = 0
        self.runs_done = 0  # agent runs finished in this attempt

    def handle_run(self, attempt: int, ev):
        if attempt != self.attempt:
            self.attempt, self.runs_done = attempt, 0
        return self.handle(ev)

    async def on_step_start(self, ev: StepStart) -> None:
        if ev.step == 1 and self.runs_done and self.screen.view is not None:
            # a new run inside the same attempt: the checks failed and went back to the agent
            await self.screen.view.notice(f"Repair round {self.runs_done}: the checks failed; their output "
                                          "went back to the agent.", "repair")

    async def on_agent_done(self, ev: AgentDone) -> None:
        self.runs_done += 1

    async def on_approval_needed(self, ev: ApprovalNeeded) -> None:
        card = self.screen.view.card(ev.call.id) if self.screen.view is not None else None
        if card is not None:
            card.set_state("approval")
        self.screen._ask(ev)

    async def on_tool_finished(self, ev: ToolFinished) -> None:
        self.screen._close_approval()


class CardScreen(Screen):
    """One card: attempts, the live (or last) agent run, and the review tab."""

    BINDINGS = [
        Binding("escape", "back", "Back to the board"),
        Binding("y", "approve", "Approve"),
        Binding("n", "reject", "Reject with comment"),
        Binding("o", "report", "HTML report"),
        Binding("1", "tab('attempts')", "Attempts", show=False),
        Binding("2", "tab('agent')", "Agent", show=False),
        Binding("3", "tab('review')", "Review", show=False),
    ]

    def __init__(self, card_id: int) -> None:
        super().__init__()
        self.card_id = card_id
        self.view: AgentRunView | None = None
        self._queue: asyncio.Queue = asyncio.Queue()
        self._live_session: str | None = None
        self._events = _CardRunEvents(self)
        self._approval: ApprovalScreen | None = None

    @property
    def service(self):
        return self.app.board

    def compose(self) -> ComposeResult:
        yield Label("", id="card-head", markup=False)
        with TabbedContent(initial="attempts", id="card-tabs"):
            with TabPane("Attempts (1)", id="attempts"), VerticalScroll():
                yield Static("", id="card-attempts", markup=False)
            with TabPane("Agent (2)", id="agent"):
                yield Conversation(id="card-conversation")
            with TabPane("Review (3)", id="review"), VerticalScroll(id="review-scroll"):
                yield Static("", id="card-checks", markup=False)
                yield DiffView(id="card-diff")
        yield Footer()

    async def on_mount(self) -> None:
        self.service.on_event.append(self._event_from_thread)
        self.service.on_change.append(self._changed_from_thread)
        self._consume()
        await self.refresh_card(load_agent=True)
        run = self.service.running(self.card_id)
        if run is not None and run.pending_approval is not None:
            self._ask(run.pending_approval)

    def on_unmount(self) -> None:
        for lst, fn in ((self.service.on_event, self._event_from_thread),
                        (self.service.on_change, self._changed_from_thread)):
            if fn in lst:
                lst.remove(fn)

    def _event_from_thread(self, run, ev) -> None:
        if run.card.id == self.card_id:
            self.app.call_from_thread(self._queue.put_nowait, (run, ev))

    def _changed_from_thread(self, card_id: int) -> None:
        if card_id == self.card_id:
            try:
                self.app.call_from_thread(self.call_later, self.refresh_card)
            except RuntimeError:
                self.call_later(self.refresh_card)

    @work(exclusive=True, group="card-events")
    async def _consume(self) -> None:
        while True:
            run, ev = await self._queue.get()
            if self.view is None or self._live_session != run.attempt.session_id:
                self._live_session = run.attempt.session_id
                conv = self.query_one("#card-conversation", Conversation)
                await conv.show([])
                self.view = AgentRunView(conv)
            pending = self._events.handle_run(run.attempt.number, ev)
            if pending is not None:
                await pending
            await self.view.event(ev)

    def _ask(self, ev: ApprovalNeeded) -> None:
        if self._approval is not None or ev.request.answered:
            return
        card = self.service.board.get(self.card_id)
        def closed(screen: ApprovalScreen) -> None:
            self._approval = None

        self._approval = ask_approval(self.app, ev, card.workspace_dir, closed)

    def _close_approval(self) -> None:
        screen, self._approval = self._approval, None
        if screen is not None and self.app.screen is screen:
            screen.dismiss("deny")

    def action_report(self) -> None:
        """Write this card's standalone HTML report (attempts, steps, checks) and say where."""
        from engine import paths

        from agents.board.actions import export_card
        from app.report import write_report

        out = paths.data_dir() / "reports" / f"card-{self.card_id}.html"
        out.parent.mkdir(parents=True, exist_ok=True)
        write_report([export_card(self.service.board, self.card_id)], out, title=f"mlxterm card {self.card_id}")
        self.notify(f"report written: {out}", timeout=8)

    async def refresh_card(self, load_agent: bool = False) -> None:
        board = self.service.board
        card = board.get(self.card_id)
        attempts = board.attempts(self.card_id)
        head = f"#{card.id} {card.title} — {card.state}"
        if card.reason:
            head += f" ({card.reason})"
        self.query_one("#card-head", Label).update(clean(head))
        self.query_one("#card-attempts", Static).update(attempts_text(card, attempts))
        last = attempts[-1] if attempts else None
        self.query_one("#card-checks", Static).update(checks_text(card, last))
        self.query_one("#card-diff", DiffView).diff = (last.diff or "") if last else ""
        if load_agent and last is not None and last.session_id and self.service.running(self.card_id) is None:
            msgs = await asyncio.to_thread(self.app.controller.messages, last.session_id)
            await self.query_one("#card-conversation", Conversation).show(msgs, agent=True,
                                                                          workspace=card.workspace_dir)

    def action_tab(self, tab: str) -> None:
        self.query_one(TabbedContent).active = tab

    async def action_approve(self) -> None:
        try:
            await asyncio.to_thread(actions.approve, self.service.board, self.card_id)
        except MlxtermError as e:
            self.notify(str(e), severity="warning")
            return
        self.notify(f"Card {self.card_id} approved: done.")
        await self.refresh_card()

    def action_reject(self) -> None:
        async def commented(text: str | None) -> None:
            if not text:
                return
            try:
                await asyncio.to_thread(actions.reject, self.service.board, self.card_id, text)
            except MlxtermError as e:
                self.notify(str(e), severity="warning")
                return
            self.service.wake()
            self.notify(f"Card {self.card_id} sent back: a follow-up attempt continues its session.")
            await self.refresh_card()

        card = self.service.board.get(self.card_id)
        if card.state != "review":
            self.notify(f"Card {card.id} is {card.state}; only cards in review can be rejected.",
                        severity="warning")
            return
        self.app.push_screen(TextScreen("Reject: what should change?", placeholder="comment for the agent"),
                             commented)

    def action_back(self) -> None:
        self.app.pop_screen()


def attempts_text(card: Card, attempts) -> str:
    lines = [f"prompt: {card.prompt}",
             f"profile: {card.profile or '(best agent-capable)'} · priority {card.priority} · "
             f"retries {card.retries_used}/{card.max_retries} · workspace {card.workspace_dir or '(not made yet)'}"]
    if card.depends_on:
        lines.append(f"after cards {', '.join(map(str, card.depends_on))}")
    if not attempts:
        lines.append("no attempts yet")
    for a in attempts:
        t = a.tokens
        ratio = a.first_step_cached_ratio
        line = f"attempt {a.number} ({a.kind}): {a.status}"
        if a.stop_reason:
            line += f", {a.stop_reason}"
        if a.wall_s is not None:
            line += f", {a.wall_s:.1f} s"
        if a.requests:
            line += f", {a.requests} requests, {t['completion']} tokens"
        if ratio is not None:
            line += f", first step {ratio:.0%} cached"
        if a.checks:
            line += ", checks " + " ".join(("✓ " if c["passed"] else "✗ ") + c["name"] for c in a.checks)
        for note in a.notes():
            line += f", {note}"
        if a.error:
            line += f" — {a.error}"
        lines.append(line)
    return clean("\n".join(lines))


def checks_text(card: Card, attempt) -> str:
    if attempt is None:
        return "No attempt yet: nothing to review."
    lines = [f"attempt {attempt.number}: {attempt.status}"
             + (" — y approves, n rejects with a comment" if card.state == "review" else "")]
    if attempt.status == "unchecked":
        lines.append("⚠ unchecked: this card has no checks, so nothing verified the work; review it yourself")
    if attempt.workspace_changed is False:
        lines.append("⚠ no file in the workspace changed during this attempt")
    ft = attempt.first_try
    if ft and attempt.repair_rounds:
        lines.append(f"first try: {ft.get('status')} ({ft.get('checks_passed')} passed, "
                     f"{ft.get('checks_failed')} failed)")
        for r in attempt.repair_rounds:
            lines.append(f"repair round {r.get('round')}: {r.get('status')} ({r.get('checks_passed')} passed, "
                         f"{r.get('checks_failed')} failed)")
    if attempt.corrective_turns:
        lines.append(f"{attempt.corrective_turns} corrective turn(s): an answer that did not do the work was sent back")
    for c in attempt.checks:
        lines.append(f"{'✓' if c['passed'] else '✗'} {c['name']}: {c['run']} (exit {c['exit_code']})")
        out = (c.get("output") or "").strip()
        if out:
            lines.extend("    " + ln for ln in out.splitlines()[-20:])
    if not attempt.checks and attempt.status != "unchecked":
        lines.append("(no checks ran)" if card.checks else "(this card has no checks)")
    lines.append("" if attempt.diff else "(no changes in the workspace)")
    return clean("\n".join(lines))
