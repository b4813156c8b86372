"""Checkpoint store: exact restores, snapshots, lookup (session, trie, trimming), RAM tier, reports."""

from __future__ import annotations

import engine  # noqa: F401  (loads OpenBLAS before mlx)

# isort: split
import logging
import threading
import time

from engine.checkpoints import CheckpointStore, make_fingerprint
from engine.checkpoints import format as fmt
from engine.checkpoints import snapshot as snap_mod
from engine.checkpoints import store as store_mod
from engine.checkpoints.ssd import SsdTier
from engine.checkpoints.trie import TokenTrie
from engine.generation.kv_cache import StaticKVCache, make_cache

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.cache import QuantizedKVCache
from mlx_lm.utils import load_model

from tests.test_checkpoints_helpers import (
    continuation,
    fake_static_cache,
    make_store,
    prefilled,
    tokens,
)


@pytest.fixture(scope="module")
def llama(tiny_llama_dir):
    model, _ = load_model(tiny_llama_dir)
    return tiny_llama_dir, model


@pytest.fixture(scope="module")
def gemma(tiny_gemma_dir):
    model, _ = load_model(tiny_gemma_dir)
    return tiny_gemma_dir, model


def _assert_same(a, b) -> None:
    assert a[0] == b[0]
    np.testing.assert_array_equal(a[1], b[1])


def test_static_restore_continues_bit_exact(llama):
    d, model = llama
    toks = tokens(48)
    store = make_store(d, model, None)
    live = prefilled(model, toks[:30])
    store.release(toks[:30], live)
    ref = continuation(model, live, toks[30:], toks)  # the uninterrupted cache, decoded on
    r = store.acquire(toks)
    assert (r.source, r.cached_tokens) == ("ram", 30)
    assert r.cache[0] is not live[0]
    assert r.cache[0].capacity % StaticKVCache.step == 0 and r.cache[0].capacity > 30
    _assert_same(continuation(model, r.cache, toks[30:], toks), ref)


def test_window_restore_continues_bit_exact_and_never_trims(gemma):
    d, model = gemma  # sliding window 8: the ring has wrapped several times at 30 tokens
    toks = tokens(44, seed=1)
    store = make_store(d, model, None)
    assert {cls for cls, _ in store.layout} == {"StaticKVCache", "WindowKVCache"}
    early = prefilled(model, toks[:20])
    store.release(toks[:20], early)
    live = prefilled(model, toks[:30])
    store.release(toks[:30], live)
    ref = continuation(model, live, toks[30:], toks)
    r = store.acquire(toks)
    assert (r.source, r.cached_tokens) == ("ram", 30)
    _assert_same(continuation(model, r.cache, toks[30:], toks), ref)
    # Diverging inside the 30-token checkpoint: only the exact 20-token one may be used.
    assert store.acquire(toks[:25] + tokens(5, seed=9)).cached_tokens == 20
    # The whole prompt checkpointed leaves no token to feed and a window cannot be trimmed.
    assert store.acquire(toks[:30]).cached_tokens == 20
    assert store.acquire(toks[:20]).source == "none"


def test_snapshot_survives_the_live_cache_rewriting_its_positions(llama):
    # Decoding on from the snapshot only writes past its slice; trimming the live cache first
    # makes the next tokens land on the very positions the snapshot holds.
    d, model = llama
    toks = tokens(40, seed=2)
    live = prefilled(model, toks[:24])
    snap = snap_mod.capture(live)
    before = [(np.array(x.keys[0]), np.array(x.values[0])) for x in snap.layers]
    ref = continuation(model, prefilled(model, toks[:24]), toks[24:], toks)
    for c in live:
        c.trim(14)
    assert live[0].offset == 10
    other = tokens(30, seed=7)
    continuation(model, live, other, toks[:10] + other)  # different tokens over positions 10..39
    assert live[0].offset > 24
    for (k, v), layer in zip(before, snap.layers, strict=True):
        np.testing.assert_array_equal(np.array(layer.keys[0]), k)
        np.testing.assert_array_equal(np.array(layer.values[0]), v)
    restored = snap_mod.restore(snap, 24, make_cache(model))
    _assert_same(continuation(model, restored, toks[24:], toks), ref)


