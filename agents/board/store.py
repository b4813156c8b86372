"""``BoardStore``: cards and attempts in SQLite (WAL) beside the sessions database, plus an
append-only JSONL event log per card (``board/cards/<id>.jsonl``).

A card's state changes only through ``move`` (checked against ``model.TRANSITIONS`` inside the
write transaction, so two processes cannot both claim a queued card). Each write is one
transaction; each event line is flushed and fsynced before the call returns, so a kill -9
loses nothing that was reported. ``recover`` marks attempts whose process is gone as
interrupted and requeues their cards.
"""

from __future__ import annotations

import json
import os
import sqlite3
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import fields
from pathlib import Path
from typing import Any

from engine import paths
from engine.pids import pid_alive
from engine.sessions.schema import connect

from agents.board.model import STATES, Attempt, BoardError, Card, CheckSpec, check_move

SCHEMA = [
    """CREATE TABLE IF NOT EXISTS cards (
        id        INTEGER PRIMARY KEY AUTOINCREMENT,
        state     TEXT NOT NULL,
        priority  INTEGER NOT NULL DEFAULT 0,
        created   REAL NOT NULL,
        updated   REAL NOT NULL,
        data      TEXT NOT NULL          -- the Card as JSON (state/priority mirrored above)
    )""",
    "CREATE INDEX IF NOT EXISTS cards_by_state ON cards(state, priority DESC, id)",
    """CREATE TABLE IF NOT EXISTS attempts (
        card_id   INTEGER NOT NULL REFERENCES cards(id) ON DELETE CASCADE,
        number    INTEGER NOT NULL,
        status    TEXT NOT NULL,
        data      TEXT NOT NULL,
        PRIMARY KEY (card_id, number)
    )""",
    "CREATE INDEX IF NOT EXISTS attempts_by_status ON attempts(status)",
]
_CARD_FIELDS = {f.name for f in fields(Card)}
_ATTEMPT_FIELDS = {f.name for f in fields(Attempt)}


def default_path() -> Path:
    return paths.data_dir() / "board.sqlite3"


def _card(row) -> Card:
    data = {k: v for k, v in json.loads(row[0]).items() if k in _CARD_FIELDS}
    data["checks"] = [CheckSpec(**c) for c in data.get("checks", [])]
    return Card(**data)


def _attempt(row) -> Attempt:
    return Attempt(**{k: v for k, v in json.loads(row[0]).items() if k in _ATTEMPT_FIELDS})




