"""Exiting right after a thread that ran MLX work: the process must end with 0, not abort.

A finished thread's C++ ``thread_local`` destructors run after ``Thread.join`` returns, and the
MLX binding's per-thread state takes the GIL in its destructor; once the interpreter is
finalizing that aborts the process ("terminate called without an active exception", exit 134:
quitting the TUI under load). app.threads waits for those OS threads before the exit paths
return. The subprocess stretches the race so it always happens: a destructor registered after
MLX's (so run before it) sleeps 0.2 s in the thread's exit path, and the interpreter's own
teardown takes 0.5 s with the GIL released."""

from __future__ import annotations

import ctypes
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.skipif(
    not sys.platform.startswith("linux") or not hasattr(ctypes.CDLL(None), "__cxa_thread_atexit_impl"),
    reason="needs glibc's thread_local destructors and /proc/self/task",
)

SCRIPT = """
import ctypes, sys, threading, time
import engine
import mlx.core as mx
from app.threads import wait_for_os_exit

libc = ctypes.CDLL(None)
usleep = ctypes.cast(libc.usleep, ctypes.c_void_p).value

def work():
    mx.eval(mx.random.normal((4,)))  # MLX's per-thread key sequence: a thread_local
    # dso_symbol: an address inside libc (a null one reads glibc's unset per-thread cache)
    libc.__cxa_thread_atexit_impl(ctypes.c_void_p(usleep), ctypes.c_void_p(200_000), ctypes.c_void_p(usleep))

class SlowTeardown:
    def __del__(self):
        time.sleep(0.5)

t = threading.Thread(target=work)
t.start()
t.join()
if sys.argv[1] == "wait":
    assert wait_for_os_exit([t]) == []
keep = SlowTeardown()  # deleted while the interpreter finalizes
"""


def _run(mode: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", SCRIPT, mode], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)


def test_exit_after_an_mlx_thread_waits_for_it_to_leave_the_os():
    control = _run("no-wait")
    if control.returncode == 0:
        pytest.skip("this MLX no longer takes the GIL in a thread-exit destructor")
    assert control.returncode == -6 and "terminate called" in control.stderr, control.stderr
    fixed = _run("wait")
    assert fixed.returncode == 0, fixed.stderr
    assert "terminate" not in fixed.stderr
