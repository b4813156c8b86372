"""SSD tier: new-process restores, corruption, SIGKILL mid-write, unwritable dirs, q8/q4, budget, CLI."""

from __future__ import annotations

import engine  # noqa: F401  (loads OpenBLAS before mlx)

# isort: split
import dataclasses
import errno
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

from engine.checkpoints import CheckpointStore, make_fingerprint, quant
from engine.checkpoints import format as fmt
from engine.checkpoints.fingerprint import Fingerprint, weights_sha256
from engine.generation.kv_cache import StaticKVCache, make_cache

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.utils import load_model

from tests.test_checkpoints_helpers import (
    continuation,
    fake_static_cache,
    make_store,
    prefilled,
    tokens,
)
from tests.tiny_models import LLAMA_CONFIG, make_model_dir

REPO = Path(__file__).resolve().parent.parent
LOGGER = "engine.checkpoints"


@pytest.fixture(scope="module")
def llama(tiny_llama_dir):
    model, _ = load_model(tiny_llama_dir)
    return tiny_llama_dir, model


def _run(script: str, *args: str, wait: bool = True, **kw):
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    cmd = [sys.executable, "-c", script, *args]
    if not wait:
        return subprocess.Popen(cmd, env=env, cwd=REPO, stdout=subprocess.PIPE, text=True)
    done = subprocess.run(cmd, env=env, cwd=REPO, capture_output=True, text=True, timeout=120, **kw)
    assert done.returncode == 0, done.stderr
    return done


def _files(d: Path, pattern: str = "*.safetensors") -> list[Path]:
    return sorted(p for p in d.rglob(pattern) if p.is_file())


def _warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records
            if r.levelno >= logging.WARNING and r.name.startswith(LOGGER)]


RESTORE_SCRIPT = """
import engine  # OpenBLAS before mlx, as in the parent: the same kernels give the same bits
import json, sys
from pathlib import Path
import numpy as np
from mlx_lm.utils import load_model
from tests.test_checkpoints_helpers import continuation, make_store
args = json.loads(sys.argv[1])
out = {}
for name, d in args["models"].items():
    model, _ = load_model(Path(d))
    store = make_store(Path(d), model, Path(args["ssd"]))
    r = store.acquire(args["prompt"])
    toks, lps = continuation(model, r.cache, args["prompt"][r.cached_tokens:], args["prompt"])
    np.save(Path(args["out"]) / f"{name}.npy", lps)
    out[name] = {"source": r.source, "cached": r.cached_tokens, "tokens": toks}
    store.close()
print(json.dumps(out))
"""


def test_ssd_checkpoint_restores_bit_exact_in_a_new_process(tiny_llama_dir, tiny_gemma_dir, tmp_path):
    prompt = tokens(44, seed=11)
    ssd = tmp_path / "ssd"
    refs = {}
    for name, d in (("llama", tiny_llama_dir), ("gemma", tiny_gemma_dir)):
        model, _ = load_model(d)
        store = make_store(d, model, ssd)
        live = prefilled(model, prompt[:30])
        store.release(prompt[:30], live, session_id="s")
        assert store.close(timeout=60).durable
        refs[name] = continuation(model, live, prompt[30:], prompt)
    args = {"models": {"llama": str(tiny_llama_dir), "gemma": str(tiny_gemma_dir)},
            "ssd": str(ssd), "prompt": prompt, "out": str(tmp_path)}
    result = json.loads(_run(RESTORE_SCRIPT, json.dumps(args)).stdout)
    for name, (ref_tokens, ref_lps) in refs.items():
        assert result[name] == {"source": "ssd", "cached": 30, "tokens": ref_tokens}
        np.testing.assert_array_equal(np.load(tmp_path / f"{name}.npy"), ref_lps)


def test_checkpoint_file_is_plain_safetensors(llama, tmp_path):
    d, model = llama
    toks = tokens(20, seed=12)
    store = make_store(d, model, tmp_path / "ssd")
    store.release(toks, prefilled(model, toks))
    store.close()
    (path,) = _files(tmp_path / "ssd")
    loaded = mx.load(str(path))
    assert loaded["tokens"].tolist() == toks
    assert loaded["0.k"].shape == (1, 2, 20, 16)
    header = json.loads(mx.load(str(path), return_metadata=True)[1]["mlxterm.checkpoint"])
    assert header["n_tokens"] == 20 and header["layers"][0]["class"] == "StaticKVCache"
    assert len(header["payload_sha256"]) == 64


