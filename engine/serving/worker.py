"""The engine thread: the only thread that touches MLX.

Callers ``submit`` requests and consume a ``RequestHandle`` as a sync or async stream of
events; ``call`` runs any other MLX work (model loading, checkpoint restore) on the same
thread. Requests wait in a FIFO; the serving loop takes one at a time today, and a batched
scheduler can replace ``_serve`` later without changing callers.
"""

from __future__ import annotations

import asyncio
import atexit
import logging
import queue
import threading
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
    """Owns the engine thread. ``serve(request, handle)`` does the actual generation."""

    def __init__(self, serve: Callable[[Any, RequestHandle], None], name: str = "mlxterm-engine"):
        self._serve_fn = serve
        self._jobs: queue.Queue = queue.Queue()
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()
        _live_workers.add(self)

    def submit(self, request: Any) -> RequestHandle:
        handle = RequestHandle(request)
        self._jobs.put(("gen", request, handle))
        return handle

    def call(self, fn: Callable[[], Any]) -> Future:
        """Run ``fn`` on the engine thread, after the requests queued before it."""
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
            job = self._jobs.get()
            if job is None:
                # Streams this thread created must go before the thread does (MLX teardown).
                mx.synchronize()
                mx.clear_streams()
                return
            kind, payload, target = job
            if kind == "call":
                if not target.set_running_or_notify_cancel():
                    continue
                try:
                    target.set_result(payload())
                except BaseException as e:  # delivered to the caller
                    target.set_exception(e)
                continue
            self._serve(payload, target)

    def _serve(self, request: Any, handle: RequestHandle) -> None:
        try:
            self._serve_fn(request, handle)
        except Exception as e:
            log.error("generation failed: %s\n%s", e, traceback.format_exc())
            if handle._done is None:
                from engine.serving.events import Timings, Usage

                handle.emit(Done("", "", "error", Usage(), Timings(), error=str(e)))
