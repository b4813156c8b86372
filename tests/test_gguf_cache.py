"""Converted-GGUF cache: a second load reads the converted arrays instead of converting, with
the same logits; a changed GGUF, a damaged entry or a converter bump reconverts (one warning
for damage); the cache can be turned off; writes leave no partial file."""

import engine  # noqa: F401  (loads OpenBLAS before mlx is imported)

# isort: split
import logging
import os

from engine.model.gguf import cache as gguf_cache
from engine.model.gguf import load_gguf
from engine.model.gguf import loader as gguf_loader

import numpy as np
import pytest

from tests.test_gguf_loader import PROMPT, run_tokens, write_tiny


@pytest.fixture(autouse=True)
def _cache_on(monkeypatch):
    monkeypatch.setenv("MLXTERM_GGUF_CACHE", "1")


def _entries():
    d = gguf_cache.cache_dir() / "gguf"
    return sorted(p.name for p in d.glob("*")) if d.exists() else []


def _no_convert(monkeypatch):
    def fail(*a, **k):
        raise AssertionError("converted although the cache holds this file")

    monkeypatch.setattr(gguf_loader, "_convert", fail)


@pytest.mark.parametrize("arch", ["llama", "qwen2", "gemma3"])
def test_second_load_reads_the_cache_with_identical_logits(tmp_path, arch, monkeypatch):
    path, _ = write_tiny(tmp_path, arch, quantize=True)
    cold = load_gguf(path, "quantized")
    assert len(_entries()) == 1 and _entries()[0].endswith(".safetensors")
    want = run_tokens(cold.model, PROMPT, 3)
    with monkeypatch.context() as m:
        _no_convert(m)
        warm = load_gguf(path, "quantized")
    np.testing.assert_array_equal(run_tokens(warm.model, PROMPT, 3), want)
    assert type(warm.model.layers[0].self_attn.q_proj).__name__ == type(cold.model.layers[0].self_attn.q_proj).__name__
    assert warm.model.layers[0].self_attn.q_proj.bits == cold.model.layers[0].self_attn.q_proj.bits


def test_dense_formats_are_not_cached(tmp_path):
    path, _ = write_tiny(tmp_path, "llama", quantize=True)
    load_gguf(path, "fp32")
    assert _entries() == []


def test_changed_gguf_reconverts_and_replaces_its_entry(tmp_path):
    path, _ = write_tiny(tmp_path, "qwen2", quantize=True)
    load_gguf(path, "quantized")
    first = _entries()
    st = path.stat()
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))
    load_gguf(path, "quantized")
    second = _entries()
    assert len(second) == 1 and second != first  # new key, old entry removed


@pytest.mark.parametrize("damage", ["truncate", "garbage", "wrong-tensors"])
def test_damaged_entry_is_rebuilt_with_one_warning(tmp_path, damage, caplog):
    path, _ = write_tiny(tmp_path, "llama", quantize=True)
    want = run_tokens(load_gguf(path, "quantized").model, PROMPT, 2)
    entry = gguf_cache.entry_path(path, gguf_cache.mode("quantized"))
    assert entry.exists()
    data = entry.read_bytes()
    if damage == "truncate":
        entry.write_bytes(data[: len(data) // 2])
    elif damage == "garbage":
        entry.write_bytes(b"\x00" * 64)
    else:  # a readable file whose tensors do not fit this model
        other, _ = write_tiny(tmp_path / "o", "qwen2", quantize=True)
        load_gguf(other, "quantized")
        moved = [p for p in entry.parent.glob("qwen2*")][0]
        os.replace(moved, entry)
    with caplog.at_level(logging.WARNING, logger="engine.model.gguf.cache"):
        lm = load_gguf(path, "quantized")
    warnings = [r for r in caplog.records if r.name == "engine.model.gguf.cache"]
    assert len(warnings) == 1 and str(entry) in warnings[0].getMessage()
    np.testing.assert_array_equal(run_tokens(lm.model, PROMPT, 2), want)
    assert entry.exists() and entry.stat().st_size == len(data)  # rewritten whole


def test_converter_version_bump_misses(tmp_path, monkeypatch):
    path, _ = write_tiny(tmp_path, "llama", quantize=True)
    load_gguf(path, "quantized")
    before = _entries()
    monkeypatch.setattr(gguf_cache, "CONVERTER_VERSION", gguf_cache.CONVERTER_VERSION + 1)
    load_gguf(path, "quantized")
    after = _entries()
    assert len(after) == 1 and after != before


def test_cache_off(tmp_path, monkeypatch):
    monkeypatch.setenv("MLXTERM_GGUF_CACHE", "0")
    path, _ = write_tiny(tmp_path, "llama", quantize=True)
    load_gguf(path, "quantized")
    assert _entries() == []


def test_failed_write_leaves_nothing_and_still_loads(tmp_path, monkeypatch, caplog):
    path, _ = write_tiny(tmp_path, "llama", quantize=True)

    def boom(f, arrays, metadata=None):
        f.write(b"partial")
        raise OSError("disk full")

    monkeypatch.setattr(gguf_cache.mx, "save_safetensors", boom)
    with caplog.at_level(logging.WARNING, logger="engine.model.gguf.cache"):
        lm = load_gguf(path, "quantized")
    assert lm.model is not None
    assert _entries() == []  # no temp file left behind either
    assert any("disk full" in r.getMessage() for r in caplog.records)


@pytest.mark.e2e
def test_smollm2_warm_load_matches_cold(smollm2_path, monkeypatch):
    from engine.generation.generate import prefill
    from engine.generation.kv_cache import make_cache

    prompt = list(range(100, 160))
    cold = load_gguf(smollm2_path, "quantized")
    want = prefill(cold.model, make_cache(cold.model), prompt)
    with monkeypatch.context() as m:
        _no_convert(m)
        warm = load_gguf(smollm2_path, "quantized")
    got = prefill(warm.model, make_cache(warm.model), prompt)
    np.testing.assert_array_equal(np.array(got), np.array(want))
