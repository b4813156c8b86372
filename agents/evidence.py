"""Evidence the host can trust: checks write into a folder of their own, the host copies out
what it expects.

A task's checks run model-written code, so nothing they can write may be what the host later
trusts. Each check runner (``mlxterm run``, a board card) gives its checks one writable
``Evidence.folder`` (``$MLXTERM_RUN_DIR`` inside the check) and nothing else of the run: the
run directory with ``transcript.jsonl`` and ``result.json`` is never mounted in the sandbox
(``Evidence.protect``: hidden where it would lie inside the workspace). Afterwards
``collect`` copies what the host expects -- ``quality.json`` and the screenshots it names --
into the run's own folder, reading each file without following links (a check could leave a
link to a host secret there), with size caps, and keeps only screenshots that lie in the
evidence folder's ``screenshots/``.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from engine.atomic import atomic_write_bytes, atomic_write_text

QUALITY = "quality.json"
SHOTS = "screenshots"
MAX_QUALITY_BYTES = 4 << 20
MAX_SHOT_BYTES = 16 << 20
MAX_SHOTS = 200
QUALITY_KEYS = ("passed", "failed", "blocked", "total")


@dataclass(frozen=True)
class Evidence:
    """``folder``: where checks may write (created empty by ``prepare``); ``dest``: the host's
    own folder the expected files are copied into (the run directory)."""

    folder: Path
    dest: Path

    @classmethod
    def for_run(cls, run_dir: Path) -> Evidence:
        """A task run's: ``RUN_DIR/evidence``, collected into ``RUN_DIR``."""
        run_dir = Path(run_dir).resolve()
        return cls(run_dir / "evidence", run_dir)

    def prepare(self) -> None:
        """An empty evidence folder (what an earlier run left is not this run's evidence)."""
        if self.folder.is_symlink() or self.folder.is_file():
            self.folder.unlink()
        elif self.folder.exists():
            shutil.rmtree(self.folder)
        self.folder.mkdir(parents=True)

    def env(self) -> dict[str, str]:
        """What a check is told: ``$MLXTERM_RUN_DIR`` is its evidence folder."""
        return {"MLXTERM_RUN_DIR": str(self.folder)}

    def protect(self) -> tuple[str, ...]:
        """Paths the sandbox must hide (the run directory, wherever it lies)."""
        return (str(self.dest),)

    def collect(self) -> dict[str, Any] | None:
        """Copy ``quality.json`` (and the screenshots it names) into ``dest``; its summary
        (``passed``/``failed``/``blocked``/``total`` and the copy's path), or None when the
        checks left no valid one. A stale copy in ``dest`` is removed first, so what is there
        afterwards came from this run's evidence."""
        out = self.dest / QUALITY
        with contextlib.suppress(FileNotFoundError):
            out.unlink()
        raw = _read_plain(self.folder, QUALITY, MAX_QUALITY_BYTES)
        if raw is None:
            return None
        try:
            quality = json.loads(raw)
            if not isinstance(quality, dict):
                return None
            summary = {k: int(quality[k]) for k in QUALITY_KEYS}
        except (ValueError, KeyError, TypeError):
            return None
        categories = quality.get("categories")
        if isinstance(categories, list):
            copied = 0
            for entry in categories:
                if isinstance(entry, dict) and "screenshot" in entry:
                    entry["screenshot"] = self._copy_shot(entry.get("screenshot")) if copied < MAX_SHOTS else None
                    copied += entry["screenshot"] is not None
        atomic_write_text(out, json.dumps(quality, indent=2, ensure_ascii=False) + "\n")
        return summary | {"path": str(out)}

    def _copy_shot(self, shot: Any) -> str | None:
        """The host's copy of a screenshot at ``folder/screenshots/NAME``, else None."""
        if not isinstance(shot, str):
            return None
        path = Path(os.path.normpath(shot))
        if path.parent != self.folder / SHOTS or path.name.startswith("."):
            return None
        data = _read_plain(self.folder, f"{SHOTS}/{path.name}", MAX_SHOT_BYTES)
        if data is None:
            return None
        target = self.dest / SHOTS / path.name
        atomic_write_bytes(target, data)
        return str(target)


def _read_plain(folder: Path, relative: str, limit: int) -> bytes | None:
    """The bytes of ``folder/relative``, every component opened without following a link; None
    when a component is a link, not a plain file or directory, missing, or over ``limit``."""
    flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC
    try:
        fd = os.open(folder, flags | os.O_DIRECTORY)
    except OSError:
        return None
    try:
        parts = relative.split("/")
        for part in parts[:-1]:
            sub = os.open(part, flags | os.O_DIRECTORY, dir_fd=fd)
            os.close(fd)
            fd = sub
        leaf = os.open(parts[-1], flags | os.O_NONBLOCK, dir_fd=fd)
        with os.fdopen(leaf, "rb") as f:
            st = os.fstat(f.fileno())
            if not stat.S_ISREG(st.st_mode) or st.st_size > limit:
                return None
            data = f.read(limit + 1)
        return data if len(data) <= limit else None
    except OSError:
        return None
    finally:
        os.close(fd)
