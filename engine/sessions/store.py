"""``SessionStore``: sessions, messages and their token ids in one SQLite file.

Several processes (TUI, agents, CLI) may open the same file at once. Each store holds one
connection; every public method is one short transaction (``BEGIN IMMEDIATE`` for writes, so
the busy timeout applies instead of failing on a lock upgrade). Nothing is cached between
calls, so what another process wrote is visible on the next call.
"""

from __future__ import annotations

import json
import os
import re
import sqlite3
import threading
import time
from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from engine.sessions import export as _export
from engine.sessions import schema
from engine.sessions.errors import SessionError, SessionNotFound
from engine.sessions.model import (
    KINDS,
    ROLES,
    Message,
    Session,
    SessionSummary,
    pack_tokens,
    unpack_tokens,
)
from engine.sessions.naming import DEFAULT_TITLE, check_named_id, is_id_prefix, new_id

DB_NAME = "sessions.sqlite3"
PREVIEW_CHARS = 80

_SESSION_COLS = ("id, title, profile, kind, workspace, parent_id, fork_at, created, updated, "
                 "message_count, token_count, meta")
_MESSAGE_COLS = ("id, session_id, idx, role, content, reasoning, tool_calls, tool_call_id, "
                 "name, token_count, context_start, profile, created, updated, meta")
# Columns copied verbatim when forking (everything but the row id and the session id).
_COPY_COLS = ("idx, role, content, reasoning, tool_calls, tool_call_id, name, token_ids, "
              "token_count, context_start, profile, created, updated, meta")


class _Unset:
    def __repr__(self) -> str:
        return "UNSET"


UNSET: Any = _Unset()  # "leave unchanged" for update_message (None means "clear")


def default_path() -> Path:
    from engine.paths import data_dir

    return data_dir() / DB_NAME


