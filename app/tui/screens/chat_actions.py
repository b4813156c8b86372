"""``ChatActions``: the main screen's chat commands (rename, delete, fork, export, clear,
system prompt) and the slash-command dispatcher.

Each action is reachable from a key binding, a slash command and a palette entry; all of
them act on the open chat through the app's ``ChatController``. ``MainScreen`` mixes this
in (Textual finds ``action_*`` methods on the screen).
"""

from __future__ import annotations

import shlex
from pathlib import Path

from engine.errors import MlxtermError

from app.tui.screens.dialogs import ConfirmScreen, TextScreen


class ChatActions:
    """Needs what ``app.tui.hosts.ChatHost`` lists from the screen it is mixed into."""

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
            if self.visible_busy:
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
        if self.visible_busy:
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
            if self.visible_busy:
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
        if self.visible_busy:
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
