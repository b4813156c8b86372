"""The workspace size cap: how much disk a workspace may use, for the file tools and for bash.

No kernel mechanism caps one directory tree as root without extra setup: project quotas need
a filesystem mounted with ``prjquota`` and quota tools, a loop-mounted image or a sized tmpfs
would change where the workspace lives (it must persist as plain files). So the cap is
measured, cheaply: ``usage`` walks the tree (disk blocks, each inode once, not into other
filesystems), and between walks ``bound`` answers with an upper bound from the filesystem's
own counter (``statvfs``: what the workspace's filesystem gained since the last walk, which
includes anything the workspace gained). Only when that bound passes the cap is the tree
walked again. A bash call is watched the same way while it runs (``Watch.check``, polled by
the bash tool) and stopped when the workspace really is past the cap and bigger than when the
call began (so ``rm`` in a full workspace still runs); ``RLIMIT_FSIZE`` (the sandbox's
``ulimit -f``, at most the cap) stops any single file in the kernel. A bound that grows only
because something else on the same filesystem grew costs a walk, never a wrong refusal.
"""

from __future__ import annotations

import os
import stat
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from tools import settings
from tools.base import ToolError

DEFAULT_CAP = settings.DEFAULT_CAP  # bytes a workspace may occupy on disk (Limits.workspace_bytes)
WALK_EVERY_S = 1.0  # during a call, at most one confirming walk per second

_lock = threading.Lock()
_known: dict[str, tuple[int, int]] = {}  # workspace real path -> (usage, filesystem used) at the last walk


def default_cap() -> int:
    """``MLXTERM_WORKSPACE_CAP`` (tools.settings), else ``DEFAULT_CAP``; a bad value is a
    ``ValueError`` naming the variable."""
    return settings.workspace_cap()


def fs_used(path: str) -> int:
    """Bytes in use on the filesystem holding ``path``."""
    st = os.statvfs(path)
    return (st.f_blocks - st.f_bfree) * st.f_frsize


def usage(root: str) -> int:
    """Disk bytes used by the tree at ``root`` (allocated blocks; hard links once; symlinks
    not followed; other filesystems mounted inside are not entered)."""
    try:
        top = os.lstat(root)
    except OSError:
        return 0
    total, seen, stack = 0, set(), [root]
    while stack:
        path = stack.pop()
        try:
            it = os.scandir(path)
        except OSError:
            continue
        with it:
            for entry in it:
                try:
                    st = entry.stat(follow_symlinks=False)
                except OSError:
                    continue
                if st.st_dev != top.st_dev:
                    continue
                if st.st_nlink > 1 and not stat.S_ISDIR(st.st_mode):
                    if st.st_ino in seen:
                        continue
                    seen.add(st.st_ino)
                total += st.st_blocks * 512
                if stat.S_ISDIR(st.st_mode):
                    stack.append(entry.path)
    return total + top.st_blocks * 512


def measure(root: str) -> int:
    """``usage(root)``, remembered with the filesystem's counter for ``bound``."""
    used = fs_used(root)
    size = usage(root)
    with _lock:
        _known[root] = (size, used)
    return size


def bound(root: str) -> int:
    """An upper bound on ``usage(root)`` without a walk where an earlier walk is known."""
    with _lock:
        known = _known.get(root)
    if known is None:
        return measure(root)
    size, used = known
    return size + max(0, fs_used(root) - used)


def human(n: int) -> str:
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if n >= 1 << shift:
            return f"{n / (1 << shift):.1f} {unit}"
    return f"{n} bytes"


def cap_for(sandbox: object) -> int:
    """The cap of a workspace whose bash runs in ``sandbox`` (a ``tools.sandbox.Sandbox`` or
    None: the default)."""
    limits = getattr(getattr(sandbox, "policy", None), "limits", None)
    return getattr(limits, "workspace_bytes", None) or default_cap()


def check_write(root: str, cap: int, old_bytes: int, new_bytes: int) -> None:
    """Refuse (``ToolError``) a file tool's write that would take the workspace at ``root``
    past ``cap`` bytes: the file's ``old_bytes`` on disk replaced by ``new_bytes``. A write
    that does not grow the file is always allowed (shrinking a full workspace must work)."""
    if new_bytes <= old_bytes:
        return
    if bound(root) - old_bytes + new_bytes <= cap:
        return
    now = measure(root) - old_bytes + new_bytes
    if now > cap:
        raise ToolError(f"write refused: the workspace would use {human(now)} on disk, past its size cap of "
                        f"{human(cap)}; delete files it no longer needs (build outputs, caches, downloads) "
                        "or write less", workspace_bytes=now - new_bytes + old_bytes, cap_bytes=cap)


@dataclass
class Watch:
    """Watches one bash call's writable trees (the workspace, and a check's evidence folder)
    against ``cap`` together: ``check()`` is cheap (one ``statvfs`` per tree) until the
    filesystems grew past what the cap leaves, then walks at most once a second; it returns a
    message once the trees are over the cap and bigger than at the start of the call."""

    roots: tuple[str, ...]
    cap: int
    start: int = 0  # the trees' usage (an upper bound) when the call began
    _known: dict[str, tuple[int, int]] = field(default_factory=dict)
    _walked_at: float = 0.0
    over: int | None = None  # the usage found over the cap, once found

    @classmethod
    def begin(cls, roots: Sequence[str], cap: int) -> Watch:
        real = tuple(dict.fromkeys(os.path.realpath(r) for r in roots if os.path.isdir(r)))
        start = sum(bound(r) for r in real)
        if start > cap:
            start = sum(measure(r) for r in real)  # over already: the exact figure decides what "grew" means
        w = cls(real, cap, start)
        w._remember()
        return w

    def _remember(self) -> None:
        with _lock:
            self._known = {r: _known[r] for r in self.roots if r in _known}

    def check(self, final: bool = False) -> str | None:
        if self.over is not None:
            return self.message()
        try:  # trees on one filesystem each count its growth: only ever too high, never too low
            estimate = sum(size + max(0, fs_used(r) - used) for r, (size, used) in self._known.items())
        except OSError:
            return None
        if estimate <= self.cap:
            return None
        now = time.monotonic()
        if not final and now - self._walked_at < WALK_EVERY_S:
            return None
        self._walked_at = now
        size = sum(measure(r) for r in self.roots)
        self._remember()
        if size > self.cap and size > self.start:
            self.over = size
            return self.message()
        return None

    def message(self) -> str:
        assert self.over is not None
        what = "the workspace" if len(self.roots) < 2 else "the workspace and the folders this call may write"
        return (f"{what} grew to {human(self.over)} on disk ({self.over} bytes), past its size cap of "
                f"{human(self.cap)} ({self.cap} bytes); "
                "delete what it does not need (rm still works) or write less")
