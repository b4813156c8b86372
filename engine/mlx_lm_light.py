"""Import mlx_lm's model modules without running its package ``__init__``.

``mlx_lm/__init__.py`` imports its converter, generator and hub loader, and through them
``transformers`` and ``huggingface_hub``: ~1-2 s of a model load here (Qwen 1.5B: 4.0 s, half of it
that import) and a hub client in the process, for code the engine never calls (it uses
``mlx_lm.models.*`` and ``mlx_lm.sample_utils``). ``install`` puts the package in
``sys.modules`` unexecuted -- its ``__path__`` set, so ``import mlx_lm.models.qwen2`` finds the
submodules -- and runs the real ``__init__`` the first time a top-level name is asked for
(``from mlx_lm import stream_generate``, as the stock-mlx_lm bench arm does), so nothing that
uses the full package breaks.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from types import ModuleType


def install() -> bool:
    """Register the unexecuted package (once, before anything imported mlx_lm). Returns whether
    it did (False: already imported, or mlx_lm is not installed)."""
    if "mlx_lm" in sys.modules:
        return False
    spec = importlib.util.find_spec("mlx_lm")
    if spec is None or spec.loader is None or not spec.submodule_search_locations:
        return False
    package = importlib.util.module_from_spec(spec)
    # What the package's __init__ sets first: submodules that import transformers themselves
    # (mlx_lm.utils, for an MLX model directory) must not print its advisory warnings either.
    os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
    state = {"loaded": False}

    def __getattr__(name: str):
        # Public names (and the version) load the package; other dunder lookups (``inspect``'s
        # and pickling's probes) must not run it.
        if state["loaded"] or (name.startswith("__") and name not in ("__version__", "__all__")):
            raise AttributeError(f"module 'mlx_lm' has no attribute {name!r}")
        state["loaded"] = True
        spec.loader.exec_module(package)
        return getattr(package, name)

    package.__getattr__ = __getattr__
    sys.modules["mlx_lm"] = package
    return True


def full_package_loaded() -> bool:
    """Whether mlx_lm's own ``__init__`` has run in this process (tests)."""
    package: ModuleType | None = sys.modules.get("mlx_lm")
    return package is not None and "convert" in vars(package)