def test_quantized_snapshot_survives_the_live_cache_rewriting_its_positions():
    mx.random.seed(0)
    k, v = mx.random.normal((1, 2, 10, 32)), mx.random.normal((1, 2, 10, 32))
    c = QuantizedKVCache(group_size=32, bits=8)
    c.update_and_fetch(k, v)
    snap = snap_mod.capture([c])
    before = [np.array(x) for x in (*snap.layers[0].keys, *snap.layers[0].values)]
    expect = QuantizedKVCache(group_size=32, bits=8)  # what restoring 10 tokens must give
    expect.update_and_fetch(k, v)
    c.trim(6)
    assert c.offset == 4
    for _ in range(8):  # the cache writes in place with x[...] = y over positions 4..11
        c.update_and_fetch(mx.random.normal((1, 2, 1, 32)) * 5, mx.random.normal((1, 2, 1, 32)) * 5)
    for b, x in zip(before, (*snap.layers[0].keys, *snap.layers[0].values), strict=True):
        np.testing.assert_array_equal(np.array(x), b)
    fresh = snap_mod.restore(snap, 10, [QuantizedKVCache(group_size=32, bits=8)])[0]
    assert fresh.offset == 10
    for got, want in zip((*fresh.keys, *fresh.values), (*expect.keys, *expect.values), strict=True):
        np.testing.assert_array_equal(np.array(got)[..., :10, :], np.array(want)[..., :10, :])


def test_token_trie_walk_split_and_remove():
    t = TokenTrie()
    a = np.array([1, 2, 3, 4, 5], np.int32)
    b = np.array([1, 2, 3, 9], np.int32)
    c = np.array([1, 2], np.int32)
    for arr, cid in ((a, "a"), (b, "b"), (c, "c")):
        t.insert(arr, cid)
    w = t.walk(np.array([1, 2, 3, 4, 7, 7], np.int32))
    assert [(d, ids) for d, ids in w.exact] == [(2, {"c"})]
    assert w.diverge == 4 and set(TokenTrie.ids_below(w.below)) == {"a"}
    w = t.walk(np.array([1, 2, 3], np.int32))
    assert w.diverge == 3 and set(TokenTrie.ids_below(w.below)) == {"a", "b"}
    t.remove(b, "b")
    t.remove(c, "c")
    w = t.walk(np.array([1, 2, 3, 9], np.int32))
    assert w.exact == [] and w.diverge == 3 and set(TokenTrie.ids_below(w.below)) == {"a"}
    t.remove(a, "a")
    assert t.walk(a).diverge == 0


def test_longest_prefix_lookup_trims_a_longer_checkpoint(llama):
    d, model = llama
    toks = tokens(40, seed=3)
    store = make_store(d, model, None)
    store.release(toks[:20], prefilled(model, toks[:20]))
    store.release(toks[:36], prefilled(model, toks[:36]))
    store.release(tokens(30, seed=4), prefilled(model, tokens(30, seed=4)))
    prompt = toks[:28] + tokens(8, seed=5)
    r = store.acquire(prompt)
    assert (r.source, r.cached_tokens) == ("ram", 28)
    ref_cache = prefilled(model, toks[:36])
    for c in ref_cache:
        c.trim(8)
    _assert_same(continuation(model, r.cache, prompt[28:], prompt),
                 continuation(model, ref_cache, prompt[28:], prompt))
    # A prompt equal to a stored checkpoint keeps one token to feed.
    assert store.acquire(toks[:36]).cached_tokens == 35
    assert store.acquire(tokens(12, seed=6)).source == "none"
    assert store.acquire(toks[:1]).source == "none"


def test_session_fast_path_and_superseding(llama):
    d, model = llama
    toks = tokens(48, seed=7)
    store = make_store(d, model, None)
    store.release(toks[:30], prefilled(model, toks[:30]))  # another conversation, longer
    store.release(toks[:12], prefilled(model, toks[:12]), session_id="s1")
    assert store.acquire(toks, session_id="s1").cached_tokens == 12  # the session's own first
    assert store.acquire(toks).cached_tokens == 30  # no session: longest prefix
    store.release(toks[:20], prefilled(model, toks[:20]), session_id="s1")
    s = store.stats()
    assert s["superseded"] == 1 and s["ram"]["entries"] == 2  # the 12-token one is gone
    assert store.acquire(toks[:16]).cached_tokens == 15  # served by trimming the 20-token one
    # The session's checkpoint is not a prefix any more (edited history): fall back to the trie.
    assert store.acquire(toks[:15] + tokens(5, seed=8), session_id="s1").cached_tokens == 15


