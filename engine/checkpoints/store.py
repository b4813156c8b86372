"""``CheckpointStore``: session-affine KV checkpoints in a RAM tier and an SSD tier.

``acquire(prompt, session_id)`` finds the checkpoint sharing the longest token prefix with
the prompt (the session's latest one first), restores it into fresh caches and says how
many tokens it covers; ``release(tokens, cache, session_id)`` snapshots a cache after a
turn. KV is only ever reused for the exact tokens it was computed from, under an identical
fingerprint, and at least one prompt token is always left to feed.

Threads: ``acquire``/``release`` run on the engine thread (they touch MLX); the writer
thread reports back through ``_written``; ``stats``/``flush`` may be called from anywhere.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from engine.checkpoints import format as fmt
from engine.checkpoints import snapshot as snap_mod
from engine.checkpoints.fingerprint import Fingerprint
from engine.checkpoints.snapshot import Snapshot, UnsupportedCache
from engine.checkpoints.ssd import SsdTier
from engine.checkpoints.trie import TokenTrie, common_prefix
from engine.checkpoints.writer import Writer

import numpy as np

log = logging.getLogger(__name__)

# A request that reuses all but at most this many tokens (and at most an eighth) of a RAM
# checkpoint continues it and takes its buffers (``CheckpointStore._hand_over``).
HANDOVER_SLACK = 256


@dataclass
class Restored:
    """What ``acquire`` hands back (same fields as ``engine.serving.prompt_cache.Reuse``)."""

    cache: list
    cached_tokens: int
    source: str  # "ram" | "ssd" | "none" | "twin" (PromptCache.fork)
    restore_ms: float = 0.0


@dataclass
class DurabilityReport:
    """Where checkpoints made since the store opened (or was cleared) stand on the SSD.

    ``dropped``: never written because the write queue was over its byte cap (or the file
    would not fit the SSD budget); ``failed``: the write raised; ``missing``: evicted from
    RAM before their SSD write finished and not on disk now (lost, or still pending).
    """

    durable: bool
    written: int
    pending: int
    dropped: list[str] = field(default_factory=list)
    failed: list[str] = field(default_factory=list)
    missing: list[str] = field(default_factory=list)
    ssd_disabled_reason: str | None = None

    def joined(self, other: DurabilityReport | None) -> DurabilityReport:
        """This report and ``other``'s (a second store's, e.g. the draft model's) as one."""
        if other is None:
            return self
        return DurabilityReport(
            durable=self.durable and other.durable,
            written=self.written + other.written,
            pending=self.pending + other.pending,
            dropped=self.dropped + other.dropped,
            failed=self.failed + other.failed,
            missing=self.missing + other.missing,
            ssd_disabled_reason=self.ssd_disabled_reason or other.ssd_disabled_reason,
        )


@dataclass
class _Entry:
    cid: str
    tokens: np.ndarray
    session_id: str | None
    trimmable: bool
    created: float
    snapshot: Snapshot | None = None  # the RAM tier copy
    path: Path | None = None  # the SSD tier copy, once written
    ssd_bytes: int = 0
    write: str = "none"  # none | pending | written | dropped | failed
    supersedes: str | None = None  # older checkpoint of the session to delete once written
    superseded: bool = False  # a newer one covers it: losing it is not a loss
    last_used: int = 0


