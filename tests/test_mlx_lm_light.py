"""engine.mlx_lm_light: the engine imports mlx_lm's model modules without the package
``__init__`` (which imports transformers and the hub client), and the full package still loads
the first time its top-level API is used."""

import subprocess
import sys

_PROBE = """
import os, sys
import engine
from engine.mlx_lm_light import full_package_loaded
assert os.environ["TRANSFORMERS_NO_ADVISORY_WARNINGS"] == "1"  # as the package's own __init__ sets it
import engine.runtime, engine.model.gguf, engine.generation.kv_cache, engine.checkpoints, engine.mlx_patches
import mlx_lm.models.qwen2, mlx_lm.sample_utils
light = (full_package_loaded(), "transformers" in sys.modules, "huggingface_hub" in sys.modules)
import mlx_lm
version = mlx_lm.__version__
from mlx_lm import stream_generate
print(light, full_package_loaded(), bool(version), callable(stream_generate))
"""


def test_engine_imports_mlx_lm_models_without_transformers():
    out = subprocess.run([sys.executable, "-c", _PROBE], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "(False, False, False) True True True"
