"""``model.weights: auto`` per backend, the backend detection, and the no-OpenBLAS note."""

from __future__ import annotations

import engine  # noqa: F401  (loads OpenBLAS before mlx)

# isort: split
import os
from types import SimpleNamespace

from engine import blas
from engine.model import weight_policy as wp

import mlx.core as mx
import pytest


@pytest.fixture
def on(monkeypatch):
    """Pretend to run on one backend: the default device, and whether CUDA is there."""
    def set_backend(name: str) -> None:
        monkeypatch.setattr(wp.mx, "default_device", lambda: mx.cpu if name == "cpu" else mx.gpu)
        monkeypatch.setattr(wp.mx, "cuda", SimpleNamespace(is_available=lambda: name == "cuda"), raising=False)
    return set_backend


@pytest.mark.parametrize("name,kernels,auto", [("cpu", False, "fp32"), ("cpu", True, "quantized"),
                                                ("metal", False, "quantized"), ("cuda", False, "quantized")])
def test_auto_weights_per_backend(on, monkeypatch, name, kernels, auto):
    """CPU: quantized through the engine's kernels when they are available, else fp32 + OpenBLAS;
    Metal/CUDA: MLX's own quantized kernels (the CPU kernels are never asked there)."""
    on(name)
    monkeypatch.setattr(wp.kernels, "available", lambda: kernels if name == "cpu" else pytest.fail("asked"))
    assert wp.backend() == name
    assert wp.choose_weights("auto") == auto
    for explicit in ("quantized", "fp32", "fp16", "bf16"):  # a profile's choice always wins
        assert wp.choose_weights(explicit) == explicit


def test_blas_note_only_on_cpu_without_openblas(on, monkeypatch):
    on("cpu")
    monkeypatch.setattr(blas, "_state", {"path": None, "reason": "OpenBLAS not found"})
    note = wp.blas_note()
    assert note and "OpenBLAS not found" in note and "slow" in note
    monkeypatch.setattr(blas, "_state", {"path": "/usr/lib/libopenblas.so.0", "reason": None})
    assert wp.blas_note() is None
    on("metal")
    monkeypatch.setattr(blas, "_state", {"path": None, "reason": "macOS uses Accelerate"})
    assert wp.blas_note() is None


def test_this_machine_runs_what_the_policy_says():
    from engine import kernels

    on_cpu = mx.default_device() == mx.cpu
    if os.environ.get("CI") == "true" and on_cpu and {"avx2", "fma"} <= kernels._cpu_flags():
        # setup.sh builds the kernels on such a machine: a missing build step fails here
        assert kernels.available(), kernels.status()
    expected = "fp32" if on_cpu and not kernels.available() else "quantized"
    assert wp.choose_weights() == expected
