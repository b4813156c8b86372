"""Agent mode of the main screen: ``/agent [PATH]``, its palette entry, runs and approvals.

An agent session (kind "agent", with a workspace directory) sends each prompt to
``agents.session.AgentSession.run_async``: the loop (parsing, tools, the session store) runs
on its own thread and the model on the engine thread; this screen's worker only receives
the events on the UI loop and renders them (``AgentRunView``). A prompt naming two or more new
files is planned first (``agents.planned``, as ``mlxterm run`` does): the view shows the plan
and ticks its items as their files are written. ``ApprovalNeeded`` opens an
``ApprovalScreen`` while the agent thread waits for the answer; Esc cancels the run.

A run streams into the pane of its session (``agent_pane``): opening another session, or a new
chat, leaves it working in the background while the user chats (both requests share the
engine's batch); reopening its session shows the pane, complete and still streaming. One
agent run works at a time.
"""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING, Any

from engine.errors import MlxtermError

from textual import work
from textual.message import Message
from textual.widget import Widget

from agents.events import (
    AgentDone,
    AgentEventHandler,
    ApprovalNeeded,
    StepDone,
    StepStart,
    TextDelta,
    ToolCallForming,
    ToolFinished,
    ToolStarted,
)
from agents.options import AgentLimits
from agents.planned import names_new_files, work_through_plan
from agents.threaded import on_a_thread
from app.tui.agent_view import AgentRunView
from app.tui.commands import SingleCommand
from app.tui.format import agent_done_summary, agent_step_summary
from app.tui.screens.approval import ApprovalScreen, ask_approval
from app.tui.slash import Command
from app.tui.widgets.message import MessageView
from app.tui.widgets.prompt import PLACEHOLDER

if TYPE_CHECKING:
    from app.tui.hosts import AgentHost

log = logging.getLogger(__name__)

AGENT_SLASH = Command("agent", "/agent [PATH]", "agent mode: a new agent session working in PATH "
                      "(default: a new workspace under the data dir); /agent again leaves it")
AGENT_PLACEHOLDER = "Task for the agent (Enter to run, Esc cancels a run, /agent leaves agent mode)"
PALETTE_TITLE = "Agent mode"
PALETTE_HELP = "Toggle agent mode: a new agent session that works in a workspace with tools"
STATUS_EVERY = 8  # update the "generating" counter every N deltas


def agent_command(text: str) -> str | None:
    """The argument of an ``/agent`` command (``""`` when none), else None."""
    word, _, rest = text.strip().partition(" ")
    return rest.strip() if word.lower() == "/" + AGENT_SLASH.name else None


class AgentCommands(SingleCommand):
    """The palette entry (same as ``/agent``; "Stop generating" cancels a run)."""

    title = PALETTE_TITLE
    help = PALETTE_HELP

    async def _run(self) -> None:
        await self.screen.run_action("agent")



