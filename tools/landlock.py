"""Landlock write rules for sandboxed commands: a second, kernel-enforced wall behind the mounts.

bubblewrap decides what a command can see; Landlock (Linux 5.13+, ABI 2 or later) decides,
whatever is mounted, where it may write: the workspace, the policy's writable directories,
``/tmp`` and ``/dev/shm``; ``/dev`` and ``/proc`` only into existing files; nothing else. So a
future mount mistake that exposes a host directory read-write is still not writable.

Landlock cannot be set up before bubblewrap (a restricted process may not mount), so this file
also runs as a small program inside the sandbox, after the uid switch and before the command:
``python -I -S landlock.py RW_PATH... -- ARGV...`` applies the rules to itself and execs
``ARGV``. It uses only the standard library (no package in this repository is imported), so it
runs from its own path with Python's isolated, site-less start; rules that cannot be applied end
the call (exit 126). ``landlock_helper.c`` is the same program in C (~1 ms of CPU per call
instead of ~20, built on first use: ``compiled_helper``); ``main`` is the fallback and the
reference. More: docs/agents.md, Sandbox.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import sys

# syscall numbers (the same on every architecture: they were added after the tables were unified)
CREATE_RULESET, ADD_RULE, RESTRICT_SELF = 444, 445, 446
CREATE_RULESET_VERSION = 1
RULE_PATH_BENEATH = 1
MIN_ABI = 2

# LANDLOCK_ACCESS_FS_* write rights, with the ABI that introduced each
WRITE_FILE, REMOVE_DIR, REMOVE_FILE = 1 << 1, 1 << 4, 1 << 5
MAKE_CHAR, MAKE_DIR, MAKE_REG, MAKE_SOCK, MAKE_FIFO, MAKE_BLOCK, MAKE_SYM = (1 << n for n in range(6, 13))
REFER, TRUNCATE, IOCTL_DEV = 1 << 13, 1 << 14, 1 << 15
ABI1_WRITE = (WRITE_FILE | REMOVE_DIR | REMOVE_FILE | MAKE_CHAR | MAKE_DIR | MAKE_REG | MAKE_SOCK
              | MAKE_FIFO | MAKE_BLOCK | MAKE_SYM)
PSEUDO_FS = ("/dev", "/proc")  # writing to existing files only
PRIVATE_RW = ("/tmp", "/dev/shm")


class _RulesetAttr(ctypes.Structure):
    _fields_ = [("handled_access_fs", ctypes.c_uint64)]


class _PathBeneath(ctypes.Structure):
    _pack_ = 1  # the kernel's struct is packed
    _fields_ = [("allowed_access", ctypes.c_uint64), ("parent_fd", ctypes.c_int32)]


def _libc() -> ctypes.CDLL:
    return ctypes.CDLL(None, use_errno=True)


def abi() -> int:
    """The kernel's Landlock ABI version (0: no Landlock here, or it is disabled at boot)."""
    if not sys.platform.startswith("linux"):
        return 0
    libc = _libc()
    libc.syscall.restype = ctypes.c_long
    version = libc.syscall(CREATE_RULESET, None, ctypes.c_size_t(0), ctypes.c_uint32(CREATE_RULESET_VERSION))
    return max(0, int(version))


def unavailable_reason() -> str | None:
    """Why this kernel cannot apply the write rules, or None (``MLXTERM_SANDBOX=no-landlock``
    turns them off in ``tools.sandbox``: this file imports nothing of the repository)."""
    version = abi()
    if version == 0:
        return "the kernel has no Landlock (Linux 5.13+ built with it and enabled in lsm=)"
    if version < MIN_ABI:
        return f"the kernel's Landlock ABI {version} forbids moving files between directories; ABI {MIN_ABI}+ is needed"
    return None


def write_rights(version: int) -> int:
    """Every write right the kernel with ABI ``version`` knows."""
    rights = ABI1_WRITE
    if version >= 2:
        rights |= REFER
    if version >= 3:
        rights |= TRUNCATE
    if version >= 5:
        rights |= IOCTL_DEV
    return rights