class CheckpointStore:
    def __init__(
        self,
        fingerprint: Fingerprint,
        new_cache: Callable[[], list] | None,
        *,
        ram_bytes: int,
        ssd_dir: Path | None,
        ssd_bytes: int,
        checkpoint_format: str = "same",
        group_size: int = 64,
        queue_bytes: int | None = None,
    ) -> None:
        """``new_cache`` makes the empty per-layer caches of the live model (None: SSD admin only)."""
        self.fingerprint = fingerprint
        self._new_cache = new_cache
        self.layout = snap_mod.layout(new_cache()) if new_cache else None
        self.ram_budget = ram_bytes
        self.storage = checkpoint_format
        self.group_size = group_size
        self._lock = threading.RLock()
        self._entries: dict[str, _Entry] = {}
        self._trie = TokenTrie()
        self._sessions: dict[str, str] = {}
        self._ram: OrderedDict[str, None] = OrderedDict()  # LRU order, oldest first
        self._ram_used = 0
        self._clock = 0
        self._counts = dict.fromkeys(
            ("ram_hits", "ssd_hits", "misses", "written", "write_failures", "dropped", "superseded"), 0)
        self._reset_report()
        self.ssd: SsdTier | None = None
        if ssd_dir is not None:
            self.ssd = SsdTier(Path(ssd_dir), ssd_bytes, fingerprint, self.layout)
            if self.ssd.enabled:
                self.ssd.clean_temps()
                for found in self.ssd.scan():
                    self._adopt(found)
        self._writer = Writer(self._write_job, queue_bytes if queue_bytes is not None else ram_bytes)

    # -- lookup and restore (engine thread) ---------------------------------------------------
    def acquire(self, prompt: Sequence[int], session_id: str | None = None, *, hand_over: bool = False) -> Restored:
        """Fresh caches holding the longest usable checkpointed prefix of ``prompt``.

        ``hand_over``: the caller (the engine's prompt cache) goes on to extend the cache, so a
        RAM checkpoint it continues may give up its buffers instead of a copy (``_hand_over``)."""
        if self._new_cache is None:
            raise RuntimeError("this CheckpointStore was opened without a model")
        t0 = time.perf_counter()
        toks = np.asarray(prompt, np.int32)
        with self._lock:
            choice = self._choose(toks, session_id) if len(toks) > 1 else None
            if choice is not None:
                entry, use = choice
                snap = entry.snapshot
                self._touch(entry)
                take = hand_over and snap is not None and self._hand_over(entry, snap, use)
        if choice is None:
            return self._miss(t0)
        source = "ram"
        if snap is None:
            source = "ssd"
            snap = self._load(entry)
            if snap is None:
                return self._miss(t0)
        cache = snap_mod.restore(snap, use, self._new_cache(), take=take)
        del snap  # a handed-over snapshot's views would keep its buffers shared (no in-place writes)
        with self._lock:
            self._counts["ram_hits" if source == "ram" else "ssd_hits"] += 1
        if entry.path is not None:
            SsdTier.touch(entry.path)
        return Restored(cache, use, source, (time.perf_counter() - t0) * 1000)

    def _hand_over(self, entry: _Entry, snap: Snapshot, use: int) -> bool:
        """Lock held. Whether a request reusing ``use`` tokens of ``entry``'s RAM snapshot takes
        its buffers instead of a copy (a 4k-token SmolLM2 checkpoint is ~95 MB of fresh memory
        to fault in and fill: 25-300 ms on the 2-core VM). Only a continuation does -- at most
        ``HANDOVER_SLACK`` and an eighth of the checkpoint's tokens past ``use`` (a reply the
        client did not send back) -- whose own checkpoint at release covers the same prefix
        again; a shorter reuse (another conversation's shared system prompt) copies its tokens
        and leaves the checkpoint to its owner, who otherwise loses at most that slack. The
        entry leaves the RAM tier; its written SSD copy stays in the index (with no SSD tier
        the entry is forgotten). Not while an SSD tier has no written copy (a write pending or
        dropped): the writer still holds the buffers, so the request's first write would copy
        them anyway (MLX copies a shared buffer), and the entry would be in no tier meanwhile --
        requests of the same prefix arriving then (a board's cards after their shared warm-up)
        missed it."""
        if snap.offset - use > min(HANDOVER_SLACK, snap.offset // 8) or not snap_mod.can_take(snap):
            return False
        if self.ssd is not None and entry.path is None:
            return False
        self._drop_ram(entry)
        if entry.path is None:
            self._remove(entry)
        return True

    def _miss(self, t0: float) -> Restored:
        with self._lock:
            self._counts["misses"] += 1
        return Restored(self._new_cache(), 0, "none", (time.perf_counter() - t0) * 1000)

    def _choose(self, toks: np.ndarray, session_id: str | None) -> tuple[_Entry, int] | None:
        n = len(toks)
        own = self._entries.get(self._sessions.get(session_id, "")) if session_id else None
        if own is not None and (own.snapshot is not None or own.path is not None) \
                and common_prefix(own.tokens, toks) == len(own.tokens):
            use = _usable(own, len(own.tokens), n)
            if use > 0:
                return own, use  # O(1) besides the token comparison
        walk = self._trie.walk(toks)
        best: tuple[tuple, _Entry, int] | None = None
        for depth, ids in walk.exact:
            for cid in ids:
                best = self._better(best, self._entries[cid], depth, n)
        reach = min(walk.diverge, n - 1)
        if reach > 0 and (best is None or best[2] < reach):
            for cid in TokenTrie.ids_below(walk.below):
                best = self._better(best, self._entries[cid], walk.diverge, n)
        return (best[1], best[2]) if best else None

    @staticmethod
    def _better(best, entry: _Entry, common: int, n: int):
        if entry.snapshot is None and entry.path is None:
            return best  # in no tier now (handed over or evicted, its SSD write pending)
        use = _usable(entry, common, n)
        if use <= 0:
            return best
        rank = (use, entry.snapshot is not None, entry.last_used)
        return (rank, entry, use) if best is None or rank > best[0] else best

    def _load(self, entry: _Entry) -> Snapshot | None:
        """Read ``entry`` from the SSD (verified) and keep it in RAM; None if unusable."""
        path = entry.path
        if path is None or self.ssd is None:
            return None
        try:
            loaded = snap_mod.load_file(path, self.ssd.check)
            if not np.array_equal(loaded.tokens, entry.tokens):
                raise fmt.CorruptCheckpoint("token ids changed since the file was indexed")
            snap = snap_mod.from_file(loaded.meta["layers"], loaded.tensors)
        except fmt.CorruptCheckpoint as e:
            self.ssd.discard(path, str(e))
            with self._lock:
                self._drop_ssd(entry)
            return None
        except OSError as e:  # evicted by another process meanwhile
            log.debug("checkpoint %s is gone: %s", path, e)
            with self._lock:
                self._drop_ssd(entry)
            return None
        with self._lock:
            if entry.cid in self._entries and entry.snapshot is None:
                self._keep_in_ram(entry, snap)
        return snap

    # -- checkpointing (engine thread) ------------------------------------------------------------
    def release(self, tokens: Sequence[int], cache: list, session_id: str | None = None) -> str | None:
        """Checkpoint ``cache`` (covering ``tokens[:cache[0].offset]``); returns its id or None."""
        offset = int(cache[0].offset) if cache else 0
        if offset <= 0 or len(tokens) < offset:
            return None
        try:
            snap = snap_mod.capture(cache)
        except UnsupportedCache as e:
            log.debug("not checkpointing: %s", e)
            return None
        toks = np.asarray(tokens[:offset], np.int32)
        with self._lock:
            same = self._same_tokens(toks, snap.trimmable)
            if same is not None:  # nothing new: refresh the existing checkpoint
                if same.snapshot is None:
                    self._keep_in_ram(same, snap)
                self._touch(same)
                if session_id:
                    self._sessions[session_id] = same.cid
                return same.cid
            ssd_on = self.ssd is not None and self.ssd.enabled
            if not ssd_on and snap.nbytes > self.ram_budget:
                return None  # would fit nowhere
            if self.ssd is not None:
                cid, _ = self.ssd.new_path()
            else:
                cid = f"ram-{self._clock + 1}"
            entry = _Entry(cid, toks, session_id, snap.trimmable, time.time())
            self._entries[cid] = entry
            self._trie.insert(toks, cid)
            self._touch(entry)
            old = self._entries.get(self._sessions.get(session_id, "")) if session_id else None
            if session_id:
                self._sessions[session_id] = cid
            if old is not None and old.cid != cid:
                self._maybe_supersede(old, entry)
            if ssd_on:
                entry.write = "pending"
                host = snap_mod.to_host(snap, cid, toks, session_id, entry.created)
                for job in self._writer.submit(host):
                    self._dropped(self._entries.get(job.cid), job.cid,
                                  f"write queue over {self._writer.cap_bytes} bytes")
            self._keep_in_ram(entry, snap)
        return cid

    def _same_tokens(self, toks: np.ndarray, trimmable: bool) -> _Entry | None:
        for depth, ids in self._trie.walk(toks).exact:
            if depth == len(toks):
                for cid in ids:
                    e = self._entries[cid]
                    if e.trimmable == trimmable:
                        return e
        return None

    def _maybe_supersede(self, old: _Entry, new: _Entry) -> None:
        """A session's newer checkpoint that extends a trimmable older one makes it redundant."""
        if not (old.trimmable and new.trimmable and len(old.tokens) <= len(new.tokens)
                and common_prefix(old.tokens, new.tokens) == len(old.tokens)):
            return
        self._counts["superseded"] += 1
        old.superseded = True
        self._drop_ram(old)
        if old.write == "pending" and self._writer.cancel(old.cid):
            old.write = "none"
        if old.path is not None or old.write == "pending":
            new.supersedes = old.cid  # keep the older file until the newer one is on disk
        else:
            self._remove(old)

    # -- the writer thread's side ------------------------------------------------------------------
    def _write_job(self, job: fmt.HostCheckpoint) -> None:
        ssd = self.ssd
        path = ssd.dir / f"{job.cid}{fmt.SUFFIX}"
        if not ssd.enabled:
            self._write_failed(job.cid, "SSD tier disabled")
            return
        if job.nbytes > ssd.budget and self.storage == "same":
            with self._lock:
                self._dropped(self._entries.get(job.cid), job.cid,
                              f"{job.nbytes} bytes exceed the SSD budget of {ssd.budget}")
            return
        try:
            size = ssd.write(path, job, self.storage, self.group_size)
        except OSError as e:
            if SsdTier.is_disabling(e):
                ssd.disable(e)
            else:
                log.warning("cannot write checkpoint %s: %s", path, e)
            self._write_failed(job.cid, str(e))
            return
        except Exception as e:  # a bug must not lose the session: report it as a failed write
            log.warning("cannot write checkpoint %s: %r", path, e)
            self._write_failed(job.cid, repr(e))
            return
        evicted = ssd.evict(keep=path)
        with self._lock:
            entry = self._entries.get(job.cid)
            if entry is None:  # cleared while it was being written
                SsdTier.delete(path)
                return
            self._counts["written"] += 1
            self._report["written"] += 1
            entry.path, entry.ssd_bytes, entry.write = path, size, "written"
            old = self._entries.get(entry.supersedes or "")
            if old is not None:  # the newer file covers everything the older one could serve
                if old.path is not None:
                    SsdTier.delete(old.path)
                self._remove(old)
            entry.supersedes = None
            by_path = {e.path: e for e in self._entries.values() if e.path is not None}
            for p in evicted:
                if p in by_path:
                    self._drop_ssd(by_path[p])

    def _write_failed(self, cid: str, reason: str) -> None:
        with self._lock:
            self._counts["write_failures"] += 1
            self._report["failed"].append(cid)
            entry = self._entries.get(cid)
            if entry is not None:
                entry.write = "failed"
                if entry.snapshot is None:
                    self._lost(entry)

    def _dropped(self, entry: _Entry | None, cid: str, reason: str) -> None:
        """Lock held. A snapshot that will not be written: say so (log + report), never silently."""
        log.warning("checkpoint %s will not be written to SSD: %s", cid, reason)
        self._counts["dropped"] += 1
        self._report["dropped"].append(cid)
        if entry is not None:
            entry.write = "dropped"
            if entry.snapshot is None:
                self._lost(entry)

    # -- tiers and index (lock held) ---------------------------------------------------------------
    def _adopt(self, found) -> None:
        entry = _Entry(found.cid, np.asarray(found.tokens, np.int32), found.session_id, found.trimmable,
                       found.created, path=found.path, ssd_bytes=found.nbytes, write="written")
        self._entries[entry.cid] = entry
        self._trie.insert(entry.tokens, entry.cid)
        self._touch(entry)
        sid = found.session_id
        if sid and (sid not in self._sessions or self._entries[self._sessions[sid]].created < found.created):
            self._sessions[sid] = entry.cid

    def _keep_in_ram(self, entry: _Entry, snap: Snapshot) -> None:
        if snap.nbytes > self.ram_budget:
            return
        entry.snapshot = snap
        self._ram[entry.cid] = None
        self._ram_used += snap.nbytes
        while self._ram_used > self.ram_budget:
            self._evict_ram(next(iter(self._ram)))

    def _evict_ram(self, cid: str) -> None:
        entry = self._entries[cid]
        self._drop_ram(entry)
        if entry.path is None and entry.write != "pending":
            if entry.write in ("dropped", "failed"):
                self._lost(entry)
            else:
                self._remove(entry)

    def _lost(self, entry: _Entry) -> None:
        """In neither tier any more and never written: report it as missing and forget it."""
        if not entry.superseded:
            self._report["missing"].append(entry.cid)
        self._remove(entry)

    def _drop_ram(self, entry: _Entry) -> None:
        if entry.snapshot is not None:
            self._ram_used -= entry.snapshot.nbytes
            entry.snapshot = None
            self._ram.pop(entry.cid, None)

    def _drop_ssd(self, entry: _Entry) -> None:
        entry.path, entry.ssd_bytes = None, 0
        if entry.write == "written":
            entry.write = "none"
        if entry.snapshot is None and entry.write != "pending":
            self._remove(entry)

    def _remove(self, entry: _Entry) -> None:
        if self._entries.pop(entry.cid, None) is None:
            return
        self._drop_ram(entry)
        self._trie.remove(entry.tokens, entry.cid)
        if entry.session_id and self._sessions.get(entry.session_id) == entry.cid:
            del self._sessions[entry.session_id]

    def _touch(self, entry: _Entry) -> None:
        self._clock += 1
        entry.last_used = self._clock
        if entry.cid in self._ram:
            self._ram.move_to_end(entry.cid)

    def _reset_report(self) -> None:
        self._report = {"written": 0, "dropped": [], "failed": [], "missing": []}

    # -- reporting and admin ---------------------------------------------------------------------
    def flush(self, timeout: float | None = None) -> DurabilityReport:
        """Wait (up to ``timeout`` s) for queued SSD writes, then report what is durable."""
        self._writer.wait(timeout)
        pending = self._writer.pending()
        with self._lock:
            r = self._report
            unwritten = [cid for cid in pending if cid in self._entries
                         and self._entries[cid].snapshot is None and not self._entries[cid].superseded]
            missing = list(r["missing"]) + [c for c in unwritten if c not in r["missing"]]
            reason = self.ssd.disabled_reason if self.ssd else "no SSD tier configured"
            durable = reason is None and not (pending or r["dropped"] or r["failed"] or missing)
            return DurabilityReport(durable, r["written"], len(pending), list(r["dropped"]),
                                    list(r["failed"]), missing, reason)

    def stats(self) -> dict:
        with self._lock:
            on_ssd = [e for e in self._entries.values() if e.path is not None]
            ssd = self.ssd
            return {
                "fingerprint": self.fingerprint.key,
                "ram": {"entries": len(self._ram), "bytes": self._ram_used, "budget": self.ram_budget,
                        "hits": self._counts["ram_hits"],
                        "misses": self._counts["ssd_hits"] + self._counts["misses"]},
                "ssd": {"entries": len(on_ssd), "bytes": sum(e.ssd_bytes for e in on_ssd),
                        "budget": ssd.budget if ssd else 0,
                        "dir": str(ssd.dir) if ssd else None,
                        "hits": self._counts["ssd_hits"], "misses": self._counts["misses"]},
                "sessions": len(self._sessions),
                "writes": self._counts["written"],
                "pending": len(self._writer.pending()),
                "write_failures": self._counts["write_failures"],
                "dropped": self._counts["dropped"],
                "discarded": ssd.discarded if ssd else 0,  # corrupt or foreign files deleted
                "superseded": self._counts["superseded"],
                "checkpoint_format": self.storage,
                "ssd_disabled_reason": ssd.disabled_reason if ssd else "no SSD tier configured",
            }

    def clear(self) -> int:
        """Forget every checkpoint in RAM and delete this fingerprint's files. Returns files deleted."""
        self._writer.cancel_all()
        self._writer.wait()
        with self._lock:
            self._entries.clear()
            self._trie = TokenTrie()
            self._sessions.clear()
            self._ram.clear()
            self._ram_used = 0
            self._reset_report()
            return self.ssd.clear() if self.ssd is not None and self.ssd.enabled else 0

    def close(self, timeout: float | None = None) -> DurabilityReport:
        """Flush and stop the writer thread."""
        report = self.flush(timeout)
        self._writer.close(0)
        return report


def _usable(entry: _Entry, common: int, n: int) -> int:
    """Tokens of ``entry`` a prompt of ``n`` tokens sharing ``common`` with it can reuse."""
    if common == len(entry.tokens) and common <= n - 1:
        return common  # an exact prefix with at least one token left to feed
    return min(common, n - 1) if entry.trimmable else 0
