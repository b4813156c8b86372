"""The sandbox around agent shell commands (``bash``) and task acceptance checks.

Why: an agent's commands must not reach anything of the host but the workspace. On Linux a
command runs under bubblewrap in a root of its own (system dirs and the policy's paths
read-only, the workspace and the policy's writable dirs read-write, private ``/tmp``,
``/dev/shm``, ``/proc``, PID/IPC/UTS/network namespaces), with no capabilities and, for a root
mlxterm, as an unprivileged uid (``MLXTERM_SANDBOX_USER``; ``_Handover`` lends it the
workspace). Behind the mounts: a seccomp filter (``tools.seccomp``), Landlock write rules
(``tools.landlock``), resource limits (``ulimit``; for root a cgroup per call,
``tools.cgroups``) and the workspace cap (``tools.space``). On macOS the same rules become a
Seatbelt profile (``seatbelt_profile``). ``probe()`` says what works here and ``describe()``
(``mlxterm doctor``) what is off and why; where nothing works a ``Sandbox`` refuses commands
unless made with ``unconfined_ok``. Every rule and why it is there: docs/agents.md, Sandbox.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import stat
import subprocess
import sys
import tempfile
import threading
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field, fields, replace
from pathlib import Path

from tools import cgroups, landlock, seccomp, settings, space

# Paths always hidden (when present): other users' homes, root's home, runtime sockets,
# removable and mounted media. The caller adds the user's home and mlxterm's data dirs.
HIDDEN_PATHS = ("/home", "/root", "/run", "/var/run", "/mnt", "/media", "/var/tmp")
# What a shell needs from the host, mounted read-only (links, as on merged-/usr systems, are
# recreated as links). Nothing else of the host's filesystem is there unless a policy names it.
SYSTEM_RO = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32", "/etc")
PRIVATE_TMP = "/tmp"  # a fresh tmpfs in every sandbox


@dataclass(frozen=True)
class Limits:
    cpu_s: int = 600  # per process; the wall-clock timeout usually ends things first
    data_bytes: int = 4 << 30  # per process (see the module docstring for why not RLIMIT_AS)
    processes: int = 512
    file_bytes: int = 1 << 30  # largest file a command may write
    memory_bytes: int = 8 << 30  # all of a call's memory, tmpfs pages included (root: memory cgroup)
    cpus: float | None = None  # CPUs' worth of time per call (root: cpu cgroup); None: all but one, at least one
    tmp_bytes: int = 512 << 20  # size of the private /tmp (it lives in memory)
    shm_bytes: int = 512 << 20  # size of the private /dev/shm (memory too)
    # disk the workspace may use in all (tools.space; MLXTERM_WORKSPACE_CAP sets the default)
    workspace_bytes: int = field(default_factory=space.default_cap)

    @classmethod
    def from_mapping(cls, values: dict) -> Limits:
        """Limits from a task's or profile's ``sandbox:`` mapping (the field names above;
        unknown names and bad values are a ``ValueError`` saying which)."""
        names = {f.name: f.type for f in fields(cls)}
        out = {}
        for key, value in values.items():
            if key not in names:
                raise ValueError(f"unknown sandbox limit {key!r}; known: {', '.join(names)}")
            if key == "cpus" and value is None:
                out[key] = None
                continue
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
                raise ValueError(f"sandbox limit {key!r} must be a positive number, got {value!r}")
            out[key] = float(value) if key == "cpus" else int(value)
        return cls(**out)


@dataclass(frozen=True)
class SandboxPolicy:
    """What a sandboxed command may reach besides the workspace."""

    network: bool = False
    hide: tuple[str, ...] = ()  # more paths to hide (mlxterm's data, config and cache dirs)
    read_only: tuple[str, ...] = ()  # hidden paths to show again read-only (a venv under $HOME)
    hide_siblings: bool = True  # kept for callers; nothing beside or above the workspace is mounted any more
    writable: tuple[str, ...] = ()  # more directories it may write (a task run's evidence dir)
    limits: Limits = field(default_factory=Limits)


@dataclass(frozen=True)
class SandboxStatus:
    backend: str  # "bwrap" | "seatbelt" | "none"
    reason: str  # why "none", or a one-line description of what confines commands
    process_limit: str = "none"  # "rlimit" | "cgroup" | "none"
    # bwrap only: the unprivileged uid/gid commands run as when mlxterm runs as root (None:
    # mlxterm is not root, commands run as its own uid inside a user namespace)
    run_as: tuple[int, int] | None = None
    disable_userns: bool = False  # bwrap --disable-userns (bubblewrap >= 0.8, user-namespace mode)
    seccomp_off: str | None = None  # bwrap: why no seccomp filter is loaded (None: it is)
    # process_limit "cgroup": "v1" or "v2"; the v2 parent directory; and in words which groups
    # a call gets, or why none (then rlimits alone)
    cgroup: str | None = None
    cgroup_parent: str | None = None
    cgroup_note: str = ""
    landlock_off: str | None = "not probed"  # bwrap: why no Landlock write rules (None: they apply)

    @property
    def available(self) -> bool:
        return self.backend != "none"

    def identity(self) -> str:
        """Which uid sandboxed commands run as, in words."""
        if self.run_as is not None:
            return f"uid {self.run_as[0]}, gid {self.run_as[1]} (dropped from root, no capabilities)"
        return f"uid {os.getuid()} (this user, no capabilities)"

    def describe(self) -> str:
        if not self.available:
            return f"unavailable: {self.reason}"
        filt = ""
        if self.backend == "bwrap":
            filt = "; seccomp filter: on" if self.seccomp_off is None else f"; seccomp filter: OFF ({self.seccomp_off})"
            filt += ("; Landlock write rules: on" if self.landlock_off is None
                     else f"; Landlock write rules: OFF ({self.landlock_off})")
        limit = self.process_limit + (f" ({self.cgroup_note})" if self.cgroup_note else "")
        return f"{self.backend} ({self.reason}; runs as {self.identity()}; process limit: {limit}{filt})"


PROBE_LIMITS = Limits(workspace_bytes=space.DEFAULT_CAP)  # the probe does not depend on MLXTERM_WORKSPACE_CAP
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
    switch = settings.sandbox()
    if not switch.enabled:
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
    root = os.geteuid() == 0
    run_as = None
    if root:
        if shutil.which("setpriv") is None:
            return SandboxStatus("none", "running as root needs setpriv (util-linux) to drop to an unprivileged uid")
        run_as = settings.sandbox_user()
    try:
        helptext = subprocess.run([bwrap, "--help"], capture_output=True, timeout=20).stdout.decode("utf-8", "replace")
    except (OSError, subprocess.TimeoutExpired) as e:
        return SandboxStatus("none", f"bwrap could not start: {e}")
    status = SandboxStatus("bwrap", "bubblewrap: system dirs read-only, writable workspace, nothing else of the host, private /tmp, own network",
                           "rlimit", run_as, disable_userns=not root and "--disable-userns" in helptext,
                           seccomp_off=seccomp.unavailable_reason(), landlock_off=_landlock_off(switch))
    if root:
        status = replace(status, **cgroups.choice())
    # the probe runs what a real call runs: namespaces, dropped capabilities, the uid switch, the filter
    err = _try_bwrap(bwrap, status)
    if err is not None and status.landlock_off is None and _try_bwrap(bwrap, replace(status, landlock_off="-")) is None:
        return replace(status, landlock_off=f"the rules could not be applied: {err}")
    if err is not None and status.seccomp_off is None and _try_bwrap(bwrap, replace(status, seccomp_off="-")) is None:
        return replace(status, seccomp_off=f"bwrap did not load it: {err}")
    if err is not None:
        return SandboxStatus("none", "bwrap cannot create namespaces here: " + err)
    return status


def _landlock_off(switch: settings.Sandbox) -> str | None:
    """Why no Landlock write rules apply (turned off, or the kernel's reason), or None."""
    if not switch.landlock:
        return f"turned off by MLXTERM_SANDBOX={settings.NO_LANDLOCK}"
    return landlock.unavailable_reason()


def _try_bwrap(bwrap: str, status: SandboxStatus) -> str | None:
    """Run ``true`` the way a real call runs; None, or why it failed."""
    fd = seccomp.program_fd() if status.seccomp_off is None else None
    ws = tempfile.mkdtemp(prefix="mlxterm-probe-")
    try:
        proc = subprocess.run([bwrap, *bwrap_args(SandboxPolicy(limits=PROBE_LIMITS), Path(ws), None, status, fd), "--", *_drop_args(status),
                               *_landlock_args(status, [ws]), shutil.which("true") or "/bin/true"],
                              capture_output=True, timeout=20, stdin=subprocess.DEVNULL, pass_fds=(fd,) if fd is not None else ())
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"bwrap could not start: {e}"
    finally:
        if fd is not None:
            os.close(fd)
        os.rmdir(ws)
    if proc.returncode != 0:
        lines = proc.stderr.decode("utf-8", "replace").strip().splitlines()
        return lines[-1] if lines else f"exit {proc.returncode}"
    return None


def _landlock_args(status: SandboxStatus | None, writable: Sequence[str]) -> list[str]:
    """The command prefix that applies the Landlock write rules (``tools.landlock``) for
    ``writable`` and then execs the rest; nothing where they are off."""
    if status is None or status.backend != "bwrap" or status.landlock_off is not None:
        return []
    return [*landlock.helper(), *writable, "--"]


def warn_once(status: SandboxStatus) -> str | None:
    """The fallback message, the first time it is asked for in this process (else None)."""
    global _warned
    if status.available or _warned:
        return None
    _warned = True
    return (f"bash runs without a sandbox ({status.reason}); every bash call needs your approval. "
            "Run `mlxterm doctor` for details.")


# -- bubblewrap -----------------------------------------------------------------------------

def _namespace_args(network: bool, status: SandboxStatus | None = None) -> list[str]:
    """Namespaces and capabilities.

    Not root: ``--unshare-all`` plus a user namespace in which the command is this user with no
    capabilities (``--cap-drop ALL``), and no further user namespaces where bwrap can forbid them.
    Root: a user namespace created by real root maps the command's uid to host root (it could
    read root's 0600 files and leave setuid-root binaries), so no user namespace at all: bwrap
    sets up as root, keeps only CAP_SETUID/SETGID/SETPCAP, and ``_drop_args`` switches to an
    unprivileged uid before the command starts, clearing every capability and the bounding set.
    bwrap always sets ``no_new_privs``: no setuid binary or file capability gives them back.
    """
    if status is not None and status.run_as is not None:
        args = ["--unshare-ipc", "--unshare-pid", "--unshare-uts", "--unshare-cgroup-try",
                *([] if network else ["--unshare-net"]), "--die-with-parent", "--new-session",
                "--cap-drop", "ALL", "--cap-add", "CAP_SETUID", "--cap-add", "CAP_SETGID", "--cap-add", "CAP_SETPCAP"]
        return args
    # --unshare-all tries a user namespace; root needs it asked for explicitly.
    args = ["--unshare-all", "--unshare-user", "--die-with-parent", "--new-session", "--cap-drop", "ALL"]
    if status is not None and status.disable_userns:
        args.append("--disable-userns")
    if network:
        args.append("--share-net")
    return args


def _drop_args(status: SandboxStatus | None) -> list[str]:
    """The command prefix (after bwrap's ``--``) that leaves root for ``status.run_as``."""
    if status is None or status.run_as is None:
        return []
    uid, gid = status.run_as
    return [shutil.which("setpriv") or "setpriv", f"--reuid={uid}", f"--regid={gid}", "--clear-groups",
            "--inh-caps=-all", "--bounding-set=-all", "--"]


def bwrap_args(policy: SandboxPolicy, workspace: Path, home: str | None = None,
               status: SandboxStatus | None = None, seccomp_fd: int | None = None) -> list[str]:
    """The bwrap options (without the command) for ``policy`` around ``workspace``
    (``seccomp_fd``: a descriptor bwrap reads the seccomp program from).

    The sandbox's root is an empty tmpfs with only what a shell needs mounted into it: the
    system directories (``SYSTEM_RO``, read-only; merged-/usr links as links), ``/dev`` and
    ``/proc`` of its own, a private ``/tmp`` and ``/dev/shm`` (sized tmpfs), the read-only
    paths (the Python running mlxterm, a task's files), the workspace and the writable paths.
    Everything else -- the directories above and beside the workspace, home directories,
    ``/run`` and ``/var`` (host sockets), ``/sys`` -- is absent. The directories leading down to a
    mount are made 0711 (passable, not listable), then the root and ``/dev`` are remounted
    read-only. Binds go shallowest first, so a bind inside another one lands on top of it;
    a hidden path (``policy.hide``, the caller's home, ``HIDDEN_PATHS``) that lies inside a
    bind is covered by an empty tmpfs (or ``/dev/null``) after that bind, unless it is
    itself one of the binds (a workspace inside mlxterm's data dir stays).
    """
    ws = os.path.realpath(workspace)
    limits = policy.limits
    args = [*_namespace_args(policy.network, status)]
    system = []
    for p in SYSTEM_RO:
        if os.path.islink(p):
            args += ["--symlink", os.readlink(p), p]
        elif os.path.isdir(p):
            args += ["--ro-bind", p, p]
            system.append(p)
    args += ["--dev", "/dev", "--proc", "/proc",
             "--perms", "1777", "--size", str(limits.tmp_bytes), "--tmpfs", PRIVATE_TMP,
             "--perms", "1777", "--size", str(limits.shm_bytes), "--tmpfs", "/dev/shm"]
    binds: dict[str, str] = {}  # path -> "--ro-bind" | "--bind"
    # With the network on, name resolution must keep working: /etc/resolv.conf is often a
    # link into /run (systemd-resolved), which is not mounted.
    helper = []
    if status is not None and status.backend == "bwrap" and status.landlock_off is None:
        helper = landlock.helper_mounts()  # the helper (and the Python that runs it, if not built)
    for p in _existing([*policy.read_only, *helper, *(["/etc/resolv.conf"] if policy.network else [])]):
        if not _within(p, ws) and not any(_within(p, s) for s in system):
            binds[p] = "--ro-bind"
    binds[ws] = "--bind"
    for p in _existing(policy.writable):
        binds[p] = "--bind"
    mounted = [*system, *binds]
    hidden = [h for h in _existing([*HIDDEN_PATHS, *([home] if home else []), *policy.hide])
              if h not in binds and any(_within(h, m) for m in mounted)]
    steps = sorted([(p, flag) for p, flag in binds.items()] + [(h, "hide") for h in hidden],
                   key=lambda item: (_depth(item[0]), item[1] == "hide"))
    made = {"/", PRIVATE_TMP, "/dev", "/proc"}
    done: list[str] = list(system)
    for path, flag in steps:
        if flag == "hide":
            args += _hide(path)
            continue
        for parent in _ancestors(path):
            if parent not in made and not any(_within(parent, d) for d in done):
                args += ["--perms", "0711", "--dir", parent]
                made.add(parent)
        args += [flag, path, path]
        done.append(path)
    # Root's bwrap has no CAP_DAC_OVERRIDE left when it would chdir: a 0700 workspace (lent to
    # the sandbox uid) is entered by the command's shell after the uid switch instead.
    root = status is not None and status.run_as is not None
    args += ["--remount-ro", "/dev", "--remount-ro", "/", "--chdir", "/" if root else ws, "--setenv", "TMPDIR", "/tmp"]
    if seccomp_fd is not None:
        args += ["--seccomp", str(seccomp_fd)]
    return args


def _depth(path: str) -> int:
    return len([c for c in path.split("/") if c])


def _ancestors(path: str) -> list[str]:
    """The directories above ``path``, outermost first, without ``/``."""
    parts = [c for c in path.split("/") if c][:-1]
    return ["/" + "/".join(parts[:i]) for i in range(1, len(parts) + 1)]


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

class SandboxRefused(Exception):
    """No sandbox works here and the caller did not consent to running unconfined."""


@dataclass
class Sandbox:
    """Runs commands under ``policy`` with the backend ``status`` found (None: probe now).

    ``unconfined_ok``: where no sandbox works, run commands unconfined (the caller has a human's
    consent, e.g. every bash call is approved by hand) instead of refusing them."""

    policy: SandboxPolicy = field(default_factory=SandboxPolicy)
    status: SandboxStatus | None = None
    unconfined_ok: bool = False

    def __post_init__(self) -> None:
        if self.status is None:
            self.status = probe()

    @property
    def active(self) -> bool:
        assert self.status is not None
        return self.status.available

    @contextlib.contextmanager
    def launch(self, command: str, workspace: Path,
               env: dict[str, str]) -> Iterator[tuple[list[str], tuple[int, ...], space.Watch]]:
        """The argv that starts ``bash -c command`` confined (plain ``bash -c`` where no sandbox
        is available and ``unconfined_ok``; else ``SandboxRefused``), the descriptors it must
        inherit (``Popen(pass_fds=...)``: the seccomp program) and the watch on the workspace's
        size cap (the caller polls ``check()`` and stops the call when it says so); cleans up after.

        When root drops to ``status.run_as``, the workspace and the writable directories are
        handed to that uid for the call and back to their owner after it (``_Handover``)."""
        bash = shutil.which("bash") or "/bin/bash"
        assert self.status is not None
        if not self.active:
            if not self.unconfined_ok:
                raise SandboxRefused(f"no sandbox is available ({self.status.reason}) and running unconfined "
                                     "was not allowed; run `mlxterm doctor`")
            yield [bash, "-c", command], (), space.Watch.begin([str(workspace)], self.policy.limits.workspace_bytes)
            return
        limits = self.policy.limits
        # the cap counts what the call may write: the workspace and the writable directories
        watch = space.Watch.begin([str(workspace), *self.policy.writable], limits.workspace_bytes)
        home = os.path.expanduser("~")  # this process's home (the command's HOME is the workspace)
        handover = None
        if self.status.backend == "bwrap" and self.status.run_as is not None:
            handover = _Handover([str(workspace), *self.policy.writable], self.status.run_as,
                                 skip=[*self.policy.hide, home], entries=self.policy.read_only)
        cgroup: cgroups.V1Groups | cgroups.V2Group | None = None
        if self.status.process_limit == "cgroup" and self.status.cgroup == "v2" and self.status.cgroup_parent:
            cgroup = cgroups.V2Group.create(limits, self.status.cgroup_parent)
        elif self.status.process_limit == "cgroup":
            cgroup = cgroups.V1Groups.create(limits)
        fds: tuple[int, ...] = ()
        try:
            if handover is not None:
                handover.give()
            inner = limits_wrapper(limits, processes=self.status.backend == "bwrap")
            if self.status.backend == "seatbelt":
                tmpdir = os.path.realpath(env.get("TMPDIR") or "/tmp")
                profile = seatbelt_profile(self.policy, workspace, home, tmpdir)
                argv = ["sandbox-exec", "-p", profile, bash, "-c", inner, bash, command]
            else:
                if self.status.run_as is not None:
                    inner = 'cd -- "$2" || exit 126; ' + inner
                if self.status.seccomp_off is None:
                    fds = (seccomp.program_fd(),)
                argv = [shutil.which("bwrap") or "bwrap",
                        *bwrap_args(self.policy, workspace, home, self.status, fds[0] if fds else None),
                        "--", *_drop_args(self.status),
                        *_landlock_args(self.status, [os.path.realpath(workspace), *_existing(self.policy.writable)]),
                        bash, "-c", inner, bash, command, os.path.realpath(workspace)]
            yield (cgroup.wrap(argv) if cgroup is not None else argv), fds, watch
        finally:
            for fd in fds:
                os.close(fd)
            if cgroup is not None:
                cgroup.remove()
            if handover is not None:
                handover.take_back()


class _Handover:
    """Lends directory trees to the sandbox uid for one call and takes them back.

    ``give`` chowns every entry (symlinks themselves, never their targets) to the sandbox uid;
    ``take_back`` returns everything that uid owns to the tree's owner, with setuid/setgid bits
    cleared, so nothing the command made can run with its owner's rights later. Runs only after
    every process of the call is gone (bwrap's PID namespace ends them all), so nothing inside
    races it. Paths in ``skip`` (mlxterm's data inside a workspace) and files with more than one
    link (a hard link may reach outside the tree) are not lent.

    ``entries``: read-only paths whose own directory the sandbox uid could not pass (a 0700
    task directory); only that directory is lent (it is mounted read-only, so owning it grants
    passing and listing, nothing else), and only when others cannot pass it already.
    """

    def __init__(self, roots: Sequence[str], ids: tuple[int, int], skip: Sequence[str] = (),
                 entries: Sequence[str] = ()):
        self.ids = ids
        self.skip = {os.path.realpath(os.path.expanduser(p)) for p in skip if p}
        self.roots: list[tuple[str, int, int]] = []
        self.entries: list[tuple[str, int, int]] = []
        for root in dict.fromkeys(os.path.realpath(r) for r in roots):
            owner = self._owner(root)
            if owner is not None:
                self.roots.append((root, *owner))
        for entry in dict.fromkeys(os.path.realpath(r) for r in entries):
            try:
                st = os.lstat(entry)
            except OSError:
                continue
            if (stat.S_ISDIR(st.st_mode) and not st.st_mode & stat.S_IXOTH and st.st_uid != ids[0]
                    and not any(_within(entry, r) for r, _, _ in self.roots)):
                self.entries.append((entry, st.st_uid, st.st_gid))

    def _owner(self, root: str) -> tuple[int, int] | None:
        try:
            st = os.lstat(root)
        except OSError:
            return None
        # a tree still lent out (an earlier call died in between) goes back to this process's user
        return (os.geteuid(), os.getegid()) if st.st_uid == self.ids[0] else (st.st_uid, st.st_gid)

    def _walk(self, root: str) -> Iterator[tuple[str, os.stat_result]]:
        stack = [root]
        while stack:
            path = stack.pop()
            if path in self.skip and path != root:
                continue
            try:
                st = os.lstat(path)
            except OSError:
                continue
            yield path, st
            if not stat.S_ISDIR(st.st_mode):
                continue
            try:
                with os.scandir(path) as it:
                    stack.extend(e.path for e in it)
            except OSError:
                continue

    def give(self) -> None:
        uid, gid = self.ids
        for entry, _, _ in self.entries:
            with contextlib.suppress(OSError):
                os.lchown(entry, uid, gid)
        for root, _, _ in self.roots:
            for path, st in self._walk(root):
                if stat.S_ISREG(st.st_mode) and st.st_nlink > 1:
                    continue
                if (st.st_uid, st.st_gid) != (uid, gid):
                    with contextlib.suppress(OSError):
                        os.lchown(path, uid, gid)

    def take_back(self) -> None:
        for entry, owner, group in self.entries:
            with contextlib.suppress(OSError):
                os.lchown(entry, owner, group)
        for root, owner, group in self.roots:
            for path, st in self._walk(root):
                if st.st_uid != self.ids[0] and st.st_gid != self.ids[1]:
                    continue
                with contextlib.suppress(OSError):
                    os.lchown(path, owner, group)
                    if not stat.S_ISLNK(st.st_mode) and st.st_mode & (stat.S_ISUID | stat.S_ISGID):
                        keep = stat.S_ISGID if stat.S_ISDIR(st.st_mode) else 0  # a setgid dir only passes on its group
                        os.chmod(path, stat.S_IMODE(st.st_mode) & ~(stat.S_ISUID | stat.S_ISGID) | keep)


def limits_wrapper(limits: Limits, processes: bool = True) -> str:
    """A ``bash -c`` script that sets the limits, then runs ``$1`` with bash.

    Set inside the sandbox rather than in a ``preexec_fn``: with one, Python has to fork its
    whole (large) process instead of spawning, which costs more per call than the sandbox.
    ``ulimit -u`` inside the new user namespace counts the sandbox's processes only (outside
    it would count every process of the user; Seatbelt has no such namespace, so not there);
    for root, whose commands run as ``run_as`` in the host's namespace, it counts every process
    of that uid, which is why root also gets a pids cgroup where one can be made.
    Each limit is set on its own: a lower hard limit already in force simply stays. ``ulimit``
    sets the soft and the hard limit, and the command runs without capabilities, so it cannot
    raise them again. No core files (``-c 0``).
    """
    settings = [("-t", limits.cpu_s), ("-d", limits.data_bytes // 1024),
                ("-f", min(limits.file_bytes, limits.workspace_bytes) // 1024),
                ("-c", 0)]
    if processes:
        settings.append(("-u", limits.processes))
    return "".join(f"ulimit {flag} {value} 2>/dev/null; " for flag, value in settings) + 'exec "$0" -c "$1"'