def test_a_continuation_takes_the_ram_checkpoints_buffers(llama, monkeypatch):
    """``acquire(hand_over=True)`` (the engine's prompt cache) gives a request that continues a
    RAM checkpoint its buffers, not a copy; the checkpoint leaves the RAM tier (RAM only: it
    is forgotten). A shorter reuse copies and leaves the checkpoint where it is."""
    d, model = llama
    toks = tokens(48, seed=11)
    store = make_store(d, model, None)
    live = prefilled(model, toks[:30])
    ref = continuation(model, prefilled(model, toks[:30]), toks[30:], toks)
    cid = store.release(toks[:30], live)
    del live
    base = [layer.base for layer in store._entries[cid].snapshot.layers]
    r = store.acquire(toks, hand_over=True)
    assert (r.source, r.cached_tokens) == ("ram", 30)
    assert all(c.keys is k and c.values is v for c, (k, v) in zip(r.cache, base, strict=True))
    del base
    assert store.stats()["ram"]["entries"] == 0 and store.acquire(toks).source == "none"
    _assert_same(continuation(model, r.cache, toks[30:], toks), ref)
    # Reusing 20 of a checkpoint's 30 tokens is no continuation (another conversation sharing
    # a prefix): a copy, even where the slack in tokens would allow it.
    monkeypatch.setattr(store_mod, "HANDOVER_SLACK", 64)
    store.release(toks[:30], prefilled(model, toks[:30]))
    r = store.acquire(toks[:20] + tokens(8, seed=12), hand_over=True)
    assert (r.source, r.cached_tokens) == ("ram", 20)
    assert store.stats()["ram"]["entries"] == 1 and store.acquire(toks).cached_tokens == 30


def test_a_pending_ssd_write_keeps_the_checkpoint_in_ram_until_written(llama, tmp_path, monkeypatch):
    """While the SSD writer still holds a checkpoint's buffers, a continuation gets a copy and the
    checkpoint stays in RAM for the next request of its prefix (a hand-over then would leave it
    in no tier until the file is written, and the first write would copy the shared buffers
    anyway). Once written, a continuation takes the buffers, overwrites positions the
    checkpoint covers, and the file still holds the checkpoint as released."""
    d, model = llama
    started, gate = threading.Event(), threading.Event()
    real_write = SsdTier.write

    def gated_write(self, *args):
        started.set()
        assert gate.wait(60)
        return real_write(self, *args)

    monkeypatch.setattr(SsdTier, "write", gated_write)
    toks = tokens(48, seed=13)
    store = make_store(d, model, tmp_path / "ssd")
    store.release(toks[:10], prefilled(model, toks[:10]))
    assert started.wait(60)  # the writer holds the first file; the second waits in the queue
    store.release(toks[:30], prefilled(model, toks[:30]))
    other = toks[:28] + tokens(16, seed=14)
    r = store.acquire(other, hand_over=True)
    assert (r.source, r.cached_tokens) == ("ram", 28)
    assert store.stats()["ram"]["entries"] == 2  # copied: the write is pending
    continuation(model, r.cache, other[28:], other)
    assert store.acquire(toks).cached_tokens == 30  # still served from RAM
    gate.set()
    assert store.flush(timeout=60).durable
    taken = store.acquire(other, hand_over=True)  # written now: a trimmed continuation takes it
    assert (taken.source, taken.cached_tokens) == ("ram", 28)
    assert store.stats()["ram"]["entries"] == 1
    continuation(model, taken.cache, other[28:], other)  # overwrites positions 28, 29
    again = store.acquire(toks)
    assert (again.source, again.cached_tokens) == ("ssd", 30)
    _assert_same(continuation(model, again.cache, toks[30:], toks),
                 continuation(model, prefilled(model, toks[:30]), toks[30:], toks))
    store.close()


def _fake_store(tmp_path, ssd: bool, **kw) -> CheckpointStore:
    weights = tmp_path / "weights.bin"
    weights.write_bytes(b"weights")
    fp = make_fingerprint(weights, "fp32")
    return CheckpointStore(fp, lambda: [StaticKVCache() for _ in range(2)],
                           ssd_dir=tmp_path / "ssd" if ssd else None,
                           **{"ram_bytes": 1 << 30, "ssd_bytes": 1 << 30, **kw})


SNAP_BYTES = 2 * 2 * (1 * 2 * 512 * 16 * 4)  # layers * (k, v) * one fp32 buffer of 512 slots


def test_ram_tier_evicts_least_recently_used_by_bytes(tmp_path):
    store = _fake_store(tmp_path, ssd=False, ram_bytes=int(SNAP_BYTES * 2.5))
    seqs = [[s] + tokens(99, seed=s) for s in (1, 2, 3, 4)]
    for i in range(3):
        store.release(seqs[i], fake_static_cache(2, 2, 100, 16, seed=i))
    assert store.stats()["ram"] == {**store.stats()["ram"], "entries": 2, "bytes": 2 * SNAP_BYTES}
    assert store.acquire(seqs[0] + [7]).source == "none"  # evicted (oldest)
    assert store.acquire(seqs[1] + [7]).source == "ram"  # now the most recently used
    store.release(seqs[3], fake_static_cache(2, 2, 100, 16, seed=3))
    assert store.acquire(seqs[2] + [7]).source == "none"
    assert store.acquire(seqs[1] + [7]).source == "ram"
    assert store.stats()["ram"]["bytes"] <= store.ram_budget