class BoardStore:
    def __init__(self, path: str | os.PathLike | None = None, *, timeout: float = 30.0):
        self.path = Path(path) if path is not None else default_path()
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.log_dir = self.path.parent / "board" / "cards"
        self._lock = threading.RLock()
        self._conn: sqlite3.Connection = connect(self.path, timeout)
        with self._tx() as c:
            for stmt in SCHEMA:
                c.execute(stmt)

    def close(self) -> None:
        with self._lock:
            self._conn.close()

    @contextmanager
    def _tx(self) -> Iterator[sqlite3.Connection]:
        with self._lock:
            self._conn.execute("BEGIN IMMEDIATE")
            try:
                yield self._conn
            except BaseException:
                self._conn.execute("ROLLBACK")
                raise
            self._conn.execute("COMMIT")

    # -- cards ------------------------------------------------------------------------------------
    def add(self, card: Card) -> Card:
        """Store a new card (its ``id`` is assigned); returns it."""
        if card.state not in ("backlog", "queued"):
            raise BoardError(f"a new card starts in backlog or queued, not {card.state}")
        now = time.time()
        card.created_at = card.updated_at = now
        with self._tx() as c:
            for dep in card.depends_on:
                if c.execute("SELECT 1 FROM cards WHERE id = ?", (dep,)).fetchone() is None:
                    raise BoardError(f"card depends on card {dep}, which does not exist")
            cur = c.execute("INSERT INTO cards(state, priority, created, updated, data) VALUES (?,?,?,?,'{}')",
                            (card.state, card.priority, now, now))
            card.id = int(cur.lastrowid)
            self._write_card(c, card)
        self.log(card.id, "created", state=card.state, title=card.title)
        return card

    def get(self, card_id: int | str) -> Card:
        try:
            cid = int(card_id)
        except (TypeError, ValueError):
            raise BoardError(f"card id must be a number, got {card_id!r}") from None
        with self._lock:
            row = self._conn.execute("SELECT data FROM cards WHERE id = ?", (cid,)).fetchone()
        if row is None:
            raise BoardError(f"no card {cid} on the board")
        return _card(row)

    def cards(self, states: tuple[str, ...] | None = None) -> list[Card]:
        """Cards in board order (priority high first, then oldest first)."""
        sql = "SELECT data FROM cards"
        args: tuple = ()
        if states:
            sql += f" WHERE state IN ({','.join('?' * len(states))})"
            args = tuple(states)
        with self._lock:
            rows = self._conn.execute(sql + " ORDER BY priority DESC, id", args).fetchall()
        return [_card(r) for r in rows]

    def update(self, card_id: int, **changes: Any) -> Card:
        """Change fields other than ``state`` (use ``move`` for that)."""
        if "state" in changes or "id" in changes:
            raise BoardError("use move() to change a card's state")
        unknown = set(changes) - _CARD_FIELDS
        if unknown:
            raise BoardError(f"unknown card fields: {', '.join(sorted(unknown))}")
        with self._tx() as c:
            card = self._read(c, card_id)
            for k, v in changes.items():
                setattr(card, k, v)
            card.updated_at = time.time()
            self._write_card(c, card)
        return card

    def move(self, card_id: int, new: str, *, reason: str | None = None, expect: str | None = None,
             **changes: Any) -> Card:
        """The one place a card changes state: checked against the transitions table in the
        same transaction as the write. ``expect``: fail unless the card is in that state now
        (a dispatcher claiming a queued card)."""
        with self._tx() as c:
            card = self._read(c, card_id)
            if expect is not None and card.state != expect:
                raise BoardError(f"card {card_id} is {card.state}, not {expect}")
            check_move(card.id, card.state, new)
            old = card.state
            for k, v in changes.items():
                setattr(card, k, v)
            card.state, card.reason, card.updated_at = new, reason, time.time()
            self._write_card(c, card)
        self.log(card.id, "moved", **{"from": old, "to": new, "reason": reason})
        return card

    def _read(self, c: sqlite3.Connection, card_id: int) -> Card:
        row = c.execute("SELECT data FROM cards WHERE id = ?", (int(card_id),)).fetchone()
        if row is None:
            raise BoardError(f"no card {card_id} on the board")
        return _card(row)

    def _write_card(self, c: sqlite3.Connection, card: Card) -> None:
        if card.state not in STATES:
            raise BoardError(f"unknown state {card.state!r}")
        c.execute("UPDATE cards SET state = ?, priority = ?, updated = ?, data = ? WHERE id = ?",
                  (card.state, card.priority, card.updated_at, json.dumps(card.as_dict()), card.id))

    # -- attempts ---------------------------------------------------------------------------------
    def new_attempt(self, card_id: int, kind: str, prompt: str, session_id: str | None = None) -> Attempt:
        with self._tx() as c:
            row = c.execute("SELECT COALESCE(MAX(number), 0) FROM attempts WHERE card_id = ?", (card_id,)).fetchone()
            att = Attempt(card_id=card_id, number=row[0] + 1, kind=kind, prompt=prompt, session_id=session_id,
                          started_at=time.time(), pid=os.getpid())
            c.execute("INSERT INTO attempts(card_id, number, status, data) VALUES (?,?,?,?)",
                      (card_id, att.number, att.status, json.dumps(att.as_dict())))
        self.log(card_id, "attempt_started", number=att.number, kind=kind, session_id=session_id)
        return att

    def save_attempt(self, att: Attempt) -> None:
        with self._tx() as c:
            c.execute("UPDATE attempts SET status = ?, data = ? WHERE card_id = ? AND number = ?",
                      (att.status, json.dumps(att.as_dict()), att.card_id, att.number))

    def attempts(self, card_id: int) -> list[Attempt]:
        with self._lock:
            rows = self._conn.execute("SELECT data FROM attempts WHERE card_id = ? ORDER BY number",
                                      (int(card_id),)).fetchall()
        return [_attempt(r) for r in rows]

    def last_attempt(self, card_id: int) -> Attempt | None:
        atts = self.attempts(card_id)
        return atts[-1] if atts else None

    # -- crash recovery ---------------------------------------------------------------------------
    def recover(self) -> list[int]:
        """Attempts left "running" by a process that is gone become "interrupted" and their
        cards go back to queued. Returns the requeued card ids."""
        with self._lock:
            rows = self._conn.execute("SELECT data FROM attempts WHERE status = 'running'").fetchall()
        requeued = []
        for att in map(_attempt, rows):
            if pid_alive(att.pid):
                continue  # this process or another dispatcher is still running it
            att.status, att.finished_at = "interrupted", time.time()
            att.error = f"the process running it (pid {att.pid}) is gone"
            self.save_attempt(att)
            self.log(att.card_id, "attempt_interrupted", number=att.number, pid=att.pid)
            card = self.get(att.card_id)
            if card.state == "running":
                # The next attempt continues the same agent session (the interrupted turn is
                # closed first; its KV prefix is reused) when there is one.
                nxt = {"kind": "resume"} if att.session_id else card.next_attempt
                self.move(card.id, "queued", reason=f"attempt {att.number} was interrupted; requeued",
                          next_attempt=nxt)
                requeued.append(card.id)
        return requeued

    # -- the event log ------------------------------------------------------------------------------
    def log_path(self, card_id: int) -> Path:
        return self.log_dir / f"{int(card_id)}.jsonl"

    def log(self, card_id: int, event: str, **fields_: Any) -> None:
        """Append one event to the card's log (flushed and fsynced: it survives kill -9)."""
        line = json.dumps({"t": round(time.time(), 3), "event": event, **fields_}, ensure_ascii=False)
        self.log_dir.mkdir(parents=True, exist_ok=True)
        with self._lock, open(self.log_path(card_id), "a", encoding="utf-8") as f:
            f.write(line + "\n")
            f.flush()
            os.fsync(f.fileno())

    def events(self, card_id: int) -> list[dict[str, Any]]:
        path = self.log_path(card_id)
        if not path.exists():
            return []
        out = []
        for line in path.read_text(encoding="utf-8").splitlines():
            try:
                out.append(json.loads(line))
            except ValueError:
                break  # a torn last line after a crash
        return out
