"""The store's records (frozen dataclasses) and the token-id BLOB codec."""

from __future__ import annotations

import sys
from array import array
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from engine.sessions.errors import SessionError

ROLES = ("system", "user", "assistant", "tool")
KINDS = ("chat", "agent")

assert array("i").itemsize == 4, "token BLOBs need a 4-byte C int"


@dataclass(frozen=True)
class Session:
    id: str
    title: str
    profile: str
    kind: str
    workspace: str | None
    parent_id: str | None
    fork_at: int | None
    created: float  # unix seconds
    updated: float
    message_count: int
    token_count: int
    meta: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Message:
    id: int  # database row id, unique across sessions
    session_id: str
    index: int  # position in the session, from 0
    role: str
    content: str
    reasoning: str | None
    tool_calls: list[dict[str, Any]] | None
    tool_call_id: str | None
    name: str | None
    token_ids: tuple[int, ...]  # empty when read with tokens=False
    token_count: int
    context_start: int  # offset of this message's first token in the session's context
    profile: str
    created: float
    updated: float
    meta: dict[str, Any] = field(default_factory=dict)

    @property
    def context_end(self) -> int:
        return self.context_start + self.token_count


@dataclass(frozen=True)
class SessionSummary:
    id: str
    title: str
    profile: str
    kind: str
    created: float
    updated: float
    message_count: int
    token_count: int
    preview: str  # last user/assistant text, one line


def pack_tokens(token_ids: Iterable[int]) -> bytes:
    """Token ids as int32 little-endian bytes (the BLOB format of ``messages.token_ids``)."""
    tobytes = getattr(token_ids, "tobytes", None)
    dtype = getattr(token_ids, "dtype", None)
    if tobytes is not None and dtype is not None and str(dtype) in ("int32", "<i4"):
        arr = array("i")
        arr.frombytes(tobytes())  # numpy int32 in native order: no per-item conversion
    else:
        try:
            arr = array("i", (int(t) for t in token_ids))
        except (OverflowError, TypeError, ValueError) as e:
            raise SessionError(f"token ids must be 32-bit integers ({e}).") from None
    if sys.byteorder == "big":
        arr.byteswap()
    return arr.tobytes()


def unpack_tokens(blob: bytes | None) -> tuple[int, ...]:
    if not blob:
        return ()
    arr = array("i")
    arr.frombytes(blob)
    if sys.byteorder == "big":
        arr.byteswap()
    return tuple(arr)
