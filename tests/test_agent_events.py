"""AgentEventHandler: dispatch by event type, and every consumer's methods name a real event."""

import asyncio
import typing
from dataclasses import dataclass

from agents import events
from agents.board.runner import _AttemptEvents
from agents.events import AgentEventHandler, Corrective, StepStart, TextDelta, handler_name
from agents.headless import _EventLine
from agents.planned import PlanUpdated
from agents.progress import Progress
from agents.repair import RepairOutcome
from app.tui.agent_mode import _RunStatus
from app.tui.agent_view import AgentRunView
from app.tui.screens.board import _CardRunEvents

CONSUMERS = (_AttemptEvents, Progress, AgentRunView, _CardRunEvents, _EventLine, _RunStatus)


def test_method_names():
    assert handler_name(StepStart) == "on_step_start"
    assert handler_name(events.ToolCallMalformed) == "on_tool_call_malformed"
    assert handler_name(PlanUpdated) == "on_plan_updated"


def test_handle_dispatches_by_type_and_ignores_the_rest():
    seen = []

    class Steps(AgentEventHandler):
        def on_step_start(self, ev):
            seen.append(ev.step)
            return "started"

    @dataclass(frozen=True)
    class LateStart(StepStart):  # a subclass dispatches to its nearest base's method
        pass

    h = Steps()
    assert h.handle(StepStart(3, 10, 20, False)) == "started"
    assert h.handle(TextDelta(3, "x")) is None
    assert h.handle(LateStart(4, 1, 2, True)) == "started"
    assert seen == [3, 4]


def test_async_handlers_return_their_coroutine():
    class View(AgentEventHandler):
        def __init__(self):
            self.notes = []

        async def on_corrective(self, ev):
            await asyncio.sleep(0)
            self.notes.append(ev.message)

    v = View()
    asyncio.run(v.handle(Corrective(2, "do the work")))
    assert v.notes == ["do the work"] and v.handle(TextDelta(1, "")) is None


def test_every_consumer_method_names_an_event():
    known = {handler_name(t) for t in typing.get_args(events.AgentEvent)}
    known |= {handler_name(PlanUpdated), handler_name(RepairOutcome)}
    for cls in CONSUMERS:
        handlers = {n for n in dir(cls) if n.startswith("on_")}
        assert handlers and handlers <= known, (cls.__name__, handlers - known)
