"""Opening the session database: connection pragmas, schema version table and migrations.

Every migration is a list of SQL statements run inside one ``BEGIN IMMEDIATE`` transaction
together with the version bump, so a crash leaves either the old or the new schema. To
change the schema append a migration to ``MIGRATIONS``; never edit a released one.
"""

from __future__ import annotations

import sqlite3
import time
from collections.abc import Callable
from pathlib import Path

from engine.sessions.errors import SessionError

FTS_TABLE = "messages_fts"

_V1 = [
    """CREATE TABLE sessions (
        id            TEXT PRIMARY KEY,
        title         TEXT NOT NULL,
        profile       TEXT NOT NULL DEFAULT '',
        kind          TEXT NOT NULL,
        workspace     TEXT,
        parent_id     TEXT REFERENCES sessions(id) ON DELETE SET NULL,
        fork_at       INTEGER,
        created       REAL NOT NULL,
        updated       REAL NOT NULL,
        -- kept equal to COUNT(messages) and SUM(messages.token_count) by every write,
        -- so listing and appending never scan messages
        message_count INTEGER NOT NULL DEFAULT 0,
        token_count   INTEGER NOT NULL DEFAULT 0,
        meta          TEXT NOT NULL DEFAULT '{}'
    )""",
    "CREATE INDEX sessions_by_updated ON sessions(updated DESC, id DESC)",
    "CREATE INDEX sessions_by_parent ON sessions(parent_id)",
    """CREATE TABLE messages (
        id            INTEGER PRIMARY KEY,
        session_id    TEXT NOT NULL REFERENCES sessions(id) ON DELETE CASCADE,
        idx           INTEGER NOT NULL,
        role          TEXT NOT NULL,
        content       TEXT NOT NULL,
        reasoning     TEXT,
        tool_calls    TEXT,            -- JSON list, NULL when none
        tool_call_id  TEXT,
        name          TEXT,
        token_ids     BLOB NOT NULL,   -- int32 little-endian
        token_count   INTEGER NOT NULL,
        context_start INTEGER NOT NULL,
        profile       TEXT NOT NULL DEFAULT '',
        created       REAL NOT NULL,
        updated       REAL NOT NULL,
        meta          TEXT NOT NULL DEFAULT '{}',
        UNIQUE (session_id, idx)
    )""",
]

# External-content FTS5 index over message text, kept in sync by triggers (which also fire
# for the ON DELETE CASCADE of a session's messages).
_V1_FTS = [
    f"""CREATE VIRTUAL TABLE {FTS_TABLE} USING fts5(
        content, content='messages', content_rowid='id',
        tokenize='unicode61 remove_diacritics 2')""",
    f"""CREATE TRIGGER messages_fts_insert AFTER INSERT ON messages BEGIN
        INSERT INTO {FTS_TABLE}(rowid, content) VALUES (new.id, new.content);
    END""",
    f"""CREATE TRIGGER messages_fts_delete AFTER DELETE ON messages BEGIN
        INSERT INTO {FTS_TABLE}({FTS_TABLE}, rowid, content) VALUES ('delete', old.id, old.content);
    END""",
    f"""CREATE TRIGGER messages_fts_update AFTER UPDATE OF content ON messages BEGIN
        INSERT INTO {FTS_TABLE}({FTS_TABLE}, rowid, content) VALUES ('delete', old.id, old.content);
        INSERT INTO {FTS_TABLE}(rowid, content) VALUES (new.id, new.content);
    END""",
]


def _migrate_v1(conn: sqlite3.Connection, fts: bool) -> None:
    for sql in _V1 + (_V1_FTS if fts else []):
        conn.execute(sql)


# MIGRATIONS[i] takes the schema from version i to i + 1.
MIGRATIONS: tuple[Callable[[sqlite3.Connection, bool], None], ...] = (_migrate_v1,)
SCHEMA_VERSION = len(MIGRATIONS)


def fts5_available() -> bool:
    """Whether this Python's sqlite3 was built with FTS5."""
    conn = sqlite3.connect(":memory:")
    try:
        conn.execute("CREATE VIRTUAL TABLE t USING fts5(x)")
        return True
    except sqlite3.OperationalError:
        return False
    finally:
        conn.close()


def connect(path: Path, timeout: float) -> sqlite3.Connection:
    """A connection in autocommit mode (we issue BEGIN ourselves), WAL, foreign keys on."""
    conn = sqlite3.connect(path, timeout=timeout, isolation_level=None, check_same_thread=False)
    try:
        conn.execute(f"PRAGMA busy_timeout = {int(timeout * 1000)}")
        conn.execute("PRAGMA foreign_keys = ON")
        _enable_wal(conn, timeout)
        # WAL + NORMAL never corrupts; a power cut may lose only the last transactions.
        conn.execute("PRAGMA synchronous = NORMAL")
    except BaseException:
        conn.close()
        raise
    return conn


def _enable_wal(conn: sqlite3.Connection, timeout: float) -> None:
    # Switching a fresh file to WAL needs an exclusive lock; when several processes create
    # the database at once the loser can get SQLITE_BUSY without the busy handler running.
    deadline = time.monotonic() + timeout
    while True:
        try:
            mode = conn.execute("PRAGMA journal_mode = WAL").fetchone()[0]
            break
        except sqlite3.OperationalError as e:
            if "locked" not in str(e) or time.monotonic() > deadline:
                raise
            time.sleep(0.01)
    if str(mode).lower() != "wal":
        raise sqlite3.OperationalError(f"cannot switch to WAL journal mode (got {mode!r})")


def schema_version(conn: sqlite3.Connection) -> int:
    try:
        row = conn.execute("SELECT version FROM schema_version").fetchone()
    except sqlite3.OperationalError:
        return 0  # no version table yet: a brand-new file
    return row[0] if row else 0


def migrate(conn: sqlite3.Connection, path: Path, fts: bool | None) -> None:
    """Bring the schema up to ``SCHEMA_VERSION``. ``fts=None`` uses FTS5 when available."""
    if schema_version(conn) == SCHEMA_VERSION:
        return  # fast path: no write lock when nothing to do
    conn.execute("BEGIN IMMEDIATE")
    try:
        conn.execute("CREATE TABLE IF NOT EXISTS schema_version (version INTEGER NOT NULL)")
        version = schema_version(conn)  # again, under the lock: another process may have won
        if version > SCHEMA_VERSION:
            raise SessionError(
                f"{path} has session schema version {version} but this mlxterm knows only up "
                f"to {SCHEMA_VERSION}; upgrade mlxterm to open it.")
        use_fts = fts5_available() if fts is None else fts
        for step in MIGRATIONS[version:]:
            step(conn, use_fts)
        conn.execute("DELETE FROM schema_version")
        conn.execute("INSERT INTO schema_version (version) VALUES (?)", (SCHEMA_VERSION,))
    except BaseException:
        conn.execute("ROLLBACK")
        raise
    conn.execute("COMMIT")


def has_fts(conn: sqlite3.Connection) -> bool:
    row = conn.execute("SELECT 1 FROM sqlite_master WHERE name = ?", (FTS_TABLE,)).fetchone()
    return row is not None
