"""Transparent huge pages for the process heap (Linux with glibc).

Decode reads every weight once per token, and at long context every cached K/V row too. On
4 KiB pages that is a TLB miss every 4 KiB, and inside a VM each miss walks two page tables;
hardware prefetchers also stop at page boundaries. Measured on a 2-core Zen 4 VM (SmolLM2, one
process per arm): decode 1.07-1.10x on a quiet machine, 1.16-1.24x with other work running.

Design notes, measurements and history: docs/engine-notes.md (hugepages.py).
"""

from __future__ import annotations

import os
import platform
import sys
from collections.abc import Mapping, MutableMapping

from engine.settings import switch

TUNABLE = "glibc.malloc.hugetlb=1"
SWITCH = "MLXTERM_HUGEPAGES"  # engine.settings' on/off rule; off turns the re-exec off
# SWITCH's value only across our own re-exec: the tunable was appended to the user's
# GLIBC_TUNABLES (which did not have it), so the new process takes it out again.
REEXEC = "reexec"
_THP_ENABLED = "/sys/kernel/mm/transparent_hugepage/enabled"

_state: dict[str, object] = {"active": False, "reason": "not checked (mlxterm sets it up at start)"}


def thp_mode(path: str = _THP_ENABLED) -> str | None:
    """The kernel's THP mode (``always``, ``madvise`` or ``never``), or None without THP."""
    try:
        with open(path) as f:
            text = f.read()
    except OSError:
        return None
    start, end = text.find("["), text.find("]")
    return text[start + 1 : end] if 0 <= start < end else None


def decide(env: Mapping[str, str], mode: str | None, system: str, libc: str) -> tuple[bool, str]:
    """Whether to re-execute with the tunable, and why (or why not)."""
    if env.get(SWITCH) == REEXEC:
        return False, "the re-exec did not take effect"  # never loop
    if not switch(env, SWITCH):
        return False, f"off ({SWITCH}={env[SWITCH]})"
    if system != "Linux":
        return False, f"not Linux ({system})"
    if libc != "glibc":
        return False, "not glibc: the malloc tunable does not exist here"
    if mode is None:
        return False, "the kernel has no transparent huge pages"
    if mode == "never":
        return False, "transparent huge pages are off on this system (mode never)"
    if mode == "always":
        return False, "on: the system gives every heap huge pages (mode always)"
    if TUNABLE in env.get("GLIBC_TUNABLES", "").split(":"):
        return False, f"on: GLIBC_TUNABLES has {TUNABLE}"
    return True, "re-executing with the malloc tunable"


def reexec_env(env: Mapping[str, str]) -> dict[str, str]:
    """The environment for the re-exec: the tunable appended to the user's, SWITCH marked."""
    new = dict(env)
    user = env.get("GLIBC_TUNABLES", "")
    new[SWITCH] = REEXEC
    new["GLIBC_TUNABLES"] = f"{user}:{TUNABLE}" if user else TUNABLE
    return new


def restore_env(env: MutableMapping[str, str]) -> bool:
    """In the re-executed process: take SWITCH's mark and the appended tunable out of ``env``
    (the user's GLIBC_TUNABLES as it was); returns whether the tunable was there."""
    if env.get(SWITCH) != REEXEC:
        return False
    del env[SWITCH]  # it was unset or on: the same setting
    parts = env.get("GLIBC_TUNABLES", "").split(":")
    if TUNABLE not in parts:
        return False
    parts.remove(TUNABLE)
    if any(parts):
        env["GLIBC_TUNABLES"] = ":".join(parts)
    else:
        env.pop("GLIBC_TUNABLES", None)
    return True


def ensure() -> None:
    """Re-execute this command once with glibc's huge-page tunable when that would help.

    Call it first thing in a program's entry point (it replaces the process on success).
    In the re-executed process it restores the user's ``GLIBC_TUNABLES`` and records the state
    for :func:`status`.
    """
    if os.environ.get(SWITCH) == REEXEC:
        took = restore_env(os.environ)
        why = f"on: glibc heaps marked for huge pages ({TUNABLE})" if took else "the re-exec did not take effect"
        _state.update(active=took, reason=why)
        return
    go, why = decide(os.environ, thp_mode(), platform.system(), platform.libc_ver()[0])
    _state.update(active=why.startswith("on:"), reason=why)
    if not go:
        return
    argv = [sys.executable, *sys.orig_argv[1:]]
    try:
        sys.stdout.flush()
        sys.stderr.flush()
        os.execve(sys.executable, argv, reexec_env(os.environ))
    except OSError as e:  # no exec (odd sandbox): run on 4 KiB pages, say why in status()
        _state.update(active=False, reason=f"re-exec failed: {e}")


def status() -> dict[str, object]:
    """Whether this process's heaps get huge pages, the system mode, why, and how much of its
    anonymous memory is on huge pages now (MiB)."""
    kib = anon_huge_kib()
    return {"mode": thp_mode(), **_state, "anon_huge_mib": None if kib is None else round(kib / 1024, 1)}


def anon_huge_kib() -> int | None:
    """Anonymous memory of this process on huge pages now, in KiB (Linux), else None."""
    try:
        with open("/proc/self/smaps_rollup") as f:
            for line in f:
                if line.startswith("AnonHugePages:"):
                    return int(line.split()[1])
    except OSError:
        return None
    return None
