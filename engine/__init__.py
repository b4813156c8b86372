"""mlxterm's headless engine: models, generation, KV checkpoints, speech.

Importing any part of the engine first loads OpenBLAS (see ``engine.blas``) so that MLX's
CPU backend binds to it; this must happen before ``mlx`` is imported anywhere. It also registers
mlx_lm without its package ``__init__`` (``engine.mlx_lm_light``: no transformers import).
"""

from engine import blas as _blas
from engine import mlx_lm_light as _mlx_lm_light

_blas.preload()
_mlx_lm_light.install()
