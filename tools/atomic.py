"""Crash-safe file replacement for the editing tools (temp file, fsync, rename, fsync dir).

A copy of the idea in ``engine.atomic`` because ``tools/`` may not import ``engine``; this one
also keeps the permission bits of the file it replaces (a 0755 script stays executable), and
works inside a directory descriptor opened by ``Workspace.open_parent`` so every step (the
temp file, the rename, the fsync) happens in the directory that was checked, never through a
symlink swapped in afterwards.
"""

from __future__ import annotations

import os
import secrets
import stat
from pathlib import Path

from tools import space
from tools.base import Workspace


def atomic_write_bytes(ws: Workspace, path: Path, data: bytes) -> None:
    """Replace ``path`` (a real path inside ``ws``, from ``ws.resolve``) with ``data``;
    ``ToolError`` where that would take the workspace past its size cap (``tools.space``)."""
    dir_fd, name = ws.open_parent(path, create=True)
    try:
        space.check_write(str(ws.root), space.cap_for(ws.sandbox), _target_blocks(dir_fd, name),
                          -(-len(data) // 4096) * 4096)
        mode = _target_mode(dir_fd, name)
        tmp = f".{name}.{secrets.token_hex(4)}.tmp"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600,
                     dir_fd=dir_fd)
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(data)
                f.flush()
                os.fchmod(f.fileno(), mode)
                os.fsync(f.fileno())
            # rename() replaces a symlink at ``name`` itself; it never writes through one.
            os.replace(tmp, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
        except BaseException:
            try:
                os.unlink(tmp, dir_fd=dir_fd)
            except FileNotFoundError:
                pass
            raise
        try:
            os.fsync(dir_fd)
        except OSError:
            pass
    finally:
        os.close(dir_fd)


def _target_blocks(dir_fd: int, name: str) -> int:
    """Disk bytes the file being replaced holds (0 for a new one)."""
    try:
        return os.stat(name, dir_fd=dir_fd, follow_symlinks=False).st_blocks * 512
    except FileNotFoundError:
        return 0


def _target_mode(dir_fd: int, name: str) -> int:
    try:
        st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
    except FileNotFoundError:
        return 0o666 & ~_umask()  # a new file gets the usual permissions
    return stat.S_IMODE(st.st_mode) if stat.S_ISREG(st.st_mode) else 0o666 & ~_umask()


def _umask() -> int:
    # os.umask() can only be read by setting it, which races with other threads.
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    return 0o022
