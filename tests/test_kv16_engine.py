"""float16 live KV on the CPU (``kv_cache.format: fp16``, the schema's default): the engine's
prompt cache makes float16 caches when the fused attention kernel reads them, its checkpoint
fingerprint says so (checkpoints of float32 caches miss), a checkpoint written by one process
restores bit for bit in another, and everything stays float32 where the kernels are off or
the profile asks for fp32."""

from __future__ import annotations

import engine  # noqa: F401  (loads OpenBLAS before mlx)

# isort: split
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

from engine import kernels
from engine.checkpoints import fingerprint_for_profile
from engine.generation.batch import prefill_together
from engine.generation.generate import prefill
from engine.kernels import hook
from engine.model.loader import load_bundle
from engine.profiles import load_profile
from engine.serving.prompt_cache import PromptCache

import mlx.core as mx
import numpy as np
import pytest

from tests.test_checkpoints_helpers import continuation, tokens
from tests.tiny_models import write_profile

REPO = Path(__file__).resolve().parents[1]
needs_kernels = pytest.mark.skipif(not kernels.available(), reason=f"kernels off: {kernels.status()['reason']}")


def _profile(tmp_path: Path, model_dir: Path, fmt: str = "fp16"):
    return load_profile(str(write_profile(
        tmp_path / f"kv-{fmt}.yaml", model_dir, kv_cache={"format": fmt}, model={"weights": "quantized"},
        cache={"ssd_dir": str(tmp_path / "ssd")})))


def _routed(model_dir: Path):
    return load_bundle(model_dir, "quantized").model  # the loader routes it when the kernels exist


@needs_kernels
def test_fp16_profile_makes_float16_caches_and_says_so_in_the_fingerprint(tmp_path, tiny_llama_dir):
    profile = _profile(tmp_path, tiny_llama_dir)
    pc = PromptCache(_routed(tiny_llama_dir), profile)
    try:
        assert pc.kv_format == "fp16"
        assert pc.store.fingerprint.kv_format == "fp16"
        cache = pc.new_cache()
        prefill(pc.model, cache, tokens(40, seed=1))
        assert {c.keys.dtype for c in cache} == {c.values.dtype for c in cache} == {mx.float16}
        # the fingerprint of the profile without the model (``mlxterm cache``) agrees
        assert fingerprint_for_profile(profile) == pc.store.fingerprint
    finally:
        pc.close(0)


@needs_kernels
def test_a_continued_float16_checkpoint_hands_its_buffers_over(tmp_path, tiny_llama_dir):
    """The engine's prompt cache continues a float16 RAM checkpoint in its own buffers (once
    its SSD copy is written: until then a continuation copies)."""
    pc = PromptCache(_routed(tiny_llama_dir), _profile(tmp_path, tiny_llama_dir))
    try:
        toks = tokens(48, seed=5)
        cache = pc.new_cache()
        prefill(pc.model, cache, toks[:30])
        cid = pc.store.release(toks[:30], cache)
        del cache
        base = [layer.base for layer in pc.store._entries[cid].snapshot.layers]
        assert pc.flush(timeout=60).durable
        got = pc.acquire(toks)
        assert (got.source, got.cached_tokens) == ("ram", 30)
        assert all(c.keys is k and k.dtype == mx.float16 for c, (k, _) in zip(got.cache, base, strict=True))
        del base
        warm = pc.new_cache()
        prefill(pc.model, warm, toks[:30])
        assert continuation(pc.model, got.cache, toks[30:], toks)[0] == continuation(pc.model, warm, toks[30:], toks)[0]
    finally:
        pc.close()


