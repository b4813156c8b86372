"""``ChatActions``: the main screen's chat commands (rename, delete, fork, export, clear,
system prompt) and the slash-command dispatcher.

Each action is reachable from a key binding, a slash command and a palette entry; all of
them act on the open chat through the app's ``ChatController``. ``MainScreen`` owns one
``ChatActions`` and keeps thin ``action_*`` methods (Textual looks for them on the screen)
that call it.
"""

from __future__ import annotations

import shlex
from pathlib import Path
from typing import TYPE_CHECKING

from engine.errors import MlxtermError

from app.tui.screens.dialogs import ConfirmScreen, TextScreen

if TYPE_CHECKING:
    from app.tui.hosts import ChatHost


class ChatActions:
    """The screen's chat commands; uses of its host only what ``app.tui.hosts.ChatHost`` lists."""

    def __init__(self, host: ChatHost) -> None:
        self.host = host

    def need_session(self) -> str | None:
        if self.host.session_id is None:
            self.host.notify("This chat has no messages yet.", severity="warning")
        return self.host.session_id

    def rename(self, title: str = "") -> None:
        sid = self.need_session()
        if sid is None:
            return
        if title:
            self._rename(sid, title)
            return
        current = self.host.controller.session(sid).title
        self.host.app.push_screen(TextScreen("Rename chat", current),
                                  lambda t: self._rename(sid, t) if t else None)

    def _rename(self, sid: str, title: str) -> None:
        try:
            self.host.controller.rename(sid, title)
        except MlxtermError as e:
            self.host.notify(str(e), severity="error")
            return
        self.host.refresh_sessions()
        self.host.notify(f"Renamed the chat to “{title.strip()}”.")

    def delete(self) -> None:
        sid = self.need_session()
        if sid is None:
            return
        title = self.host.controller.session(sid).title

        async def confirmed(yes: bool | None) -> None:
            if not yes:
                return
            if self.host.visible_busy:
                await self.host.stop_and_wait()
            self.host.controller.delete(sid)
            self.host.notify(f"Deleted “{title}”.")
            await self.host.action_new_chat()

        self.host.app.push_screen(ConfirmScreen(f"Delete “{title}” and all its messages?", "Delete"),
                                  confirmed)

    async def fork(self, at: int | None = None) -> None:
        sid = self.need_session()
        if sid is None:
            return
        if self.host.visible_busy:
            self.host.notify("Wait for the reply to finish (or press Esc) before forking.",
                             severity="warning")
            return
        count = self.host.controller.session(sid).message_count
        at = count if at is None else at
        try:
            new = self.host.controller.fork(sid, at)
        except MlxtermError as e:
            self.host.notify(str(e), severity="error")
            return
        await self.host.open_session(new.id)
        self.host.notify(f"Forked at message {at} into a new chat; its next reply reuses the "
                         "cached context.")

    def export(self, fmt: str = "md", path: str | None = None) -> None:
        sid = self.need_session()
        if sid is None:
            return
        try:
            written = self.host.controller.export(sid, fmt, path)
        except MlxtermError as e:
            self.host.notify(str(e), severity="error")
            return
        self.host.notify(f"Exported the chat to {written}", timeout=8)

    def clear(self) -> None:
        sid = self.need_session()
        if sid is None:
            return

        async def confirmed(yes: bool | None) -> None:
            if not yes:
                return
            if self.host.visible_busy:
                await self.host.stop_and_wait()
            removed = self.host.controller.clear(sid)
            await self.host.open_session(sid, switch_profile=False)
            self.host.notify(f"Cleared {removed} messages.")

        self.host.app.push_screen(ConfirmScreen("Delete all messages of this chat?", "Clear"), confirmed)

    async def system(self, text: str = "") -> None:
        if text:
            await self._set_system(text)
            return
        current = self.host.controller.system_prompt(self.host.session_id)
        self.host.app.push_screen(TextScreen("System prompt for a new chat", current,
                                             "You are a helpful assistant."), self._set_system)

    async def _set_system(self, text: str | None) -> None:
        if text is None or not text.strip():
            return
        if self.host.visible_busy:
            self.host.notify("Wait for the reply to finish first.", severity="warning")
            return
        try:
            if self.host.session_id and self.host.controller.session(self.host.session_id).message_count:
                await self.host.action_new_chat()  # a system prompt only makes sense at the start
            created = self.host.session_id is None
            if created:
                self.host.session_id = self.host.controller.new_session().id
            self.host.controller.set_system(self.host.session_id, text.strip())
        except MlxtermError as e:
            self.host.notify(str(e), severity="error")
            return
        await self.host.open_session(self.host.session_id, switch_profile=False)
        self.host.notify("System prompt set for this chat.")

    async def run_slash(self, command, arg: str) -> None:
        name = command.name
        if name == "new":
            await self.host.action_new_chat()
        elif name == "profile":
            self.host.action_switch_profile(arg)
        elif name == "system":
            await self.system(arg)
        elif name == "fork":
            if arg and not arg.isdigit():
                self.host.notify(f"/fork takes a message number, not {arg!r}.", severity="warning")
                return
            await self.fork(int(arg) if arg else None)
        elif name == "export":
            self._slash_export(arg)
        elif name == "retry":
            await self.host.action_retry()
        elif name == "clear":
            self.clear()
        elif name == "rename":
            self.rename(arg)
        elif name == "delete":
            self.delete()
        elif name == "help":
            self.host.app.action_help()
        elif name == "quit":
            self.host.app.exit()

    def _slash_export(self, arg: str) -> None:
        try:
            words = shlex.split(arg)
        except ValueError as e:
            self.host.notify(f"cannot read /export arguments: {e}.", severity="warning")
            return
        fmt = "md"
        if words and words[0].lower() in ("md", "json", "markdown"):
            fmt = "md" if words.pop(0).lower() in ("md", "markdown") else "json"
        path = words[0] if words else None
        if path and Path(path).suffix.lower() == ".json" and not arg.lower().startswith("md"):
            fmt = "json"
        self.export(fmt, path)
