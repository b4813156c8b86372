"""Fewer OpenBLAS threads while Whisper runs, for steady speed on a busy machine.

MLX's CPU matmuls go to the OpenBLAS that ``engine.blas`` preloads, which splits a call
across all cores and makes the caller wait for every part. When other processes keep the
cores busy, one part is often descheduled and the call stalls for a whole scheduler
slice: on the 2-core VM with two busy processes beside it, a Whisper decoder step went
from 14 ms to 110-200 ms in long phases, and a 12-s clip took 10-12 s instead of 1.3-2.4 s
(one thread: steady 1.8-2.4 s). Whisper's calls are small (decoder steps) or plenty
(encoder), so one thread loses little when the machine is idle (tiny.en encoder window
0.57 -> 0.84 s, decoder step 11 -> 13 ms) and avoids the stalls.

Design notes, measurements and history: docs/engine-notes.md (threads.py).
"""

from __future__ import annotations

import ctypes
import threading
from collections.abc import Iterator
from contextlib import contextmanager

_lock = threading.Lock()
_state: dict = {"lib": None, "checked": False, "users": 0, "saved": None}


def _openblas():
    """The preloaded OpenBLAS with its thread-count functions, or None."""
    if not _state["checked"]:
        _state["checked"] = True
        from engine import blas

        path = blas.status().get("path")
        if path:
            try:
                lib = ctypes.CDLL(path)
                lib.openblas_get_num_threads.restype = ctypes.c_int
                lib.openblas_set_num_threads.argtypes = [ctypes.c_int]
                _state["lib"] = lib
            except (OSError, AttributeError):
                pass
    return _state["lib"]


@contextmanager
def blas_threads(n: int | None) -> Iterator[None]:
    """Run the body with ``n`` OpenBLAS threads (None, or no OpenBLAS loaded: unchanged)."""
    lib = _openblas() if n else None
    if lib is None:
        yield
        return
    with _lock:
        if _state["users"] == 0:
            _state["saved"] = lib.openblas_get_num_threads()
            lib.openblas_set_num_threads(n)
        _state["users"] += 1
    try:
        yield
    finally:
        with _lock:
            _state["users"] -= 1
            if _state["users"] == 0:
                lib.openblas_set_num_threads(_state["saved"])
