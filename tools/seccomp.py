"""The seccomp filter for sandboxed commands: kernel-enforced, so a future mount mistake or a
missed capability is still no escape.

Built with libseccomp (the ``pyseccomp`` bindings over the system's ``libseccomp2``: the
library knows each architecture's syscall numbers, argument layout and the x32/i386 traps a
hand-written BPF program gets wrong) and exported as a BPF program that bubblewrap loads with
``--seccomp FD`` just before it starts the command. Everything is allowed except mounting,
new namespaces (``clone3`` answers ENOSYS so libc falls back to a checked ``clone``), reaching
other processes or the kernel (ptrace, keyrings, bpf, perf, io_uring, modules, ...), packet,
netlink and raw sockets, and calls of another architecture. The full list and why unix
sockets need no rule: docs/agents.md, Sandbox.
"""

from __future__ import annotations

import errno
import functools
import os
import socket
import tempfile

DENY = (
    "mount", "umount2", "pivot_root", "chroot", "fsopen", "fsconfig", "fsmount", "fspick", "move_mount",
    "open_tree", "mount_setattr", "unshare", "setns", "ptrace", "process_vm_readv", "process_vm_writev",
    "keyctl", "add_key", "request_key", "bpf", "perf_event_open", "io_uring_setup", "io_uring_enter",
    "io_uring_register", "kexec_load", "kexec_file_load", "init_module", "finit_module", "delete_module",
    "userfaultfd",
)
# every namespace flag clone(2) takes (CLONE_NEWTIME has the value of CSIGNAL's bit 7: clone3 only)
CLONE_NEW = (0x00020000, 0x02000000, 0x04000000, 0x08000000, 0x10000000, 0x20000000, 0x40000000)
DENIED_FAMILIES = (socket.AF_PACKET, socket.AF_NETLINK) if hasattr(socket, "AF_PACKET") else ()
SOCK_TYPE_MASK = 0xF  # the type without SOCK_NONBLOCK / SOCK_CLOEXEC
RAW_TYPES = (socket.SOCK_RAW, 10)  # 10: SOCK_PACKET


class SeccompUnavailable(Exception):
    """The filter cannot be built here (no libseccomp, an unknown architecture)."""


@functools.lru_cache(maxsize=1)
def program() -> bytes:
    """The BPF program (built once per process); ``SeccompUnavailable`` says why not."""
    try:
        import pyseccomp as sc
    except (ImportError, OSError, RuntimeError) as e:  # OSError/RuntimeError: no libseccomp.so
        raise SeccompUnavailable(f"libseccomp's Python bindings are not usable ({e}); "
                                 "install libseccomp2 and `pip install pyseccomp`") from None
    try:
        f = sc.SyscallFilter(sc.ALLOW)
        eperm = sc.ERRNO(errno.EPERM)
        for name in DENY:
            try:
                f.add_rule(eperm, name)
            except (ValueError, OSError, RuntimeError):
                continue  # a syscall this architecture or libseccomp does not know: nothing to deny
        for flag in CLONE_NEW:
            f.add_rule(eperm, "clone", sc.Arg(0, sc.MASKED_EQ, flag, flag))
        f.add_rule(sc.ERRNO(errno.ENOSYS), "clone3")
        for family in DENIED_FAMILIES:
            f.add_rule(sc.ERRNO(errno.EAFNOSUPPORT), "socket", sc.Arg(0, sc.EQ, family))
        for kind in RAW_TYPES:
            f.add_rule(eperm, "socket", sc.Arg(1, sc.MASKED_EQ, SOCK_TYPE_MASK, kind))
        with tempfile.TemporaryFile() as out:
            f.export_bpf(out)
            out.seek(0)
            return out.read()
    except (ValueError, OSError, RuntimeError) as e:
        raise SeccompUnavailable(f"libseccomp could not build the filter: {e}") from None


def unavailable_reason() -> str | None:
    """Why no filter can be made here, or None when ``program()`` works."""
    try:
        program()
    except SeccompUnavailable as e:
        return str(e)
    return None


def program_fd() -> int:
    """A fresh read-only descriptor holding ``program()`` at offset 0, for ``bwrap --seccomp FD``
    (bwrap reads it to the end); the caller closes it once bwrap has started."""
    data = program()
    fd = os.memfd_create("mlxterm-seccomp", os.MFD_CLOEXEC) if hasattr(os, "memfd_create") else None
    if fd is None:
        r, w = os.pipe()  # the program is a few hundred bytes: far below a pipe's buffer
        os.write(w, data)
        os.close(w)
        return r
    os.write(fd, data)
    os.lseek(fd, 0, os.SEEK_SET)
    return fd
