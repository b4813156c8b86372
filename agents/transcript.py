"""``transcript.jsonl``: one JSON object per line, appended (and flushed) as the run goes.

Every record has ``type``, ``t`` (seconds since the transcript opened) and ``step``. A
``message`` record holds a session message exactly as ``SessionStore.export(id, "json")``
writes it (``engine.sessions.export.message_dict``), so replaying the message records (a
``compaction`` record replaces the messages from its ``from_index`` on) gives the exported
session. See docs/agents.md for every record type.
"""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path
from typing import IO, Any

from engine.sessions import Message
from engine.sessions.export import message_dict


class Transcript:
    def __init__(self, path: str | Path | None = None):
        self.path = Path(path) if path is not None else None
        self.records: list[dict[str, Any]] = []  # kept in memory too (tests, result.json)
        self._file: IO[str] | None = None
        self._t0 = time.monotonic()
        self._lock = threading.Lock()
        if self.path is not None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._file = open(self.path, "a", encoding="utf-8")  # noqa: SIM115 (closed by close())

    def write(self, type_: str, step: int = 0, **fields: Any) -> dict[str, Any]:
        record = {"type": type_, "t": round(time.monotonic() - self._t0, 3), "step": step, **fields}
        line = json.dumps(record, ensure_ascii=False, default=str)
        with self._lock:
            self.records.append(record)
            if self._file is not None:
                self._file.write(line + "\n")
                self._file.flush()  # a crash or kill leaves every finished line readable
        return record

    def message(self, m: Message, step: int = 0) -> None:
        self.write("message", step, message=message_dict(m))

    def of_type(self, type_: str) -> list[dict[str, Any]]:
        return [r for r in self.records if r["type"] == type_]

    def close(self) -> None:
        with self._lock:
            if self._file is not None:
                self._file.close()
                self._file = None


def read_transcript(path: str | Path) -> list[dict[str, Any]]:
    """All records of a transcript file (a torn last line, e.g. after a kill, is skipped)."""
    out = []
    for line in Path(path).read_text(encoding="utf-8").splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return out


def replay_messages(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The session's messages as the transcript describes them (compactions applied)."""
    messages: list[dict[str, Any]] = []
    for r in records:
        if r["type"] == "compaction":
            del messages[r["from_index"]:]
        elif r["type"] == "message":
            messages.append(r["message"])
    return messages