def _corrupt(kind: str, path: Path, other: Path) -> None:
    data = bytearray(path.read_bytes())
    if kind == "truncated":
        path.write_bytes(data[: len(data) // 2])
    elif kind == "payload_byte":
        data[-100] ^= 0x01
        path.write_bytes(data)
    elif kind == "header_byte":
        n = int.from_bytes(data[:8], "little")
        i = data.index(b"n_tokens", 8, 8 + n) + 12  # inside the header JSON, after the key
        data[i] ^= 0x01
        path.write_bytes(data)
    elif kind == "other_model":
        path.write_bytes(other.read_bytes())


@pytest.mark.parametrize("kind", ["truncated", "payload_byte", "header_byte", "other_model"])
def test_corrupt_file_is_discarded_with_one_warning(llama, tmp_path, caplog, kind):
    d, model = llama
    toks = tokens(30, seed=13)
    ssd = tmp_path / "ssd"
    live = prefilled(model, toks[:24])
    for weights in ("fp32", "fp16"):  # fp16: a different fingerprint, for the "other_model" case
        s = make_store(d, model, ssd, weight_format=weights)
        s.release(toks[:24], live)
        s.close()
    store_dir = ssd / make_fingerprint(d, "fp32").key
    other_dir = ssd / make_fingerprint(d, "fp16").key
    (path,), (other,) = _files(store_dir), _files(other_dir)
    _corrupt(kind, path, other)
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        store = make_store(d, model, ssd)
        r = store.acquire(toks)
        again = store.acquire(toks)
    assert (r.source, r.cached_tokens, again.source) == ("none", 0, "none")
    warnings = _warnings(caplog)
    assert len(warnings) == 1 and path.name in warnings[0], warnings
    assert not path.exists() and _files(other_dir) == [other]
    assert store.stats()["discarded"] == 1
    store.close()


KILL_SCRIPT = """
import engine
import sys, time
from pathlib import Path
import engine.checkpoints.format as fmt
from engine.checkpoints import CheckpointStore, make_fingerprint
from engine.generation.kv_cache import StaticKVCache
from tests.test_checkpoints_helpers import fake_static_cache, tokens

real_write = fmt.write
def slow_write(f, meta, tensors):  # a slow disk: the parent kills us in the middle
    class Slow:
        def write(self, b):
            f.write(b)
            f.flush()
            time.sleep(0.02)
    return real_write(Slow(), meta, tensors)
fmt.write = slow_write
ssd, weights = Path(sys.argv[1]), Path(sys.argv[2])
store = CheckpointStore(make_fingerprint(weights, "fp32"), lambda: [StaticKVCache() for _ in range(2)],
                        ram_bytes=1 << 30, ssd_dir=ssd, ssd_bytes=1 << 30)
store.release(tokens(2048, seed=1), fake_static_cache(2, 8, 2048, 64))
print("queued", flush=True)
store.flush()
print("finished", flush=True)
"""


def test_writer_killed_mid_write_leaves_nothing_loadable(tmp_path, caplog):
    weights = tmp_path / "weights.bin"
    weights.write_bytes(b"w")
    ssd = tmp_path / "ssd"
    proc = _run(KILL_SCRIPT, str(ssd), str(weights), wait=False)
    try:
        deadline = time.monotonic() + 60
        temps: list[Path] = []
        while time.monotonic() < deadline:
            temps = [p for p in _files(ssd, ".*.tmp") if p.stat().st_size > 0]
            if temps:
                break
            time.sleep(0.002)
        assert temps, "the writer never started"
        proc.send_signal(signal.SIGKILL)
    finally:
        proc.wait(timeout=30)
    assert proc.returncode == -signal.SIGKILL
    assert _files(ssd) == []  # nothing was renamed into place
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        store = CheckpointStore(make_fingerprint(weights, "fp32"), lambda: [StaticKVCache() for _ in range(2)],
                                ram_bytes=1 << 30, ssd_dir=ssd, ssd_bytes=1 << 30)
        r = store.acquire(tokens(2048, seed=1) + [5])
    assert r.source == "none"
    assert _files(ssd, ".*.tmp") == []  # the dead writer's temp file was cleaned up
    assert _warnings(caplog) == []
    store.close()


def test_temp_files_of_live_writers_are_kept(tmp_path):
    weights = tmp_path / "weights.bin"
    weights.write_bytes(b"w")
    fp = make_fingerprint(weights, "fp32")
    d = tmp_path / "ssd" / fp.key
    d.mkdir(parents=True)
    dead = _dead_pid()
    (d / f".{dead}-abc123.safetensors.x1.tmp").write_bytes(b"partial")
    (d / f".{os.getppid()}-abc123.safetensors.x2.tmp").write_bytes(b"in progress")
    CheckpointStore(fp, None, ram_bytes=0, ssd_dir=tmp_path / "ssd", ssd_bytes=1 << 20).close()
    assert [p.name for p in _files(d, ".*.tmp")] == [f".{os.getppid()}-abc123.safetensors.x2.tmp"]


def _dead_pid() -> int:
    p = subprocess.Popen(["true"])
    p.wait()
    return p.pid


def test_unwritable_ssd_dir_goes_ram_only_with_one_warning(llama, tmp_path, caplog):
    d, model = llama
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("x")
    toks = tokens(30, seed=14)
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        store = make_store(d, model, blocker / "ssd")
        for n in (20, 24):
            store.release(toks[:n], prefilled(model, toks[:n]))
        r = store.acquire(toks)
    assert (r.source, r.cached_tokens) == ("ram", 24)
    assert len(_warnings(caplog)) == 1
    assert store.stats()["ssd_disabled_reason"]
    report = store.close()
    assert not report.durable and report.ssd_disabled_reason


@pytest.mark.parametrize("where,err", [
    ("mkdir", errno.EACCES),  # a directory the user may not write (what chmod 0500 gives a non-root user)
    ("probe", errno.EROFS),  # a read-only filesystem: the directory exists, writing fails
])
def test_unwritable_ssd_dir_goes_ram_only(llama, tmp_path, caplog, monkeypatch, where, err):
    # The failure is injected rather than made with chmod: root ignores directory permissions,
    # so a chmod test would pass vacuously (or be skipped) exactly where CI runs as root.
    d, model = llama
    ssd = tmp_path / "ssd"
    real_mkdir, real_write = Path.mkdir, Path.write_bytes

    def mkdir(self, *a, **kw):
        if where == "mkdir" and ssd in (self, *self.parents):
            raise PermissionError(err, os.strerror(err), str(self))
        return real_mkdir(self, *a, **kw)

    def write_bytes(self, data):
        if where == "probe" and ssd in self.parents:
            raise OSError(err, os.strerror(err), str(self))
        return real_write(self, data)

    monkeypatch.setattr(Path, "mkdir", mkdir)
    monkeypatch.setattr(Path, "write_bytes", write_bytes)
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        store = make_store(d, model, ssd)
        reason = store.stats()["ssd_disabled_reason"]
        assert reason and os.strerror(err) in reason
        # RAM-only still serves the checkpoint, and later writes do not warn again
        ids = tokens(40)
        store.release(ids, prefilled(model, ids), "s")
        store.flush()
        assert store.acquire(ids + [7], "s").cached_tokens == len(ids)
    assert len(_warnings(caplog)) == 1
    assert not any(p.is_file() for p in tmp_path.rglob("*") if ssd in p.parents)
    report = store.close()
    assert not report.durable and report.ssd_disabled_reason == reason


def test_disk_full_while_writing_goes_ram_only_with_one_warning(llama, tmp_path, caplog, monkeypatch):
    d, model = llama
    real_write = fmt.write

    def full_disk(f, meta, tensors):
        real_write(f, meta, tensors[:1])  # some bytes land in the temp file, then ENOSPC
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(fmt, "write", full_disk)
    toks = tokens(30, seed=15)
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        store = make_store(d, model, tmp_path / "ssd")
        first = store.release(toks[:20], prefilled(model, toks[:20]))
        store.flush(timeout=30)
        store.release(toks[:24], prefilled(model, toks[:24]))
        report = store.flush(timeout=30)
    assert len(_warnings(caplog)) == 1 and "No space left" in _warnings(caplog)[0]
    assert report.failed[0] == first and not report.durable and report.ssd_disabled_reason
    assert store.acquire(toks).source == "ram"
    assert _files(tmp_path / "ssd", "*") == []  # the temp file was removed
    store.close()


@pytest.mark.parametrize("storage,bits", [("q8", 8), ("q4", 4)])
def test_quantized_storage_round_trip_within_tolerance(tmp_path, storage, bits):
    weights = tmp_path / "weights.bin"
    weights.write_bytes(b"w")
    fp = make_fingerprint(weights, "fp32", checkpoint_format=storage)

    def open_store() -> CheckpointStore:
        return CheckpointStore(fp, lambda: [StaticKVCache() for _ in range(2)], ram_bytes=1 << 30,
                               ssd_dir=tmp_path / "ssd", ssd_bytes=1 << 30, checkpoint_format=storage)

    toks = tokens(100, seed=16)
    live = fake_static_cache(2, 2, 100, 64, seed=16)
    store = open_store()
    store.release(toks, live)
    store.close()
    (path,) = _files(tmp_path / "ssd")
    assert path.stat().st_size < 0.3 * 2 * 2 * (2 * 100 * 64 * 4)  # much smaller than fp32
    r = open_store().acquire(toks + [1])
    assert (r.source, r.cached_tokens) == ("ssd", 100)
    for got, want in zip(r.cache, live, strict=True):
        x = np.array(want.keys[..., :100, :]).reshape(1, 2, 100, -1, 64)
        step = (x.max(-1) - x.min(-1)) / (2**bits - 1)
        err = np.abs(np.array(got.keys[..., :100, :]).reshape(x.shape) - x).max(-1)
        # Half a quantization step, plus float16 rounding of each group's scale and bias.
        assert (err <= 0.5 * step + 2e-3 * np.abs(x).max(-1) + 1e-6).all()


def test_q8_checkpoint_keeps_greedy_decoding_close(tmp_path):
    cfg = {**LLAMA_CONFIG, "num_attention_heads": 2, "num_key_value_heads": 1}  # head_dim 32
    d = make_model_dir(tmp_path / "llama-hd32", cfg)
    model, _ = load_model(d)
    prompt = tokens(40, seed=17)
    store = make_store(d, model, tmp_path / "ssd", checkpoint_format="q8", group_size=64)
    live = prefilled(model, prompt[:30])
    store.release(prompt[:30], live)
    store.close()
    ref_tokens, ref_lps = continuation(model, live, prompt[30:], prompt)
    r = make_store(d, model, tmp_path / "ssd", checkpoint_format="q8").acquire(prompt)
    assert (r.source, r.cached_tokens) == ("ssd", 30)
    got_tokens, got_lps = continuation(model, r.cache, prompt[30:], prompt)
    assert got_tokens == ref_tokens
    # Stated q8 tolerance (docs/checkpoints.md): next-token KL below 0.01 nats (measured ~0.002).
    kl = (np.exp(ref_lps) * (ref_lps - got_lps)).sum(-1)
    assert kl.max() < 0.01 and np.abs(got_lps - ref_lps).mean() < 0.05


def test_numpy_quantization_matches_mlx_dequantize():
    x = np.random.default_rng(0).normal(size=(2, 3, 5, 64)).astype(np.float32)
    for bits in (8, 4):
        q, s, b = quant.quantize(x, "float32", 32, bits)
        mine = (quant.unpack(q, bits).reshape(2, 3, 5, 2, 32) * s[..., None].astype(np.float32)
                + b[..., None].astype(np.float32)).reshape(x.shape)
        s32, b32 = mx.array(s).astype(mx.float32), mx.array(b).astype(mx.float32)
        theirs = mx.dequantize(mx.array(q), s32, b32, group_size=32, bits=bits)
        np.testing.assert_allclose(np.array(theirs), mine, rtol=1e-6, atol=1e-6)


def test_ssd_budget_evicts_least_recently_used_files_across_fingerprints(tmp_path):
    weights = tmp_path / "weights.bin"
    weights.write_bytes(b"w")
    seqs = [[s] + tokens(99, seed=s) for s in range(4)]

    def open_store(weight_format: str, budget: int) -> CheckpointStore:
        return CheckpointStore(make_fingerprint(weights, weight_format), lambda: [StaticKVCache() for _ in range(2)],
                               ram_bytes=0, ssd_dir=tmp_path / "ssd", ssd_bytes=budget)

    other = open_store("fp16", 1 << 30)  # an older model's file in the same root
    other.release(seqs[0], fake_static_cache(2, 2, 100, 16))
    other.close()
    size = _files(tmp_path / "ssd")[0].stat().st_size
    store = open_store("fp32", int(size * 2.5))
    for i in (1, 2):
        time.sleep(0.02)  # distinct mtimes
        store.release(seqs[i], fake_static_cache(2, 2, 100, 16, seed=i))
        store.flush(timeout=30)
    assert len(_files(tmp_path / "ssd")) == 2  # the other model's file went first
    time.sleep(0.02)
    assert store.acquire(seqs[1] + [7]).source == "ssd"  # touch: now the most recent
    time.sleep(0.02)
    store.release(seqs[3], fake_static_cache(2, 2, 100, 16, seed=3))
    store.flush(timeout=30)
    assert store.acquire(seqs[2] + [7]).source == "none"
    assert store.acquire(seqs[1] + [7]).source in ("ssd", "ram")
    assert store.stats()["ssd"]["entries"] == 2
    store.close()


def test_weights_hash_is_computed_once_per_file(tmp_path, monkeypatch):
    from engine.checkpoints import fingerprint

    weights = tmp_path / "model.gguf"
    weights.write_bytes(b"abc")
    calls = []
    real = fingerprint._file_sha256
    monkeypatch.setattr(fingerprint, "_file_sha256", lambda p: calls.append(p) or real(p))
    first = weights_sha256(weights)
    assert weights_sha256(weights) == first and len(calls) == 1
    weights.write_bytes(b"abd")  # new content, size kept: mtime changes the key
    os.utime(weights, ns=(time.time_ns(), time.time_ns() + 1_000_000))
    assert weights_sha256(weights) != first and len(calls) == 2


def _cli(capsys, *argv: str) -> tuple[int, str]:
    from app.cli import main

    capsys.readouterr()
    rc = main(["cache", *argv])
    return rc, capsys.readouterr().out


def test_cache_command_stats_flush_clear(llama, tiny_profile, capsys):
    from engine.checkpoints import open_store
    from engine.generation.kv_cache import make_cache
    from engine.profiles import load_profile

    d, model = llama
    toks = tokens(20, seed=18)
    store = open_store(load_profile(str(tiny_profile)), lambda: make_cache(model))
    store.release(toks, prefilled(model, toks))
    store.close()
    rc, out = _cli(capsys, "stats", "--json", "--profile", str(tiny_profile))
    stats = json.loads(out)
    assert rc == 0 and stats["ssd"]["entries"] == 1 and stats["ssd"]["bytes"] > 0
    rc, out = _cli(capsys, "flush", "--json", "--profile", str(tiny_profile))
    assert rc == 0 and json.loads(out)["durable"] and json.loads(out)["pending"] == 0
    rc, out = _cli(capsys, "clear", "--profile", str(tiny_profile))
    assert rc == 0 and "deleted 1 checkpoint file" in out
    rc, out = _cli(capsys, "stats", "--profile", str(tiny_profile))
    assert rc == 0 and "files:    0" in out


def _roundtrip_store(tmp_path, make_layers, **kw) -> CheckpointStore:
    weights = tmp_path / "weights.bin"
    weights.write_bytes(b"w")
    fp = make_fingerprint(weights, "bf16", checkpoint_format=kw.get("checkpoint_format", "same"))
    return CheckpointStore(fp, make_layers, ram_bytes=1 << 30, ssd_dir=tmp_path / "ssd",
                           ssd_bytes=1 << 30, **kw)


def test_bfloat16_and_quantized_live_caches_round_trip_exactly(tmp_path):
    from mlx_lm.models.cache import QuantizedKVCache

    toks = tokens(70, seed=19)
    bf16 = fake_static_cache(2, 2, 70, 32, seed=19, dtype=mx.bfloat16)
    mx.random.seed(19)
    q = [QuantizedKVCache(group_size=32, bits=4) for _ in range(2)]
    for c in q:
        c.update_and_fetch(mx.random.normal((1, 2, 70, 32)), mx.random.normal((1, 2, 70, 32)))
    for name, live, make in (("bf16", bf16, lambda: [StaticKVCache() for _ in range(2)]),
                             ("q4-live", q, lambda: [QuantizedKVCache(group_size=32, bits=4) for _ in range(2)])):
        root = tmp_path / name
        root.mkdir()
        store = _roundtrip_store(root, make)
        store.release(toks, live)
        assert store.close(timeout=30).durable
        r = _roundtrip_store(root, make).acquire(toks + [3])
        assert (r.source, r.cached_tokens) == ("ssd", 70), name
        for got, want in zip(r.cache, live, strict=True):
            g = got.keys if isinstance(got.keys, tuple) else (got.keys,)
            w = want.keys if isinstance(want.keys, tuple) else (want.keys,)
            for a, b in zip(g, w, strict=True):
                assert a.dtype == b.dtype
                assert mx.array_equal(a[..., :70, :], b[..., :70, :]).item(), name


def test_cache_command_names_a_bad_profile_in_one_line(capsys):
    from app.cli import main

    assert main(["cache", "stats", "--profile", "no-such-profile"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("mlxterm: ") and "no-such-profile" in err and err.count("\n") == 1


def test_superseded_session_file_is_deleted_once_the_newer_one_is_written(tmp_path):
    make = lambda: [StaticKVCache() for _ in range(2)]  # noqa: E731
    toks = tokens(120, seed=20)
    store = _roundtrip_store(tmp_path, make)
    first = store.release(toks[:80], fake_static_cache(2, 2, 80, 16, seed=1), session_id="s1")
    store.flush(timeout=30)
    second = store.release(toks, fake_static_cache(2, 2, 120, 16, seed=2), session_id="s1")
    report = store.close(timeout=30)
    assert report.durable and report.written == 2 and store.stats()["superseded"] == 1
    assert [p.stem for p in _files(tmp_path / "ssd")] == [second] != [first]
    fresh = _roundtrip_store(tmp_path, make)
    r = fresh.acquire(toks[:90] + [1], session_id="s1")
    assert (r.source, r.cached_tokens) == ("ssd", 90)  # the newer file, trimmed
    assert fresh.stats()["sessions"] == 1


FINGERPRINT_FIELDS = [f.name for f in dataclasses.fields(Fingerprint)]


@pytest.mark.parametrize("field", FINGERPRINT_FIELDS)
def test_every_fingerprint_field_invalidates_a_checkpoint(llama, tmp_path, field):
    d, model = llama
    ssd = tmp_path / "ssd"
    toks = tokens(24, seed=21)
    base = make_fingerprint(d, "fp32")
    writer = CheckpointStore(base, lambda: make_cache(model), ssd_dir=ssd, ram_bytes=1 << 30, ssd_bytes=1 << 30)
    writer.release(toks, prefilled(model, toks))
    assert writer.close(timeout=60).durable

    def reader(fp):
        return CheckpointStore(fp, lambda: make_cache(model), ssd_dir=ssd, ram_bytes=1 << 30, ssd_bytes=1 << 30)

    same = reader(base)
    assert same.acquire(toks + [5]).source == "ssd"  # the control: an identical fingerprint restores
    same.close()
    changed = dataclasses.replace(base, **{field: getattr(base, field) + "-other"})
    assert changed.key != base.key
    other = reader(changed)
    assert other.acquire(toks + [5]).source == "none"
    # Even a file moved into the other fingerprint's directory is refused by its header.
    (src,) = _files(ssd / base.key)
    shutil.copy(src, ssd / changed.key / src.name)
    other.close()
    again = reader(changed)
    assert again.acquire(toks + [5]).source == "none"
    assert not (ssd / changed.key / src.name).exists()  # discarded as invalid
    again.close()
