"""Load a fast BLAS into the process before MLX's CPU backend binds its symbols.

The MLX CPU wheel links a slow reference BLAS. Loading OpenBLAS globally *before*
``import mlx`` lets the dynamic linker resolve ``sgemm`` & co. to OpenBLAS, which makes
fp32 matmul an order of magnitude faster. On macOS (Accelerate) this is a no-op.
"""

from __future__ import annotations

import ctypes
import glob
import os
import sys

from engine.settings import SettingsError, current

_CANDIDATES = (
    "/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0",
    "/usr/lib/aarch64-linux-gnu/openblas-pthread/libopenblas.so.0",
    "/usr/lib/x86_64-linux-gnu/libopenblas.so.0",
    "/usr/lib/aarch64-linux-gnu/libopenblas.so.0",
)

_state: dict[str, str | None] = {"path": None, "reason": None}


def preload() -> str | None:
    """Load OpenBLAS with RTLD_GLOBAL once; return its path, or None (and why, via status())."""
    if _state["path"] or _state["reason"]:
        return _state["path"]
    if sys.platform == "darwin":
        _state["reason"] = "macOS uses Accelerate"
        return None
    try:
        wanted = current().blas
    except SettingsError as e:  # reported again, as one line, where the caller reads settings
        _state["reason"] = str(e)
        return None
    if not wanted.enabled:
        _state["reason"] = "turned off by MLXTERM_OPENBLAS=off"
        return None
    if "mlx.core" in sys.modules:
        _state["reason"] = "mlx was imported before OpenBLAS could be loaded"
        return None
    paths = [wanted.path] if wanted.path else []
    paths += list(_CANDIDATES) + sorted(glob.glob("/usr/lib/*/libopenblas*.so*"))
    # One OpenBLAS thread unless the user asks for more. Debian's OpenBLAS 0.3.21 (pthreads)
    # loses wake-ups between its thread server and a worker going to sleep: a caller then spins
    # in exec_blas_async_wait forever, or a fork() (its atfork shutdown joins the workers) hangs.
    # Both hung test runs here. With one thread there is no server. The engine's hot paths run
    # on the CPU kernels' own pool; fp32 matmuls (fp32 profiles, the no-kernels fallback) use
    # one core (dictation already transcribes on one, engine.speech.threads).
    os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
    for path in paths:
        if os.path.exists(path):
            try:
                ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)
            except OSError:
                continue
            _state["path"] = path
            return path
    _state["reason"] = "OpenBLAS not found (apt-get install libopenblas0-pthread)"
    return None


def status() -> dict[str, str | None]:
    """Which BLAS was loaded, or the reason none was."""
    return dict(_state)