@needs_kernels
def test_requests_prefilled_together_keep_their_float16_kv(tmp_path, tiny_llama_dir):
    """The scheduler's joint prefill of newcomers (``prefill_together``) stores K/V as the rows'
    own caches do: float16, the history as it was and the chunk within rounding of the row's
    solo prefill (on this tiny model the kernels' results at 3 x 24 rows differ from 24 rows in
    the last bits; on SmolLM2 they are equal).
    It once built float32 caches, so after any joint prefill the rows' batch, their
    checkpoints and every later request restored from those held float32 K/V (twice the bytes
    to copy at a follow-up turn's restore)."""
    pc = PromptCache(_routed(tiny_llama_dir), _profile(tmp_path, tiny_llama_dir))
    try:
        head = tokens(40, seed=1)
        chunks = [tokens(24, seed=s) for s in (2, 3, 4)]
        rows = [pc.new_cache() for _ in chunks]
        for cache in rows:
            prefill(pc.model, cache, head, logits=False)
        joint, _ = prefill_together(pc.model, rows, chunks)
        for chunk, got in zip(chunks, joint, strict=True):
            solo = pc.new_cache()
            prefill(pc.model, solo, head, logits=False)
            prefill(pc.model, solo, chunk, logits=False)
            for g, s in zip(got, solo, strict=True):
                assert g.offset == s.offset == 64 and g.dtype == mx.float16
                for a, b in ((g.keys, s.keys), (g.values, s.values)):
                    assert a.dtype == b.dtype == mx.float16
                    a, b = np.array(a[..., :64, :]), np.array(b[..., :64, :])
                    assert np.array_equal(a[..., :40, :], b[..., :40, :])
                    np.testing.assert_allclose(a, b, rtol=4e-3, atol=4e-3)
    finally:
        pc.close()


@pytest.mark.parametrize("why", ["profile-fp32", "kernels-off", "unrouted-model"])
def test_float32_caches_where_fp16_kv_does_not_apply(tmp_path, tiny_llama_dir, monkeypatch, why):
    model = _routed(tiny_llama_dir)
    profile = _profile(tmp_path, tiny_llama_dir, "fp32" if why == "profile-fp32" else "fp16")
    if why == "kernels-off":
        monkeypatch.setattr(kernels, "available", lambda: False)
    elif why == "unrouted-model":
        hook.uninstall(model)
    pc = PromptCache(model, profile)
    try:
        assert pc.kv_format == "dense" and pc.store.fingerprint.kv_format == "dense"
        cache = pc.new_cache()
        prefill(model, cache, tokens(20, seed=2))
        assert {c.keys.dtype for c in cache} == {mx.float32}
    finally:
        pc.close(0)


WRITER = textwrap.dedent(
    """
    import engine
    import json, sys
    from engine.generation.generate import prefill
    from engine.model.loader import load_bundle
    from engine.profiles import load_profile
    from engine.serving.prompt_cache import PromptCache

    profile = load_profile(sys.argv[1])
    toks = json.loads(sys.argv[2])
    pc = PromptCache(load_bundle(profile.model.source, "quantized").model, profile)
    cache = pc.new_cache()
    prefill(pc.model, cache, toks)
    pc.release(toks, cache)
    assert pc.close().durable
    print(pc.kv_format)
    """
)


