"""Agent sessions in the conversation: live runs (``AgentRunView``) and stored ones.

A run's events become, in order: assistant text (streamed into a ``MessageView``), a
``ToolCard`` per call (from the first ``ToolCallForming`` to ``ToolFinished``), small
``AgentNotice`` lines for malformed calls, compactions and the end of the run, and for a
planned run a ``PlanView`` checklist updated as its items are written. A reopened
session is rebuilt from its stored messages the same way (example turns and the system
prompt are folded into one notice).
"""

from __future__ import annotations

import difflib
import json
from collections.abc import Iterable
from typing import Any

from textual.widget import Widget

from agents.events import (
    AgentDone,
    AgentEventHandler,
    Compacted,
    Corrective,
    StepDone,
    StepStart,
    TextDelta,
    ToolCallForming,
    ToolCallMalformed,
    ToolCallParsed,
    ToolFinished,
    ToolStarted,
)
from agents.plan import Plan
from agents.planned import PlanUpdated
from app.tui.widgets.message import MessageView
from app.tui.widgets.plan_view import PlanView
from app.tui.widgets.tool_card import AgentNotice, ToolCard

STEP_STATES = {"cancelled": "stopped", "error": "error"}  # a step's finish reason -> reply state
STOP_NOTES = {
    "max_steps": "Stopped: the step limit was reached.",
    "max_tokens": "Stopped: the token budget of the run was used up.",
    "wall_time": "Stopped: the time limit was reached.",
    "context": "Stopped: the context is full, even after compacting old tool output.",
    "repeated": "Stopped: the agent kept repeating the same calls with nothing changed.",
    "wrote": "The file is written: the checks run now.",
}


class AgentRunView(AgentEventHandler):
    """Puts one run's events into ``conversation`` (a ``Conversation`` widget)."""

    def __init__(self, conversation) -> None:
        self.conversation = conversation
        self.reply: MessageView | None = None
        self.cards: dict[str, ToolCard] = {}
        self._pending_text = ""  # leading whitespace waits for real text
        self.plan_view: PlanView | None = None
        self._last_step = 0

    def card(self, call_id: str) -> ToolCard | None:
        return self.cards.get(call_id)

    async def event(self, ev) -> None:
        pending = self.handle(ev)
        if pending is not None:
            await pending

    async def on_step_start(self, ev: StepStart) -> None:
        if ev.step <= self._last_step:  # the next run of a planned task: call ids start again
            self.cards = {}
        self._last_step = ev.step

    async def on_text_delta(self, ev: TextDelta) -> None:
        await self._text(ev.text)

    async def on_tool_call_forming(self, ev: ToolCallForming) -> None:
        card = await self._card(f"call_{ev.step}_{ev.index}", ev.name)
        card.forming(ev.name, ev.text)

    async def on_tool_call_parsed(self, ev: ToolCallParsed) -> None:
        card = await self._card(ev.call.id, ev.call.name)
        card.set_call(ev.call.name, ev.call.arguments)

    async def on_tool_call_malformed(self, ev: ToolCallMalformed) -> None:
        await self._malformed(ev)

    async def on_step_done(self, ev: StepDone) -> None:
        await self.end_reply(STEP_STATES.get(ev.finish_reason, "done"))

    async def on_tool_started(self, ev: ToolStarted) -> None:
        card = await self._card(ev.call.id, ev.call.name)
        card.set_state("running")

    async def on_tool_finished(self, ev: ToolFinished) -> None:
        card = self.cards.get(ev.call_id)
        if card is not None:
            card.finish(ok=ev.result.ok, output=ev.result.content, approval=ev.approval,
                        duration_ms=ev.duration_ms, exit_code=ev.exit_code, diff=ev.diff,
                        cancelled=bool(ev.result.data.get("cancelled")),
                        sandboxed=ev.result.data.get("sandboxed"))

    async def on_compacted(self, ev: Compacted) -> None:
        await self.notice(compacted_text(len(ev.messages), ev.tokens_before, ev.tokens_after), "compacted")

    async def on_corrective(self, ev: Corrective) -> None:
        await self.notice(f"Sent back: {ev.message}", "corrective")

    async def on_plan_updated(self, ev: PlanUpdated) -> None:
        await self._plan(ev)

    async def on_agent_done(self, ev: AgentDone) -> None:
        await self.done(ev)

    async def _plan(self, ev: PlanUpdated) -> None:
        if self.plan_view is None:
            await self.end_reply()
            self.plan_view = await self.conversation.add(PlanView(ev.plan))
        else:
            self.plan_view.show(ev.plan)

    async def _text(self, text: str) -> None:
        if self.reply is None:
            self._pending_text += text
            if not self._pending_text.strip():
                return
            text, self._pending_text = self._pending_text, ""
            self.reply = await self.conversation.add(MessageView("assistant", state="streaming"))
        await self.reply.write(text)

    async def end_reply(self, state: str = "done") -> None:
        if self.reply is not None:
            await self.reply.finish(state)
        self.reply, self._pending_text = None, ""

    async def _card(self, call_id: str, name: str | None) -> ToolCard:
        card = self.cards.get(call_id)
        if card is None:
            await self.end_reply()  # text after the call starts a new view
            card = self.cards[call_id] = ToolCard(call_id, name)
            await self.conversation.add(card)
        return card

    async def _malformed(self, ev: ToolCallMalformed) -> None:
        card = self.cards.pop(ev.call_id, None)
        if card is not None:
            await card.remove()
        await self.notice(f"Malformed tool call ({ev.call_id}): {ev.error}", "malformed")

    async def notice(self, text: str, kind: str) -> AgentNotice:
        await self.end_reply()
        return await self.conversation.add(AgentNotice(text, kind))

    async def done(self, ev: AgentDone) -> None:
        await self.end_reply("stopped" if ev.reason == "cancelled" else "done")
        if ev.reason == "cancelled":
            await self.notice(f"Cancelled after {_steps(ev.step)}; what was done so far is kept.",
                              "cancelled")
        elif ev.reason == "error":
            await self.notice(f"The agent stopped with an error: {ev.error}", "error")
        elif ev.reason == "wrote" and self.plan_view is not None:
            pass  # a plan item's run ends at its write: the plan view shows it ticked
        elif ev.reason in STOP_NOTES:
            await self.notice(STOP_NOTES[ev.reason], "stopped")
        for card in self.cards.values():
            if card.state in ("forming", "parsed", "approval", "running"):
                card.set_state("cancelled")


