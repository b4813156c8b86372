"""``MainScreen``: sessions sidebar, conversation, message box and status bar.

It turns user intent (keys, slash commands, palette entries, widget messages) into calls on
the app's ``ChatController`` and streams chat turns into the conversation. Model loading
runs in a thread worker and generation on the engine thread, so the UI never waits on MLX.
"""

from __future__ import annotations

import asyncio
import logging
import shlex
from collections.abc import Callable
from pathlib import Path

from textual import on, work
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical
from textual.screen import Screen
from textual.widgets import Footer

from app.tui.commands import ChatCommands, literal, parse_slash
from app.tui.format import done_meta, turn_summary
from app.tui.screens.dialogs import ConfirmScreen, PickScreen, TextScreen
from app.tui.screens.error import ErrorScreen
from app.tui.screens.profiles import ProfileScreen
from app.tui.widgets.conversation import Conversation
from app.tui.widgets.message import MessageView
from app.tui.widgets.prompt import PromptInput
from app.tui.widgets.sidebar import SessionSidebar
from app.tui.widgets.status import StatusBar
from engine.errors import MlxtermError
from engine.events import Done, PrefillProgress, ReasoningDelta, TextDelta

log = logging.getLogger(__name__)
STATUS_EVERY = 8  # update the "generating" counter every N text deltas


