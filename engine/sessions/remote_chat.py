"""Chat sessions on a remote profile's server: ``RemoteChatService`` (same API as ``ChatService``).

A local session keeps each message's exact token ids so its next turn extends the previous
context and KV checkpoint. A remote turn has neither: the server tokenizes and caches on its
side. So a remote session stores messages (text, reasoning, usage, timings) with no token ids,
and its meta says where it ran (``remote: {base_url, model}``, ``engine.sessions.chat.remote_mark``).
Each turn sends the stored conversation as messages; a server with a prefix cache (``mlxterm
serve``, llama.cpp, vLLM) reuses what it computed for the turn before, reported as cached
tokens. A local ``ChatService`` refuses to continue a marked session (it has no tokens to feed
and no checkpoint to restore). A failed turn (server down, an error answer) is stored like a
local one, with its error; it is left out of the next turn's messages.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from engine.serving.remote_engine import RemoteEngine
from engine.sessions import Session, SessionStore
from engine.sessions.chat import (
    REMOTE_KEY,
    ChatError,
    ChatService,
    ChatTurn,
    message_dicts,
    remote_mark,
)


class RemoteChatService(ChatService):
    """Runs chat turns of stored sessions on a ``RemoteEngine``."""

    keeps_tokens = False

    def __init__(self, engine: RemoteEngine, store: SessionStore):
        super().__init__(engine, store)

    @property
    def mark(self) -> dict[str, Any]:
        return {"base_url": self.engine.base_url, "model": self.engine.model_name}

    def create(self, title: str | None = None, kind: str = "chat", **kw) -> Session:
        if kind != "chat":
            raise ChatError(f"profile {self.engine.profile.name} is remote: only chats run on it")
        meta = {**(kw.pop("meta", None) or {}), REMOTE_KEY: self.mark}
        return self.store.create(title=title, profile=self.engine.profile.name, kind=kind, meta=meta, **kw)

    def conversation(self, session_id: str) -> list[dict[str, Any]]:
        """The messages a turn sends: the stored ones, less failed replies."""
        msgs = [m for m in self.store.messages(session_id, tokens=False)
                if not (m.role == "assistant" and m.meta.get("error"))]
        return message_dicts(msgs)

    # -- internals ---------------------------------------------------------------------------
    def _generate(self, session_id: str, **overrides) -> ChatTurn:
        session = self.store.get(session_id)
        self._check_session(session)
        if remote_mark(session) != self.mark:  # where its latest turn ran
            self.store.set_meta(session.id, {REMOTE_KEY: self.mark})
        messages = self.conversation(session_id)
        if not any(m["role"] != "system" for m in messages):
            raise ChatError("there is no message to answer yet.")
        handle = self.engine.submit_messages(messages, self.engine.sampling(**overrides))
        return ChatTurn(self, session_id, handle)

    def _check_session(self, session: Session) -> None:
        profile = self.engine.profile
        if session.kind != "chat":
            raise ChatError(f"session {session.id} is an agent session; agents need a model loaded "
                            f"here (profile {profile.name} runs on {self.engine.base_url})")
        if session.message_count and session.profile and session.profile != profile.name:
            raise ChatError(f"session {session.id} was made with profile {session.profile}; "
                            f"load that profile to continue it (this is {profile.name}).")

    def _add(self, session: Session, message: Mapping[str, Any], tools=None) -> None:
        """Store ``message`` with no token ids (``_generate`` marks the session remote)."""
        profile = self.engine.profile
        self._check_session(session)
        history = self.store.messages(session.id, tokens=False)
        if not history and profile.chat.system_prompt and message["role"] != "system":
            self.store.add_message(session.id, "system", profile.chat.system_prompt)
        self.store.add_message(session.id, message["role"], message["content"])
