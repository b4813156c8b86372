"""engine's subpackages import one way: the q8 row format (engine.kvrows) and the mlx_lm patches
(engine.mlx_patches) sit below kernels and generation, and checkpoints read caches through a
protocol, so neither kernels nor checkpoints pull in engine.generation."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("module", ["engine.kernels.attention", "engine.kernels.hook", "engine.checkpoints",
                                    "engine.kvrows", "engine.mlx_patches"])
def test_lower_layers_do_not_import_generation(module):
    code = f"import json, sys, {module}\nprint(json.dumps(sorted(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    loaded = json.loads(out.stdout)
    assert not [m for m in loaded if m.startswith("engine.generation")], module


def test_generation_caches_declare_their_checkpoint_kind():
    from engine.checkpoints import snapshot
    from engine.generation.kv_cache import StaticKVCache, WindowKVCache

    assert snapshot.layout([StaticKVCache(), WindowKVCache(8)]) == [("StaticKVCache", None), ("WindowKVCache", 8)]
    with pytest.raises(snapshot.UnsupportedCache):
        snapshot.layout([object()])
