"""Bit-identity checks shared by the kernel tests: across kernel-pool thread counts and across
instruction sets.

The extension picks its instruction set once per process (``MLXTERM_KERNEL_ISA``), so the
narrower one runs in a subprocess: it calls the same results function (a module-level function
of a test module returning ``{name: np.ndarray}``), saves what it got, and every array must
equal this process's bit for bit.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

from engine import kernels

import mlx.core as mx
import numpy as np

T = TypeVar("T")

ROOT = Path(__file__).resolve().parents[1]


def on_one_and_two_threads(fn: Callable[[], T]) -> tuple[T, T]:
    """``fn()`` evaluated with the kernel pool at 1 thread, then at 2 (the caller compares the
    two); the pool's thread count is restored."""
    before = kernels.status()["threads"]
    outs = []
    try:
        for n in (1, 2):
            kernels.set_threads(n)
            out = fn()
            mx.eval(out)
            outs.append(out)
    finally:
        kernels.set_threads(before)
    return outs[0], outs[1]


def assert_same_under_isa(
    results: Callable[[], dict[str, np.ndarray]], tmp_path: Path, isa: str = "avx2"
) -> None:
    """``results()`` here and in a subprocess forced to ``isa`` give the same keys and bits."""
    here = results()
    dump = tmp_path / f"{isa}.npz"
    code = (
        "import engine, numpy as np\n"
        "from engine import kernels\n"
        f"from {results.__module__} import {results.__name__}\n"
        f"assert kernels.status()['isa'] == {isa!r}, kernels.status()\n"
        f"np.savez({str(dump)!r}, **{results.__name__}())\n"
    )
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
    env = dict(os.environ, MLXTERM_KERNEL_ISA=isa, PYTHONPATH=path)
    proc = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr
    other = np.load(dump)
    assert sorted(other.files) == sorted(here)
    for key, y in here.items():
        np.testing.assert_array_equal(y, other[key], err_msg=key)
