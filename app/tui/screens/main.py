"""``MainScreen``: sessions sidebar, conversation, message box and status bar.

It turns user intent (keys, palette entries, widget messages) into calls on the app's
``ChatController``, loads profiles and streams chat turns into the conversation (the chat
commands and slash commands live in ``chat_actions.py``). Model loading runs in a thread
worker and generation on the engine thread, so the UI never waits on MLX.
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


class MainScreen(ChatActions, AgentActions, DictationActions, Screen):
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
        self.init_dictation()
        self.init_agent()

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

    @property
    def controller(self):
        return self.app.controller

    @property
    def conversation(self) -> Conversation:
        return self.query_one(Conversation)

    @property
    def prompt(self) -> PromptInput:
        return self.query_one(PromptInput)

    @property
    def status(self) -> StatusBar:
        return self.query_one(StatusBar)

    @property
    def generating(self) -> bool:
        return self.turn is not None or self._starting or self.agent_busy

    def on_unmount(self) -> None:
        self.close_dictation()

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
            return self.generating  # Esc does nothing (and is not shown) when idle
        if action == "dictate":
            return self.dictation_state()  # shown disabled when there is no microphone
        return True

    # -- sessions ------------------------------------------------------------------------------
    def refresh_sessions(self) -> None:
        sidebar = self.query_one(SessionSidebar)
        sessions = self.controller.sessions(sidebar.query_text)
        sidebar.set_sessions(sessions, self.session_id, self.app.clock())

    def update_context(self) -> None:
        info = self.controller.info()
        used = self.controller.session(self.session_id).token_count if self.session_id else 0
        self.status.set_context(used, info.max_context if info else None)

    async def open_session(self, session_id: str, switch_profile: bool = True) -> None:
        if self.generating:
            await self.stop_and_wait()
        try:
            session = self.controller.session(session_id)
        except MlxtermError as e:
            self.notify(str(e), severity="error")
            return
        self.session_id = session.id
        self.set_agent_mode(session)
        await self.conversation.show(self.controller.messages(session.id),
                                     agent=self.agent_mode, workspace=session.workspace)
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
        if self.generating:
            await self.stop_and_wait()
        self.session_id = None
        self.set_agent_mode(None)
        await self.conversation.show([])
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
        pending, self._agent_after_load = self._agent_after_load, None
        if pending is not None and info.profile == self.controller.engine.profile.name:
            await self.action_agent(pending)

    def _load_failed(self, spec: str, message: str) -> None:
        self._loading = None
        self._agent_after_load = None
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
            self.dictate_command()
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
            await self.run_slash(*slash)
            return
        await self.send(literal(text))

    async def send(self, text: str) -> None:
        if self.generating:
            self.notify("A reply is still streaming; press Esc to stop it.", severity="warning")
            return
        if not self.controller.loaded:
            message = ("The model is still loading; send again in a moment." if self._loading
                       else "No model is loaded; pick a profile with /profile.")
            self.notify(message, severity="warning")
            return
        if self.agent_mode:
            await self.send_agent(text)
            return
        if self.session_id is None:
            self.session_id = self.controller.new_session().id
        self.prompt.sent(text)
        self.app.history.add(text)
        user = await self.conversation.add(MessageView("user", text))
        sid = self.session_id
        self.start_turn(lambda: self.controller.send(sid, text), user)

    async def action_retry(self) -> None:
        sid = self._need_session()
        if sid is None:
            return
        if self.generating:
            self.notify("A reply is still streaming; press Esc to stop it.", severity="warning")
            return
        if self.agent_mode:
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
        self.refresh_bindings()
        self._stream_turn(start, user)

    @work(exclusive=True, group="turn")
    async def _stream_turn(self, start: Callable, user: MessageView | None) -> None:
        reply = MessageView("assistant", state="streaming")
        await self.conversation.add(reply)
        self.status.set_turn("waiting for the model…")
        try:
            # Storing the message and tokenizing it touch SQLite: keep them off the UI loop.
            turn = await asyncio.to_thread(start)
        except MlxtermError as e:
            self._starting = False
            self.refresh_bindings()
            await reply.remove()
            self.status.set_turn("")
            self.notify(str(e), severity="error")
            return
        self.turn, self._starting = turn, False
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
                        self.status.set_turn(f"generating… {count} tokens{accept}")
                elif isinstance(ev, ReasoningDelta):
                    await reply.write_reasoning(ev.text)
                elif isinstance(ev, SpeculationProgress):  # a speculative preset is streaming
                    accept = f" · {speculation_note(ev.accepted, ev.drafted)}"
                    self.status.set_turn(f"generating… {count} tokens{accept}")
                elif isinstance(ev, PrefillProgress):
                    self.status.set_turn(f"reading the prompt… {ev.done:,}/{ev.total:,} tokens")
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
        await self._finish_turn(turn, done, reply, user)

    async def _finish_turn(self, turn, done: Done | None, reply: MessageView,
                           user: MessageView | None) -> None:
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
            self.status.set_turn(f"stopped · {summary}" if done.finish_reason == "cancelled"
                                 else summary)
            log.info("turn done: %s", summary)
        self.update_context()
        self.refresh_sessions()

    def action_stop(self) -> None:
        if self.agent_busy:
            self.stop_agent()
        elif self.turn is not None:
            self.turn.cancel()
            self.status.set_turn("stopping…")
        elif self._starting:
            self._stop_requested = True

    async def stop_and_wait(self) -> None:
        """Stop the streaming reply (or the agent run) and wait until it is saved."""
        self.action_stop()
        for worker in self.workers:
            if worker.group in ("turn", "agent"):
                await worker.wait()