def _restores_bit_for_bit_in_another_process(profile, model_dir: Path, kv_format: str, dtype) -> None:
    """A checkpoint written by another process under ``profile`` restores caches of ``dtype``
    equal to a fresh prefill's, and the continuation is the same."""
    toks = tokens(90, seed=3)
    done = subprocess.run([sys.executable, "-c", WRITER, str(profile.path), json.dumps(toks)],
                          cwd=REPO, capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": str(REPO)})
    assert done.returncode == 0, done.stderr
    assert done.stdout.split()[-1] == kv_format
    model = _routed(model_dir)
    pc = PromptCache(model, profile)
    try:
        got = pc.acquire(toks + [7, 8])
        assert got.source == "ssd" and got.cached_tokens == len(toks)
        assert {c.keys.dtype for c in got.cache} == {dtype}
        warm = pc.new_cache()
        prefill(model, warm, toks)
        for a, b in zip(got.cache, warm, strict=True):
            assert np.array_equal(np.array(a.keys[..., : len(toks), :]), np.array(b.keys[..., : len(toks), :]))
            assert np.array_equal(np.array(a.values[..., : len(toks), :]), np.array(b.values[..., : len(toks), :]))
        t1, lp1 = continuation(model, got.cache, [7, 8], toks)
        t2, lp2 = continuation(model, warm, [7, 8], toks)
        assert t1 == t2 and np.array_equal(lp1, lp2)
    finally:
        pc.close(0)


@needs_kernels
def test_fp16_checkpoint_from_another_process_restores_bit_for_bit(tmp_path, tiny_llama_dir):
    profile = _profile(tmp_path, tiny_llama_dir)
    _restores_bit_for_bit_in_another_process(profile, tiny_llama_dir, "fp16", mx.float16)


@needs_kernels
def test_checkpoints_of_float32_caches_miss_under_fp16(tmp_path, tiny_llama_dir):
    model = _routed(tiny_llama_dir)
    toks = tokens(30, seed=4)
    old = PromptCache(model, _profile(tmp_path, tiny_llama_dir, "fp32"))  # same ssd dir
    cache = old.new_cache()
    prefill(model, cache, toks)
    old.release(toks, cache)
    assert old.close().durable
    new = PromptCache(model, _profile(tmp_path, tiny_llama_dir, "fp16"))
    try:
        got = new.acquire(toks + [5])
        assert got.source == "none" and got.cached_tokens == 0
    finally:
        new.close(0)


@needs_kernels
@pytest.mark.parametrize("storage", ["fp16", "q8"])
def test_fp16_live_kv_with_other_checkpoint_storage(tmp_path, tiny_llama_dir, storage):
    profile = load_profile(str(write_profile(
        tmp_path / "kv.yaml", tiny_llama_dir, model={"weights": "quantized"},
        kv_cache={"format": "fp16", "checkpoint_format": storage}, cache={"ssd_dir": str(tmp_path / "ssd")})))
    model = _routed(tiny_llama_dir)
    toks = tokens(70, seed=5)
    first = PromptCache(model, profile)
    cache = first.new_cache()
    prefill(model, cache, toks)
    first.release(toks, cache)
    assert first.close().durable
    second = PromptCache(model, profile)  # empty RAM tier: the SSD file
    try:
        got = second.acquire(toks + [9])
        assert got.source == "ssd" and got.cached_tokens == len(toks)
        for a, b in zip(got.cache, cache, strict=True):
            assert a.keys.dtype == mx.float16
            ka, kb = np.array(a.keys[..., : len(toks), :], np.float32), np.array(b.keys[..., : len(toks), :], np.float32)
            if storage == "fp16":
                assert np.array_equal(ka, kb)
            else:  # 8-bit groups: within a step of the group's range
                assert np.abs(ka - kb).max() <= 0.02 * np.abs(kb).max()
    finally:
        second.close(0)


# -- live 8-bit KV (kv_cache.format: q8 -> "q8hrows-g<group>") --------------------------------
@pytest.fixture(scope="module")
def wide_head_llama_dir(tmp_path_factory):
    """The tiny llama with head dim 32 (the tiny models' 16 is below the kernel's groups)."""
    from tests.tiny_models import LLAMA_CONFIG, make_model_dir

    return make_model_dir(tmp_path_factory.mktemp("tiny-llama-d32"),
                          {**LLAMA_CONFIG, "num_attention_heads": 2, "num_key_value_heads": 1})


def _q8_profile(tmp_path: Path, model_dir: Path, group: int = 32):
    return load_profile(str(write_profile(
        tmp_path / f"kv-q8-{group}.yaml", model_dir, kv_cache={"format": "q8", "group_size": group},
        model={"weights": "quantized"}, cache={"ssd_dir": str(tmp_path / "ssd")})))


@needs_kernels
def test_q8_profile_makes_8bit_row_caches_and_says_so_in_the_fingerprint(tmp_path, wide_head_llama_dir):
    profile = _q8_profile(tmp_path, wide_head_llama_dir)
    pc = PromptCache(_routed(wide_head_llama_dir), profile)
    try:
        assert pc.kv_format == "q8hrows-g32" == pc.store.fingerprint.kv_format
        cache = pc.new_cache()
        prefill(pc.model, cache, tokens(40, seed=1))
        assert {c.keys.dtype for c in cache} == {mx.uint8}
        assert cache[0].keys.shape[-1] == 32 + 4  # 32 int8 values + one float32 scale
        assert fingerprint_for_profile(profile) == pc.store.fingerprint
    finally:
        pc.close(0)


@needs_kernels
def test_q8_falls_back_to_fp16_when_the_group_does_not_fit_the_head(tmp_path, tiny_llama_dir):
    pc = PromptCache(_routed(tiny_llama_dir), _q8_profile(tmp_path, tiny_llama_dir))  # head dim 16
    try:
        assert pc.kv_format == "fp16"
    finally:
        pc.close(0)


@needs_kernels
def test_q8_checkpoint_from_another_process_restores_bit_for_bit(tmp_path, wide_head_llama_dir):
    profile = _q8_profile(tmp_path, wide_head_llama_dir)
    _restores_bit_for_bit_in_another_process(profile, wide_head_llama_dir, "q8hrows-g32", mx.uint8)
