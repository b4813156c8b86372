"""Huge pages for the heap (engine/hugepages.py): the decision, the re-exec, and real 2 MiB pages.

The subprocess tests run a real interpreter through ``ensure()`` and read the child's
``AnonHugePages`` from /proc: an MLX buffer of 64 MiB must land on huge pages when it is on, and
the user's ``GLIBC_TUNABLES`` must be back in the child's environment (so the shells and tools the
app starts do not inherit the setting).
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
from pathlib import Path

from engine import hugepages
from engine.hugepages import REEXEC, SWITCH, TUNABLE, decide, reexec_env, restore_env

import pytest

REPO = Path(__file__).resolve().parents[1]

CHILD = """
import json, os, sys
from engine import hugepages
hugepages.ensure()
import mlx.core as mx
a = mx.ones((64 << 20) // 4)
mx.eval(a)
print(json.dumps({"status": hugepages.status(), "tunables": os.environ.get("GLIBC_TUNABLES"),
                  "switch": os.environ.get("MLXTERM_HUGEPAGES"),
                  "blas": str(__import__("engine.blas").blas.status())}))
"""


@pytest.mark.parametrize(
    ("env", "mode", "system", "libc", "go", "why"),
    [
        ({}, "madvise", "Linux", "glibc", True, "re-executing"),
        ({SWITCH: "0"}, "madvise", "Linux", "glibc", False, "off"),
        ({SWITCH: "off"}, "madvise", "Linux", "glibc", False, "off"),
        ({}, "madvise", "Darwin", "", False, "not Linux"),
        ({}, "madvise", "Linux", "", False, "not glibc"),
        ({}, None, "Linux", "glibc", False, "no transparent huge pages"),
        ({}, "never", "Linux", "glibc", False, "mode never"),
        ({}, "always", "Linux", "glibc", False, "on: the system"),
        ({"GLIBC_TUNABLES": f"glibc.malloc.arena_max=2:{TUNABLE}"}, "madvise", "Linux", "glibc", False, "on: GLIBC"),
        # the re-exec happened but the tunable is gone: never loop
        ({SWITCH: REEXEC}, "madvise", "Linux", "glibc", False, "did not take effect"),
    ],
)
def test_decide(env, mode, system, libc, go, why):
    got, reason = decide(env, mode, system, libc)
    assert got is go
    assert why in reason


def test_reexec_env_appends_to_the_users_tunables_and_restore_takes_it_out():
    user = {"GLIBC_TUNABLES": "glibc.malloc.arena_max=2", "HOME": "/h"}
    new = reexec_env(user)
    assert new["GLIBC_TUNABLES"] == f"glibc.malloc.arena_max=2:{TUNABLE}"
    assert new[SWITCH] == REEXEC and new["HOME"] == "/h"
    assert restore_env(new) and new == user
    bare = reexec_env({})
    assert bare["GLIBC_TUNABLES"] == TUNABLE
    assert restore_env(bare) and bare == {}
    assert not restore_env({SWITCH: REEXEC, "GLIBC_TUNABLES": "glibc.malloc.arena_max=2"})


def test_thp_mode_reads_the_bracketed_word(tmp_path):
    f = tmp_path / "enabled"
    f.write_text("always [madvise] never\n")
    assert hugepages.thp_mode(str(f)) == "madvise"
    assert hugepages.thp_mode(str(tmp_path / "absent")) is None


def _usable() -> str | None:
    """Why this machine cannot show huge pages, or None."""
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return "system lacks: Linux with glibc"
    if hugepages.thp_mode() not in ("madvise", "always"):
        return f"system lacks: transparent huge pages (mode {hugepages.thp_mode()})"
    return None


def _child(env_extra: dict[str, str]) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("GLIBC_TUNABLES", SWITCH)}
    env.update(env_extra, PYTHONPATH=str(REPO))
    proc = subprocess.run([sys.executable, "-c", CHILD], env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(_usable() is not None, reason=_usable() or "")
def test_ensure_puts_mlx_buffers_on_huge_pages_and_restores_the_environment():
    out = _child({"GLIBC_TUNABLES": "glibc.malloc.arena_max=8"})
    assert out["status"]["active"] is True, out
    assert out["status"]["anon_huge_mib"] >= 32, out  # most of the 64 MiB buffer
    assert out["tunables"] == "glibc.malloc.arena_max=8"  # the user's value, not ours
    assert out["switch"] is None  # the re-exec mark is gone
    assert "MLXTERM_HUGEPAGES" not in out["blas"], out  # settings were read mid re-exec
    out = _child({})
    assert out["status"]["active"] is True and out["tunables"] is None, out


@pytest.mark.skipif(_usable() is not None, reason=_usable() or "")
def test_switch_off_keeps_small_pages():
    out = _child({SWITCH: "0"})
    assert out["status"]["active"] is False
    assert "off" in out["status"]["reason"]
    if hugepages.thp_mode() == "madvise":  # with mode always the system gives them anyway
        assert out["status"]["anon_huge_mib"] < 32, out