class AgentActions(Widget):
    """The screen's agent-mode controller: a hidden child widget (the run worker is its own)
    that uses of its host only what ``app.tui.hosts.AgentHost`` lists, and posts ``RunEnded``
    when a run is over (the screen then updates the sidebar and drops a hidden pane)."""

    DEFAULT_CSS = "AgentActions { display: none; }"

    class RunEnded(Message):
        """A run stopped streaming into ``pane`` (finished, failed or cancelled)."""

        def __init__(self, pane) -> None:
            super().__init__()
            self.pane = pane

    def __init__(self, host: AgentHost, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.host = host
        self.agent = None  # the AgentSession of the open session, once a task ran or started
        self.agent_mode = False  # the open session is an agent session
        self.agent_workspace: str | None = None
        self.agent_busy = False  # from Enter until the run's AgentDone
        self.agent_pane = None  # the Conversation pane the run streams into
        self.running_agent = None  # the AgentSession of the run (its session may be hidden)
        self._run_workspace: str | None = None
        self.agent_view: AgentRunView | None = None
        self._agent_stop = False  # Esc before the run had started
        self._approval: ApprovalScreen | None = None
        self._agent_after_load: str | None = None  # /agent waiting for an agent-capable model

    def streams_into(self, pane) -> bool:
        """A run is working and streams into ``pane``."""
        return self.agent_busy and pane is self.agent_pane

    async def profile_loaded(self, profile: str) -> None:
        """The screen loaded ``profile``: start agent mode if ``/agent`` waited for it."""
        pending, self._agent_after_load = self._agent_after_load, None
        if pending is not None and profile == self.host.controller.engine.profile.name:
            await self.toggle(pending)

    def load_failed(self) -> None:
        """The screen could not load a profile: ``/agent`` no longer waits for it."""
        self._agent_after_load = None

    def set_agent_mode(self, session) -> None:
        """Follow the open session (None: a new chat): agent mode for kind "agent"."""
        on = session is not None and session.kind == "agent"
        if self.agent is not None and (not on or self.agent.session_id != session.id):
            self.agent = None
        running = self.running_agent
        if on and self.agent_busy and running is not None and running.session_id == session.id:
            self.agent = running  # back in the running session: Esc and approvals reach it
        self.agent_mode = on
        self.agent_workspace = session.workspace if on else None
        self.host.query_one("#chat").set_class(on, "-agent")
        self.host.prompt.border_title = f"agent · {self.agent_workspace}" if on else None
        self.host.prompt.placeholder = AGENT_PLACEHOLDER if on else PLACEHOLDER

    async def toggle(self, path: str = "") -> None:
        """Toggle agent mode: start a new agent session (in ``path``), or leave agent mode.
        A run in progress keeps working in its own pane."""
        if self.agent_mode and not path:
            await self.host.action_new_chat()
            self.notify("Left agent mode; this is a new chat.")
            return
        if not self.host.controller.loaded:
            self.notify("Agent mode needs the model; wait for it to load.", severity="warning")
            return
        loaded = self.host.controller.engine.profile
        # a remote profile's server runs the agent in the text protocol (docs/serving.md); a
        # local one that cannot do agent work hands over to the best installed one
        if not loaded.agent.capable and not self.host.controller.remote:
            from agents.choose import best_agent_profile

            try:
                best = await asyncio.to_thread(best_agent_profile)
            except MlxtermError as e:
                self.notify(f"{e}. Agent mode runs on {loaded.name} for now.", severity="warning", timeout=10)
            else:
                # The chat model cannot do agent work: load the best agent-capable one first;
                # agent mode starts when it is loaded (profile_loaded).
                self._agent_after_load = path
                self.notify(f"Agent mode runs on {best} ({loaded.name} cannot do agent tasks); loading it…")
                self.host.load_profile(best)
                return
        try:
            agent = await asyncio.to_thread(self.host.controller.new_agent, path or None)
        except MlxtermError as e:
            self.notify(str(e), severity="error")
            return
        await self.host.open_session(agent.session_id, switch_profile=False)
        self.agent = agent
        self.notify(f"Agent mode: working in {agent.workspace}. Type a task; tools set to "
                    "ask (bash) wait for your approval.", timeout=8)
        if agent.sandbox_notice:  # no sandbox here: said once per process
            self.notify(agent.sandbox_notice, severity="warning", timeout=12)

    async def send(self, text: str) -> None:
        if self.agent_busy:  # one run at a time; it works in another session's pane
            self.notify(f"An agent run is still working in “{self.host.pane_title(self.agent_pane)}”; wait "
                        "for it or open that session and press Esc.", severity="warning")
            return
        self.host.prompt.sent(text)
        self.app.history.add(text)
        pane = self.agent_pane = self.host.conversation
        await pane.add(MessageView("user", text))
        self.agent_busy, self._agent_stop = True, False
        self._run_workspace = self.agent_workspace
        self.host.refresh_bindings()
        self.host.refresh_sessions()  # the sidebar marks the working session
        self._run_agent(self.host.session_id, text, pane)

    @work(exclusive=True, group="agent")
    async def _run_agent(self, session_id: str, text: str, pane) -> None:
        status = lambda text: self.host.turn_status(pane, text)  # noqa: E731 (only while it is visible)
        status("agent · starting…")
        view = self.agent_view = AgentRunView(pane)
        done: AgentDone | None = None
        agent = None
        try:
            agent = self.running_agent = await asyncio.to_thread(self._agent_for, session_id, text)
            if self._agent_stop:
                agent.cancel()
            planned = await asyncio.to_thread(names_new_files, text, agent.workspace)
            run_status = _RunStatus(self, view, pane, status)
            async for ev in (self._planned_run(agent, text) if planned else agent.run_async(text)):
                await view.event(ev)
                run_status.handle(ev)
            done = run_status.done
        except MlxtermError as e:
            await view.notice(f"The agent could not run: {e}", "error")
            self.notify(str(e), severity="error")
        except asyncio.CancelledError:
            if agent is not None:
                agent.cancel()  # the screen is going away: do not leave the agent running
            raise
        finally:
            self.agent_busy = False
            self.agent_pane = self.running_agent = None
            self._close_approval()
            self.host.refresh_bindings()
        if done is not None:
            self._agent_done(done, pane)
        self.post_message(self.RunEnded(pane))

    def _planned_run(self, agent, text: str):
        """A task naming two or more new files: the plan first, then one run per item (the
        view shows the plan and ticks it); as ``mlxterm run`` does."""
        return on_a_thread(lambda: work_through_plan(
            agent, text, AgentLimits(), transcript=agent.transcript, cancelled=lambda: self._agent_stop,
            retry_temperature=agent.engine.profile.agent.repair_temperature), agent.cancel)

    def _agent_for(self, session_id: str, text: str):
        """The open session's AgentSession (reused while the model stays the same, so
        "always" approvals last), else opened again. Runs on a thread (SQLite)."""
        agent = self.agent
        if agent is None or agent.session_id != session_id or agent.engine is not self.host.controller.engine:
            agent = self.agent = self.host.controller.open_agent(session_id)
        self.host.controller.name_agent(session_id, text)
        return agent

    def _ask(self, ev: ApprovalNeeded, view: AgentRunView, pane) -> None:
        card = view.card(ev.call.id)
        if card is not None:
            card.set_state("approval")
        self.host.turn_status(pane, f"agent · step {ev.step} · waiting for approval of {ev.call.name}")
        def closed(screen: ApprovalScreen) -> None:
            if self._approval is screen:
                self._approval = None

        self._approval = ask_approval(self.app, ev, self._run_workspace, closed)

    def _close_approval(self) -> None:
        screen, self._approval = self._approval, None
        if screen is not None and self.app.screen is screen:
            screen.dismiss("deny")  # the run ended first: the request already counts as denied

    def _agent_done(self, done: AgentDone, pane) -> None:
        summary = agent_done_summary(done)
        self.host.turn_status(pane, summary)
        log.info("agent run done: %s", summary)
        if done.reason == "error":
            self.notify(f"The agent stopped with an error: {done.error}", severity="error")

    def stop(self) -> None:
        """Esc: cancel the run (generation stops, a running tool is killed)."""
        if self.running_agent is not None and self.agent_busy:
            self.running_agent.cancel()
        self._agent_stop = True
        self.host.turn_status(self.agent_pane, "agent · cancelling…")


class _RunStatus(AgentEventHandler):
    """What a run's events do besides the agent view: the status line, approvals, the context."""

    def __init__(self, actions: AgentActions, view: AgentRunView, pane, status) -> None:
        self.actions, self.view, self.pane, self.status = actions, view, pane, status
        self.count = 0  # tokens of this step so far
        self.done: AgentDone | None = None

    def on_approval_needed(self, ev: ApprovalNeeded) -> None:
        self.actions._ask(ev, self.view, self.pane)

    def on_text_delta(self, ev: TextDelta | ToolCallForming) -> None:
        self.count += 1
        if self.count % STATUS_EVERY == 1:
            doing = f"writing a {ev.name or 'tool'} call" if isinstance(ev, ToolCallForming) else "generating"
            self.status(f"agent · step {ev.step} · {doing}… {self.count} tokens")

    on_tool_call_forming = on_text_delta

    def on_step_start(self, ev: StepStart) -> None:
        self.count = 0
        self.actions.host.status.refresh_shared()
        self.status(f"agent · step {ev.step} · reading {ev.prompt_tokens:,} tokens…")

    def on_step_done(self, ev: StepDone) -> None:
        self.status(agent_step_summary(ev))
        self.actions.host.update_context()

    def on_tool_started(self, ev: ToolStarted) -> None:
        self.status(f"agent · step {ev.step} · running {ev.call.name}…")

    def on_tool_finished(self, ev: ToolFinished) -> None:
        self.actions._close_approval()

    def on_agent_done(self, ev: AgentDone) -> None:
        self.done = ev
