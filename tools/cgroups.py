"""Per-call cgroups for a root mlxterm's sandboxed commands: process, memory and CPU limits
that hold for everything a call starts (``tools.sandbox`` uses them; rlimits stay as well).

RLIMIT_NPROC counts every process of the shared sandbox uid, and there is no rlimit for a
call's memory in all (tmpfs pages included) or its share of the CPUs, so root gets a fresh
group per call: cgroup v2 (``pids.max``, ``memory.max``, ``cpu.max``) where the unified
hierarchy has the pids controller and groups can be made there (``v2_parent``), else v1
(``pids``, ``memory``, ``cpu`` hierarchies) where they are writable, else none. ``choice()``
says which, and why not v2, in words for ``mlxterm doctor``. A group is joined by a one-line
shell before bwrap starts (``wrap``), so the limits hold from the first instruction, and
removed after the call with whatever is left in it killed.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import threading
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from tools.sandbox import Limits

CGROUP_V1 = "/sys/fs/cgroup"  # cgroup v1 hierarchies (pids, memory, cpu), used for root


def choice() -> dict:
    """Which per-call groups root gets: v2 where the unified hierarchy has the pids controller
    and groups can be made, else v1 where its pids hierarchy is writable, else none (rlimits)."""
    parent, note = cgroup_v2()
    if parent is not None:
        return {"process_limit": "cgroup", "cgroup": "v2", "cgroup_parent": parent,
                "cgroup_note": f"{note}: pids.max, memory.max, cpu.max per call"}
    if pids_v1_root():
        return {"process_limit": "cgroup", "cgroup": "v1",
                "cgroup_note": f"cgroup v1 pids, memory, cpu per call; not v2: {note}"}
    return {"process_limit": "rlimit", "cgroup_note": f"rlimits only; no writable cgroup v1 pids hierarchy, not v2: {note}"}


def _read_proc(name: str) -> str | None:
    """``/proc/self/<name>``, or None where it cannot be read (not Linux, no /proc)."""
    try:
        with open(f"/proc/self/{name}") as f:
            return f.read()
    except OSError:
        return None


def own_v1(controller: str) -> str | None:
    """This process's own cgroup v1 directory for ``controller`` when root may make groups
    in it (a group made there is nested, so a container's own limits still apply)."""
    for line in (_read_proc("cgroup") or "").splitlines():
        parts = line.split(":", 2)
        if len(parts) == 3 and controller in parts[1].split(","):
            path = os.path.join(CGROUP_V1, controller, parts[2].lstrip("/"))
            if os.access(os.path.join(path, "cgroup.procs"), os.W_OK):
                return path
    return None


def pids_v1_root() -> str | None:
    return own_v1("pids")


# -- cgroup v2 ------------------------------------------------------------------------------

V2_CONTROLLERS = ("pids", "memory", "cpu")  # pids is required; memory and cpu where there


def v2_mount(mountinfo: str | None = None) -> str | None:
    """Where the unified (v2) hierarchy is mounted (``/sys/fs/cgroup`` on a pure v2 host,
    ``/sys/fs/cgroup/unified`` on a hybrid one), from ``/proc/self/mountinfo``."""
    mountinfo = _read_proc("mountinfo") if mountinfo is None else mountinfo
    for line in (mountinfo or "").splitlines():
        left, _, right = line.partition(" - ")
        if right.split(" ", 1)[0] == "cgroup2":
            return left.split()[4]
    return None


def v2_own(mount: str, cgroup: str | None = None) -> str | None:
    """This process's own v2 cgroup directory (the ``0::`` line of ``/proc/self/cgroup``)."""
    cgroup = _read_proc("cgroup") if cgroup is None else cgroup
    for line in (cgroup or "").splitlines():
        if line.startswith("0::"):
            return os.path.normpath(os.path.join(mount, line[3:].strip().lstrip("/")))
    return None


def v2_parent(own: str, pid: int | None = None) -> tuple[str | None, str]:
    """The v2 directory in which per-call groups with ``pids`` (and ``memory``, ``cpu``) limits can
    be made, and what was done or why none can: (path, note).

    A v2 group that holds processes cannot hand controllers to children (the "no internal
    processes" rule, the root group excepted). So the controllers are enabled in this process's
    own group where that works; where the group holds only this process (mlxterm as a
    container's main process, a delegated service), this process first moves into a leaf of
    its own (``mlxterm-host``), which leaves every limit above it in force; where other
    processes share the group, no groups are made (the caller falls back)."""
    pid = os.getpid() if pid is None else pid
    try:
        with open(os.path.join(own, "cgroup.controllers")) as f:
            available = f.read().split()
    except OSError as e:
        return None, f"cannot read {own}/cgroup.controllers ({e.strerror})"
    if "pids" not in available:
        return None, f"the pids controller is not in the v2 hierarchy at {own} (it is bound to cgroup v1 or not delegated)"
    want = [c for c in V2_CONTROLLERS if c in available]
    err = enable(own, want)
    if err is None:
        return own, "v2 groups under " + own
    try:
        with open(os.path.join(own, "cgroup.procs")) as f:
            procs = [int(x) for x in f.read().split()]
    except OSError as e:
        return None, f"cannot read {own}/cgroup.procs ({e.strerror})"
    if procs != [pid]:
        return None, f"cannot enable controllers in {own} ({err}) and other processes share it"
    leaf = os.path.join(own, "mlxterm-host")
    try:
        os.makedirs(leaf, exist_ok=True)
        with open(os.path.join(leaf, "cgroup.procs"), "w") as f:
            f.write(str(pid))
    except OSError as e:
        return None, f"cannot move mlxterm into {leaf} ({e.strerror})"
    err = enable(own, want)
    if err is not None:
        return None, f"cannot enable controllers in {own} ({err})"
    return own, f"v2 groups under {own} (mlxterm moved into mlxterm-host)"


def enable(path: str, controllers: Sequence[str]) -> str | None:
    """Enable ``controllers`` for ``path``'s children; None, or the error."""
    try:
        with open(os.path.join(path, "cgroup.subtree_control")) as f:
            enabled = f.read().split()
    except OSError as e:
        return e.strerror or str(e)
    for c in controllers:
        if c in enabled:
            continue
        try:
            with open(os.path.join(path, "cgroup.subtree_control"), "w") as f:
                f.write("+" + c)
        except OSError as e:
            if c == "pids":
                return e.strerror or str(e)
    return None


_v2_lock = threading.Lock()
_v2_found: tuple[str | None, str] | None = None


def cgroup_v2() -> tuple[str | None, str]:
    """``v2_parent`` for this process, found once (root only: others cannot write the tree)."""
    global _v2_found
    with _v2_lock:
        if _v2_found is None:
            mount = v2_mount()
            own = v2_own(mount) if mount else None
            if own is None:
                _v2_found = (None, "no cgroup v2 hierarchy")
            elif os.geteuid() != 0:
                _v2_found = (None, "not root")
            else:
                _v2_found = v2_parent(own)
        return _v2_found


class V2Group:
    """A fresh v2 cgroup for one root-run command under ``parent`` (``cgroup_v2()``):
    ``pids.max``, ``memory.max`` (processes and tmpfs pages together; no swap beyond it) and
    ``cpu.max`` (a CFS quota), each where the controller is enabled."""

    def __init__(self, path: str):
        self.path = path

    @classmethod
    def create(cls, limits: Limits, parent: str) -> V2Group | None:
        period = 100_000  # µs
        try:
            with open(os.path.join(parent, "cgroup.subtree_control")) as f:
                enabled = set(f.read().split())
        except OSError:
            return None
        if "pids" not in enabled:
            return None
        knobs = [("pids.max", limits.processes)]
        if "memory" in enabled:
            knobs += [("memory.max", limits.memory_bytes), ("memory.swap.max", 0)]
        if "cpu" in enabled:
            knobs.append(("cpu.max", f"{round(cpu_share(limits) * period)} {period}"))
        path = os.path.join(parent, f"mlxterm-{os.getpid()}-{secrets.token_hex(4)}")
        try:
            os.mkdir(path)
        except OSError:
            return None
        group = cls(path)
        for knob, value in knobs:
            try:
                with open(os.path.join(path, knob), "w") as f:
                    f.write(str(value))
            except OSError:
                if knob == "memory.swap.max":
                    continue  # no swap accounting here: memory.max still holds
                group.remove()
                return None
        return group

    def wrap(self, argv: list[str]) -> list[str]:
        """``argv`` started from a shell that first moves itself into the group (a failed
        write ends there: never unlimited)."""
        return ["/bin/sh", "-c", 'echo 0 > "$0" && exec "$@"', os.path.join(self.path, "cgroup.procs"), *argv]

    def remove(self) -> None:
        with contextlib.suppress(OSError):  # cgroup.kill (Linux 5.14+) ends everything inside at once
            with open(os.path.join(self.path, "cgroup.kill"), "w") as f:
                f.write("1")
        remove_group(self.path)


def cpu_share(limits: Limits) -> float:
    """The CPUs' worth of time one call may use: ``limits.cpus``, else all but one CPU (at least
    one), so the model beside it keeps a core."""
    if limits.cpus is not None:
        if limits.cpus <= 0:
            raise ValueError(f"Limits.cpus must be > 0, got {limits.cpus}")
        return limits.cpus
    return float(max(1, (os.cpu_count() or 1) - 1))


class V1Groups:
    """Fresh cgroups (v1) for one root-run command: ``pids`` caps its processes (RLIMIT_NPROC
    counts every process of the shared sandbox uid), ``memory`` its memory in all (processes
    and the pages of its tmpfs files together), ``cpu`` its CPU time per period (a CFS quota),
    where this process may make such groups."""

    def __init__(self, paths: list[str]):
        self.paths = paths

    @classmethod
    def create(cls, limits: Limits) -> V1Groups | None:
        period = 100_000  # µs
        settings = {"pids": [("pids.max", limits.processes)], "memory": [("memory.limit_in_bytes", limits.memory_bytes)],
                    "cpu": [("cpu.cfs_period_us", period), ("cpu.cfs_quota_us", round(cpu_share(limits) * period))]}
        paths = []
        name = f"mlxterm-{os.getpid()}-{secrets.token_hex(4)}"
        for controller, knobs in settings.items():
            parent = own_v1(controller)
            if parent is None:
                continue
            path = os.path.join(parent, name)
            try:
                os.mkdir(path)
            except OSError:
                continue
            paths.append(path)
            try:
                for knob, value in knobs:
                    with open(os.path.join(path, knob), "w") as f:
                        f.write(str(value))
            except OSError:
                cls(paths).remove()
                return None
        if not any(p.startswith(os.path.join(CGROUP_V1, "pids") + "/") for p in paths):
            cls(paths).remove()
            return None  # the process cap is what root needs most; without it, no groups at all
        return cls(paths)

    def wrap(self, argv: list[str]) -> list[str]:
        """``argv`` started from a shell that first moves itself into the groups ("0" is the
        writer) and then execs it, so the limits hold from the first instruction. A shell
        rather than a ``preexec_fn``: with one, Python forks its whole (large) process and
        runs every library's atfork handlers instead of spawning. The shell is one thread, so
        it writes ``tasks`` (moves itself only): the kernel then skips the global threadgroup
        lock whose RCU grace period made each ``cgroup.procs`` write cost milliseconds."""
        procs = [os.path.join(p, "tasks") for p in self.paths]
        # $0 is the first group's file, $1.. the others; a failed write ends here: never unlimited
        join = "".join(f'echo 0 > "${i}" && ' for i in range(len(procs))) + f'shift {len(procs) - 1} && exec "$@"'
        return ["/bin/sh", "-c", join, *procs, *argv]

    def remove(self) -> None:
        """Kill anything left in the groups, then remove them (empty once all are reaped)."""
        for path in self.paths:
            remove_group(path)


def remove_group(path: str) -> None:
    for attempt in range(120):  # about 2 s at most
        try:
            with open(os.path.join(path, "cgroup.procs")) as f:
                pids = [int(x) for x in f.read().split()]
            for pid in pids:
                with contextlib.suppress(OSError):
                    os.kill(pid, 9)
            os.rmdir(path)
            return
        except FileNotFoundError:
            return
        except OSError:  # still emptying: the last processes are being reaped
            time.sleep(min(0.02, 0.0005 * 2 ** attempt))
