"""The board screen in the TUI: pilot tests on the scripted engine (create, move, start, open,
review, approval) and a snapshot of the board."""

from __future__ import annotations

import time

from engine.sessions import SessionStore

import pytest

from agents.board.model import Attempt, Card, CheckSpec
from agents.protocol import format_call
from agents.scripted import Reply, scripted_profile
from app.tui.app import MlxtermApp
from app.tui.screens.approval import ApprovalScreen
from app.tui.screens.board import BoardScreen, CardScreen, NewCardScreen
from app.tui.screens.dialogs import TextScreen
from app.tui.widgets.board_card import BoardCard
from app.tui.widgets.prompt import PromptInput
from app.tui.widgets.tool_card import DiffView, ToolCard
from tests.board_engine import RoutedEngine, answer, write
from tests.tui_helpers import palette_offers

SIZE = (150, 36)


class TuiRoutedEngine(RoutedEngine):
    weight_format = "scripted"
    load_ms = 0.0


def make_app(scripts, **kw):
    engine = TuiRoutedEngine(scripts, profile=scripted_profile(capable=True))
    app = MlxtermApp("scripted", engine_factory=lambda spec: engine, store=SessionStore(),
                     memory_probe=lambda: 300 << 20, clock=lambda: 1_750_000_000.0, **kw)
    return app, engine


