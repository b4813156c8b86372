"""Plan, then work through it: the first part of a long task run.

The agent first answers the task with a short plan (one line per file: its path and its
features; ``agents.plan``), which is kept in the session's meta (``plan``) and the transcript.
Then each item gets a run of its own: one user turn naming the file and its features, the file
opened for the model (path line and fence, ``AgentSession.next_file``), the run ending at the
write (``end_on_write``). The write's tool result is the check of that file; the item is ticked
(meta and transcript) as soon as its file is written, so a resumed run (``mlxterm run --resume``)
goes on with the first item not yet done. An item whose runs write nothing is given up after
``MAX_ATTEMPTS``. The task's acceptance checks and repair rounds come after, in
``agents.repair.run_with_repair`` (``prior=`` these runs).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

from agents.events import AgentDone, AgentEvent, StepDone, ToolFinished
from agents.plan import Plan, parse_plan, plan_from_task
from agents.session import AgentLimits, AgentSession
from agents.transcript import Transcript

MAX_ATTEMPTS = 2  # runs per item that write nothing before the item is given up
ITEM_STEPS = 3  # steps per item run: write, and a retry after a malformed or refused block
META_KEY = "plan"


@dataclass(frozen=True)
class PlanUpdated:
    """The plan was made, or an item was ticked or given up (``plan`` is the whole plan now)."""

    step: int
    plan: Plan
    what: str  # "planned", "ticked", "given_up"
    path: str | None = None


@dataclass
class PlanOutcome:
    plan: Plan | None  # None: the reply held no plan and the task names no new file
    runs: list[AgentDone] = field(default_factory=list)


def plan_request(task_prompt: str, edit_format: str) -> str:
    """The first user turn of a planned run: the task, and the request for a plan only."""
    how = ("You will then write each file whole, its path on a line and one fenced block" if edit_format != "json"
           else "You will then write each file with write_file")
    return (f"{task_prompt.rstrip()}\n\nThis task needs more than one file. First reply with a short plan only, "
            "no code: a numbered list with one line per file to write, the file's path first, then the features "
            f"that file holds. {how}, one file at a time.")


def item_request(plan: Plan, index: int, edit_format: str) -> str:
    """The user turn for one plan item."""
    item = plan.items[index]
    what = f" It holds: {item.features}." if item.features else ""
    how = ("Write the whole file: its path on a line of its own, then one fenced block." if edit_format != "json"
           else "Call write_file with the whole file.")
    return (f"Plan:\n{plan.render()}\n\nNow write {item.path} (item {index + 1} of {len(plan.items)}).{what} "
            f"Use the ids and names the task gives and keep it consistent with the files already written. {how} "
            "Only this file.")


def load_plan(agent: AgentSession) -> Plan | None:
    data = agent.store.get_meta(agent.session_id).get(META_KEY)
    return Plan.from_dict(data) if data else None


def save_plan(agent: AgentSession, plan: Plan) -> None:
    agent.store.set_meta(agent.session_id, {META_KEY: plan.to_dict()})


def names_new_files(task_prompt: str, workspace: Path) -> bool:
    """Whether a task should be planned by default: it names two or more files ``workspace`` lacks."""
    return len(plan_from_task(task_prompt, lambda p: (workspace / p).exists()).items) >= 2


def work_through_plan(agent: AgentSession, task_prompt: str, limits: AgentLimits, *,
                      transcript: Transcript | None = None, cancelled: Callable[[], bool] = lambda: False,
                      retry_temperature: float | None = None) -> Iterator[AgentEvent | PlanUpdated | PlanOutcome]:
    """Make the plan (unless the session has one: a resumed run) and write its items; yields the
    agent's events, ``PlanUpdated`` and, last, the ``PlanOutcome``. ``limits.wall_s`` bounds all
    of it; ``limits.tokens`` each run. ``retry_temperature`` samples an item's second run (the
    0.5B at 0.2 wrote the same looping style.css block again, token for token)."""
    saved_end_on_write = agent.end_on_write
    # every run ends at its writes, the planning turn too (the 0.5B writes files right after its
    # plan): the turn is then left open for the next user message, no empty reply closes it
    agent.end_on_write = True
    try:
        yield from _work(agent, task_prompt, limits, transcript, cancelled, retry_temperature)
    finally:
        agent.next_file = None
        agent.seed_offset = 0
        agent.end_on_write = saved_end_on_write


def _work(agent: AgentSession, task_prompt: str, limits: AgentLimits, transcript: Transcript | None,
          cancelled: Callable[[], bool], retry_temperature: float | None
          ) -> Iterator[AgentEvent | PlanUpdated | PlanOutcome]:
    t0 = time.monotonic()
    runs: list[AgentDone] = []
    plan = load_plan(agent)
    if plan is None:
        # the files the task names that the workspace lacks bound the plan (a small model adds
        # tests, a README, package.json); taken before the planning turn, which may write some
        named = plan_from_task(task_prompt, lambda p: (agent.workspace / p).exists())
        agent.plan_turn = True
        replies: list[str] = []  # the reply's text, also when it went on to write files (no final answer)
        try:
            done = yield from _run(agent, plan_request(task_prompt, agent.edit_format),
                                   AgentLimits(steps=1, tokens=limits.tokens, wall_s=limits.wall_s), runs,
                                   replies=replies)
        finally:
            agent.plan_turn = False
        if done.reason in ("cancelled", "error") or cancelled():
            yield PlanOutcome(None, runs)
            return
        # files the task names that the model's plan leaves out are added after its items; a plan
        # of other files only is taken as it is; none at all falls back to the task's files
        text = "\n".join(replies) or done.final_text
        plan = parse_plan(text, [i.path for i in named.items] if len(named.items) > 1 else None)
        if not plan.items:
            plan = parse_plan(text) if len(named.items) > 1 else plan
        if plan.items:
            planned = {i.path for i in plan.items}
            plan.items += [i for i in named.items if i.path not in planned]
        else:
            plan = named
        # a call in the planning reply may already have written files
        plan.tick(list(done.extra.get("changed_files", [])))
        if not plan.items:
            yield PlanOutcome(None, runs)
            return
        save_plan(agent, plan)
        if transcript is not None:
            transcript.write("plan", done.step, source=plan.source, items=plan.to_dict()["items"],
                             text=plan.render())
        yield PlanUpdated(done.step, plan, "planned")
    try:
        while (index := _next_index(plan)) is not None:
            if cancelled() or (limits.wall_s is not None and time.monotonic() - t0 >= limits.wall_s):
                break
            item = plan.items[index]
            item.attempts += 1
            save_plan(agent, plan)
            agent.next_file = item.path
            # a retry with the same seed drew the same tokens at 0.7 as at 0.2 (the 0.5B's index.html)
            agent.seed_offset = 1000 * (item.attempts - 1)
            left = None if limits.wall_s is None else max(0.001, limits.wall_s - (time.monotonic() - t0))
            item_limits = AgentLimits(steps=min(ITEM_STEPS, limits.steps or ITEM_STEPS), tokens=limits.tokens,
                                      wall_s=left)
            done = yield from _run(agent, item_request(plan, index, agent.edit_format), item_limits, runs,
                                   plan=plan, transcript=transcript,
                                   temperature=retry_temperature if item.attempts > 1 else None)
            if done.reason in ("cancelled", "error") or cancelled():
                break
            if not item.done and item.attempts >= MAX_ATTEMPTS:
                item.given_up = True
                save_plan(agent, plan)
                if transcript is not None:
                    transcript.write("plan_given_up", done.step, path=item.path, attempts=item.attempts)
                yield PlanUpdated(done.step, plan, "given_up", item.path)
    finally:
        save_plan(agent, plan)
    yield PlanOutcome(plan, runs)


def _next_index(plan: Plan) -> int | None:
    return next((n for n, i in enumerate(plan.items) if not i.done and not i.given_up), None)


def _run(agent: AgentSession, message: str, limits: AgentLimits, runs: list[AgentDone], *,
         plan: Plan | None = None, transcript: Transcript | None = None,
         replies: list[str] | None = None, temperature: float | None = None) -> Iterator[AgentEvent | PlanUpdated]:
    done = None
    for ev in agent.run(message, limits, temperature=temperature):
        if isinstance(ev, AgentDone):
            done = ev
        elif isinstance(ev, StepDone) and replies is not None:
            replies.append(ev.text)
        yield ev
        if plan is not None and isinstance(ev, ToolFinished) and ev.result.ok and ev.diff is not None:
            # ticked as soon as the file is written: a kill after this point does not redo it
            for item in plan.tick([ev.result.data.get("path", "")]):
                save_plan(agent, plan)
                if transcript is not None:
                    transcript.write("plan_tick", ev.step, path=item.path, text=plan.render())
                yield PlanUpdated(ev.step, plan, "ticked", item.path)
    assert done is not None
    runs.append(done)
    return done
