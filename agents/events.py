"""What an agent run streams to its caller (the TUI, the headless runner, tests).

Every event carries ``step`` (1-based; 0 before the first step). Order within a step:
``StepStart``, then ``TextDelta`` / ``ToolCallForming`` / ``ToolCallParsed`` /
``ToolCallMalformed`` as the reply streams, ``StepDone``, then per call ``ApprovalNeeded``
(only for tools set to "ask"), ``ToolStarted`` and ``ToolFinished``. ``Compacted`` comes before
the ``StepStart`` whose context needed it; ``AgentDone`` is always last. Consumers that render
or record events subclass ``AgentEventHandler`` (one ``on_<event>`` method per event handled).
"""

from __future__ import annotations

import re
import threading
from dataclasses import dataclass, field
from typing import Any, Literal

from agents.protocol import ToolCall
from tools import ToolResult

Decision = Literal["once", "always", "deny"]
# "repeated": the model kept making the same calls with nothing changed in between (a loop);
# "wrote": a step wrote files and the checks take over (agent.test_after_write)
StopReason = Literal["answered", "max_steps", "max_tokens", "wall_time", "cancelled", "context", "error", "repeated",
                     "wrote"]


class ApprovalRequest:
    """A pending "may this tool run?" question. Answer it once, from any thread.

    The agent thread waits for the answer (or for cancellation, which counts as deny).
    ``"always"`` approves this tool for the rest of the session.
    """

    def __init__(self, call: ToolCall):
        self.call = call
        self._answered = threading.Event()
        self.decision: Decision | None = None
        self.reason: str | None = None

    def approve(self) -> None:
        self.answer("once")

    def approve_always(self) -> None:
        self.answer("always")

    def deny(self, reason: str | None = None) -> None:
        self.answer("deny", reason)

    def answer(self, decision: Decision, reason: str | None = None) -> None:
        if decision not in ("once", "always", "deny"):
            raise ValueError(f"unknown approval decision {decision!r}; use once, always or deny")
        if not self._answered.is_set():
            self.decision, self.reason = decision, reason
            self._answered.set()

    @property
    def answered(self) -> bool:
        return self._answered.is_set()

    def wait(self, cancelled: threading.Event, poll_s: float = 0.05) -> Decision:
        while not self._answered.wait(poll_s):
            if cancelled.is_set():
                self.answer("deny", "cancelled")
        assert self.decision is not None
        return self.decision


@dataclass(frozen=True)
class StepStart:
    step: int
    prompt_tokens: int
    max_tokens: int
    constrained: bool


@dataclass(frozen=True)
class TextDelta:
    step: int
    text: str  # visible reply text (tool-call blocks are reported as ToolCall* events)


@dataclass(frozen=True)
class ToolCallForming:
    step: int
    index: int
    text: str  # raw call text so far
    name: str | None


@dataclass(frozen=True)
class ToolCallParsed:
    step: int
    call: ToolCall


@dataclass(frozen=True)
class ToolCallMalformed:
    step: int
    call_id: str
    raw: str
    error: str


@dataclass(frozen=True)
class StepDone:
    step: int
    finish_reason: str
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    decode_tps: float
    ttft_ms: float
    cache_source: str
    text: str  # the visible reply text of this step


@dataclass(frozen=True)
class ApprovalNeeded:
    step: int
    call: ToolCall
    request: ApprovalRequest = field(compare=False)

    def approve(self) -> None:
        self.request.approve()

    def approve_always(self) -> None:
        self.request.approve_always()

    def deny(self, reason: str | None = None) -> None:
        self.request.deny(reason)


@dataclass(frozen=True)
class ToolStarted:
    step: int
    call: ToolCall


@dataclass(frozen=True)
class ToolFinished:
    step: int
    call_id: str
    name: str
    result: ToolResult
    approval: str  # "allow" (policy), "once", "always", "deny", "malformed"
    duration_ms: int
    exit_code: int | None = None  # bash only
    diff: str | None = None  # write_file / edit_file: unified diff


@dataclass(frozen=True)
class Compacted:
    step: int
    messages: tuple[int, ...]  # session message indices whose tool output was shortened
    tokens_before: int
    tokens_after: int
    chars_removed: int


@dataclass(frozen=True)
class Corrective:
    """A final answer that did not do the work was sent back once (the message is in the session)."""

    step: int
    message: str


@dataclass(frozen=True)
class AgentDone:
    step: int  # steps taken in this run
    reason: StopReason
    final_text: str
    prompt_tokens: int  # summed over steps
    cached_tokens: int
    completion_tokens: int
    wall_s: float
    error: str | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def cached_ratio(self) -> float:
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0


AgentEvent = (
    StepStart | TextDelta | ToolCallForming | ToolCallParsed | ToolCallMalformed | StepDone
    | ApprovalNeeded | ToolStarted | ToolFinished | Compacted | Corrective | AgentDone
)


_HANDLER_NAMES: dict[type, str] = {}
_RESOLVED: dict[tuple[type, type], str | None] = {}  # (handler class, event type) -> method name


def handler_name(event_type: type) -> str:
    """The ``AgentEventHandler`` method for an event type: ``ToolCallParsed`` -> ``on_tool_call_parsed``."""
    name = _HANDLER_NAMES.get(event_type)
    if name is None:
        name = _HANDLER_NAMES[event_type] = "on_" + re.sub(r"(?<!^)(?=[A-Z])", "_", event_type.__name__).lower()
    return name


class AgentEventHandler:
    """Base class for what renders or records agent events (board runner, TUI views, progress).

    ``handle(ev)`` calls the subclass's ``on_<event>`` method for ``ev``'s type or its nearest
    base (see ``handler_name``; events defined elsewhere dispatch the same way: ``PlanUpdated``
    -> ``on_plan_updated``) and returns its result; an event without a method is ignored (None).
    A subclass lists only what it handles; a new event needs one method where it matters.
    Async handlers return their coroutine for the caller to await.
    """

    def handle(self, ev: Any) -> Any:
        key = (type(self), type(ev))
        try:
            name = _RESOLVED[key]
        except KeyError:
            names = (handler_name(t) for t in type(ev).__mro__[:-1])
            name = _RESOLVED[key] = next((n for n in names if callable(getattr(type(self), n, None))), None)
        return None if name is None else getattr(self, name)(ev)
