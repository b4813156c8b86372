"""The dispatcher: picks queued cards and runs their attempts concurrently on shared engines.

Order: priority (high first), then the oldest card. A card runs when a slot is free under the
global WIP limit (``concurrency``) and its profile's limit (``per_profile``), and when every
card it depends on is done; while one is not, the card waits in ``blocked`` (and goes back to
queued when they are done). Each attempt runs on its own thread against one ``Engine`` per
profile: requests from several cards decode together in the engine's batched scheduler.
Inside an attempt, failing checks go back to the same agent session for the card's repair
rounds (``runner``). After an attempt: passed (at least one check ran,
all passed) -> review (done with ``auto_accept``); unchecked (no checks, the agent answered)
-> review, never done by itself; failed -> queued again with the check output for the next
attempt (a new session), up to ``max_retries``, then failed; cancelled -> backlog. On start,
``BoardStore.recover`` requeues cards whose attempt was running in a process that is gone.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any

from agents.board import workspace as ws_mod
from agents.board.model import Attempt, BoardError, Card
from agents.board.runner import AttemptRun, attempt_prompt, check_feedback
from agents.board.store import BoardStore

log = logging.getLogger(__name__)
DEP_PREFIX = "waiting for card"


class Dispatcher:
    def __init__(self, board: BoardStore, sessions, engine_for: Callable[[str], Any], *,
                 concurrency: int = 1, per_profile: dict[str, int] | None = None,
                 default_profile: str | Callable[[], str] = "", interactive: bool = False,
                 on_event: Callable[[AttemptRun, Any], None] | None = None,
                 on_change: Callable[[int], None] | None = None, warm: bool = True):
        if concurrency < 1:
            raise BoardError("concurrency must be at least 1")
        self.board, self.sessions = board, sessions
        self.engine_for = engine_for
        self.concurrency = concurrency
        self.per_profile = dict(per_profile or {})
        self._default = default_profile
        self.interactive = interactive
        self.on_event = on_event
        self.on_change = on_change
        self.warm = warm
        self.running: dict[int, AttemptRun] = {}
        self.finished: list[tuple[int, Attempt]] = []  # (card id, attempt) in finishing order
        self.started: list[int] = []  # card ids in start order
        self._threads: dict[int, threading.Thread] = {}
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._loop: threading.Thread | None = None
        self.recovered = board.recover()

    # -- choosing ---------------------------------------------------------------------------------
    def profile_of(self, card: Card) -> str:
        if card.profile:
            return card.profile
        return self._default() if callable(self._default) else self._default

    def _deps(self, card: Card) -> tuple[list[int], list[int]]:
        """(unfinished deps, deps that can no longer finish: failed or archived)."""
        waiting, dead = [], []
        for dep in card.depends_on:
            try:
                state = self.board.get(dep).state
            except BoardError:
                dead.append(dep)
                continue
            if state in ("failed", "archived"):
                dead.append(dep)
            elif state != "done":
                waiting.append(dep)
        return waiting, dead

    def runnable(self) -> list[Card]:
        """Queued cards whose dependencies are done, in dispatch order; cards waiting for a
        dependency move to blocked (and back to queued once it is done)."""
        for card in self.board.cards(("blocked",)):
            if (card.reason or "").startswith(DEP_PREFIX):
                waiting, dead = self._deps(card)
                if dead:
                    self.board.update(card.id, reason=_dead_reason(dead))
                    self._changed(card.id)
                elif not waiting:
                    self._move(card.id, "queued", reason="its dependencies are done")
        out = []
        for card in self.board.cards(("queued",)):
            waiting, dead = self._deps(card)
            if dead:
                self._move(card.id, "blocked", reason=_dead_reason(dead))
            elif waiting:
                self._move(card.id, "blocked", reason=f"{DEP_PREFIX} {', '.join(map(str, waiting))}")
            else:
                out.append(card)
        return out

    def tick(self) -> list[int]:
        """Start attempts for as many runnable cards as the WIP limits allow; their ids."""
        started = []
        for card in self.runnable():
            with self._lock:
                if len(self.running) >= self.concurrency:
                    break
                profile = self.profile_of(card)
                limit = self.per_profile.get(profile)
                busy = sum(1 for r in self.running.values() if self.profile_of(r.card) == profile)
                if limit is not None and busy >= limit:
                    continue
            if self._start(card, profile):
                started.append(card.id)
        return started

    # -- running ----------------------------------------------------------------------------------
    def _start(self, card: Card, profile: str) -> bool:
        try:
            card = self.board.move(card.id, "running", expect="queued", reason=None, cancel_requested=False)
        except BoardError:
            return False  # another dispatcher took it, or it was moved meanwhile
        nxt = card.next_attempt or {}
        kind = nxt.get("kind", "first")
        last = self.board.last_attempt(card.id)
        session_id = last.session_id if kind in ("followup", "resume") and last else None
        if kind in ("followup", "resume") and not session_id:
            kind = "first"
        att = self.board.new_attempt(card.id, kind, attempt_prompt(card, kind, nxt.get("feedback")), session_id)
        run = AttemptRun(self.board, self.sessions, None, card, att, interactive=self.interactive,
                         on_event=self.on_event, warm=self.warm)
        with self._lock:
            self.running[card.id] = run
            self.started.append(card.id)
        t = threading.Thread(target=self._work, args=(run, profile), name=f"board-card-{card.id}", daemon=True)
        self._threads[card.id] = t
        self._changed(card.id)
        t.start()
        return True

    def _work(self, run: AttemptRun, profile: str) -> None:
        card, att = run.card, run.attempt
        try:
            try:
                run.engine = self.engine_for(profile)
                wdir, base = ws_mod.prepare(self.board, card)
                if wdir != card.workspace_dir:
                    card = run.card = self.board.update(card.id, workspace_dir=wdir, base=base)
            except Exception as e:  # noqa: BLE001 (no engine or no workspace: the attempt errors)
                att.status, att.error, att.finished_at = "error", f"{type(e).__name__}: {e}", time.time()
                att.wall_s = round(time.time() - (att.started_at or time.time()), 3)
                self.board.save_attempt(att)
                self.board.log(card.id, "attempt_finished", number=att.number, status="error", error=att.error)
            else:
                att = run.run()
            self._settle(card.id, att)
        except Exception:  # a bug must not leave the card "running" in this live process
            log.exception("board attempt for card %s failed", card.id)
            try:
                self._move(card.id, "failed", reason="internal error; see the log")
            except BoardError:
                pass
        finally:
            with self._lock:
                self.running.pop(card.id, None)
                self.finished.append((card.id, att))
            self._changed(card.id)
            self._wake.set()

    def _settle(self, card_id: int, att: Attempt) -> None:
        card = self.board.get(card_id)
        if att.status == "cancelled" and self._stop.is_set() and not card.cancel_requested:
            # The dispatcher is shutting down (the app closed): the card resumes next time.
            nxt = {"kind": "resume"} if att.session_id else card.next_attempt
            self._move(card_id, "queued", reason=f"attempt {att.number} stopped when the board closed; "
                       "it resumes next time", next_attempt=nxt)
        elif att.status == "cancelled" or card.cancel_requested:
            nxt = {"kind": "resume"} if att.session_id else None
            self._move(card_id, "backlog", reason=f"attempt {att.number} was cancelled",
                       next_attempt=nxt, cancel_requested=False)
        elif att.status == "passed":
            target = "done" if card.auto_accept else "review"
            self._move(card_id, target, reason=f"attempt {att.number}: checks passed" + _notes(att),
                       next_attempt=None)
        elif att.status == "unchecked":  # nothing verified it: a person looks, even with auto_accept
            self._move(card_id, "review", reason=f"attempt {att.number}: unchecked (the card has no checks)"
                       + _notes(att), next_attempt=None)
        elif card.retries_used < card.max_retries:
            feedback = check_feedback(att.checks) or (
                f"the agent stopped ({att.stop_reason}): {att.error or att.final_text or 'no answer'}")
            self._move(card_id, "queued", reason=f"attempt {att.number} {att.status}; retrying",
                       next_attempt={"kind": "retry", "feedback": feedback}, retries_used=card.retries_used + 1)
        else:
            self._move(card_id, "failed", reason=f"attempt {att.number} {att.status}; "
                       f"{card.max_retries} retries used", next_attempt=None)

    def _move(self, card_id: int, state: str, **kw) -> Card:
        card = self.board.move(card_id, state, **kw)
        self._changed(card_id)
        return card

    def _changed(self, card_id: int) -> None:
        if self.on_change is not None:
            try:
                self.on_change(card_id)
            except Exception:  # noqa: BLE001 (a UI callback must not break the dispatcher)
                log.exception("board change callback failed")

    def cancel(self, card_id: int) -> None:
        """Stop a card: a queued one goes back to the backlog, a running one is cancelled
        (here at once; in another process through ``cancel_requested``)."""
        card = self.board.get(card_id)
        request_cancel(self.board, card)
        run = self.running.get(card.id)
        if run is not None:
            run.cancel()
        self._changed(card.id)

    def poll_cancels(self) -> None:
        """Cancel attempts whose card was marked ``cancel_requested`` by another process."""
        for cid, run in list(self.running.items()):
            if not run.cancelled and self.board.get(cid).cancel_requested:
                run.cancel()

    def drain(self, until_empty: bool = True, poll_s: float = 0.2) -> list[Card]:
        """Run until nothing is queued or running (``until_empty``), or until ``stop()``;
        returns the cards this dispatcher ran, in their final states."""
        while not self._stop.is_set():
            self._wake.clear()
            try:
                self.tick()
                self.poll_cancels()
                with self._lock:
                    idle = not self.running
                if until_empty and idle and not self.runnable():
                    break
            except BoardError as e:  # a card moved by someone else meanwhile: look again
                log.debug("board changed while dispatching: %s", e)
            self._wake.wait(poll_s)
        for t in list(self._threads.values()):
            t.join()
        return [self.board.get(cid) for cid in dict.fromkeys(self.started)]

    def start(self, poll_s: float = 0.5) -> None:
        """Keep dispatching on a background thread (the TUI board) until ``stop()``."""
        if self._loop is None:
            self._loop = threading.Thread(target=self.drain, args=(False, poll_s), name="board-dispatcher",
                                          daemon=True)
            self._loop.start()

    def wake(self) -> None:
        self._wake.set()

    def stop(self, cancel: bool = True) -> None:
        self._stop.set()
        self._wake.set()
        if cancel:
            for run in list(self.running.values()):
                run.cancel()
        if self._loop is not None:
            self._loop.join(30)

    def approval(self, card_id: int):
        run = self.running.get(card_id)
        return run.pending_approval if run is not None else None


def _notes(att: Attempt) -> str:
    """What review should know beyond the status (repair rounds, an unchanged workspace)."""
    notes = att.notes()
    return f" ({'; '.join(notes)})" if notes else ""


def _dead_reason(dead: list[int]) -> str:
    return f"dependency card {dead[0]} failed or was archived"


def request_cancel(board: BoardStore, card: Card) -> Card:
    """The cancel action on the store alone: queued/blocked -> backlog; running -> flagged
    (its dispatcher stops the attempt and moves the card to the backlog)."""
    if card.state in ("queued", "blocked"):
        return board.move(card.id, "backlog", reason="cancelled")
    if card.state == "running":
        board.log(card.id, "cancel_requested")
        return board.update(card.id, cancel_requested=True)
    raise BoardError(f"card {card.id} is {card.state}; only queued, blocked or running cards can be cancelled")
