"""Let finished threads leave the OS before the interpreter finalizes.

``Thread.join`` returns once the Python side of a thread is done, but the OS thread still runs
its C++ ``thread_local`` destructors after that. MLX's Python binding keeps a per-thread random
key sequence (made by the first draw without an explicit key) whose destructor takes the GIL to
drop a Python reference, unless the thread ended with ``mx.clear_streams()`` (the engine and
dictation threads do; asyncio's executor workers and other helper threads cannot). If the main
thread has begun finalizing meanwhile, taking the GIL ends the thread with ``pthread_exit`` from
inside that ``noexcept`` destructor: ``std::terminate``, "terminate called without an active
exception", exit 134. That is how quitting the TUI under load aborted. So the exit paths take a
snapshot of the threads before they close them and wait, with the GIL released, for the OS
threads of the finished ones to be gone before they return to the interpreter.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Iterable


def wait_for_os_exit(threads: Iterable[threading.Thread], timeout: float = 5.0) -> list[int]:
    """Wait until the OS threads of the finished threads among ``threads`` have exited.

    Threads still running are left alone (waiting on them could take forever). Returns the
    native ids still present when ``timeout`` ran out. Linux only (``/proc/self/task``):
    elsewhere it returns at once."""
    if not os.path.isdir("/proc/self/task"):
        return []
    ids = [t.native_id for t in threads if t.native_id is not None and not t.is_alive()]
    deadline = time.monotonic() + timeout
    while True:
        left = [tid for tid in ids if os.path.exists(f"/proc/self/task/{tid}")]
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.002)  # releases the GIL: the exiting threads' destructors may need it