def test_flush_report_counts_drops_and_missing(tmp_path, monkeypatch, caplog):
    started, gate = threading.Event(), threading.Event()
    real_write = SsdTier.write

    def gated_write(self, path, ck, storage, group_size):
        started.set()
        assert gate.wait(30)
        return real_write(self, path, ck, storage, group_size)

    monkeypatch.setattr(SsdTier, "write", gated_write)
    store = _fake_store(tmp_path, ssd=True, ram_bytes=int(SNAP_BYTES * 2.5), queue_bytes=1)
    seqs = [[s] + tokens(99, seed=s) for s in (1, 2, 3)]
    with caplog.at_level(logging.WARNING, logger="engine.checkpoints"):
        c1 = store.release(seqs[0], fake_static_cache(2, 2, 100, 16, seed=1))
        assert started.wait(30)
        c2 = store.release(seqs[1], fake_static_cache(2, 2, 100, 16, seed=2))
        c3 = store.release(seqs[2], fake_static_cache(2, 2, 100, 16, seed=3))  # drops c2; evicts c1
    blocked = store.flush(timeout=0.1)
    assert (blocked.durable, blocked.written, blocked.pending) == (False, 0, 2)
    assert blocked.dropped == [c2] and blocked.missing == [c1]
    assert [r.message for r in caplog.records if c2 in r.message]  # the drop was logged by id
    gate.set()
    done = store.close(timeout=30)
    assert (done.written, done.pending, done.dropped, done.missing) == (2, 0, [c2], [])
    assert not done.durable  # one checkpoint never reached the disk
    assert {p.stem for p in (tmp_path / "ssd" / store.fingerprint.key).glob("*.safetensors")} == {c1, c3}


def test_release_only_enqueues_and_writer_reads_during_decoding(llama, tmp_path, monkeypatch):
    d, model = llama
    started, gate = threading.Event(), threading.Event()
    real_write = SsdTier.write

    def gated_write(self, *args):  # hold the writer so "pending" is observed, not raced
        started.set()
        assert gate.wait(60)
        return real_write(self, *args)

    monkeypatch.setattr(SsdTier, "write", gated_write)
    store = _fake_store(tmp_path, ssd=True)
    big = fake_static_cache(2, 8, 4096, 64, seed=5)  # 2 x 2 x 8 MiB of K/V
    toks = tokens(4096, seed=5)
    t0 = time.perf_counter()
    cid = store.release(toks, big)
    release_ms = (time.perf_counter() - t0) * 1000
    assert started.wait(60)
    assert store.flush(timeout=0).pending == 1  # written in the background, not by release
    gate.set()  # the writer now hashes and writes the snapshot while this thread decodes
    # Decode on this thread while the writer hashes and writes the snapshot's buffers.
    prompt = tokens(40, seed=6)
    ref = continuation(model, prefilled(model, prompt[:30]), prompt[30:], prompt)
    live = prefilled(model, prompt[:30])
    for c in big:  # and write into the live buffers the snapshot views (copy on write)
        c.keys[..., :64, :] = 0.0
        mx.eval(c.keys)
    _assert_same(continuation(model, live, prompt[30:], prompt), ref)
    report = store.flush(timeout=60)
    assert report.durable and report.written == 1
    loaded = fmt.load(tmp_path / "ssd" / store.fingerprint.key / f"{cid}.safetensors", lambda h: None)
    again = fake_static_cache(2, 8, 4096, 64, seed=5)
    for i, c in enumerate(again):
        np.testing.assert_array_equal(loaded.tensors[f"{i}.k"], np.array(c.keys[..., :4096, :]))
    assert release_ms < 5000, release_ms  # generous; "only enqueues" is shown by pending == 1
    store.close()


def test_prompt_cache_reports_the_draft_store_too():
    """A draft model's checkpoint store (the prompt cache's companion) counts in the one
    durability report that flush/close return: a lost draft checkpoint is not hidden."""
    from engine.checkpoints.store import DurabilityReport
    from engine.serving.prompt_cache import PromptCache

    class _Reports:
        def __init__(self, report):
            self.report = report

        def flush(self, timeout=None):
            return self.report

        close = flush

    target = DurabilityReport(durable=True, written=3, pending=0)
    draft = DurabilityReport(durable=False, written=1, pending=1, missing=["d-1"],
                             ssd_disabled_reason="disk full")
    pc = object.__new__(PromptCache)  # the stores are what is checked, not a model
    pc.store, pc.companion = _Reports(target), _Reports(draft)
    for report in (pc.flush(), pc.close()):
        assert not report.durable
        assert (report.written, report.pending, report.missing) == (4, 1, ["d-1"])
        assert report.ssd_disabled_reason == "disk full"
    pc.companion = None
    assert pc.flush() is target
