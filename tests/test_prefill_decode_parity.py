"""A cold prefill writes the K/V a token-by-token decode wrote, bit for bit, on every
instruction set the CPU kernels run here (issue 30, item 4): tiny random-weight llama and qwen2
models, 4-bit through the kernels, float32 and float16 K/V, 300 tokens (three 128-key blocks, so
the decode splits its keys), decoded by the compiled step after a short prompt, then replayed
cold in one forward and in chunks. Each instruction set runs in its own process
(``MLXTERM_KERNELS=<isa>`` fixes it at the first kernel call); where AMX is present the
avx512vnni run takes it and a second run switches it off. The old prompt paths (float panels,
many-query attention tiles) are checked to differ, so the comparison can fail."""

import json
import os
import subprocess
import sys
from pathlib import Path

from engine import kernels

import pytest

pytestmark = pytest.mark.skipif(not kernels.available(), reason=f"kernels off: {kernels.status()['reason']}")

TOKENS = [(37 * i + 11) % 380 for i in range(300)]


def _cpu_flags() -> set[str]:
    return kernels._cpu_flags()


def check(model_dir: str, amx: bool) -> dict:
    """Run in the child: {"isa", "prefill", "mismatches": [...], "old_paths_differ": bool}."""
    from engine.generation.generate import DecodeStep, prefill
    from engine.generation.kv_cache import make_cache
    from engine.generation.sampling import SamplingParams
    from engine.kernels import hook

    import mlx.core as mx
    import mlx.nn as nn
    from mlx_lm.utils import load_model

    kernels.set_amx(amx)
    model, _ = load_model(Path(model_dir))
    nn.quantize(model, group_size=32, bits=4)
    mx.eval(model.parameters())
    assert hook.install(model) > 0

    def decoded(prefix: int, kv_dtype):
        cache = make_cache(model, kv_dtype=kv_dtype)
        prefill(model, cache, TOKENS[:prefix], logits=False)
        step = DecodeStep(model, cache, SamplingParams(temperature=0.0), 384)
        key, recent = mx.random.key(0), mx.full((16,), -1, mx.int32)
        for t in TOKENS[prefix:]:  # teacher-forced: each step writes this token's K/V
            step(cache, mx.array([t]), key, recent)
        return cache

    def cold(chunk: int, kv_dtype):
        cache = make_cache(model, kv_dtype=kv_dtype)
        prefill(model, cache, TOKENS, chunk=chunk, logits=False)
        return cache

    def diff(a, b) -> list[int]:
        n = len(TOKENS)
        return [i for i, (x, y) in enumerate(zip(a, b, strict=True))
                if not (mx.array_equal(x.keys[..., :n, :], y.keys[..., :n, :]).item()
                        and mx.array_equal(x.values[..., :n, :], y.values[..., :n, :]).item())]

    mismatches = []
    for kv_name, kv_dtype in (("float32", None), ("float16", mx.float16)):
        for prefix in (1, 37):
            live = decoded(prefix, kv_dtype)
            for chunk in (512, 64):
                bad = diff(live, cold(chunk, kv_dtype))
                if bad:
                    mismatches.append({"kv": kv_name, "prefix": prefix, "chunk": chunk, "layers": bad})
    live = decoded(1, None)
    was = kernels.set_int8_prefill(False), kernels.set_attn_rows(False)
    try:
        old = cold(512, None)
        mx.eval([c.keys for c in old])
    finally:
        kernels.restore_int8_prefill(was[0])
        kernels.set_attn_rows(was[1])
    return {"isa": kernels.status()["isa"], "prefill": kernels.prefill_path(), "mismatches": mismatches,
            "old_paths_differ": bool(diff(live, old))}


ISAS = {
    "avx2": ("avx2", True, set()),
    "avx512vnni": ("avx512vnni", True, {"avx512_vnni", "avx512vl"}),
    "avx512vnni-noamx": ("avx512vnni", False, {"avx512_vnni", "avx512vl"}),
}
EXPECT_ISA = {"avx2": "avx2", "avx512vnni": "avx2+avx512vnni"}


@pytest.mark.parametrize("which", ["llama", "qwen2"])
@pytest.mark.parametrize("run", list(ISAS))
def test_cold_prefill_writes_the_decoded_kv(run, which, tiny_llama_dir, tiny_qwen2_dir):
    isa, amx, needs = ISAS[run]
    if not needs <= _cpu_flags():
        pytest.skip(f"CPU feature missing: no {'/'.join(sorted(needs))} here for the {isa} kernels")
    model_dir = {"llama": tiny_llama_dir, "qwen2": tiny_qwen2_dir}[which]
    code = ("import json, sys\nfrom tests.test_prefill_decode_parity import check\n"
            "print(json.dumps(check(sys.argv[1], sys.argv[2] == '1')))\n")
    root = str(Path(__file__).resolve().parents[1])
    out = subprocess.run([sys.executable, "-c", code, str(model_dir), "1" if amx else "0"],
                         env=dict(os.environ, MLXTERM_KERNELS=isa, PYTHONPATH=root), capture_output=True,
                         text=True, timeout=600, cwd=root)
    assert out.returncode == 0, out.stderr[-3000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["isa"] == EXPECT_ISA[isa]
    assert got["prefill"] in ("int8 many rows", "vnni512", "amx")
    assert got["mismatches"] == []
    assert got["old_paths_differ"]
