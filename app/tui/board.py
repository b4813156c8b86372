"""``BoardService``: the task board behind the TUI (no Textual import).

The app owns one: its dispatcher keeps running while you chat or look elsewhere. Cards run
on the loaded engine when their profile is the loaded one (chat and cards then decode together
in its batched scheduler), else on an engine loaded for them.
Attempts run interactively: a tool set to ``ask`` waits, and the card shows it.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any

from agents.board.dispatcher import Dispatcher
from agents.board.model import ACTIVE
from agents.board.store import BoardStore, default_path

log = logging.getLogger(__name__)
DEFAULT_CONCURRENCY = 2


class BoardService:
    def __init__(self, controller, board: BoardStore | None = None, *, concurrency: int = DEFAULT_CONCURRENCY):
        self.controller = controller
        self._board = board
        self.concurrency = concurrency
        self.dispatcher: Dispatcher | None = None
        self._engines: dict[str, Any] = {}
        self._lock = threading.Lock()
        self.on_change: list[Callable[[int], None]] = []
        self.on_event: list[Callable[[Any, Any], None]] = []

    @property
    def board(self) -> BoardStore:
        if self._board is None:
            self._board = BoardStore()
        return self._board

    def engine_for(self, profile: str):
        eng = self.controller.engine
        if eng is not None and eng.profile.name == profile:
            return eng  # a remote profile's server runs cards in the text protocol
        with self._lock:
            if profile not in self._engines:
                factory = self.controller.engine_factory
                if factory is None:
                    from engine.serving.remote_engine import load_engine

                    self._engines[profile] = load_engine(profile)
                else:
                    self._engines[profile] = factory(profile)
            return self._engines[profile]

    def default_profile(self) -> str:
        """The loaded profile when it is agent-capable, else the best installed one."""
        from agents.choose import best_agent_profile

        eng = self.controller.engine
        if eng is not None and eng.profile.agent.capable:
            return eng.profile.name
        return best_agent_profile()

    def start(self) -> Dispatcher:
        """The dispatcher, started on first use (crash recovery runs then)."""
        if self.dispatcher is None:
            self.dispatcher = Dispatcher(self.board, self.controller.store, self.engine_for,
                                         concurrency=self.concurrency, default_profile=self.default_profile,
                                         interactive=True, on_event=self._event, on_change=self._changed)
            self.dispatcher.start(poll_s=0.5)
        return self.dispatcher

    def resume_pending(self) -> int:
        """Start the dispatcher when cards wait to run (queued, or left running by a crash).

        Called once the chat model is loaded, so cards on that profile share its engine
        instead of loading a second one. Returns how many cards were waiting; 0 (and no
        board file created) when there is no board yet.
        """
        if self.dispatcher is not None or (self._board is None and not default_path().exists()):
            return 0
        waiting = len(self.board.cards(ACTIVE))
        if waiting:
            self.start()
        return waiting

    def wake(self) -> None:
        if self.dispatcher is not None:
            self.dispatcher.wake()

    def running(self, card_id: int):
        d = self.dispatcher
        return d.running.get(card_id) if d is not None else None

    def cards_on(self, engine) -> list[int]:
        """Ids of the cards running on ``engine`` now (a profile switch would close it)."""
        d = self.dispatcher
        if d is None or engine is None:
            return []
        return sorted(cid for cid, run in list(d.running.items()) if run.engine is engine)

    def cancel(self, card_id: int) -> None:
        self.start().cancel(card_id)

    def _changed(self, card_id: int) -> None:
        for fn in list(self.on_change):
            fn(card_id)

    def _event(self, run, ev) -> None:
        for fn in list(self.on_event):
            fn(run, ev)

    def close(self) -> None:
        if self.dispatcher is not None:
            self.dispatcher.stop(cancel=True)
            self.dispatcher = None
        for eng in self._engines.values():
            eng.close()
        self._engines.clear()
