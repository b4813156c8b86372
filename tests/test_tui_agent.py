"""Agent mode in the TUI: pilot tests on a scripted model (``agents.scripted.ScriptedEngine``).

The app loads its "model" through the ``engine_factory`` seam, so every reply, tool call and
approval is fixed; the tools run for real in the session's workspace.
"""

from __future__ import annotations

import contextlib
import threading
import time
from pathlib import Path

from engine.sessions import SessionStore

import pytest

from agents.protocol import format_call
from agents.scripted import Reply, ScriptedEngine, scripted_profile
from app.tui.app import MlxtermApp
from app.tui.screens.approval import ApprovalScreen
from app.tui.widgets.message import MessageView
from app.tui.widgets.prompt import PromptInput
from app.tui.widgets.tool_card import AgentNotice, DiffView, ToolCard
from tests.tui_helpers import palette_offers
from tools.sandbox import probe

SIZE = (120, 40)


class TuiScriptedEngine(ScriptedEngine):
    """What the status bar reads besides the agent surface."""

    weight_format = "scripted"
    load_ms = 0.0


def call(name: str, **args) -> str:
    return format_call(name, args)


def make_app(replies, profile=None, **kwargs) -> tuple[MlxtermApp, TuiScriptedEngine]:
    engine = TuiScriptedEngine(replies, profile=profile)
    kwargs.setdefault("memory_probe", lambda: 300 << 20)
    kwargs.setdefault("store", SessionStore())
    return MlxtermApp("scripted", engine_factory=lambda spec: engine, **kwargs), engine


