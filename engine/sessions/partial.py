"""A streaming reply kept in the session store as it is generated, so a kill loses at most ~1 s.

``PartialReply`` writes the assistant message on its first save and rewrites it (text, exact
token ids so far) at most every ``SAVE_EVERY_S`` or ``SAVE_EVERY_TOKENS``; ``finish`` writes the
final message in the same row. While streaming, the message's meta holds ``streaming: {pid,
started}``. A process killed mid-reply leaves that mark behind; ``recover_interrupted`` (called
when a session is opened or continued) turns it into ``interrupted: true`` with finish reason
"interrupted", so the next turn follows a complete assistant message and its prompt extends the
exact tokens that were generated (and the KV checkpoint of the turn before, where one exists).
A remote turn (``tokens=False``) is saved the same way without token ids. Chat turns and agent
steps use it; anything else that streams into a session can: ``PartialReply(store, sid,
handle)``, ``update(text)`` per event, ``finish(...)`` on ``Done``.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Iterable, Mapping
from typing import Any

from engine.pids import pid_alive
from engine.sessions.model import Message
from engine.sessions.store import SessionStore

SAVE_EVERY_S = 1.0
SAVE_EVERY_TOKENS = 32
INTERRUPTED = "interrupted"

_live_lock = threading.Lock()
_live: set[tuple[str, str]] = set()  # (store path, session id) streaming in this process


class PartialReply:
    """The assistant message of one streaming generation, saved as it grows."""

    def __init__(self, store: SessionStore, session_id: str, handle: Any, *,
                 meta: Mapping[str, Any] | None = None, clock=time.monotonic, tokens: bool = True):
        self.store = store
        self.session_id = store.get(session_id).id
        self.handle = handle  # exposes ``token_ids``: the ids generated so far (engine thread appends)
        # False for a remote turn: no token ids; progress is counted in updates (streamed pieces)
        self.tokens = tokens
        self._updates = 0
        self.meta = dict(meta or {})
        self.clock = clock
        self.saves = 0
        self.message: Message | None = None
        self._saved_tokens = 0
        self._saved_at = clock()
        self._started = time.time()
        self._key = (str(store.path), self.session_id)
        with _live_lock:
            _live.add(self._key)

    def update(self, content: str, reasoning: str = "") -> None:
        """Called after each streamed event; saves when a second or enough tokens have passed."""
        self._updates += 1
        n = len(self.handle.token_ids) if self.tokens else self._updates
        if n == self._saved_tokens:
            return
        if n - self._saved_tokens >= SAVE_EVERY_TOKENS or self.clock() - self._saved_at >= SAVE_EVERY_S:
            self.save(content, reasoning)

    def save(self, content: str, reasoning: str = "") -> None:
        ids = list(self.handle.token_ids) if self.tokens else []  # a copy: the engine thread appends
        meta = {**self.meta, "streaming": {"pid": os.getpid(), "started": self._started}}
        self._write(content, reasoning or None, ids, meta, None)
        self._saved_tokens, self._saved_at = (len(ids) if self.tokens else self._updates), self.clock()
        self.saves += 1

    def finish(self, content: str, *, token_ids: Iterable[int], meta: Mapping[str, Any],
               reasoning: str | None = None, tool_calls: list[dict[str, Any]] | None = None) -> Message:
        """The final message (same row as the partial saves, if any)."""
        try:
            return self._write(content, reasoning, list(token_ids), dict(meta), tool_calls)
        finally:
            self.close()

    def close(self) -> None:
        with _live_lock:
            _live.discard(self._key)

    def _write(self, content: str, reasoning: str | None, ids: list[int], meta: dict[str, Any],
               tool_calls: list[dict[str, Any]] | None) -> Message:
        if self.message is None:
            self.message = self.store.add_message(self.session_id, "assistant", content, reasoning=reasoning,
                                                  tool_calls=tool_calls, token_ids=ids, meta=meta)
        else:
            self.message = self.store.update_message(self.session_id, content=content, reasoning=reasoning,
                                                     tool_calls=tool_calls, token_ids=ids, meta=meta)
        return self.message


def recover_interrupted(store: SessionStore, session_id: str) -> Message | None:
    """Mark a reply left streaming by a process that is gone as interrupted; returns it (else None)."""
    msgs = store.messages(session_id, tokens=False)
    if not msgs or msgs[-1].role != "assistant" or "streaming" not in msgs[-1].meta:
        return None
    last = msgs[-1]
    writer = last.meta["streaming"].get("pid") if isinstance(last.meta["streaming"], dict) else None
    with _live_lock:
        live_here = (str(store.path), last.session_id) in _live
    if live_here or (writer != os.getpid() and pid_alive(writer)):
        return None  # still streaming, here or in another process
    meta = {k: v for k, v in last.meta.items() if k != "streaming"}
    meta.update(interrupted=True, finish_reason=INTERRUPTED)
    return store.update_message(last.session_id, meta=meta)


