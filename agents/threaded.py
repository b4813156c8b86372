"""A blocking event generator consumed from asyncio: the agent loop runs on a worker thread
(it waits on the engine, tools and SQLite) while the TUI's event loop awaits its events."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator, Callable, Iterator
from typing import TypeVar

T = TypeVar("T")


async def on_a_thread(events: Callable[[], Iterator[T]], abandon: Callable[[], None]) -> AsyncIterator[T]:
    """Iterate ``events()`` on a daemon thread, yielding each item here; an exception it raises
    is raised here. If this iteration stops early (closed, cancelled), ``abandon()`` is called
    so the thread's work can end."""
    loop = asyncio.get_running_loop()
    queue: asyncio.Queue = asyncio.Queue()
    end = object()

    def work() -> None:
        try:
            for ev in events():
                loop.call_soon_threadsafe(queue.put_nowait, ev)
        except BaseException as e:  # delivered to the awaiting side
            loop.call_soon_threadsafe(queue.put_nowait, e)
        finally:
            loop.call_soon_threadsafe(queue.put_nowait, end)

    thread = threading.Thread(target=work, name="mlxterm-agent", daemon=True)
    thread.start()
    try:
        while True:
            ev = await queue.get()
            if ev is end:
                return
            if isinstance(ev, BaseException):
                raise ev
            yield ev
    finally:
        if thread.is_alive():
            abandon()
