"""The one place the engine patches mlx_lm: the attention its model modules call.

mlx_lm's llama, qwen2 and gemma3_text modules import ``scaled_dot_product_attention`` by name,
so routing their attention means rebinding that name in each module. engine.kernels.attention
installs its kernel attention here; speculation's row-exact verify wraps whatever is installed.
(The kernel hook's per-model class swaps are in engine.kernels.hook; they patch no module.)
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from types import ModuleType

from mlx_lm.models import base

MODULES = ("llama", "qwen2", "gemma3_text")  # mlx_lm model modules routed by name
ORIGINAL = base.scaled_dot_product_attention  # mlx_lm's own attention


def modules() -> list[ModuleType]:
    """The mlx_lm model modules whose attention the engine routes."""
    return [importlib.import_module(f"mlx_lm.models.{name}") for name in MODULES]


def routes(module_name: str) -> bool:
    """True when models of mlx_lm module ``module_name`` (dotted or not) call the routed attention."""
    return module_name.rsplit(".", 1)[-1] in MODULES


def install_attention(fn: Callable) -> None:
    """Every routed module calls ``fn`` as its attention (``ORIGINAL``: mlx_lm's again)."""
    for mod in modules():
        mod.scaled_dot_product_attention = fn


def wrap_attention(wrap: Callable[[Callable], Callable], done: Callable[[Callable], bool]) -> None:
    """Replace each routed module's attention ``f`` with ``wrap(f)`` unless ``done(f)``."""
    for mod in modules():
        if not done(mod.scaled_dot_product_attention):
            mod.scaled_dot_product_attention = wrap(mod.scaled_dot_product_attention)
