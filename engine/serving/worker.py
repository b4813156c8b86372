"""The engine thread: the only thread that touches MLX.

Callers ``submit`` requests and consume a ``RequestHandle`` as a sync or async stream of
events; ``call`` runs any other MLX work (model loading, checkpoint restore) on the same
thread. Between ticks of the attached scheduler (engine.serving.scheduler: continuous
batching) the loop takes every queued job: requests join the scheduler, calls run at once
(after rows that already answered are checkpointed). Idle, it sleeps on the job queue.
"""

from __future__ import annotations

import asyncio
import atexit
import logging
import queue
import threading
import time
import traceback
import weakref
from collections.abc import AsyncIterator, Callable, Iterator
from concurrent.futures import Future
from typing import Any

from engine.serving.events import Done, Event

import mlx.core as mx

log = logging.getLogger(__name__)
_END = object()
_live_workers: weakref.WeakSet = weakref.WeakSet()


@atexit.register
def _close_all() -> None:
    # An engine thread still holding MLX streams at interpreter exit aborts the process
    # ("terminate called without an active exception"); close them first.
    for worker in list(_live_workers):
        worker.close()


class RequestHandle:
    """One request's event stream; iterate it (sync or async) or wait for ``result()``."""

    def __init__(self, request: Any):
        self.request = request
        self.t_submit = time.perf_counter()
        self._cancel = threading.Event()
        self._events: queue.SimpleQueue = queue.SimpleQueue()
        self._done: Done | None = None
        self._finished = threading.Event()
        self._listeners: list[tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = []
        self._lock = threading.Lock()
        # Ids generated so far, appended by the engine thread (read a copy): what a streaming
        # reply saves before Done arrives (engine.sessions.partial).
        self.token_ids: list[int] = []

    # -- producer side (engine thread) ---------------------------------------------------
    def emit(self, event: Event) -> None:
        if isinstance(event, Done):
            self._done = event
        with self._lock:
            self._events.put(event)
            for loop, aq in self._listeners:
                loop.call_soon_threadsafe(aq.put_nowait, event)
            if isinstance(event, Done):
                self._events.put(_END)
                for loop, aq in self._listeners:
                    loop.call_soon_threadsafe(aq.put_nowait, _END)
                self._finished.set()

    @property
    def cancelled(self) -> bool:
        return self._cancel.is_set()

    # -- consumer side -----------------------------------------------------------------------
    def cancel(self) -> None:
        """Ask generation to stop; it ends within one token with finish_reason "cancelled"."""
        self._cancel.set()

    def __iter__(self) -> Iterator[Event]:
        while True:
            ev = self._events.get()
            if ev is _END:
                self._events.put(_END)  # later iterations end at once
                return
            yield ev

    async def __aiter__(self) -> AsyncIterator[Event]:
        loop = asyncio.get_running_loop()
        aq: asyncio.Queue = asyncio.Queue()
        with self._lock:
            # Replay what was already produced, then follow live events.
            backlog = []
            while True:
                try:
                    backlog.append(self._events.get_nowait())
                except queue.Empty:
                    break
            for ev in backlog:
                self._events.put(ev)
                aq.put_nowait(ev)
            if not self._finished.is_set():
                self._listeners.append((loop, aq))
        while True:
            ev = await aq.get()
            if ev is _END:
                return
            yield ev

    def result(self, timeout: float | None = None) -> Done:
        if not self._finished.wait(timeout):
            raise TimeoutError("generation did not finish in time")
        assert self._done is not None
        return self._done


class EngineWorker:
    """Owns the engine thread; requests go to the scheduler ``attach``ed on that thread."""

    def __init__(self, name: str = "mlxterm-engine"):
        self._scheduler = None
        self._jobs: queue.Queue = queue.Queue()
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()
        _live_workers.add(self)

    def attach(self, scheduler) -> None:
        """Serve requests with ``scheduler`` (call on the engine thread, e.g. via ``call``)."""
        self._scheduler = scheduler

    @property
    def scheduler(self):
        """The attached scheduler (touch its state on the engine thread only, e.g. via ``call``)."""
        return self._scheduler

    @property
    def active(self) -> int:
        """Requests submitted and not answered yet (approximate: read without a lock)."""
        sched = self._scheduler
        return self._jobs.qsize() + (sched.active if sched is not None else 0)

    def submit(self, request: Any) -> RequestHandle:
        handle = RequestHandle(request)
        self._jobs.put(("gen", request, handle))
        return handle

    def call(self, fn: Callable[[], Any]) -> Future:
        """Run ``fn`` on the engine thread at the next step boundary."""
        fut: Future = Future()
        self._jobs.put(("call", fn, fut))
        return fut

    def close(self, timeout: float = 30.0) -> None:
        if self._thread.is_alive():
            self._jobs.put(None)
            self._thread.join(timeout)
        _live_workers.discard(self)

    @property
    def on_engine_thread(self) -> bool:
        return threading.current_thread() is self._thread

    def _loop(self) -> None:
        while True:
            sched = self._scheduler
            busy = sched is not None and sched.busy
            jobs = []
            try:
                jobs.append(self._jobs.get(block=not busy))
                while True:
                    jobs.append(self._jobs.get_nowait())
            except queue.Empty:
                pass
            for job in jobs:
                if job is None:
                    if sched is not None:
                        sched.abort("the engine was closed")
                    # Streams this thread created must go before the thread does (MLX teardown).
                    mx.synchronize()
                    mx.clear_streams()
                    return
                kind, payload, target = job
                if kind == "call":
                    self._run_call(payload, target)
                elif self._scheduler is None:
                    target.emit(_error_done("no model is loaded on this engine"))
                else:
                    self._scheduler.add(payload, target)
            sched = self._scheduler
            if sched is not None and sched.busy:
                self._tick(sched)

    def _run_call(self, fn: Callable[[], Any], fut: Future) -> None:
        if not fut.set_running_or_notify_cancel():
            return
        try:
            if self._scheduler is not None:
                self._scheduler.settle()
            fut.set_result(fn())
        except BaseException as e:  # delivered to the caller
            fut.set_exception(e)

    def _tick(self, sched) -> None:
        try:
            sched.tick()
        except Exception as e:
            # A failed step fails the requests in flight, not the engine thread.
            log.error("generation failed: %s\n%s", e, traceback.format_exc())
            sched.abort(str(e))


def _error_done(message: str) -> Done:
    from engine.serving.events import Timings, Usage

    return Done("", "", "error", Usage(), Timings(), error=message)
