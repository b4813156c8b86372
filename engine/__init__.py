"""mlxterm's headless engine: models, generation, KV checkpoints, speech.

Importing any part of the engine first loads OpenBLAS (see ``engine.blas``) so that MLX's
CPU backend binds to it; this must happen before ``mlx`` is imported anywhere.
"""

from engine import blas as _blas

_blas.preload()