class SessionStore:
    """The persistent session store. ``path`` defaults to ``data_dir()/sessions.sqlite3``.

    Methods taking a ``session_id`` also accept a unique id prefix (like git). ``fts`` picks
    the search index when the file is created: ``None`` = FTS5 if available, ``False`` =
    plain LIKE scans (the store always searches the way the file was built).
    """

    def __init__(self, path: str | os.PathLike | None = None, *, timeout: float = 30.0,
                 fts: bool | None = None) -> None:
        self.path = Path(path) if path is not None else default_path()
        self._timeout = timeout
        self._fts_wanted = fts
        self._lock = threading.RLock()  # one connection, shared by this object's threads
        self._conn: sqlite3.Connection | None = None
        self._pid = 0
        self._fts = False
        self._connection()  # open now so a bad path fails here, not on first use

    # -- connection and transactions ---------------------------------------------------------

    def _connection(self) -> sqlite3.Connection:
        if self._conn is not None and self._pid == os.getpid():
            return self._conn
        # A connection inherited through fork() must not be used (or closed) by the child.
        self._conn = None
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            conn = schema.connect(self.path, self._timeout)
            try:
                schema.migrate(conn, self.path, self._fts_wanted)
                self._fts = schema.has_fts(conn)
            except BaseException:
                conn.close()
                raise
        except sqlite3.DatabaseError as e:
            raise SessionError(f"cannot open session database {self.path}: {e}.") from None
        except OSError as e:
            raise SessionError(f"cannot create session database {self.path}: {e.strerror}.") from None
        self._conn, self._pid = conn, os.getpid()
        return conn

    @contextmanager
    def _tx(self, write: bool) -> Iterator[sqlite3.Connection]:
        """One transaction: all-or-nothing for writes, one consistent snapshot for reads."""
        with self._lock:
            conn = self._connection()
            try:
                conn.execute("BEGIN IMMEDIATE" if write else "BEGIN")
            except sqlite3.OperationalError as e:
                raise SessionError(f"session database {self.path} is unavailable: {e}.") from None
            try:
                yield conn
            except BaseException:
                if conn.in_transaction:
                    conn.execute("ROLLBACK")
                raise
            try:
                conn.execute("COMMIT")
            except sqlite3.OperationalError as e:
                if conn.in_transaction:
                    conn.execute("ROLLBACK")
                raise SessionError(f"cannot write session database {self.path}: {e}.") from None

    def close(self) -> None:
        with self._lock:
            if self._conn is not None and self._pid == os.getpid():
                self._conn.close()
            self._conn = None

    def __enter__(self) -> SessionStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def uses_fts(self) -> bool:
        """Whether searches use the FTS5 index (else LIKE scans)."""
        return self._fts

    # -- sessions ----------------------------------------------------------------------------

    def create(self, title: str | None = None, profile: str = "", kind: str = "chat",
               workspace: str | os.PathLike | None = None, parent_id: str | None = None,
               fork_at: int | None = None, meta: Mapping[str, Any] | None = None,
               session_id: str | None = None) -> Session:
        """A new session; ``session_id`` names it (else a sortable id is generated)."""
        _check_kind(kind)
        named = check_named_id(session_id) if session_id is not None else None
        meta_json = _dump_json(dict(meta or {}), "session meta")
        now = time.time()
        with self._tx(write=True) as conn:
            parent = self._resolve(conn, parent_id).id if parent_id else None
            if named is not None and conn.execute(
                    "SELECT 1 FROM sessions WHERE id = ?", (named,)).fetchone():
                raise SessionError(f"a session with id {named!r} already exists.")
            sid = named or _unused_id(conn, now)
            conn.execute(
                f"INSERT INTO sessions ({_SESSION_COLS}) VALUES (?,?,?,?,?,?,?,?,?,0,0,?)",
                (sid, _clean_title(title), profile, kind,
                 None if workspace is None else str(workspace), parent, fork_at, now, now,
                 meta_json))
            return self._resolve(conn, sid)

    def get(self, session_id: str) -> Session:
        with self._tx(write=False) as conn:
            return self._resolve(conn, session_id)

    def list(self, query: str | None = None, limit: int = 200,
             kind: str | None = None) -> list[SessionSummary]:
        """Sessions by most recently updated. ``query`` matches titles and message text: every
        word must occur in the title or in one message (FTS5: word prefixes; LIKE: substrings)."""
        if kind is not None:
            _check_kind(kind)
        where, params = ["(:kind IS NULL OR s.kind = :kind)"], {"kind": kind, "limit": limit}
        if query and query.strip():
            where.append(self._search_clause(query, params))
        sql = f"""
            SELECT s.id, s.title, s.profile, s.kind, s.created, s.updated, s.message_count,
                   s.token_count,
                   (SELECT substr(m.content, 1, 400) FROM messages m
                     WHERE m.session_id = s.id AND m.role IN ('user', 'assistant')
                       AND trim(m.content) != ''
                     ORDER BY m.idx DESC LIMIT 1)
              FROM sessions s
             WHERE {" AND ".join(where)}
             ORDER BY s.updated DESC, s.id DESC
             LIMIT :limit"""
        with self._tx(write=False) as conn:
            rows = conn.execute(sql, params).fetchall()
        return [SessionSummary(*row[:8], preview=_preview(row[8] or "")) for row in rows]

    def _search_clause(self, query: str, params: dict[str, Any]) -> str:
        words = query.split()
        title = []
        for i, w in enumerate(words):
            params[f"w{i}"] = f"%{_escape_like(w)}%"
            title.append(f"s.title LIKE :w{i} ESCAPE '\\'")
        title_sql = " AND ".join(title)
        fts_terms = [t for w in words for t in re.findall(r"\w+", w)]
        if self._fts and fts_terms:
            # Each term quoted (no FTS syntax from the user) and prefix-matched.
            params["fts"] = " ".join('"' + t.replace('"', '""') + '"*' for t in fts_terms)
            body_sql = f"""s.id IN (SELECT m.session_id FROM messages m
                            WHERE m.id IN (SELECT rowid FROM {schema.FTS_TABLE}
                                            WHERE {schema.FTS_TABLE} MATCH :fts))"""
        else:
            body = " AND ".join(f"m.content LIKE :w{i} ESCAPE '\\'" for i in range(len(words)))
            body_sql = f"s.id IN (SELECT m.session_id FROM messages m WHERE {body})"
        return f"(({title_sql}) OR {body_sql})"

    def rename(self, session_id: str, title: str) -> Session:
        if not title or not title.strip():
            raise SessionError("a session title cannot be empty.")
        with self._tx(write=True) as conn:
            sid = self._resolve(conn, session_id).id
            conn.execute("UPDATE sessions SET title = ? WHERE id = ?", (_clean_title(title), sid))
            return self._resolve(conn, sid)

    def set_profile(self, session_id: str, profile: str) -> Session:
        """Change the session's current profile (each message keeps the one it was made with)."""
        with self._tx(write=True) as conn:
            sid = self._resolve(conn, session_id).id
            conn.execute("UPDATE sessions SET profile = ? WHERE id = ?", (profile, sid))
            return self._resolve(conn, sid)

    def delete(self, session_id: str) -> str:
        """Delete a session and its messages; returns the full id. Forks keep their copies."""
        with self._tx(write=True) as conn:
            sid = self._resolve(conn, session_id).id
            conn.execute("DELETE FROM sessions WHERE id = ?", (sid,))
            return sid

    def fork(self, session_id: str, at: int, title: str | None = None) -> Session:
        """A new session holding copies of ``messages[:at]`` (token ids included)."""
        now = time.time()
        with self._tx(write=True) as conn:
            src = self._resolve(conn, session_id)
            if not 0 <= at <= src.message_count:
                raise SessionError(
                    f"cannot fork session {src.id} at message {at}: it has "
                    f"{src.message_count} messages (use 0 to {src.message_count}).")
            tokens = _context_start(conn, src.id, at, src.token_count)
            sid = _unused_id(conn, now)
            conn.execute(
                f"INSERT INTO sessions ({_SESSION_COLS}) VALUES (?,?,?,?,?,?,?,?,?,?,?,?)",
                (sid, _clean_title(title) if title else src.title, src.profile, src.kind,
                 src.workspace, src.id, at, now, now, at, tokens,
                 _dump_json(src.meta, "session meta")))
            conn.execute(
                f"INSERT INTO messages (session_id, {_COPY_COLS}) "
                f"SELECT ?, {_COPY_COLS} FROM messages WHERE session_id = ? AND idx < ? "
                "ORDER BY idx", (sid, src.id, at))
            return self._resolve(conn, sid)

    def set_meta(self, session_id: str, updates: Mapping[str, Any]) -> dict[str, Any]:
        """Merge ``updates`` into the session's meta (a ``None`` value removes the key)."""
        with self._tx(write=True) as conn:
            s = self._resolve(conn, session_id)
            meta = dict(s.meta)
            for key, value in updates.items():
                if value is None:
                    meta.pop(key, None)
                else:
                    meta[key] = value
            conn.execute("UPDATE sessions SET meta = ? WHERE id = ?",
                         (_dump_json(meta, "session meta"), s.id))
            return meta

    def get_meta(self, session_id: str) -> dict[str, Any]:
        return self.get(session_id).meta

    # -- messages ----------------------------------------------------------------------------

    def add_message(self, session_id: str, role: str, content: str, *,
                    reasoning: str | None = None,
                    tool_calls: Iterable[Mapping[str, Any]] | None = None,
                    tool_call_id: str | None = None, name: str | None = None,
                    token_ids: Iterable[int] = (), meta: Mapping[str, Any] | None = None,
                    profile: str | None = None) -> Message:
        """Append a message; ``token_ids`` are exactly the tokens fed (user/system/tool) or
        generated (assistant) for it. ``profile`` defaults to the session's profile."""
        if role not in ROLES:
            raise SessionError(f"unknown message role {role!r} (use one of {', '.join(ROLES)}).")
        if not isinstance(content, str):
            raise SessionError(f"message content must be text, not {type(content).__name__}.")
        calls = _dump_json(list(tool_calls), "tool calls") if tool_calls is not None else None
        meta_json = _dump_json(dict(meta or {}), "message meta")
        blob = pack_tokens(token_ids)
        count = len(blob) // 4
        now = time.time()
        with self._tx(write=True) as conn:
            s = self._resolve(conn, session_id)
            cur = conn.execute(
                "INSERT INTO messages (session_id, idx, role, content, reasoning, tool_calls, "
                "tool_call_id, name, token_ids, token_count, context_start, profile, created, "
                "updated, meta) VALUES (?,?,?,?,?,?,?,?,?,?,?,?,?,?,?)",
                (s.id, s.message_count, role, content, reasoning, calls, tool_call_id, name,
                 blob, count, s.token_count, s.profile if profile is None else profile, now,
                 now, meta_json))
            conn.execute(
                "UPDATE sessions SET message_count = message_count + 1, "
                "token_count = token_count + ?, updated = ? WHERE id = ?", (count, now, s.id))
            return self._message(conn, cur.lastrowid, tokens=True)

    def update_message(self, session_id: str, *, content: str = UNSET, reasoning: str | None = UNSET,
                       tool_calls: Iterable[Mapping[str, Any]] | None = UNSET,
                       token_ids: Iterable[int] = UNSET,
                       meta: Mapping[str, Any] = UNSET) -> Message:
        """Replace fields of the session's last message, which must be an assistant message
        (retry, stop). Arguments left out are unchanged; ``meta`` replaces the whole dict."""
        sets: dict[str, Any] = {}
        if content is not UNSET:
            if not isinstance(content, str):
                raise SessionError(f"message content must be text, not {type(content).__name__}.")
            sets["content"] = content
        if reasoning is not UNSET:
            sets["reasoning"] = reasoning
        if tool_calls is not UNSET:
            sets["tool_calls"] = (None if tool_calls is None
                                  else _dump_json(list(tool_calls), "tool calls"))
        if meta is not UNSET:
            sets["meta"] = _dump_json(dict(meta or {}), "message meta")
        if token_ids is not UNSET:
            sets["token_ids"] = pack_tokens(token_ids)
            sets["token_count"] = len(sets["token_ids"]) // 4
        now = time.time()
        sets["updated"] = now
        with self._tx(write=True) as conn:
            s = self._resolve(conn, session_id)
            row = conn.execute(
                "SELECT id, role, token_count FROM messages WHERE session_id = ? AND idx = ?",
                (s.id, s.message_count - 1)).fetchone()
            if row is None:
                raise SessionError(f"session {s.id} has no messages to update.")
            msg_id, role, old_count = row
            if role != "assistant":
                raise SessionError(f"the last message of session {s.id} is a {role} message; "
                                   "only a last assistant message can be updated.")
            assignments = ", ".join(f"{col} = ?" for col in sets)
            conn.execute(f"UPDATE messages SET {assignments} WHERE id = ?", (*sets.values(), msg_id))
            delta = sets.get("token_count", old_count) - old_count
            conn.execute("UPDATE sessions SET token_count = token_count + ?, updated = ? "
                         "WHERE id = ?", (delta, now, s.id))
            return self._message(conn, msg_id, tokens=True)

    def delete_last(self, session_id: str, n: int = 1) -> int:
        """Delete the last ``n`` messages (fewer if the session is shorter); returns how many."""
        if n < 0:
            raise SessionError(f"cannot delete {n} messages; give a count of 0 or more.")
        with self._tx(write=True) as conn:
            s = self._resolve(conn, session_id)
            keep = max(0, s.message_count - n)
            if keep == s.message_count:
                return 0
            tokens = _context_start(conn, s.id, keep, s.token_count)
            conn.execute("DELETE FROM messages WHERE session_id = ? AND idx >= ?", (s.id, keep))
            conn.execute("UPDATE sessions SET message_count = ?, token_count = ?, updated = ? "
                         "WHERE id = ?", (keep, tokens, time.time(), s.id))
            return s.message_count - keep

    def messages(self, session_id: str, *, tokens: bool = True) -> list[Message]:
        """All messages in order. ``tokens=False`` skips decoding token ids (faster listing)."""
        with self._tx(write=False) as conn:
            sid = self._resolve(conn, session_id).id
            token_col = "token_ids" if tokens else "NULL"
            rows = conn.execute(
                f"SELECT {_MESSAGE_COLS}, {token_col} FROM messages WHERE session_id = ? "
                "ORDER BY idx", (sid,)).fetchall()
        return [_row_to_message(r) for r in rows]

    def context_tokens(self, session_id: str, upto: int | None = None) -> list[int]:
        """The session's context: every message's token ids concatenated in order
        (only ``messages[:upto]`` when ``upto`` is given)."""
        with self._tx(write=False) as conn:
            s = self._resolve(conn, session_id)
            end = s.message_count if upto is None else upto
            blobs = conn.execute(
                "SELECT token_ids FROM messages WHERE session_id = ? AND idx < ? ORDER BY idx",
                (s.id, end)).fetchall()
        return list(unpack_tokens(b"".join(b for (b,) in blobs)))

    # -- export ------------------------------------------------------------------------------

    def export(self, session_id: str, fmt: str = "md", *, include_tokens: bool = False) -> str:
        """The transcript as ``"md"`` (Markdown) or ``"json"`` (see the package docstring)."""
        if fmt not in ("md", "json"):
            raise SessionError(f"unknown export format {fmt!r} (use md or json).")
        with self._tx(write=False) as conn:
            s = self._resolve(conn, session_id)
            token_col = "token_ids" if include_tokens else "NULL"
            rows = conn.execute(
                f"SELECT {_MESSAGE_COLS}, {token_col} FROM messages WHERE session_id = ? "
                "ORDER BY idx", (s.id,)).fetchall()
        msgs = [_row_to_message(r) for r in rows]
        if fmt == "json":
            return _export.to_json(s, msgs, include_tokens=include_tokens)
        return _export.to_markdown(s, msgs)

    # -- helpers -----------------------------------------------------------------------------

    def _resolve(self, conn: sqlite3.Connection, ident: str | None) -> Session:
        key = str(ident or "").strip().lower()
        if not is_id_prefix(key):
            raise SessionNotFound(f"no session with id {ident!r}.")
        row = conn.execute(f"SELECT {_SESSION_COLS} FROM sessions WHERE id = ?", (key,)).fetchone()
        if row is None:
            # '~' sorts after every id character, so this range is "ids starting with key".
            rows = conn.execute(
                f"SELECT {_SESSION_COLS} FROM sessions WHERE id > ? AND id < ? ORDER BY id LIMIT 3",
                (key, key + "~")).fetchall()
            if not rows:
                raise SessionNotFound(f"no session with id {ident!r}.")
            if len(rows) > 1:
                some = ", ".join(r[0] for r in rows[:2]) + (", ..." if len(rows) > 2 else "")
                raise SessionNotFound(f"session id prefix {ident!r} is ambiguous ({some}); "
                                      "type more characters.")
            row = rows[0]
        return _row_to_session(row)

    def _message(self, conn: sqlite3.Connection, msg_id: int, tokens: bool) -> Message:
        token_col = "token_ids" if tokens else "NULL"
        row = conn.execute(f"SELECT {_MESSAGE_COLS}, {token_col} FROM messages WHERE id = ?",
                           (msg_id,)).fetchone()
        return _row_to_message(row)


