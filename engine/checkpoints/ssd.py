"""The SSD tier: one directory of checkpoint files per fingerprint under a shared root.

``<root>/<fingerprint key>/<pid>-<random>.safetensors``. Files appear only by atomic rename,
so a reader never sees a partial one; temp files of dead writers are removed at startup.
Last use is the file's mtime (touched on every hit), and the byte budget covers the whole
root, so files of older fingerprints (another model, an engine upgrade) age out first.
"""

from __future__ import annotations

import errno
import logging
import os
import re
import secrets
import time
from dataclasses import dataclass
from pathlib import Path

from engine.atomic import atomic_write
from engine.checkpoints import format as fmt
from engine.checkpoints.fingerprint import Fingerprint
from engine.pids import pid_alive

log = logging.getLogger(__name__)

# Errors that mean "this directory cannot take checkpoints": go RAM-only instead of retrying.
DISABLING = {errno.ENOSPC, errno.EDQUOT, errno.EACCES, errno.EPERM, errno.EROFS,
             errno.ENOTDIR, errno.EEXIST}
_TEMP = re.compile(r"^\.(\d+)-[0-9a-f]+\.safetensors\..*\.tmp$")
STALE_TEMP_S = 3600.0  # a temp file this old is abandoned even if its pid is alive (pid reuse)
_STARTED = time.time()  # our own pid's temp files from before this are a dead namesake's


@dataclass
class Found:
    """A checkpoint file found on disk (header checked, payload not yet)."""

    cid: str
    path: Path
    tokens: object  # np.ndarray int32
    session_id: str | None
    created: float
    trimmable: bool
    nbytes: int


class SsdTier:
    def __init__(self, root: Path, budget: int, fingerprint: Fingerprint,
                 layout: list[tuple[str, int | None]] | None = None) -> None:
        self.root = Path(root)
        self.budget = budget
        self.fingerprint = fingerprint
        self.layout = layout
        self.dir = self.root / fingerprint.key
        self.disabled_reason: str | None = None
        self.discarded = 0
        try:
            self.dir.mkdir(parents=True, exist_ok=True)
            probe = self.dir / f".probe-{os.getpid()}-{secrets.token_hex(4)}"
            probe.write_bytes(b"")
            probe.unlink()
        except OSError as e:
            self.disable(e)

    # -- state ------------------------------------------------------------------------------
    @property
    def enabled(self) -> bool:
        return self.disabled_reason is None

    def disable(self, err: OSError) -> None:
        """Go RAM-only; logs one warning the first time."""
        if self.disabled_reason is None:
            self.disabled_reason = f"{err.strerror or err} ({self.dir})"
            log.warning("SSD checkpoints disabled, keeping them in RAM only: %s", self.disabled_reason)

    @staticmethod
    def is_disabling(err: OSError) -> bool:
        return err.errno in DISABLING

    def new_path(self) -> tuple[str, Path]:
        cid = f"{os.getpid()}-{secrets.token_hex(6)}"
        return cid, self.dir / f"{cid}{fmt.SUFFIX}"

    # -- startup ----------------------------------------------------------------------------
    def clean_temps(self) -> int:
        """Remove temp files left by writers that died (SIGKILL, power loss). Returns the count."""
        removed = 0
        now = time.time()
        for p in _listdir(self.dir):
            m = _TEMP.match(p.name)
            if not m:
                continue
            pid = int(m.group(1))
            try:
                age = now - p.stat().st_mtime
                if pid == os.getpid():
                    stale = p.stat().st_mtime < _STARTED - 1
                else:
                    stale = not pid_alive(pid) or age > STALE_TEMP_S
                if stale:
                    p.unlink()
                    removed += 1
            except FileNotFoundError:
                pass
        return removed

    def scan(self) -> list[Found]:
        """Every valid checkpoint file of this fingerprint; bad ones are discarded (one warning each)."""
        found = []
        for p in sorted(_listdir(self.dir)):
            if p.suffix != fmt.SUFFIX or p.name.startswith("."):
                continue
            try:
                header, tokens = fmt.scan(p, self.check)
            except fmt.CorruptCheckpoint as e:
                self.discard(p, str(e))
                continue
            except OSError:
                continue  # vanished (another process evicted it)
            meta = header.meta
            found.append(Found(p.stem, p, tokens, meta.get("session_id"), float(meta.get("created", 0)),
                               bool(meta.get("trimmable")), header.file_size))
        return found

    def check(self, header: fmt.Header) -> None:
        if header.meta.get("fingerprint") != self.fingerprint.to_dict():
            raise fmt.CorruptCheckpoint("it was made by another model, weight/KV format or engine version")
        fmt.check_layers(header.meta, header.index, self.layout)

    # -- files ------------------------------------------------------------------------------
    def write(self, path: Path, ck: fmt.HostCheckpoint, storage: str, group_size: int) -> int:
        """Encode and atomically write ``ck`` to ``path`` (writer thread). Returns the file size."""
        tensors, layers = fmt.encode(ck, storage, group_size)
        meta = {
            "format": fmt.FORMAT, "version": fmt.VERSION,
            "fingerprint": self.fingerprint.to_dict(), "fingerprint_key": self.fingerprint.key,
            "n_tokens": int(len(ck.tokens)), "session_id": ck.session_id, "created": ck.created,
            "storage": storage, "trimmable": all(x["class"] != "WindowKVCache" for x in layers),
            "layers": layers,
        }
        size = 0

        def _write(f) -> None:
            nonlocal size
            size = fmt.write(f, meta, tensors)

        atomic_write(path, _write)
        return size

    def discard(self, path: Path, reason: str) -> None:
        log.warning("discarding checkpoint %s: %s", path, reason)
        self.discarded += 1
        self.delete(path)

    @staticmethod
    def delete(path: Path) -> None:
        try:
            path.unlink()
        except FileNotFoundError:
            pass
        except OSError as e:
            log.debug("cannot delete %s: %s", path, e)

    @staticmethod
    def touch(path: Path) -> None:
        try:
            os.utime(path)
        except OSError:
            pass

    def _files(self) -> list[tuple[float, int, Path]]:
        """(mtime, size, path) of every checkpoint file under the root, all fingerprints."""
        files = []
        for sub in [self.root, *_subdirs(self.root)]:
            for p in _listdir(sub):
                if p.suffix == fmt.SUFFIX and not p.name.startswith("."):
                    try:
                        st = p.stat()
                    except OSError:
                        continue
                    files.append((st.st_mtime, st.st_size, p))
        return files

    def evict(self, keep: Path | None = None) -> list[Path]:
        """Delete least recently used files under the root until it fits the budget."""
        files = self._files()
        total = sum(size for _, size, _ in files)
        deleted = []
        for _, size, p in sorted(files, key=lambda t: t[0]):
            if total <= self.budget:
                break
            if p == keep:
                continue
            self.delete(p)
            total -= size
            deleted.append(p)
        return deleted

    def clear(self) -> int:
        """Delete every checkpoint file of this fingerprint. Returns the count."""
        n = 0
        for p in _listdir(self.dir):
            if p.suffix == fmt.SUFFIX and not p.name.startswith("."):
                self.delete(p)
                n += 1
        self.clean_temps()
        return n


def _listdir(d: Path) -> list[Path]:
    try:
        return [Path(e.path) for e in os.scandir(d) if e.is_file(follow_symlinks=False)]
    except OSError:
        return []


def _subdirs(d: Path) -> list[Path]:
    try:
        return [Path(e.path) for e in os.scandir(d) if e.is_dir(follow_symlinks=False)]
    except OSError:
        return []