class MainScreen(Screen):
    COMMANDS = {ChatCommands}
    BINDINGS = [
        Binding("escape", "stop", "Stop"),
        Binding("ctrl+n", "new_chat", "New chat"),
        Binding("ctrl+o", "switch_profile", "Profile"),
        Binding("ctrl+r", "retry", "Retry"),
        Binding("f2", "rename", "Rename chat"),
        Binding("f8", "delete", "Delete chat", show=False),
        Binding("ctrl+s", "export('md')", "Export chat (Markdown)", show=False),
        Binding("ctrl+l", "focus_sessions", "Go to the chat list", show=False),
        Binding("ctrl+f", "focus_filter", "Filter chats", show=False),
    ]

    def __init__(self) -> None:
        super().__init__()
        self.session_id: str | None = None
        self.turn = None  # the ChatTurn streaming now
        self._stop_requested = False
        self._loading: str | None = None  # profile spec being loaded

    # -- layout ----------------------------------------------------------------------------------
    def compose(self) -> ComposeResult:
        with Horizontal(id="body"):
            yield SessionSidebar(id="sidebar")
            with Vertical(id="chat"):
                yield Conversation(id="conversation")
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
        return self.turn is not None or self._starting

    _starting = False  # between submit and the ChatTurn existing

    async def on_mount(self) -> None:
        self.prompt.focus()
        if self.app.initial_session:
            await self.open_session(self.app.initial_session, switch_profile=False)
        else:
            self.refresh_sessions()
        if self.app.autoload:
            self.load_profile(self.controller.profile_spec)

    def check_action(self, action: str, parameters: tuple) -> bool | None:
        if action == "stop":
            return self.generating  # Esc does nothing (and is not shown) when idle
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
        await self.conversation.show(self.controller.messages(session.id))
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
        await self.conversation.show([])
        self.status.set_turn("")
        self.update_context()
        self.refresh_sessions()
        self.prompt.focus()

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

    def _need_session(self) -> str | None:
        if self.session_id is None:
            self.notify("This chat has no messages yet.", severity="warning")
        return self.session_id

    def action_rename(self, title: str = "") -> None:
        sid = self._need_session()
        if sid is None:
            return
        if title:
            self._rename(sid, title)
            return
        current = self.controller.session(sid).title
        self.app.push_screen(TextScreen("Rename chat", current),
                             lambda t: self._rename(sid, t) if t else None)

    def _rename(self, sid: str, title: str) -> None:
        try:
            self.controller.rename(sid, title)
        except MlxtermError as e:
            self.notify(str(e), severity="error")
            return
        self.refresh_sessions()
        self.notify(f"Renamed the chat to “{title.strip()}”.")

    def action_delete(self) -> None:
        sid = self._need_session()
        if sid is None:
            return
        title = self.controller.session(sid).title

        async def confirmed(yes: bool | None) -> None:
            if not yes:
                return
            if self.generating:
                await self.stop_and_wait()
            self.controller.delete(sid)
            self.notify(f"Deleted “{title}”.")
            await self.action_new_chat()

        self.app.push_screen(ConfirmScreen(f"Delete “{title}” and all its messages?", "Delete"),
                             confirmed)

    async def action_fork(self, at: int | None = None) -> None:
        sid = self._need_session()
        if sid is None:
            return
        if self.generating:
            self.notify("Wait for the reply to finish (or press Esc) before forking.",
                        severity="warning")
            return
        count = self.controller.session(sid).message_count
        at = count if at is None else at
        try:
            new = self.controller.fork(sid, at)
        except MlxtermError as e:
            self.notify(str(e), severity="error")
            return
        await self.open_session(new.id)
        self.notify(f"Forked at message {at} into a new chat; its next reply reuses the "
                    "cached context.")

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

    def action_export(self, fmt: str = "md", path: str | None = None) -> None:
        sid = self._need_session()
        if sid is None:
            return
        try:
            written = self.controller.export(sid, fmt, path)
        except MlxtermError as e:
            self.notify(str(e), severity="error")
            return
        self.notify(f"Exported the chat to {written}", timeout=8)

    def action_clear(self) -> None:
        sid = self._need_session()
        if sid is None:
            return

        async def confirmed(yes: bool | None) -> None:
            if not yes:
                return
            if self.generating:
                await self.stop_and_wait()
            removed = self.controller.clear(sid)
            await self.open_session(sid, switch_profile=False)
            self.notify(f"Cleared {removed} messages.")

        self.app.push_screen(ConfirmScreen("Delete all messages of this chat?", "Clear"), confirmed)

    async def action_system(self, text: str = "") -> None:
        if text:
            await self._set_system(text)
            return
        current = self.controller.system_prompt(self.session_id)
        self.app.push_screen(TextScreen("System prompt for a new chat", current,
                                        "You are a helpful assistant."), self._set_system)

    async def _set_system(self, text: str | None) -> None:
        if text is None or not text.strip():
            return
        if self.generating:
            self.notify("Wait for the reply to finish first.", severity="warning")
            return
        try:
            if self.session_id and self.controller.session(self.session_id).message_count:
                await self.action_new_chat()  # a system prompt only makes sense at the start
            created = self.session_id is None
            if created:
                self.session_id = self.controller.new_session().id
            self.controller.set_system(self.session_id, text.strip())
        except MlxtermError as e:
            self.notify(str(e), severity="error")
            return
        await self.open_session(self.session_id, switch_profile=False)
        self.notify("System prompt set for this chat.")

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
        self.app.post_message(self.app.ProfileLoaded(info))

    def _load_failed(self, spec: str, message: str) -> None:
        self._loading = None
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
        reply = MessageView("assistant")
        reply.start()
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
        try:
            async for ev in turn:
                if isinstance(ev, TextDelta):
                    await reply.write(ev.text)
                    count += 1
                    if count % STATUS_EVERY == 1:
                        self.status.set_turn(f"generating… {count} tokens")
                elif isinstance(ev, ReasoningDelta):
                    await reply.write_reasoning(ev.text)
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
        if self.turn is not None:
            self.turn.cancel()
            self.status.set_turn("stopping…")
        elif self._starting:
            self._stop_requested = True

    async def stop_and_wait(self) -> None:
        """Stop the streaming reply and wait until it is saved."""
        self.action_stop()
        for worker in self.workers:
            if worker.group == "turn":
                await worker.wait()

    # -- slash commands -------------------------------------------------------------------------
    async def run_slash(self, command, arg: str) -> None:
        name = command.name
        if name == "new":
            await self.action_new_chat()
        elif name == "profile":
            self.action_switch_profile(arg)
        elif name == "system":
            await self.action_system(arg)
        elif name == "fork":
            if arg and not arg.isdigit():
                self.notify(f"/fork takes a message number, not {arg!r}.", severity="warning")
                return
            await self.action_fork(int(arg) if arg else None)
        elif name == "export":
            self._slash_export(arg)
        elif name == "retry":
            await self.action_retry()
        elif name == "clear":
            self.action_clear()
        elif name == "rename":
            self.action_rename(arg)
        elif name == "delete":
            self.action_delete()
        elif name == "help":
            self.app.action_help()
        elif name == "quit":
            self.app.exit()

    def _slash_export(self, arg: str) -> None:
        try:
            words = shlex.split(arg)
        except ValueError as e:
            self.notify(f"cannot read /export arguments: {e}.", severity="warning")
            return
        fmt = "md"
        if words and words[0].lower() in ("md", "json", "markdown"):
            fmt = "md" if words.pop(0).lower() in ("md", "markdown") else "json"
        path = words[0] if words else None
        if path and Path(path).suffix.lower() == ".json" and not arg.lower().startswith("md"):
            fmt = "json"
        self.action_export(fmt, path)