def _context_start(conn: sqlite3.Connection, sid: str, idx: int, total: int) -> int:
    """Token offset where message ``idx`` starts (the session total when idx is past the end)."""
    row = conn.execute("SELECT context_start FROM messages WHERE session_id = ? AND idx = ?",
                       (sid, idx)).fetchone()
    return total if row is None else row[0]


def _unused_id(conn: sqlite3.Connection, now: float) -> str:
    while True:  # 15 random bits per millisecond: a clash is rare, and we hold the write lock
        sid = new_id(now)
        if conn.execute("SELECT 1 FROM sessions WHERE id = ?", (sid,)).fetchone() is None:
            return sid


def _check_kind(kind: str) -> None:
    if kind not in KINDS:
        raise SessionError(f"unknown session kind {kind!r} (use one of {', '.join(KINDS)}).")


def _clean_title(title: str | None) -> str:
    title = " ".join((title or "").split())
    return title or DEFAULT_TITLE


def _preview(text: str) -> str:
    line = " ".join(text.split())
    return line if len(line) <= PREVIEW_CHARS else line[: PREVIEW_CHARS - 1] + "…"


def _escape_like(text: str) -> str:
    return text.replace("\\", "\\\\").replace("%", "\\%").replace("_", "\\_")


def _dump_json(value: Any, what: str) -> str:
    try:
        return json.dumps(value, ensure_ascii=False, allow_nan=False)
    except (TypeError, ValueError) as e:
        raise SessionError(f"{what} must be plain JSON data ({e}).") from None


def _load_json(text: str | None, default: Any) -> Any:
    if text is None:
        return default
    try:
        return json.loads(text)
    except ValueError:
        return default  # a hand-edited or damaged field should not make the session unreadable


def _row_to_session(r: tuple) -> Session:
    return Session(id=r[0], title=r[1], profile=r[2], kind=r[3], workspace=r[4], parent_id=r[5],
                   fork_at=r[6], created=r[7], updated=r[8], message_count=r[9],
                   token_count=r[10], meta=_load_json(r[11], {}))


def _row_to_message(r: tuple) -> Message:
    return Message(id=r[0], session_id=r[1], index=r[2], role=r[3], content=r[4],
                   reasoning=r[5], tool_calls=_load_json(r[6], None), tool_call_id=r[7],
                   name=r[8], token_count=r[9], context_start=r[10], profile=r[11],
                   created=r[12], updated=r[13], meta=_load_json(r[14], {}),
                   token_ids=unpack_tokens(r[15]))
