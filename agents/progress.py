"""Progress of a long headless run, across its agent runs and across resumes.

``Progress`` counts steps and completion tokens over every run of a task attempt (the plan, its
items, the repair rounds) and the elapsed time, starting from what an earlier process recorded
(``state()`` goes into the session's meta as ``progress``; a resumed run starts from it). Its
lines are what ``mlxterm run`` prints: ``[step 7] app.js: 812 tokens (5130 in all), 2950/3120
prompt tokens cached, 214 s``, and the plan as a checklist when it is made or ticked.
"""

from __future__ import annotations

import time
from typing import Any

from agents.events import AgentEventHandler, StepDone, ToolFinished
from agents.planned import PlanUpdated


class Progress(AgentEventHandler):
    def __init__(self, state: dict[str, Any] | None = None):
        state = state or {}
        self.steps = int(state.get("steps", 0))
        self.tokens = int(state.get("completion_tokens", 0))
        self._elapsed0 = float(state.get("elapsed_s", 0.0))
        self._t0 = time.monotonic()
        self.file: str | None = None  # the file being written (a plan item) or last written
        self._last: tuple[Any, str | None] = (None, None)

    @property
    def elapsed_s(self) -> float:
        return self._elapsed0 + time.monotonic() - self._t0

    def state(self) -> dict[str, Any]:
        return {"steps": self.steps, "completion_tokens": self.tokens, "elapsed_s": round(self.elapsed_s, 1)}

    def observe(self, ev: Any, current_file: str | None = None) -> str | None:
        """Count ``ev``; the progress line it deserves, or None (other events: ``describe_event``)."""
        line = self._line(ev, current_file)
        self._last = (ev, line)
        return line

    def line_for(self, ev: Any) -> str | None:
        """The line ``observe`` gave for ``ev`` (the last event observed), or None."""
        last, line = self._last
        return line if last is ev else None

    def _line(self, ev: Any, current_file: str | None) -> str | None:
        if current_file:
            self.file = current_file
        return self.handle(ev)

    def on_tool_finished(self, ev: ToolFinished) -> None:
        if ev.diff is not None and ev.result.ok:
            self.file = ev.result.data.get("path", self.file)

    def on_step_done(self, ev: StepDone) -> str:
        self.steps += 1
        self.tokens += ev.completion_tokens
        return (f"[step {self.steps}] {self.file or '-'}: {ev.completion_tokens} tokens ({self.tokens} in all), "
                f"{ev.cached_tokens}/{ev.prompt_tokens} prompt tokens cached, {ev.finish_reason}, "
                f"{self.elapsed_s:.0f} s")

    def on_plan_updated(self, ev: PlanUpdated) -> str:
        head = {"planned": "plan", "ticked": f"done: {ev.path}", "given_up": f"given up: {ev.path}"}[ev.what]
        return f"[step {self.steps}] {head}\n" + "\n".join("    " + line for line in ev.plan.render().splitlines())