def compacted_text(count: int, before: int, after: int) -> str:
    return (f"Compacted {count} old tool result{'s' if count != 1 else ''} to fit the context: "
            f"{before:,} → {after:,} tokens.")


def _steps(n: int) -> str:
    return f"{n} step{'s' if n != 1 else ''}"


# -- stored sessions ---------------------------------------------------------------------------

def stored_widgets(messages: Iterable, workspace: str | None = None, plan: dict | None = None) -> list[Widget]:
    """The widgets of a stored agent session: messages, cards (collapsed) and notices, and its
    plan (the session meta's ``plan``) as it stands, after the header."""
    out: list[Widget] = []
    cards: dict[str, ToolCard] = {}
    hidden = 0
    for m in messages:
        meta = m.meta or {}
        if meta.get("example") or m.role == "system":
            hidden += 1
            continue
        if m.role == "tool":
            card = cards.get(m.tool_call_id or "")
            if card is not None:
                _fill(card, m)
            if meta.get("compacted"):
                out.append(AgentNotice(f"Tool output of {m.tool_call_id} was compacted "
                                       f"({meta['compacted'].get('original_chars', 0):,} "
                                       "characters before).", "compacted"))
            continue
        if m.content.strip() or m.role != "assistant":
            out.append(MessageView(m.role, m.content, reasoning=m.reasoning, number=m.index + 1,
                                   state="stopped" if meta.get("finish_reason") == "cancelled"
                                   else "done"))
        for call in m.tool_calls or []:
            fn = call.get("function") or {}
            if call.get("error"):
                out.append(AgentNotice(f"Malformed tool call ({call.get('id')}): {call['error']}",
                                       "malformed"))
                continue
            card = cards[call["id"]] = ToolCard(call["id"], fn.get("name"), collapsed=True)
            card.set_call(fn.get("name") or "", _arguments(fn.get("arguments")))
            out.append(card)
    head = f"Agent session in {workspace}" if workspace else "Agent session"
    if hidden:
        head += f" · system prompt and {hidden - 1} example messages hidden" if hidden > 1 \
            else " · system prompt hidden"
    plan_view = [PlanView(Plan.from_dict(plan))] if isinstance(plan, dict) and plan.get("items") else []
    return [AgentNotice(head, "session"), *plan_view, *out]


def _arguments(value: Any) -> dict[str, Any]:
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError:
            return {"arguments": value}
    return dict(value) if isinstance(value, dict) else {}


def _fill(card: ToolCard, m) -> None:
    meta = m.meta or {}
    approval = meta.get("approval")
    card.finish(ok=bool(meta.get("ok", True)), output=m.content, approval=approval,
                duration_ms=meta.get("duration_ms"), exit_code=meta.get("exit_code"),
                diff=stored_diff(card.tool, card.arguments or {}, m.content, meta),
                cancelled=bool(meta.get("cancelled")), sandboxed=meta.get("sandboxed"))


def stored_diff(tool: str, args: dict[str, Any], content: str, meta: dict[str, Any]) -> str | None:
    """The diff of a stored write/edit (the store keeps the result text, not the tool data)."""
    if not meta.get("ok") or meta.get("approval") in ("deny", "cancelled"):
        return None
    if tool == "edit_file":
        _, _, rest = content.partition("\n")
        return rest if rest.startswith("--- ") else None
    if tool == "write_file" and meta.get("created") and isinstance(args.get("content"), str):
        name = str(meta.get("path") or args.get("path") or "file")
        lines = difflib.unified_diff([], args["content"].splitlines(keepends=True),
                                     fromfile="/dev/null", tofile=f"b/{name}")
        return "".join(line if line.endswith("\n") else line + "\n" for line in lines)
    return None