async def wait_for(pilot, condition, timeout: float = 15.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await pilot.pause(0.02)


async def open_board(pilot, how: str = "key") -> BoardScreen:
    app = pilot.app
    await wait_for(pilot, lambda: app.controller.loaded, what="the model")
    if how == "slash":
        app.query_one(PromptInput).focus()
        await pilot.press(*"/board", "enter")
    elif how == "palette":
        await pilot.press("ctrl+p", *"task board")
        await wait_for(pilot, lambda: palette_offers(app, "task board"), what="the board command")
        await pilot.press("enter")
    else:
        await pilot.press("ctrl+b")
    await wait_for(pilot, lambda: isinstance(app.screen, BoardScreen), what="the board")
    await wait_for(pilot, lambda: board_ready(app.screen), what="the board to start and draw its cards")
    await pilot.pause()
    return app.screen


def board_ready(screen: BoardScreen) -> bool:
    """The board screen's mount is done: its dispatcher started and every column shows the
    cards it holds."""
    if screen.service.dispatcher is None:
        return False
    return all([w.card_id for w in screen.query_one(f"#col-{state}").query(BoardCard)]
               == [c.id for c in screen.columns[state]] for state in screen.columns)


def state(app, cid: int) -> str:
    return app.board.board.get(cid).state


def column_of(screen: BoardScreen, cid: int) -> str | None:
    for s, cards in screen.columns.items():
        if any(c.id == cid for c in cards):
            return s
    return None


def key_card(key: str, **kw) -> Card:
    return Card(id=0, title=f"task {key}", prompt=f"[card-{key}] make {key}.txt",
                checks=[CheckSpec("exists", f"test -f {key}.txt")], **kw)


@pytest.mark.parametrize("how", ["key", "slash", "palette"])
async def test_board_opens_from_key_slash_and_palette(how):
    app, _ = make_app({})
    async with app.run_test(size=SIZE) as pilot:
        screen = await open_board(pilot, how)
        assert [c.border_title for c in screen.query(".board-column")][:3] == ["backlog (0)", "queued (0)",
                                                                              "running (0)"]
        await pilot.press("escape")
        assert not isinstance(app.screen, BoardScreen)


async def test_create_card_with_the_form_runs_it_to_review():
    app, engine = make_app({"new": [write("new.txt", "x"), answer("Made new.txt.")]})
    async with app.run_test(size=SIZE) as pilot:
        screen = await open_board(pilot)
        await pilot.press("n")
        await wait_for(pilot, lambda: isinstance(app.screen, NewCardScreen), what="the form")
        await pilot.press(*"make new", "tab", *"[card-new] create new.txt", "tab", "tab", "tab")
        app.screen.query_one("#card-checks").text = "test -f new.txt"
        await pilot.press("ctrl+s")
        await wait_for(pilot, lambda: app.board.board.cards(), what="the card")
        cid = app.board.board.cards()[0].id
        card = app.board.board.get(cid)
        assert card.title == "make new" and card.checks[0].run == "test -f new.txt"
        await wait_for(pilot, lambda: state(app, cid) == "review", what="review")
        await wait_for(pilot, lambda: column_of(screen, cid) == "review", what="the review column")
        # the board re-renders its columns on every change (a card widget is mounted, then
        # filled): wait until the widget shows the finished attempt
        def card_text() -> str:
            cards = screen.query(BoardCard)
            return str(cards.first().render()) if cards else ""

        await wait_for(pilot, lambda: "attempt 1 passed" in card_text(), what="the card's status")
        assert "#1 make new" in card_text() and "attempt 1 passed ✓ 1/1" in card_text()


async def test_move_start_cancel_archive_with_keys():
    app, _ = make_app({"a": [Reply(format_call("write_file", {"content": "a" * 300, "path": "a.txt"}),
                                   delay_s=0.02), answer()], "b": []})
    async with app.run_test(size=SIZE) as pilot:
        a = app.board.board.add(key_card("a"))
        b = app.board.board.add(key_card("b"))
        screen = await open_board(pilot)
        await screen.refresh_board()
        assert screen.selected().id == a.id  # backlog, first card
        await pilot.press("shift+left")  # nothing to the left of the backlog
        await pilot.press("j")
        assert screen.selected().id == b.id
        await pilot.press("a")  # archive b
        assert state(app, b.id) == "archived" and column_of(screen, b.id) is None
        await pilot.press("shift+right")  # a: backlog -> queued; the dispatcher starts it
        await wait_for(pilot, lambda: state(app, a.id) == "running", what="running")
        await screen.refresh_board()
        assert column_of(screen, a.id) == "running" and screen.selected().id == a.id
        await pilot.press("shift+right")  # a running card is not moved by hand
        assert state(app, a.id) == "running"
        await pilot.press("x")  # cancel
        await wait_for(pilot, lambda: column_of(screen, a.id) == "backlog", what="cancelled")
        assert state(app, a.id) == "backlog" and screen.selected().id == a.id
        await pilot.press("s")  # start again: it resumes its session
        await wait_for(pilot, lambda: len(app.board.board.attempts(a.id)) >= 2, what="restarted")
        assert app.board.board.attempts(a.id)[1].kind == "resume"


async def test_open_card_review_reject_then_approve():
    app, engine = make_app({"a": [write("a.txt", "a"), answer("Wrote it."), write("a.txt", "A!"),
                                  answer("Changed it.")]})
    async with app.run_test(size=SIZE) as pilot:
        a = app.board.board.add(key_card("a", state="queued"))
        screen = await open_board(pilot)
        await wait_for(pilot, lambda: state(app, a.id) == "review", what="review")
        await screen.refresh_board()
        screen.select(a.id)
        await pilot.press("enter")
        await wait_for(pilot, lambda: isinstance(app.screen, CardScreen), what="the card screen")
        card_screen = app.screen
        await wait_for(pilot, lambda: "attempt 1 (first): passed" in str(card_screen.query_one("#card-attempts").render()),
                       what="the attempt list")
        await pilot.press("3")
        assert "+++ b/a.txt" in card_screen.query_one(DiffView).diff
        assert "✓ exists" in str(card_screen.query_one("#card-checks").render())
        assert card_screen.query(ToolCard)  # the stored run, as tool cards
        await pilot.press("n")
        await wait_for(pilot, lambda: isinstance(app.screen, TextScreen), what="the comment box")
        await pilot.press(*"use capital A", "enter")
        await wait_for(pilot, lambda: len(app.board.board.attempts(a.id)) == 2
                       and state(app, a.id) == "review", what="the follow-up")
        first, second = app.board.board.attempts(a.id)
        assert second.kind == "followup" and second.session_id == first.session_id
        await wait_for(pilot, lambda: "A!" in card_screen.query_one(DiffView).diff, what="the new diff")
        await pilot.press("y")
        await wait_for(pilot, lambda: state(app, a.id) == "done", what="done")
        await pilot.press("o")  # the card's HTML report: both attempts, the model's words escaped
        from engine import paths

        html = (paths.data_dir() / "reports" / f"card-{a.id}.html").read_text()
        assert "attempt 2" in html and "exists" in html and "a.txt" in html
        await pilot.press("escape")
        assert isinstance(app.screen, BoardScreen)


async def test_card_waiting_for_approval_shows_it_and_opens_the_dialog():
    bash = format_call("bash", {"command": "echo hi > b.txt"})
    app, _ = make_app({"b": [bash, answer("Ran it.")]})
    async with app.run_test(size=SIZE) as pilot:
        b = app.board.board.add(key_card("b", state="queued"))
        screen = await open_board(pilot)
        await wait_for(pilot, lambda: (r := app.board.running(b.id)) is not None and r.pending_approval,
                       what="the approval request")
        await screen.refresh_board()
        widget = screen.query_one(BoardCard)
        assert "waiting for approval: bash" in str(widget.render()) and widget.has_class("-approval")
        screen.select(b.id)
        await pilot.press("enter")
        await wait_for(pilot, lambda: isinstance(app.screen, ApprovalScreen), what="the approval dialog")
        await pilot.press("y")
        await wait_for(pilot, lambda: state(app, b.id) == "review", what="review")
        assert app.board.board.attempts(b.id)[0].checks[0]["passed"]


async def test_board_keeps_running_while_chatting():
    app, engine = make_app({"a": [write("a.txt", "a", delay_s=0.01), answer()]})
    async with app.run_test(size=SIZE) as pilot:
        a = app.board.board.add(key_card("a", state="queued"))
        await open_board(pilot)
        await pilot.press("escape")  # back to the chat while the card runs
        await wait_for(pilot, lambda: state(app, a.id) == "review", what="review while chatting")


async def test_cards_queued_before_launch_run_without_opening_the_board():
    from agents.board.store import BoardStore, default_path

    assert not default_path().exists()
    app, _ = make_app({})
    async with app.run_test(size=SIZE) as pilot:  # no board yet: none is created
        await wait_for(pilot, lambda: app.controller.loaded, what="the model")
        assert app.board.dispatcher is None and not default_path().exists()
    board = BoardStore()  # e.g. `mlxterm tasks add --queue` while the app was closed
    cid = board.add(key_card("q", state="queued")).id
    board.close()
    app, _ = make_app({"q": [write("q.txt", "x"), answer("Made q.txt.")]})
    async with app.run_test(size=SIZE) as pilot:
        await wait_for(pilot, lambda: state(app, cid) == "review", what="the card in review")
        assert not isinstance(app.screen, BoardScreen)
        assert any("1 board card waiting to run" in n.message for n in app._notifications)


async def test_profile_switch_waits_for_cards_on_the_chat_model():
    app, engine = make_app({"a": [write("a.txt", "a" * 400, delay_s=0.02), answer()]})
    async with app.run_test(size=SIZE) as pilot:
        a = app.board.board.add(key_card("a", state="queued"))
        await open_board(pilot)
        await wait_for(pilot, lambda: app.board.cards_on(engine) == [a.id], what="the card on the chat engine")
        await pilot.press("escape")
        main = app.screen_stack[0]
        main.load_profile("other")
        assert main._loading is None and app.controller.engine is engine  # refused, said why
        app.board.cancel(a.id)
        await wait_for(pilot, lambda: state(app, a.id) == "backlog", what="cancelled")


def _snapshot_board(board):
    def add(card, attempt=None):
        c = board.add(card)
        if attempt is not None:
            att = board.new_attempt(c.id, "first", card.prompt)
            for k, v in attempt.items():
                setattr(att, k, v)
            board.save_attempt(att)
        return c

    add(key_card("a", labels=["docs"]))
    add(key_card("b", priority=2))
    r = add(key_card("c", state="queued"), {"status": "passed", "checks": [
        {"name": "exists", "run": "test -f c.txt", "passed": True, "exit_code": 0, "output": ""}]})
    board.move(r.id, "running")
    board.move(r.id, "review")
    f = add(key_card("d", state="queued", labels=["bug"]), {"status": "failed", "checks": [
        {"name": "exists", "run": "test -f d.txt", "passed": False, "exit_code": 1, "output": ""}]})
    board.move(f.id, "running")
    board.move(f.id, "failed", reason="attempt 1 failed; 0 retries used")
    d = add(key_card("e", state="queued"), {"status": "passed", "checks": []})
    board.move(d.id, "running")
    board.move(d.id, "done")


def test_board_snapshot(snap_compare):
    app, _ = make_app({})
    _snapshot_board(app.board.board)

    async def ready(pilot):
        screen = await open_board(pilot)
        # on_mount ends by starting the dispatcher (nothing queued: it stays idle); by then
        # every card is drawn and no redraw is pending
        await wait_for(
            pilot,
            lambda: app.board.dispatcher is not None
            and len(screen.query(BoardCard)) == 5
            and not screen._refresh_pending,
            what="the board drawn",
        )
        await pilot.pause()

    assert snap_compare(app, terminal_size=SIZE, run_before=ready)


def test_attempt_dataclass_roundtrip(tmp_path):
    from agents.board.store import BoardStore

    b = BoardStore(tmp_path / "b.sqlite3")
    c = b.add(key_card("z"))
    att = b.new_attempt(c.id, "first", "p")
    assert isinstance(att, Attempt) and b.attempts(c.id)[0].prompt == "p"


async def test_repair_round_and_unchecked_card_in_the_card_screen():
    """A card whose first answer fails its check is repaired in the same attempt (the live agent
    tab says so); a card without checks lands in review marked unchecked and unchanged."""
    from app.tui.widgets.tool_card import AgentNotice

    app, _ = make_app({"r": [write("r.txt", "x", delay_s=0.03), answer("Wrote it."), write("r.txt", "r"),
                             answer("Fixed it.")],
                       "u": [answer("Nothing to do.")] * 2})
    async with app.run_test(size=SIZE) as pilot:
        r = app.board.board.add(Card(id=0, title="task r", prompt="[card-r] make r.txt", state="queued",
                                     checks=[CheckSpec("content", 'test "$(cat r.txt)" = r')]))
        screen = await open_board(pilot)
        screen.select(r.id)
        await pilot.press("enter")
        await wait_for(pilot, lambda: isinstance(app.screen, CardScreen), what="the card screen")
        card_screen = app.screen
        await wait_for(pilot, lambda: state(app, r.id) == "review", what="review")
        await wait_for(pilot, lambda: any(n.kind == "repair" for n in card_screen.query(AgentNotice)),
                       what="the repair notice")
        (att,) = app.board.board.attempts(r.id)
        assert att.first_try["status"] == "failed" and att.repair_rounds[0]["status"] == "passed"
        await card_screen.refresh_card()
        await pilot.press("3")
        review = str(card_screen.query_one("#card-checks").render())
        assert "first try: failed (0 passed, 1 failed)" in review and "repair round 1: passed" in review
        assert "1 repair round" in str(card_screen.query_one("#card-attempts").render())
        await pilot.press("escape")
        u = app.board.board.add(Card(id=0, title="task u", prompt="[card-u] what is u?", state="queued",
                                     auto_accept=True))
        await wait_for(pilot, lambda: state(app, u.id) == "review", what="the unchecked card in review")
        await screen.refresh_board()
        widget = next(w for w in screen.query(BoardCard) if w.card_id == u.id)
        assert "attempt 1 unchecked · no changes" in str(widget.render()) and widget.has_class("-unchecked")


async def test_corrective_turn_shows_once_in_the_card_screen():
    """A final answer that did the work nowhere is sent back once: one notice, not one per
    consumer of the event (the agent view renders it; the card screen adds nothing)."""
    from app.tui.widgets.tool_card import AgentNotice

    app, _ = make_app({"k": [answer("Nothing to write; the answer is k.", delay_s=0.03), answer("Still nothing.")]})
    async with app.run_test(size=SIZE) as pilot:
        k = app.board.board.add(Card(id=0, title="task k", prompt="[card-k] create k.txt containing k",
                                     state="queued", auto_accept=True))
        screen = await open_board(pilot)
        screen.select(k.id)
        await pilot.press("enter")
        await wait_for(pilot, lambda: isinstance(app.screen, CardScreen), what="the card screen")
        card_screen = app.screen
        await wait_for(pilot, lambda: state(app, k.id) == "review", what="review")
        notes = lambda: [n for n in card_screen.query(AgentNotice) if n.kind == "corrective"]  # noqa: E731
        await wait_for(pilot, lambda: bool(notes()), what="the corrective notice")
        await pilot.pause(0.2)
        assert len(notes()) == 1