async def wait_for(pilot, condition, timeout: float = 10.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await pilot.pause(0.02)


def main(app):
    return app.screen_stack[0]


def cards(app) -> list[ToolCard]:
    return list(main(app).conversation.query(ToolCard))


def notices(app) -> list[str]:
    return [n.text for n in main(app).conversation.query(AgentNotice)]


def replies(app) -> list[str]:
    return [v.content.strip() for v in main(app).conversation.query(MessageView) if v.role == "assistant"]


async def start_agent(pilot, arg: str = "", palette: bool = False) -> None:
    app = pilot.app
    await wait_for(pilot, lambda: app.controller.loaded, what="the scripted model")
    prompt = app.query_one(PromptInput)
    prompt.focus()
    if palette:
        await pilot.press("ctrl+p", *"agent mode")
        await wait_for(pilot, lambda: palette_offers(app, "agent mode"), what="agent mode in the palette")
        await pilot.press("enter")
    else:
        prompt.load_text(f"/agent {arg}".rstrip())
        await pilot.press("enter")
    await wait_for(pilot, lambda: main(app).agent_actions.agent_mode, what="agent mode")


def users(app) -> list[str]:
    return [v.content for v in main(app).conversation.query(MessageView) if v.role == "user"]


async def task(pilot, text: str) -> None:
    before = len(users(pilot.app))
    pilot.app.query_one(PromptInput).focus()
    await pilot.press(*text, "enter")
    await wait_for(pilot, lambda: len(users(pilot.app)) > before, what="the task to be sent")


async def approval(pilot) -> ApprovalScreen:
    await wait_for(pilot, lambda: isinstance(pilot.app.screen, ApprovalScreen), what="the approval dialog")
    await pilot.pause()
    return pilot.app.screen


async def answer(pilot, key: str) -> None:
    dialog = await approval(pilot)
    await pilot.press(key)
    await wait_for(pilot, lambda: pilot.app.screen is not dialog, what="the dialog to close")


async def idle(pilot, timeout: float = 10.0) -> None:
    await wait_for(pilot, lambda: not main(pilot.app).generating, timeout, what="the run to end")
    await pilot.pause()


def diff_lines(card: ToolCard) -> list[str]:
    return card.query_one(DiffView).render().plain.splitlines()


async def test_write_edit_bash_with_approval_then_reopen(tmp_path):
    app, engine = make_app([
        "I will write the file.\n" + call("write_file", content="alpha\nbeta\ngamma\n", path="notes.txt"),
        call("edit_file", path="notes.txt", old_text="beta\n", new_text="BETA\n"),
        call("bash", command="cat notes.txt; exit 3"),
        "Done: notes.txt now says BETA.",
    ])
    ws = tmp_path / "ws"
    ws.mkdir()
    async with app.run_test(size=SIZE) as pilot:
        await start_agent(pilot, str(ws))
        screen = main(app)
        sid = screen.session_id
        session = app.controller.session(sid)
        assert (session.kind, Path(session.workspace)) == ("agent", ws.resolve())
        assert "agent" in str(screen.prompt.border_title)
        await task(pilot, "fix notes")

        dialog = await approval(pilot)
        assert dialog.tool == "bash"
        assert str(dialog.query_one("#approval-arguments").render()) == "$ cat notes.txt; exit 3"
        write, edit, bash = cards(app)
        assert bash.state == "approval" and "waiting for approval" in str(bash.title)
        await answer(pilot, "y")
        await idle(pilot)

        assert (ws / "notes.txt").read_text() == "alpha\nBETA\ngamma\n"
        assert [c.tool for c in cards(app)] == ["write_file", "edit_file", "bash"]
        # write_file: the new file as added lines; edit_file: exactly one line swapped.
        assert [ln for ln in diff_lines(write) if ln.startswith("+") and not ln.startswith("+++")] \
            == ["+alpha", "+beta", "+gamma"]
        changed = [ln for ln in diff_lines(edit) if ln[:1] in "+-" and ln[:3] not in ("+++", "---")]
        assert changed == ["-beta", "+BETA"]
        assert "+1 -1" in str(edit.title)
        added = edit.query_one(DiffView).render()
        assert any(str(span.style) for span in added.spans)  # the +/- lines are coloured
        # bash: approved once, exit code and output shown.
        meta = str(bash.query_one(".tool-meta").render())
        assert "exit code 3" in meta and "approved once" in meta
        sandboxed = probe().available  # the card says whether the shell was confined
        assert ("sandboxed" in meta.split(" · ")) == sandboxed and ("NOT sandboxed" in meta) != sandboxed
        assert ("unsandboxed" in str(bash.title)) != sandboxed
        assert "exit 3" in str(bash.title)
        assert "alpha" in str(bash.query_one(".tool-output").render())
        assert replies(app)[0] == "I will write the file."
        assert replies(app)[-1] == "Done: notes.txt now says BETA."
        assert screen.status.turn_text.startswith("agent answered after 4 steps · cached ")
        # the sidebar lists the agent session with its marker, titled after the task
        row = str(app.query_one("#session-list").get_option_at_index(0).prompt)
        assert row.startswith("◆ fix notes") and "agent · " in row

        # Leave agent mode, then reopen the session from the sidebar: the same cards.
        await pilot.press("ctrl+n")
        assert not screen.agent_actions.agent_mode and cards(app) == []
        await pilot.press("ctrl+l", "enter")
        await wait_for(pilot, lambda: screen.session_id == sid and cards(app), what="the reopened session")
        assert screen.agent_actions.agent_mode
        write, edit, bash = cards(app)
        assert [c.tool for c in (write, edit, bash)] == ["write_file", "edit_file", "bash"]
        assert all(c.collapsed for c in (write, edit, bash))
        assert [ln for ln in diff_lines(edit) if ln[:1] in "+-" and ln[:3] not in ("+++", "---")] \
            == ["-beta", "+BETA"]
        assert "+alpha" in diff_lines(write)
        assert bash.exit_code == 3 and "exit code 3" in str(bash.query_one(".tool-meta").render())
        assert bash.sandboxed is sandboxed  # kept in the stored message
        assert replies(app) == ["I will write the file.", "Done: notes.txt now says BETA."]
        assert notices(app)[0].startswith(f"Agent session in {ws.resolve()}")


async def test_deny_then_always_allow(tmp_path):
    app, engine = make_app([
        call("bash", command="touch denied.txt"),
        call("bash", command="echo first > ok.txt"),
        call("bash", command="echo second >> ok.txt"),
        "Could not create denied.txt; ok.txt is written.",
    ])
    async with app.run_test(size=SIZE) as pilot:
        await start_agent(pilot, palette=True)
        screen = main(app)
        ws = Path(app.controller.session(screen.session_id).workspace)
        from engine.paths import data_dir

        assert ws == data_dir() / "workspaces" / screen.session_id  # the default workspace
        await task(pilot, "make files")
        await answer(pilot, "n")
        await answer(pilot, "a")  # the second call asks again
        await idle(pilot)  # the third call runs without asking: "always" for this session

        denied, first, second = cards(app)
        assert denied.state == "denied" and "denied" in str(denied.title)
        assert "did not allow" in denied.output and not (ws / "denied.txt").exists()
        assert "always allowed" in str(first.query_one(".tool-meta").render())
        assert second.approval == "allow" and second.exit_code == 0
        assert (ws / "ok.txt").read_text() == "first\nsecond\n"
        assert replies(app)[-1] == "Could not create denied.txt; ok.txt is written."


async def test_escape_cancels_running_tool_and_streaming_text():
    app, engine = make_app([
        # a long command keeps the call forming for seconds: on a loaded machine the pilot may
        # look only after a short call has been parsed and is asking for approval
        Reply(call("bash", command="sleep 30  # " + "z" * 120), delay_s=0.02),
        Reply("thinking " * 200, delay_s=0.01),
    ])
    async with app.run_test(size=SIZE) as pilot:
        await start_agent(pilot)
        screen = main(app)
        await task(pilot, "wait a while")
        # The card is there while the model is still writing the call.
        await wait_for(pilot, lambda: cards(app) and cards(app)[0].tool == "bash"
                       and cards(app)[0].state == "forming", what="a forming card")
        forming = cards(app)[0]
        assert forming.state == "forming" and str(forming.title).endswith("forming…")
        assert '"name": "bash"' in str(forming.query_one(".tool-args").render())
        await answer(pilot, "y")
        await wait_for(pilot, lambda: cards(app) and cards(app)[0].state == "running", what="bash to run")
        t0 = time.monotonic()
        await pilot.press("escape")
        await idle(pilot, timeout=5)
        assert time.monotonic() - t0 < 25  # the 30-s sleep was killed, not waited for (generous: loaded CI)
        (card,) = cards(app)
        assert card.state == "cancelled" and "cancelled" in str(card.title)
        assert any(n.startswith("Cancelled after 1 step") for n in notices(app))
        assert screen.status.turn_text.startswith("agent cancelled")

        # The next task starts afresh; Esc while the reply streams keeps the partial text.
        await task(pilot, "think")
        await wait_for(pilot, lambda: len(replies(app)) == 1 and len(replies(app)[0]) > 20,
                       what="streamed text")
        await pilot.press("escape")
        await idle(pilot, timeout=5)
        (reply,) = [v for v in screen.conversation.query(MessageView) if v.role == "assistant"]
        assert reply.state == "stopped" and reply.content.startswith("thinking")
        assert len(reply.content) < len("thinking " * 200)
        stored = app.controller.messages(screen.session_id)
        last = [m for m in stored if m.role == "assistant"][-1]
        assert last.content == reply.content.strip() and last.meta["finish_reason"] == "cancelled"


async def test_malformed_call_shows_a_notice():
    app, engine = make_app([
        '<tool_call>{"name": "nope", "arguments": {}}</tool_call>',
        "Sorry.",
    ], profile=scripted_profile(constrained_tool_calls=False))  # the grammar would repair it
    async with app.run_test(size=SIZE) as pilot:
        await start_agent(pilot)
        await task(pilot, "x")
        await idle(pilot)
        assert cards(app) == []
        assert any("Malformed tool call (call_1_0)" in n and "unknown tool" in n for n in notices(app))
        assert replies(app) == ["Sorry."]


@pytest.mark.parametrize("text", ["/agent", "/agent  "])
def test_agent_command_parsing(text):
    from app.tui.agent_mode import agent_command

    assert agent_command(text) == ""
    assert agent_command("/agent ~/src") == "~/src"
    assert agent_command("/agents") is None and agent_command("hello") is None


async def test_compaction_and_limit_notices():
    from agents.events import AgentDone, Compacted, StepDone, TextDelta
    from app.tui.agent_view import AgentRunView

    app, engine = make_app([], autoload=False)
    async with app.run_test(size=SIZE) as pilot:
        await pilot.pause()
        view = AgentRunView(main(app).conversation)
        await view.event(Compacted(3, (4, 6), 7_900, 5_100, 12_000))
        await view.event(TextDelta(3, "  "))  # whitespace alone opens no reply
        assert replies(app) == []
        await view.event(TextDelta(3, "half an ans"))
        await view.event(StepDone(3, "length", 10, 5, 32, 0.0, 0.0, "ram", "half an ans"))
        await view.event(AgentDone(3, "max_steps", "", 30, 15, 96, 1.0))
        await pilot.pause()
        assert notices(app) == ["Compacted 2 old tool results to fit the context: 7,900 → 5,100 tokens.",
                                "Stopped: the step limit was reached."]
        assert replies(app) == ["half an ans"]


class SharedEngine(TuiScriptedEngine):
    """Serves requests concurrently, like the batched engine: a prompt whose user text says
    ``[chat]`` gets the next chat reply, any other the next agent reply. Records when each
    side streamed text and counts requests in flight (the status bar reads it).

    ``wait_at[(name, n)]``: an event the n-th streamed piece (from 1) of request ``name``
    ("agent2": the agent's second request) waits for; ``mark_at[(name, n)]`` is set once that
    piece streamed. They fix the interleaving whatever the machine's load."""

    def __init__(self, agent: list, chat: list, **kw):
        super().__init__([], **kw)
        self._lock = contextlib.nullcontext()  # no one-request-at-a-time lock: rows interleave
        self._submit = threading.Lock()
        self.scripts = {"agent": list(agent), "chat": list(chat)}
        self.active_requests = 0
        self.submitted = {"agent": 0, "chat": 0}
        self.streamed: dict[str, list[float]] = {"agent": [], "chat": []}
        self.wait_at: dict[tuple[str, int], threading.Event] = {}
        self.mark_at: dict[tuple[str, int], threading.Event] = {}

    def key(self, request) -> str:
        return "chat" if "[chat]" in self.tokenizer.decode(request.prompt_ids) else "agent"

    def submit(self, request):
        with self._submit:
            side = self.key(request)
            self.submitted[side] += 1
            request.name = f"{side}{self.submitted[side]}"
            script = self.scripts[side]
            self.replies = [script.pop(0) if script else Reply("(script exhausted)")]
            self.active_requests += 1
            return super().submit(request)

    def _serve(self, req, handle, reply):
        side, name = self.key(req), req.name
        times, emit = self.streamed[side], handle.emit
        pieces = [0]

        def timed(ev):
            if type(ev).__name__ == "TextDelta":
                pieces[0] += 1
                n = pieces[0]
                gate = self.wait_at.get((name, n))
                deadline = time.monotonic() + 60
                while gate is not None and not gate.wait(0.01) and not handle.cancelled:
                    assert time.monotonic() < deadline, f"{name} piece {n} waited too long"
                times.append(time.monotonic())
                emit(ev)
                if (name, n) in self.mark_at:
                    self.mark_at[name, n].set()
                return
            if type(ev).__name__ == "Done":
                with self._submit:
                    self.active_requests -= 1
            emit(ev)

        handle.emit = timed
        super()._serve(req, handle, reply)


AGENT_SAYS = "Writing the plan first, then I will check it twice."
AGENT_ENDS = ("The plan is in plan.txt; it lists three steps and each one is short. Step a comes "
              "first, then b, then c; none of them needs a tool, and each can be checked alone.")
CHAT_SAYS = "Hello! The agent keeps working while we talk."


def streaming_reply(pane) -> MessageView | None:
    found = [v for v in pane.query(MessageView) if v.role == "assistant" and v.state == "streaming"]
    return found[0] if found and found[0].content else None


def pane_text(pane) -> list[tuple[str, str]]:
    return [(v.role, v.content.strip()) for v in pane.query(MessageView)]


async def open_from_sidebar(pilot, sid: str) -> None:
    screen = main(pilot.app)
    await pilot.press("ctrl+l")
    options = pilot.app.query_one("#session-list")
    options.highlighted = [options.get_option_at_index(i).id for i in range(options.option_count)].index(sid)
    await pilot.press("enter")
    await wait_for(pilot, lambda: screen.session_id == sid, what="the session to open")


async def test_chat_while_the_agent_runs(tmp_path):
    """The agent keeps streaming in its own pane while the user chats in another session;
    both stream at the same time on the one engine, the status bar counts them, and switching
    back shows the live run with nothing lost."""
    first = AGENT_SAYS + "\n" + call("write_file", content="1. a\n2. b\n3. c\n", path="plan.txt")
    engine = SharedEngine(agent=[Reply(first, delay_s=0.002), Reply(AGENT_ENDS, delay_s=0.002)],
                          chat=[Reply(CHAT_SAYS, delay_s=0.002)])
    chat_started, agent_went_on, release = threading.Event(), threading.Event(), threading.Event()
    step2, chat_go = threading.Event(), threading.Event()
    engine.mark_at = {("agent2", 4): step2, ("chat1", 1): chat_started, ("agent2", 15): agent_went_on}
    # a few pieces into its second step the agent waits for the chat to start, the chat for
    # the agent to stream 10 more pieces, the chat's end waits for the test to have seen both
    # mid-stream, and the agent's end for the test to have switched back to it
    engine.wait_at = {("agent2", 5): chat_started, ("chat1", 5): agent_went_on,
                      ("chat1", 20): chat_go, ("agent2", 40): release}
    app = MlxtermApp("scripted", engine_factory=lambda spec: engine, memory_probe=lambda: 300 << 20,
                     store=SessionStore())
    ws = tmp_path / "ws"
    ws.mkdir()
    async with app.run_test(size=SIZE) as pilot:
        await start_agent(pilot, str(ws))
        screen = main(app)
        agent_sid = screen.session_id
        await task(pilot, "make a plan")
        agent_pane = screen.conversation
        await wait_for(pilot, step2.is_set, what="the agent's second step")

        # A new chat: the agent's pane is hidden, not stopped.
        await pilot.press("ctrl+n")
        assert screen.agent_actions.agent_busy and not screen.agent_actions.agent_mode
        assert screen.conversation is not agent_pane and not agent_pane.display
        assert screen.panes == {agent_sid: agent_pane}
        await pilot.press(*"[chat] hi", "enter")
        chat_pane = screen.conversation
        # both replies are on screen mid-stream (the chat's pane shown, the agent's hidden)
        await wait_for(pilot, lambda: streaming_reply(chat_pane) and streaming_reply(agent_pane),
                       what="the chat to stream while the agent works")
        await wait_for(pilot, lambda: "2 requests share the engine" in str(
            app.query_one("#status-shared").render()), what="the shared-engine count")
        # the sidebar marks both sessions as streaming
        rows = {app.query_one("#session-list").get_option_at_index(i).id:
                str(app.query_one("#session-list").get_option_at_index(i).prompt)
                for i in range(2)}
        assert all("streaming · " in row for row in rows.values()), rows
        chat_go.set()
        await wait_for(pilot, lambda: not screen.chat_busy, what="the chat reply")
        assert pane_text(chat_pane) == [("user", "[chat] hi"), ("assistant", CHAT_SAYS)]
        # both streams progressed together: the agent streamed while the chat was streaming
        agent_t, chat_t = engine.streamed["agent"], engine.streamed["chat"]
        assert sum(chat_t[0] < t < chat_t[-1] for t in agent_t) >= 10

        # Back to the agent: the same pane, still streaming, then complete.
        assert screen.agent_actions.agent_busy
        await open_from_sidebar(pilot, agent_sid)
        assert screen.conversation is agent_pane and agent_pane.display and screen.agent_actions.agent_mode
        assert screen.panes == {}  # the finished chat's pane was dropped with nothing streaming
        release.set()
        await idle(pilot, 20)
        assert (ws / "plan.txt").read_text() == "1. a\n2. b\n3. c\n"
        live = pane_text(agent_pane)
        assert [c.tool for c in cards(app)] == ["write_file"]
        assert replies(app) == [AGENT_SAYS, AGENT_ENDS]
        assert screen.status.turn_text.startswith("agent answered after 2 steps")

        # Nothing was lost while hidden: the live pane equals the session rebuilt from the store.
        await pilot.press("ctrl+n")
        await open_from_sidebar(pilot, agent_sid)
        assert pane_text(screen.conversation) == live
        chat_sid = next(s.id for s in app.controller.sessions() if s.id != agent_sid)
        stored = [(m.role, m.content.strip()) for m in app.controller.messages(chat_sid)]
        assert stored[-2:] == [("user", "[chat] hi"), ("assistant", CHAT_SAYS)]


async def test_esc_stops_the_visible_run_only(tmp_path):
    """Esc in the chat stops the chat reply and leaves the hidden agent run working; Esc in
    the agent's session cancels the agent."""
    engine = SharedEngine(agent=[Reply(AGENT_ENDS, delay_s=0.002)],
                          chat=[Reply(CHAT_SAYS, delay_s=0.002)])
    agent_held, chat_held = threading.Event(), threading.Event()  # never set: held until cancelled
    engine.wait_at = {("agent1", 20): agent_held, ("chat1", 10): chat_held}
    app = MlxtermApp("scripted", engine_factory=lambda spec: engine, memory_probe=lambda: 300 << 20,
                     store=SessionStore())
    async with app.run_test(size=SIZE) as pilot:
        await start_agent(pilot)
        screen = main(app)
        agent_sid = screen.session_id
        await task(pilot, "write a long answer")
        agent_pane = screen.conversation
        await wait_for(pilot, lambda: len(engine.streamed["agent"]) == 19, what="the agent to stream")
        await pilot.press("ctrl+n", *"[chat] tell me more", "enter")
        chat_pane = screen.conversation
        await wait_for(pilot, lambda: len(engine.streamed["chat"]) == 9, what="the chat to stream")
        await pilot.press("escape")
        await wait_for(pilot, lambda: not screen.chat_busy, what="the chat to stop")
        (reply,) = [v for v in chat_pane.query(MessageView) if v.role == "assistant"]
        assert reply.state == "stopped" and reply.content.strip() == CHAT_SAYS[:10].strip()
        assert screen.agent_actions.agent_busy and not screen.agent_actions.running_agent.cancelled
        await open_from_sidebar(pilot, agent_sid)
        assert screen.conversation is agent_pane and screen.agent_actions.agent_busy
        await pilot.press("escape")
        await idle(pilot, 20)
        (step,) = [v for v in agent_pane.query(MessageView) if v.role == "assistant"]
        assert step.state == "stopped" and step.content.strip() == AGENT_ENDS[:20].strip()
        assert screen.status.turn_text.startswith("agent cancelled")



async def test_a_task_naming_new_files_is_planned_and_the_plan_ticks(tmp_path):
    """A prompt naming two new files is planned first, as ``mlxterm run`` does: the plan appears
    as a checklist in the conversation and each item is ticked when its file is written; the
    item runs end at their writes without the headless "checks run now" note."""
    from app.tui.widgets.plan_view import PlanView

    app, engine = make_app([
        "index.html: the page\n2. app.js: the click",  # after the "Plan:\n1. " opening
        Reply("<p>hi</p>\n```\n", delay_s=0.05),
        Reply("let a = 1;\n```\n", delay_s=0.05),
    ], profile=scripted_profile(edit_format="whole"))
    ws = tmp_path / "ws"
    ws.mkdir()
    async with app.run_test(size=SIZE) as pilot:
        await start_agent(pilot, str(ws))
        await task(pilot, "build index.html and app.js")
        await wait_for(pilot, lambda: list(main(app).conversation.query(PlanView)), what="the plan view")
        await idle(pilot)
        (view,) = main(app).conversation.query(PlanView)
        assert view.text.splitlines() == ["Plan · 2 of 2 done", "✓ 1. index.html — the page",
                                          "✓ 2. app.js — the click"]
        assert (ws / "index.html").read_text() == "<p>hi</p>\n" and (ws / "app.js").read_text() == "let a = 1;\n"
        assert [c.tool for c in cards(app)] == ["write_file", "write_file"]
        assert not any("checks run now" in n for n in notices(app))
        prompts = [engine.tokenizer.decode(r.prompt_ids) for r in engine.requests]
        assert "short plan only" in prompts[0] and prompts[2].endswith("assistant\napp.js\n```javascript\n")
        # the plan is kept in the session (a resumed or reopened run reads it)
        sid = main(app).session_id
        meta = app.controller.store.get_meta(sid)
        assert [i["path"] for i in meta["plan"]["items"]] == ["index.html", "app.js"]
        # reopened from the sidebar: the plan as it stands, above the cards
        await pilot.press("ctrl+n")
        await pilot.press("ctrl+l", "enter")
        await wait_for(pilot, lambda: main(app).session_id == sid and cards(app), what="the reopened session")
        (view,) = main(app).conversation.query(PlanView)
        assert view.text.splitlines()[0] == "Plan · 2 of 2 done"


async def test_a_one_file_task_is_not_planned(tmp_path):
    from app.tui.widgets.plan_view import PlanView

    app, engine = make_app([call("write_file", path="a.txt", content="a"), "Wrote a.txt."])
    async with app.run_test(size=SIZE) as pilot:
        await start_agent(pilot, str(tmp_path))
        await task(pilot, "create a.txt containing a")
        await idle(pilot)
        assert not list(main(app).conversation.query(PlanView)) and replies(app) == ["Wrote a.txt."]
        assert "short plan only" not in engine.tokenizer.decode(engine.requests[0].prompt_ids)
