"""``MainScreen``: sessions sidebar, conversation, message box and status bar.

It turns user intent (keys, palette entries, widget messages) into calls on the app's
``ChatController``, loads profiles and streams chat turns into the conversation. It owns three
controllers, each given the screen as a host typed in ``app.tui.hosts``: ``ChatActions`` (chat
and slash commands), ``AgentActions`` and ``DictationActions`` (hidden child widgets); its
``action_*`` methods for them only delegate. Model loading runs in a thread worker and
generation on the engine thread, so the UI never waits on MLX.

Each session streams into its own ``Conversation`` pane. Opening another session while a chat
reply or an agent run is still streaming hides that pane instead of stopping the work: it keeps
streaming (both requests share the engine's batch) and is shown again, complete, when its
session is reopened; once its work ends while hidden it is dropped (the store has it all). One
chat turn and one agent run stream at a time; Esc stops the one in the visible pane.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from pathlib import Path

from engine.errors import MlxtermError
from engine.serving.events import (
    Done,
    PrefillProgress,
    ReasoningDelta,
    SpeculationProgress,
    TextDelta,
)

from textual import on, work
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical
from textual.screen import Screen
from textual.widgets import Footer

from app.tui.agent_mode import AgentActions, AgentCommands, agent_command
from app.tui.commands import ChatCommands
from app.tui.dictation import DictationActions, DictationCommands, is_dictate_command
from app.tui.format import done_meta, speculation_note, turn_summary
from app.tui.screens.chat_actions import ChatActions
from app.tui.screens.dialogs import PickScreen
from app.tui.screens.error import ErrorScreen
from app.tui.screens.profiles import ProfileScreen
from app.tui.slash import literal, parse_slash
from app.tui.widgets.conversation import Conversation
from app.tui.widgets.message import MessageView
from app.tui.widgets.prompt import PromptInput
from app.tui.widgets.recording import RecordingIndicator
from app.tui.widgets.sidebar import SessionSidebar
from app.tui.widgets.status import StatusBar

log = logging.getLogger(__name__)
STATUS_EVERY = 8  # update the "generating" counter every N text deltas


class MainScreen(Screen):
    COMMANDS = {ChatCommands, AgentCommands, DictationCommands}
    BINDINGS = [
        Binding("escape", "stop", "Stop"),
        Binding("ctrl+n", "new_chat", "New chat"),
        Binding("ctrl+o", "switch_profile", "Profile"),
        Binding("ctrl+r", "retry", "Retry"),
        Binding("f2", "rename", "Rename chat"),
        Binding("f5", "dictate", "Dictate"),
        Binding("ctrl+b", "board", "Task board", show=False),
        Binding("f3", "continue_last", "Reopen the most recent session", show=False),
        Binding("f8", "delete", "Delete chat", show=False),
        Binding("ctrl+s", "export('md')", "Export chat (Markdown)", show=False),
        Binding("ctrl+l", "focus_sessions", "Go to the chat list", show=False),
        Binding("ctrl+f", "focus_filter", "Filter chats", show=False),
    ]

    AUTO_FOCUS = "#prompt"

    def __init__(self) -> None:
        super().__init__()
        self.session_id: str | None = None
        self.turn = None  # the ChatTurn streaming now
        self._starting = False  # between Enter and the ChatTurn existing
        self._stop_requested = False
        self._loading: str | None = None  # profile spec being loaded
        self._pane: Conversation | None = None  # the visible conversation pane
        self.panes: dict[str, Conversation] = {}  # session id -> hidden pane still streaming
        self.chat_pane: Conversation | None = None  # where the chat turn streams
        self.chat_actions = ChatActions(self)
        self.dictation_actions = DictationActions(self, id="dictation-actions")
        self.agent_actions = AgentActions(self, id="agent-actions")

    # -- layout ----------------------------------------------------------------------------------
    def compose(self) -> ComposeResult:
        with Horizontal(id="body"):
            yield SessionSidebar(id="sidebar")
            with Vertical(id="chat"):
                yield Conversation(id="conversation")
                yield RecordingIndicator(id="recording")
                yield PromptInput(prompts=self.app.history.entries, id="prompt")
        yield StatusBar(self.app.memory_probe, id="status")
        yield Footer()
        yield self.dictation_actions
        yield self.agent_actions

    @property
    def controller(self):
        return self.app.controller

    @property
    def conversation(self) -> Conversation:
        """The visible pane (hidden panes of background runs are in ``panes``)."""
        if self._pane is None:
            self._pane = self.query_one(Conversation)
        return self._pane

    @property
    def prompt(self) -> PromptInput:
        return self.query_one(PromptInput)

    @property
    def status(self) -> StatusBar:
        return self.query_one(StatusBar)

    @property
    def chat_busy(self) -> bool:
        """A chat turn is starting or streaming (in any pane)."""
        return self.turn is not None or self._starting

    @property
    def generating(self) -> bool:
        """Anything streaming: a chat turn or an agent run, visible or not."""
        return self.chat_busy or self.agent_actions.agent_busy

    @property
    def visible_busy(self) -> bool:
        """The visible pane's session is streaming (what Esc stops)."""
        pane = self.conversation
        return (self.chat_busy and pane is self.chat_pane) or self.agent_actions.streams_into(pane)

    def busy_sessions(self) -> set[str]:
        """Sessions with a reply or an agent run streaming (the sidebar marks them)."""
        agent = self.agent_actions
        panes = ((self.chat_busy, self.chat_pane), (agent.agent_busy, agent.agent_pane))
        return {p.session_id for busy, p in panes if busy and p is not None and p.session_id}

    def turn_status(self, pane: Conversation, text: str) -> None:
        """Show a run's progress in the status bar while its pane is the visible one."""
        if pane is self.conversation:
            self.status.set_turn(text)

    async def show_pane(self, session_id: str | None) -> tuple[Conversation, bool]:
        """Make ``session_id``'s pane the visible one. Returns it and whether it is a live pane
        (a run still streams into it: its widgets are current, do not reload them)."""
        old = self.conversation
        if old.session_id == session_id and session_id is not None and self._streams(old):
            return old, True
        live = self.panes.pop(session_id, None) if session_id else None
        if self._streams(old):
            old.display = False
            self.panes[old.session_id] = old
            new = live or await self._new_pane()
        elif live is not None:
            await old.remove()
            new = live
        else:
            new = old
        new.session_id = session_id
        new.display = True
        self._pane = new
        return new, live is not None

    async def _new_pane(self) -> Conversation:
        pane = Conversation()
        await self.query_one("#chat").mount(pane, before=self.query_one(RecordingIndicator))
        return pane

    def _streams(self, pane: Conversation) -> bool:
        return (pane is self.chat_pane and self.chat_busy) or self.agent_actions.streams_into(pane)

    async def release_pane(self, pane: Conversation | None) -> None:
        """A run in ``pane`` ended: drop the pane if it is hidden (its session is stored)."""
        self.status.refresh_shared()
        if pane is None or pane is self.conversation or self._streams(pane):
            return
        if self.panes.get(pane.session_id) is pane:
            del self.panes[pane.session_id]
        await pane.remove()

    def on_unmount(self) -> None:
        self.dictation_actions.close()

    def on_mount(self) -> None:
        self.status.requests_probe = self.controller.active_requests
        # Nested containers may still be mounting their children: start after a refresh.
        self.call_after_refresh(self._startup)

    async def _startup(self) -> None:
        if self.app.initial_session:
            await self.open_session(self.app.initial_session, switch_profile=False)
        else:
            self.refresh_sessions()
        if self.app.autoload:
            self.load_profile(self.controller.profile_spec)

    def check_action(self, action: str, parameters: tuple) -> bool | None:
        if action == "stop":
            return self.visible_busy  # Esc does nothing (and is not shown) when idle
        if action == "dictate":
            return self.dictation_actions.enabled()  # shown disabled when there is no microphone
        return True

    # -- sessions ------------------------------------------------------------------------------
    def refresh_sessions(self) -> None:
        sidebar = self.query_one(SessionSidebar)
        sessions = self.controller.sessions(sidebar.query_text)
        sidebar.set_sessions(sessions, self.session_id, self.app.clock(), self.busy_sessions())

    def update_context(self) -> None:
        info = self.controller.info()
        used = self.controller.context_used(self.session_id)
        self.status.set_context(used, info.max_context if info else None)

    async def open_session(self, session_id: str, switch_profile: bool = True) -> None:
        try:
            session = self.controller.session(session_id)
        except MlxtermError as e:
            self.notify(str(e), severity="error")
            return
        self.session_id = session.id
        self.agent_actions.set_agent_mode(session)
        agent_mode = self.agent_actions.agent_mode
        pane, live = await self.show_pane(session.id)
        if live:  # still streaming: its pane kept every event
            pane.scroll_end(animate=False)
            self.status.set_turn(f"opened “{session.title}” · still "
                                 f"{'working' if agent_mode else 'streaming'}…")
        else:
            plan = self.controller.store.get_meta(session.id).get("plan") if agent_mode else None
            await pane.show(self.controller.messages(session.id),
                            agent=agent_mode, workspace=session.workspace, plan=plan)
            self.status.set_turn(f"opened “{session.title}” · {session.message_count} messages")
        self.update_context()
        self.refresh_sessions()
        self.prompt.focus()
        info = self.controller.info()
        if switch_profile and session.profile and info and session.profile != info.profile:
            self._switch_for_session(session.profile)

    def _switch_for_session(self, profile: str) -> None:
        from engine.profiles import find_profile

        try:
            find_profile(profile)
        except MlxtermError:
            self.notify(f"This chat was made with profile {profile}, which is not available; "
                        "replies will use the loaded profile.", severity="warning")
            return
        self.notify(f"Loading profile {profile}, which this chat was made with.")
        self.load_profile(profile)

    async def action_new_chat(self) -> None:
        self.session_id = None
        self.agent_actions.set_agent_mode(None)
        pane, _ = await self.show_pane(None)
        await pane.show([])
        self.status.set_turn("")
        self.update_context()
        self.refresh_sessions()
        self.prompt.focus()

    async def action_continue_last(self) -> None:
        """F3 (on the start screen, or any time): reopen the most recent session."""
        from app.tui.controller import latest_session

        sid = latest_session(self.controller.store)
        if sid is None:
            self.notify("There is no session to reopen yet.", severity="warning")
        elif sid != self.session_id:
            await self.open_session(sid)

    # -- agent mode (``AgentActions``) --------------------------------------------------------
    async def action_agent(self, path: str = "") -> None:
        """Toggle agent mode (``/agent [PATH]``, the palette)."""
        await self.agent_actions.toggle(path)

    @on(AgentActions.RunEnded)
    async def _agent_run_ended(self, event: AgentActions.RunEnded) -> None:
        self.update_context()
        self.refresh_sessions()  # drops the sidebar's working mark
        await self.release_pane(event.pane)

    # -- chat commands (``ChatActions``) ------------------------------------------------------
    def action_rename(self, title: str = "") -> None:
        self.chat_actions.rename(title)

    def action_delete(self) -> None:
        self.chat_actions.delete()

    async def action_fork(self, at: int | None = None) -> None:
        await self.chat_actions.fork(at)

    def action_export(self, fmt: str = "md", path: str | None = None) -> None:
        self.chat_actions.export(fmt, path)

    def action_clear(self) -> None:
        self.chat_actions.clear()

    async def action_system(self, text: str = "") -> None:
        await self.chat_actions.system(text)

    # -- dictation (``DictationActions``) -----------------------------------------------------
    def action_dictate(self) -> None:
        """F5: start or stop dictation into the message box."""
        self.dictation_actions.toggle()

    def action_board(self) -> None:
        """Open the task board (its cards keep running when you come back here)."""
        from app.tui.screens.board import BoardScreen

        if not isinstance(self.app.screen, BoardScreen):
            self.app.push_screen(BoardScreen())

    def action_focus_sessions(self) -> None:
        self.query_one("#session-list").focus()

    def action_focus_filter(self) -> None:
        self.query_one("#session-filter").focus()

    @on(SessionSidebar.Opened)
    async def _opened(self, event: SessionSidebar.Opened) -> None:
        await self.open_session(event.session_id)

    @on(SessionSidebar.FilterChanged)
    def _filtered(self, event: SessionSidebar.FilterChanged) -> None:
        self.refresh_sessions()

    @on(MessageView.ForkRequested)
    async def _fork_at(self, event: MessageView.ForkRequested) -> None:
        if event.view.number is None:
            self.notify("This message is not saved yet.", severity="warning")
            return
        await self.action_fork(event.view.number)

    @on(MessageView.CopyCodeRequested)
    def _pick_code(self, event: MessageView.CopyCodeRequested) -> None:
        blocks = event.blocks
        labels = [f"{i + 1}. {(b.strip().splitlines() or [''])[0][:60]}" for i, b in enumerate(blocks)]

        def picked(i: int | None) -> None:
            if i is not None:
                self.app.copy_to_clipboard(blocks[i])
                self.notify(f"Copied code block {i + 1} to the clipboard.")

        self.app.push_screen(PickScreen("Copy which code block?", labels), picked)

    # -- profiles ------------------------------------------------------------------------------
    def action_switch_profile(self, spec: str = "") -> None:
        if spec:
            self.load_profile(spec)
            return
        info = self.controller.info()
        self.app.push_screen(ProfileScreen(info.profile if info else None),
                             lambda chosen: self.load_profile(chosen) if chosen else None)

    def load_profile(self, spec: str) -> None:
        if self.generating:
            self.notify("Wait for the reply to finish (or press Esc) before switching.",
                        severity="warning")
            return
        busy = self.app.board.cards_on(self.controller.engine)
        if busy:  # switching closes the engine those board cards are running on
            self.notify(f"Board card{'s' if len(busy) > 1 else ''} {', '.join(map(str, busy))} "
                        "running on this model; wait for them or cancel them on the board (Ctrl+B) "
                        "before switching.", severity="warning")
            return
        self._loading = spec
        self.status.set_loading(f"loading {Path(spec).stem if '/' in spec else spec}…")
        self._load(spec)

    @work(thread=True, exclusive=True, group="load", exit_on_error=False)
    def _load(self, spec: str) -> None:
        try:
            info = self.controller.load(spec)
        except MlxtermError as e:
            self.app.call_from_thread(self._load_failed, spec, str(e))
        except Exception as e:  # noqa: BLE001 (an unexpected failure still gets a readable screen)
            log.exception("loading profile %s failed", spec)
            self.app.call_from_thread(self._load_failed, spec, f"unexpected error: {e}")
        else:
            self.app.call_from_thread(self._loaded, info)

    async def _loaded(self, info) -> None:
        self._loading = None
        self.status.set_model(info)
        self.update_context()
        if info.remote:
            self._probe_remote()
        if self.session_id:
            session = self.controller.session(self.session_id)
            if session.message_count and session.profile and session.profile != info.profile:
                await self.action_new_chat()
                self.notify(f"Started a new chat for profile {info.profile}; the previous chat "
                            "stays in the sidebar.")
        waiting = self.app.board.resume_pending()
        if waiting:
            self.notify(f"{waiting} board card{'s' if waiting > 1 else ''} waiting to run: running in the "
                        "background (Ctrl+B shows the board).")
        await self.agent_actions.profile_loaded(info.profile)

    @work(thread=True, exclusive=True, group="probe", exit_on_error=False)
    def _probe_remote(self) -> None:
        """A remote profile: say at once when its server does not answer (turns would fail)."""
        problem = self.controller.probe()
        if problem:
            self.app.call_from_thread(self.notify, f"The server does not answer: {problem}. Chats "
                                      "stay here; send again once it is up.", severity="warning", timeout=10)

    def _load_failed(self, spec: str, message: str) -> None:
        self._loading = None
        self.agent_actions.load_failed()
        log.error("cannot load profile %s: %s", spec, message)
        self.status.set_model(self.controller.info())

        def chosen(button: str | None) -> None:
            if button == "profiles":
                self.action_switch_profile()
            elif button == "quit":
                self.app.exit(return_code=2)

        self.app.push_screen(ErrorScreen("Cannot load the model", message, self.app.log_path,
                                         offer_profiles=True), chosen)

    # -- sending and streaming -----------------------------------------------------------------
    @on(PromptInput.Submitted)
    async def _submitted(self, event: PromptInput.Submitted) -> None:
        text = event.text
        if is_dictate_command(text):
            self.prompt.sent(text)
            self.dictation_actions.command()
            return
        if text.strip().lower() == "/board":
            self.prompt.sent(text)
            self.action_board()
            return
        agent_arg = agent_command(text)
        if agent_arg is not None:
            self.prompt.sent(text)
            await self.action_agent(agent_arg.strip("'\""))
            return
        try:
            slash = parse_slash(text)
        except MlxtermError as e:
            self.notify(str(e), severity="warning")
            return
        if slash is not None:
            self.prompt.sent(text)
            await self.chat_actions.run_slash(*slash)
            return
        await self.send(literal(text))

    async def send(self, text: str) -> None:
        if self.visible_busy:
            self.notify("A reply is still streaming; press Esc to stop it.", severity="warning")
            return
        if not self.controller.loaded:
            message = ("The model is still loading; send again in a moment." if self._loading
                       else "No model is loaded; pick a profile with /profile.")
            self.notify(message, severity="warning")
            return
        if self.agent_actions.agent_mode:
            await self.agent_actions.send(text)
            return
        if self.chat_busy:  # one chat turn at a time; it streams in another session's pane
            self.notify(f"A reply is still streaming in “{self.pane_title(self.chat_pane)}”; wait for "
                        "it or open that chat and press Esc.", severity="warning")
            return
        if self.session_id is None:
            self.session_id = self.controller.new_session().id
            self.conversation.session_id = self.session_id
        self.prompt.sent(text)
        self.app.history.add(text)
        user = await self.conversation.add(MessageView("user", text))
        sid = self.session_id
        self.start_turn(lambda: self.controller.send(sid, text), user)

    def pane_title(self, pane: Conversation | None) -> str:
        try:
            return self.controller.session(pane.session_id).title
        except (MlxtermError, AttributeError):
            return "another session"

    async def action_retry(self) -> None:
        sid = self.chat_actions.need_session()
        if sid is None:
            return
        if self.chat_busy:
            self.notify("A reply is still streaming; press Esc to stop it.", severity="warning")
            return
        if self.agent_actions.agent_mode:
            self.notify("Retry is for chats; in agent mode send the task again.",
                        severity="warning")
            return
        last = self.conversation.last()
        if last is not None and last.role == "assistant":
            await last.remove()
        self.start_turn(lambda: self.controller.retry(sid), None)

    def start_turn(self, start: Callable, user: MessageView | None) -> None:
        self._starting = True
        self._stop_requested = False
        self.chat_pane = self.conversation
        self.refresh_bindings()
        self._stream_turn(start, user, self.chat_pane)

    @work(exclusive=True, group="turn")
    async def _stream_turn(self, start: Callable, user: MessageView | None, pane: Conversation) -> None:
        try:
            await self._stream_turn_in(start, user, pane)
        finally:
            self.chat_pane = None
        self.refresh_bindings()
        self.refresh_sessions()  # drops the sidebar's streaming mark
        await self.release_pane(pane)

    async def _stream_turn_in(self, start: Callable, user: MessageView | None, pane: Conversation) -> None:
        reply = MessageView("assistant", state="streaming")
        await pane.add(reply)
        self.refresh_sessions()  # the sidebar marks the streaming session
        self.turn_status(pane, "waiting for the model…")
        try:
            # Storing the message and tokenizing it touch SQLite: keep them off the UI loop.
            turn = await asyncio.to_thread(start)
        except MlxtermError as e:
            self._starting = False
            self.refresh_bindings()
            await reply.remove()
            self.turn_status(pane, "")
            self.notify(str(e), severity="error")
            return
        self.turn, self._starting = turn, False
        self.status.refresh_shared()  # "N requests share the engine" at once, not in 2 s
        if self._stop_requested:
            turn.cancel()
        done: Done | None = None
        count = 0
        accept = ""
        try:
            async for ev in turn:
                if isinstance(ev, TextDelta):
                    await reply.write(ev.text)
                    count += 1
                    if count % STATUS_EVERY == 1:
                        self.turn_status(pane, f"generating… {count} tokens{accept}")
                elif isinstance(ev, ReasoningDelta):
                    await reply.write_reasoning(ev.text)
                elif isinstance(ev, SpeculationProgress):  # a speculative preset is streaming
                    accept = f" · {speculation_note(ev.accepted, ev.drafted)}"
                    self.turn_status(pane, f"generating… {count} tokens{accept}")
                elif isinstance(ev, PrefillProgress):
                    self.turn_status(pane, f"reading the prompt… {ev.done:,}/{ev.total:,} tokens")
                elif isinstance(ev, Done):
                    done = ev
        except MlxtermError as e:  # e.g. the reply could not be saved (disk full)
            await reply.finish("error", str(e))
            self.notify(str(e), severity="error")
            return
        except asyncio.CancelledError:
            turn.cancel()  # the screen is going away: do not leave the engine generating
            raise
        finally:
            self.turn = None
            self.refresh_bindings()
        await self._finish_turn(turn, done, reply, user, pane)

    async def _finish_turn(self, turn, done: Done | None, reply: MessageView,
                           user: MessageView | None, pane: Conversation) -> None:
        if done is None or done.finish_reason == "error" or done.error:
            note = (done.error if done else None) or "generation failed"
            await reply.finish("error", note)
            self.notify(f"The model could not answer: {note}", severity="error")
        elif done.finish_reason == "cancelled":
            await reply.finish("stopped")
        else:
            await reply.finish("done")
        if turn.message is not None:
            reply.set_number(turn.message.index + 1)
            if user is not None:
                user.set_number(turn.message.index)
        if done is not None and not done.error:
            summary = turn_summary(done_meta(done))
            self.turn_status(pane, f"stopped · {summary}" if done.finish_reason == "cancelled"
                             else summary)
            log.info("turn done: %s", summary)
        self.update_context()
        self.refresh_sessions()

    def action_stop(self) -> None:
        """Esc: stop what streams in the visible pane (a run in a hidden pane keeps going)."""
        pane = self.conversation
        if self.agent_actions.streams_into(pane):
            self.agent_actions.stop()
        elif pane is self.chat_pane:
            self._stop_chat()

    def _stop_chat(self) -> None:
        if self.turn is not None:
            self.turn.cancel()
            self.turn_status(self.chat_pane, "stopping…")
        elif self._starting:
            self._stop_requested = True

    async def stop_and_wait(self, everything: bool = False) -> None:
        """Stop what streams in the visible pane (``everything``: in every pane, e.g. on quit)
        and wait until it is saved."""
        groups = set()
        if everything or self.conversation is self.chat_pane:
            groups.add("turn")
            self._stop_chat()
        if everything or self.conversation is self.agent_actions.agent_pane:
            groups.add("agent")
            if self.agent_actions.agent_busy:
                self.agent_actions.stop()
        for worker in self.workers:
            if worker.group in groups:
                await worker.wait()
