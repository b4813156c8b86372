"""The sandbox around agent shell commands (``bash``) and task acceptance checks.

On Linux a command runs under bubblewrap (``bwrap``): the whole filesystem read-only, the
workspace read-write, a private ``/tmp``; home directories, ``/run`` (sockets), the directory
holding the workspace (files beside it) and the caller's sensitive paths (``$MLXTERM_HOME``, the session database...) hidden behind empty
tmpfs mounts; its own PID, IPC, UTS, user and network namespaces (so loopback works for the
command's own servers but reaches nothing on the host; ``network=True`` keeps the host
network). ``--die-with-parent`` and the PID namespace end every process when the command ends
or is killed. Resource limits make a fork bomb, a memory hog or a runaway file a tool error:
CPU seconds, data segment size, file size, and process count (``ulimit -u`` inside the user
namespace, where it counts only the sandbox's processes; root is exempt from that limit, so
for root a fresh ``pids`` cgroup with ``pids.max`` is used where one can be made).

On macOS the same rules are written as a Seatbelt (``sandbox-exec``) profile; see
``seatbelt_profile``. Where neither works, ``probe()`` says why; callers then run unconfined
and force ``bash`` approvals to "ask" (see ``agents.policy``).

The data segment limit (RLIMIT_DATA) stands in for an address-space limit: RLIMIT_AS also
counts reserved but unused address space, which V8 (headless chromium, node) reserves by the
gigabyte at start, so RLIMIT_AS would break a browser check while RLIMIT_DATA still stops a
process that actually allocates too much.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

# Paths always hidden (when present): other users' homes, root's home, runtime sockets,
# removable and mounted media. The caller adds the user's home and mlxterm's data dirs.
HIDDEN_PATHS = ("/home", "/root", "/run", "/var/run", "/mnt", "/media", "/var/tmp")
# Never hidden as "the directory beside the workspace": the system would stop working.
SYSTEM_DIRS = ("/", "/usr", "/etc", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/opt", "/var", "/srv",
               "/nix", "/proc", "/dev", "/sys", "/boot", "/snap")
PRIVATE_TMP = "/tmp"  # a fresh tmpfs in every sandbox
PIDS_CGROUP_ROOTS = ("/sys/fs/cgroup/pids",)  # cgroup v1 pids hierarchy (root-only path)


@dataclass(frozen=True)
class Limits:
    cpu_s: int = 600  # per process; the wall-clock timeout usually ends things first
    data_bytes: int = 4 << 30  # per process (see the module docstring for why not RLIMIT_AS)
    processes: int = 512
    file_bytes: int = 1 << 30  # largest file a command may write
    tmp_bytes: int = 1 << 30  # size of the private /tmp (it lives in memory)


@dataclass(frozen=True)
class SandboxPolicy:
    """What a sandboxed command may reach besides the workspace."""

    network: bool = False
    hide: tuple[str, ...] = ()  # more paths to hide (mlxterm's data, config and cache dirs)
    read_only: tuple[str, ...] = ()  # hidden paths to show again read-only (a venv under $HOME)
    hide_siblings: bool = True  # hide the workspace's parent directory (files beside it)
    writable: tuple[str, ...] = ()  # more directories it may write (a task run's evidence dir)
    limits: Limits = field(default_factory=Limits)


@dataclass(frozen=True)
class SandboxStatus:
    backend: str  # "bwrap" | "seatbelt" | "none"
    reason: str  # why "none", or a one-line description of what confines commands
    process_limit: str = "none"  # "rlimit" | "cgroup" | "none"

    @property
    def available(self) -> bool:
        return self.backend != "none"

    def describe(self) -> str:
        if not self.available:
            return f"unavailable: {self.reason}"
        return f"{self.backend} ({self.reason}; process limit: {self.process_limit})"


_probe_lock = threading.Lock()
_probed: SandboxStatus | None = None
_warned = False


def probe(refresh: bool = False) -> SandboxStatus:
    """Whether commands can be sandboxed here (cached: bwrap is tried once per process)."""
    global _probed
    with _probe_lock:
        if _probed is None or refresh:
            _probed = _probe()
        return _probed


def _probe() -> SandboxStatus:
    if os.environ.get("MLXTERM_SANDBOX") == "off":
        return SandboxStatus("none", "turned off by MLXTERM_SANDBOX=off")
    if sys.platform == "darwin":
        exe = shutil.which("sandbox-exec")
        if exe is None:
            return SandboxStatus("none", "sandbox-exec not found")
        return SandboxStatus("seatbelt", "sandbox-exec with a generated Seatbelt profile", "none")
    if not sys.platform.startswith("linux"):
        return SandboxStatus("none", f"no sandbox for platform {sys.platform}")
    bwrap = shutil.which("bwrap")
    if bwrap is None:
        return SandboxStatus("none", "bubblewrap (bwrap) is not installed; install the Debian package bubblewrap")
    try:
        proc = subprocess.run([bwrap, *_namespace_args(False), "--ro-bind", "/", "/", "true"],
                              capture_output=True, timeout=20, stdin=subprocess.DEVNULL)
    except (OSError, subprocess.TimeoutExpired) as e:
        return SandboxStatus("none", f"bwrap could not start: {e}")
    if proc.returncode != 0:
        err = proc.stderr.decode("utf-8", "replace").strip().splitlines()
        return SandboxStatus("none", "bwrap cannot create namespaces here: " + (err[-1] if err else f"exit {proc.returncode}"))
    plimit = "cgroup" if os.geteuid() == 0 and _pids_cgroup_root() else ("none" if os.geteuid() == 0 else "rlimit")
    return SandboxStatus("bwrap", "bubblewrap: read-only system, writable workspace, private /tmp, own network", plimit)


def warn_once(status: SandboxStatus) -> str | None:
    """The fallback message, the first time it is asked for in this process (else None)."""
    global _warned
    if status.available or _warned:
        return None
    _warned = True
    return (f"bash runs without a sandbox ({status.reason}); every bash call needs your approval. "
            "Run `mlxterm doctor` for details.")


# -- bubblewrap -----------------------------------------------------------------------------

def _namespace_args(network: bool) -> list[str]:
    # --unshare-all tries a user namespace; root needs it asked for explicitly.
    args = ["--unshare-all", "--unshare-user", "--die-with-parent", "--new-session"]
    if network:
        args.append("--share-net")
    return args


def bwrap_args(policy: SandboxPolicy, workspace: Path, home: str | None = None) -> list[str]:
    """The bwrap options (without the command) for ``policy`` around ``workspace``.

    Mount order matters: hidden paths are covered by empty tmpfs first, then read-only
    re-exposures, then the workspace bind (so a workspace under a hidden directory, such as
    ``$MLXTERM_HOME/data/runs/ID/workspace`` or ``~/project``, is still there), then hidden
    paths that lie inside the workspace.
    """
    ws = os.path.realpath(workspace)
    args = [*_namespace_args(policy.network), "--ro-bind", "/", "/", "--dev", "/dev", "--proc", "/proc",
            "--size", str(policy.limits.tmp_bytes), "--tmpfs", PRIVATE_TMP]
    parent = [os.path.dirname(ws)] if policy.hide_siblings and os.path.dirname(ws) not in SYSTEM_DIRS else []
    hidden = _existing([*HIDDEN_PATHS, *([home] if home else []), *policy.hide, *parent])
    inside = [h for h in hidden if _within(h, ws)]
    for h in hidden:
        if h in inside or _within(h, PRIVATE_TMP) or any(_within(h, o) and o != h for o in hidden):
            continue  # covered by the private /tmp or a hiding parent, or hidden after the bind
        args += _hide(h)
    # With the network on, name resolution must keep working: /etc/resolv.conf is often a
    # link into /run (systemd-resolved), which is hidden.
    shown = [*policy.read_only, *(["/etc/resolv.conf"] if policy.network else [])]
    for p in _existing(shown):
        if not _within(p, ws):
            args += ["--ro-bind", p, p]
    args += ["--bind", ws, ws]
    for p in _existing(policy.writable):
        args += ["--bind", p, p]
    for h in inside:
        if h != ws:
            args += _hide(h)
    args += ["--chdir", ws, "--setenv", "TMPDIR", "/tmp"]
    return args


def _hide(path: str) -> list[str]:
    return ["--tmpfs", path] if os.path.isdir(path) else ["--ro-bind", "/dev/null", path]


def _existing(paths: Sequence[str]) -> list[str]:
    out: list[str] = []
    for p in paths:
        if not p:
            continue
        real = os.path.realpath(os.path.expanduser(p))
        if os.path.lexists(real) and real != "/" and real not in out:
            out.append(real)
    return out


def _within(path: str, parent: str) -> bool:
    return path == parent or path.startswith(parent.rstrip("/") + "/")


# -- Seatbelt (macOS) -----------------------------------------------------------------------

def _sb_quote(path: str) -> str:
    return '"' + path.replace("\\", "\\\\").replace('"', '\\"') + '"'


def seatbelt_profile(policy: SandboxPolicy, workspace: Path, home: str | None, tmpdir: str) -> str:
    """A ``sandbox-exec`` profile with the bwrap rules: read everything but the hidden paths,
    write only the workspace and a private temp dir, no network unless ``policy.network``.

    Seatbelt has no network namespace: "loopback only" there means connections to
    ``localhost``, which also reaches servers the user runs on the host. Later rules win.
    """
    ws = os.path.realpath(workspace)
    hidden = [os.path.realpath(os.path.expanduser(p)) for p in ("/Users", "/var/root", *([home] if home else []),
                                                                 *policy.hide) if p]
    lines = [
        "(version 1)",
        "(deny default)",
        "(allow process-exec process-fork)",
        "(allow signal (target same-sandbox))",
        "(allow sysctl-read)",
        "(allow mach-lookup)",
        "(allow ipc-posix-shm)",
        "(allow file-read*)",
        "(deny file-read* " + " ".join(f"(subpath {_sb_quote(h)})" for h in hidden) + ")",
        # Walking down to a workspace under a hidden directory needs its parents' metadata.
        "(allow file-read-metadata " + " ".join(f"(literal {_sb_quote(p)})" for p in _parents(ws)) + ")",
    ]
    writable = [ws, tmpdir, *(os.path.realpath(p) for p in policy.writable)]
    readable = [*writable, *(os.path.realpath(p) for p in policy.read_only)]
    lines.append("(allow file-read* " + " ".join(f"(subpath {_sb_quote(p)})" for p in readable) + ")")
    lines.append("(allow file-write* " + " ".join(f"(subpath {_sb_quote(p)})" for p in writable) + " "
                 '(literal "/dev/null") (literal "/dev/zero") (literal "/dev/dtracehelper"))')
    if policy.network:
        lines.append("(allow network*)")
    else:
        lines.append('(allow network-bind network-inbound (local ip "localhost:*"))')
        lines.append('(allow network-outbound (remote ip "localhost:*") (remote unix-socket))')
    return "\n".join(lines) + "\n"


def _parents(path: str) -> list[str]:
    p = Path(path)
    return [str(x) for x in reversed(p.parents)] + [str(p)]


# -- running --------------------------------------------------------------------------------

@dataclass
class Sandbox:
    """Runs commands under ``policy`` with the backend ``status`` found (None: probe now)."""

    policy: SandboxPolicy = field(default_factory=SandboxPolicy)
    status: SandboxStatus | None = None

    def __post_init__(self) -> None:
        if self.status is None:
            self.status = probe()

    @property
    def active(self) -> bool:
        assert self.status is not None
        return self.status.available

    @contextlib.contextmanager
    def launch(self, command: str, workspace: Path, env: dict[str, str]) -> Iterator[list[str]]:
        """The argv that starts ``bash -c command`` confined (plain ``bash -c`` where no sandbox
        is available); cleans up after."""
        bash = shutil.which("bash") or "/bin/bash"
        if not self.active:
            yield [bash, "-c", command]
            return
        limits = self.policy.limits
        home = os.path.expanduser("~")  # this process's home (the command's HOME is the workspace)
        cgroup = _PidsCgroup.create(limits.processes) if self.status.process_limit == "cgroup" else None
        try:
            inner = limits_wrapper(limits, processes=self.status.backend == "bwrap")
            if self.status.backend == "seatbelt":
                tmpdir = os.path.realpath(env.get("TMPDIR") or "/tmp")
                profile = seatbelt_profile(self.policy, workspace, home, tmpdir)
                argv = ["sandbox-exec", "-p", profile, bash, "-c", inner, bash, command]
            else:
                argv = [shutil.which("bwrap") or "bwrap", *bwrap_args(self.policy, workspace, home),
                        "--", bash, "-c", inner, bash, command]
            yield cgroup.wrap(argv) if cgroup is not None else argv
        finally:
            if cgroup is not None:
                cgroup.remove()


def limits_wrapper(limits: Limits, processes: bool = True) -> str:
    """A ``bash -c`` script that sets the limits, then runs ``$1`` with bash.

    Set inside the sandbox rather than in a ``preexec_fn``: with one, Python has to fork its
    whole (large) process instead of spawning, which costs more per call than the sandbox.
    ``ulimit -u`` inside the new user namespace counts the sandbox's processes only (outside
    it would count every process of the user; Seatbelt has no such namespace, so not there).
    Each limit is set on its own: a lower hard limit already in force simply stays.
    """
    settings = [("-t", limits.cpu_s), ("-d", limits.data_bytes // 1024), ("-f", limits.file_bytes // 1024)]
    if processes:
        settings.append(("-u", limits.processes))
    return "".join(f"ulimit {flag} {value} 2>/dev/null; " for flag, value in settings) + 'exec "$0" -c "$1"'


def _pids_cgroup_root() -> str | None:
    for root in PIDS_CGROUP_ROOTS:
        if os.access(os.path.join(root, "cgroup.procs"), os.W_OK):
            return root
    return None


class _PidsCgroup:
    """A fresh pids cgroup capping how many processes a root-run command may have."""

    def __init__(self, path: str):
        self.path = path

    @classmethod
    def create(cls, max_pids: int) -> _PidsCgroup | None:
        root = _pids_cgroup_root()
        if root is None:
            return None
        path = os.path.join(root, f"mlxterm-{os.getpid()}-{secrets.token_hex(4)}")
        try:
            os.mkdir(path)
            with open(os.path.join(path, "pids.max"), "w") as f:
                f.write(str(max_pids))
        except OSError:
            return None
        return cls(path)

    def wrap(self, argv: list[str]) -> list[str]:
        """``argv`` started from a shell that first moves itself into the group ("0" is the
        writer) and then execs it, so the limit holds from the first instruction. A shell
        rather than a ``preexec_fn``: with one, Python forks its whole (large) process and
        runs every library's atfork handlers instead of spawning."""
        join = 'echo 0 > "$0" && exec "$@"'  # a failed write ends here: never run unlimited
        return ["/bin/sh", "-c", join, os.path.join(self.path, "cgroup.procs"), *argv]

    def remove(self) -> None:
        """Kill anything left in the group, then remove it (empty once all are reaped)."""
        for attempt in range(120):  # about 2 s at most
            try:
                with open(os.path.join(self.path, "cgroup.procs")) as f:
                    pids = [int(x) for x in f.read().split()]
                for pid in pids:
                    with contextlib.suppress(OSError):
                        os.kill(pid, 9)
                os.rmdir(self.path)
                return
            except FileNotFoundError:
                return
            except OSError:  # still emptying: the last processes are being reaped
                time.sleep(min(0.02, 0.0005 * 2 ** attempt))
