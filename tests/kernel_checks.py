"""Bit-identity checks shared by the kernel tests: across kernel-pool thread counts and across
instruction sets.

The extension picks its instruction set once per process (``MLXTERM_KERNELS``, passed to its configure()), so the
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
    env = dict(os.environ, MLXTERM_KERNELS=isa, PYTHONPATH=path)
    proc = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr
    other = np.load(dump)
    assert sorted(other.files) == sorted(here)
    for key, y in here.items():
        np.testing.assert_array_equal(y, other[key], err_msg=key)


def int_activation_reference(x: np.ndarray, wq, s, b, gs: int, bits: int, qmax: int = 127) -> np.ndarray:
    """float64 out[m, n] of the kernels' integer-activation scheme: each 32-block of x rounded to
    integers in [-qmax, qmax] (prepare_x's float32 rounding emulated; qmax 127: int8, 16256: the
    16-bit activations), exact block dot products with the weights' integers, then the scales
    and the affine biases on the sums of the *rounded* activations."""
    x = x.astype(np.float32)
    M, K = x.shape
    N = wq.shape[0]
    blocks = x.reshape(M, K // 32, 32)
    amax = np.abs(blocks).max(axis=2)
    d = (amax / np.float32(qmax)).astype(np.float32)
    with np.errstate(divide="ignore"):
        inv = np.where(amax > 0, np.float32(qmax) / amax, np.float32(0.0)).astype(np.float32)
    q = np.rint((blocks * inv[:, :, None]).astype(np.float32)).astype(np.int64)  # round to even
    assert np.abs(q).max() <= qmax
    ints = np.array(mx.dequantize(wq, mx.ones_like(s), mx.zeros_like(b), group_size=gs, bits=bits))
    ints = ints.astype(np.int64).reshape(N, K // 32, 32)
    dots = np.einsum("mbk,nbk->mnb", q, ints).astype(np.float64)  # exact block dot products
    scale = np.repeat(np.array(s, dtype=np.float64), gs // 32, axis=1)  # (N, blocks)
    out = np.einsum("mnb,nb,mb->mn", dots, scale, d.astype(np.float64))
    gsum = (d.astype(np.float64) * q.sum(axis=2)).reshape(M, K // gs, gs // 32).sum(axis=2)
    return out + gsum @ np.array(b, dtype=np.float64).T


def assert_rows_are_solo_rows(x: mx.array, wq, s, b, gs: int, bits: int, ref: np.ndarray) -> list[mx.array]:
    """Each of x's 16 rows alone is within 2e-6 of ``ref`` (relative), and every prefix of 2..15
    rows gives each row its solo bits. Returns the solo rows."""
    solo = [kernels.quantized_matmul(x[i : i + 1], wq, s, b, gs, bits)[0] for i in range(16)]
    mx.eval(solo)
    for i in range(16):
        err = np.abs(np.array(solo[i], dtype=np.float64) - ref[i]).max() / np.abs(ref[i]).max()
        assert err < 2e-6, (i, err)
    for m in range(2, 16):
        y = kernels.quantized_matmul(x[:m], wq, s, b, gs, bits)
        for i in range(m):
            assert mx.array_equal(y[i], solo[i]).item(), (m, i)
    return solo


def blas_rows_depend_on_count() -> bool:
    """True when an fp32 matmul here (MLX on OpenBLAS) gives a row other bits inside a 70-row
    product than inside a 16-row one: OpenBLAS's sgemm kernels for this CPU block the rows by
    count (its AVX2 kernels do; on the AVX-512 machines measured they did not). fp32 forwards of
    different lengths then differ in the last bits whatever the engine does."""
    x = mx.array(np.random.default_rng(0).standard_normal((70, 64)).astype(np.float32))
    w = mx.array(np.random.default_rng(1).standard_normal((384, 64)).astype(np.float32))
    return not mx.array_equal((x @ w.T)[-1], (x[-16:] @ w.T)[-1]).item()


BLAS_ROWS_REASON = ("CPU feature missing: this CPU's OpenBLAS fp32 sgemm gives a row other bits by row "
                    "count (its AVX2 kernels), so fp32 forwards of other lengths differ in the last bits")