def restrict(writable: list[str], version: int | None = None) -> None:
    """Allow writes only beneath ``writable`` (and ``PRIVATE_RW``; existing files in
    ``PSEUDO_FS``) for this process and everything it starts; ``OSError`` when it fails."""
    version = abi() if version is None else version
    if version < MIN_ABI:
        raise OSError(f"Landlock ABI {version} is below {MIN_ABI}")
    handled = write_rights(version)
    libc = _libc()
    libc.syscall.restype = ctypes.c_long
    attr = _RulesetAttr(handled)
    ruleset = libc.syscall(CREATE_RULESET, ctypes.byref(attr), ctypes.c_size_t(ctypes.sizeof(attr)), ctypes.c_uint32(0))
    if ruleset < 0:
        raise _err("landlock_create_ruleset")
    try:
        pseudo = handled & (WRITE_FILE | TRUNCATE | IOCTL_DEV)
        rules = [(p, handled) for p in (*writable, *PRIVATE_RW)] + [(p, pseudo) for p in PSEUDO_FS]
        for path, allowed in rules:
            try:
                fd = os.open(path, os.O_PATH | os.O_CLOEXEC)
            except OSError:
                continue  # not in this sandbox: nothing to allow
            try:
                if not os.path.isdir(path):
                    allowed &= WRITE_FILE | TRUNCATE | IOCTL_DEV  # a file takes file rights only
                rule = _PathBeneath(allowed, fd)
                if libc.syscall(ADD_RULE, ctypes.c_int(ruleset), ctypes.c_int(RULE_PATH_BENEATH), ctypes.byref(rule),
                                ctypes.c_uint32(0)) < 0:
                    raise _err(f"landlock_add_rule({path})")
            finally:
                os.close(fd)
        if libc.syscall(RESTRICT_SELF, ctypes.c_int(ruleset), ctypes.c_uint32(0)) < 0:
            raise _err("landlock_restrict_self")
    finally:
        os.close(ruleset)


def _err(what: str) -> OSError:
    code = ctypes.get_errno()
    return OSError(code, f"{what}: {os.strerror(code)}")


SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "landlock_helper.c")


_UNSET = object()
_compiled: object = _UNSET


def compiled_helper() -> str | None:
    """The C helper (``landlock_helper.c``), built next to its source on first use with the
    system's C compiler (``$CC``, else ``cc``) and named by the source's hash, so an edit
    rebuilds it; None where it cannot be built (no compiler, a read-only install)."""
    global _compiled
    if _compiled is not _UNSET:
        return _compiled
    import hashlib  # here, not at the top: the Python helper's own start stays lean
    import shutil
    import subprocess

    _compiled = None
    try:
        with open(SOURCE, "rb") as f:
            digest = hashlib.sha256(f.read()).hexdigest()[:12]
        target = os.path.join(os.path.dirname(SOURCE), f"_landlock-{digest}")
        if os.access(target, os.X_OK):
            _compiled = target
            return target
        cc = shutil.which(os.environ.get("CC") or "cc")
        if cc is None:
            return None
        tmp = f"{target}.{os.getpid()}.tmp"
        done = subprocess.run([cc, "-O2", "-o", tmp, SOURCE], capture_output=True, timeout=120)
        if done.returncode != 0:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            return None
        os.chmod(tmp, 0o755)
        os.replace(tmp, target)
        _compiled = target
    except (OSError, subprocess.SubprocessError):
        return None
    return _compiled


def helper() -> list[str]:
    """The argv prefix that applies the rules (then ``RW_PATH... -- ARGV...``): the C helper
    where it can be built, else this file run by this Python (isolated, no site: ~20 ms)."""
    built = compiled_helper()
    if built is not None:
        return [built]
    return [os.path.realpath(sys.executable), "-I", "-S", os.path.abspath(__file__)]


def helper_mounts() -> list[str]:
    """What the sandbox must mount read-only for ``helper()`` to run inside it."""
    built = compiled_helper()
    if built is not None:
        return [built]
    return [os.path.abspath(__file__), sys.base_prefix, os.path.dirname(os.path.realpath(sys.executable))]


def main(argv: list[str]) -> None:
    """``RW_PATH... -- ARGV...``: restrict, then exec ARGV."""
    if "--" not in argv:
        sys.stderr.write("usage: landlock.py RW_PATH... -- ARGV...\n")
        sys.exit(2)
    split = argv.index("--")
    writable, command = argv[:split], argv[split + 1:]
    try:
        restrict(writable)
    except OSError as e:
        sys.stderr.write(f"mlxterm sandbox: Landlock rules could not be applied ({e}); not running the command\n")
        sys.exit(126)
    # an ignored signal stays ignored across exec: Python ignores SIGPIPE and SIGXFSZ at start,
    # a host under nohup SIGHUP; give the command the defaults a shell expects (`yes | head`
    # ends quietly, RLIMIT_FSIZE kills)
    for sig in signal.valid_signals():
        if sig not in (signal.SIGKILL, signal.SIGSTOP):
            with contextlib.suppress(OSError, ValueError):
                signal.signal(sig, signal.SIG_DFL)
    os.execv(command[0], command)


if __name__ == "__main__":
    main(sys.argv[1:])
