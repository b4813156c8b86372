"""The background checkpoint writer: a FIFO of snapshots and one low-priority thread.

The engine thread only enqueues (numpy views of already evaluated arrays); encoding,
hashing, writing and fsync happen here, so token streaming never waits on the disk. The
thread runs no MLX code. When queued bytes exceed ``cap_bytes`` the oldest snapshots that
are not being written are dropped and handed back to the caller, which reports them.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
from collections import deque
from collections.abc import Callable

from engine.checkpoints.format import HostCheckpoint

log = logging.getLogger(__name__)


class Writer:
    def __init__(self, write: Callable[[HostCheckpoint], None], cap_bytes: int) -> None:
        """``write(job)`` runs on the writer thread and reports its own outcome."""
        self._write = write
        self.cap_bytes = cap_bytes
        self._queue: deque[HostCheckpoint] = deque()
        self._queued_bytes = 0
        self._busy: HostCheckpoint | None = None
        self._cond = threading.Condition()
        self._thread: threading.Thread | None = None
        self._closing = False

    def submit(self, job: HostCheckpoint) -> list[HostCheckpoint]:
        """Queue ``job``; returns older queued jobs dropped to stay under the byte cap."""
        dropped = []
        with self._cond:
            self._queue.append(job)
            self._queued_bytes += job.nbytes
            # Never drop the newest: a single snapshot above the cap is still written.
            while self._queued_bytes > self.cap_bytes and len(self._queue) > 1:
                old = self._queue.popleft()
                self._queued_bytes -= old.nbytes
                dropped.append(old)
            self._start()
            self._cond.notify_all()
        return dropped

    def cancel(self, cid: str) -> bool:
        """Remove a queued (not yet started) job; False if it is running or gone."""
        with self._cond:
            for job in self._queue:
                if job.cid == cid:
                    self._queue.remove(job)
                    self._queued_bytes -= job.nbytes
                    self._cond.notify_all()
                    return True
        return False

    def cancel_all(self) -> list[HostCheckpoint]:
        with self._cond:
            jobs = list(self._queue)
            self._queue.clear()
            self._queued_bytes = 0
            self._cond.notify_all()
        return jobs

    def pending(self) -> list[str]:
        with self._cond:
            return [j.cid for j in ([self._busy] if self._busy else []) + list(self._queue)]

    def wait(self, timeout: float | None = None) -> bool:
        """Block until nothing is queued or being written; False on timeout."""
        with self._cond:
            return self._cond.wait_for(lambda: not self._queue and self._busy is None, timeout)

    def close(self, timeout: float | None = None) -> bool:
        """Finish queued writes (up to ``timeout``) and stop the thread."""
        done = self.wait(timeout)
        with self._cond:
            self._closing = True
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join(timeout=0 if not done else timeout)
        return done

    # -- the thread ---------------------------------------------------------------------------
    def _start(self) -> None:
        if self._thread is None or not self._thread.is_alive():
            self._closing = False
            self._thread = threading.Thread(target=self._run, name="kv-checkpoint-writer", daemon=True)
            self._thread.start()

    def _run(self) -> None:
        _lower_priority()
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._queue or self._closing)
                if not self._queue:
                    return
                job = self._queue.popleft()
                self._queued_bytes -= job.nbytes
                self._busy = job
            try:
                self._write(job)
            except Exception:  # the callback reports its own errors; never kill the thread
                log.exception("checkpoint writer failed on %s", job.cid)
            finally:
                with self._cond:
                    self._busy = None
                    self._cond.notify_all()


def _lower_priority() -> None:
    """Nice this thread so decoding keeps the CPU when both want it (Linux: per-thread nice)."""
    with contextlib.suppress(AttributeError, OSError):
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 10)
