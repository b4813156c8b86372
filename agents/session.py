"""``AgentSession``: the agent loop over a stored session.

generate -> parse tool calls and text edits -> approval -> run tools -> append results ->
generate ... until a reply without a call (the final answer), the step / token / wall-time
limits, the context limit, or ``cancel()``. A final answer that shows code without writing it,
or a task that asks for changes while nothing changed, gets one corrective turn first. Every message goes into the SessionStore (kind "agent") with
its exact tokens, so each step's prompt extends the previous one and the engine reuses the
KV cache for it (requests carry the session id). See docs/agents.md.

Use it from a plain loop (``for ev in session.run(prompt)``) or from asyncio
(``async for ev in session.run_async(prompt)``, which runs the loop on a worker thread).
"""

from __future__ import annotations

import asyncio
import fnmatch
import json
import logging
import os
import re
import threading
import time
import weakref
from collections.abc import AsyncIterator, Iterator, Mapping
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from engine.errors import MlxtermError
from engine.runtime import GenerationRequest, Priority
from engine.serving.events import Done
from engine.serving.events import TextDelta as EngineTextDelta
from engine.sessions import Message, SessionStore
from engine.sessions.partial import PartialReply, recover_interrupted

from agents import compaction
from agents.checks import agent_sandbox
from agents.constrained import TokenTable, ToolCallConstraint, ToolCallMasks, table_width
from agents.edits import LANG_EXTS, PATH_TOKEN
from agents.events import (
    AgentDone,
    AgentEvent,
    ApprovalNeeded,
    ApprovalRequest,
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
from agents.grammar import ToolCallGrammar
from agents.ledger import TokenLedger, render_dict
from agents.loops import LoopGuard
from agents.parser import Forming, Malformed, Parsed, ParseEvent, Text, ToolCallParser, call_name
from agents.policy import ApprovalPolicy
from agents.prompts import corrective_message, example_messages, system_prompt
from agents.protocol import (
    CLOSE,
    OPEN,
    ToolCall,
    malformed_result,
    template_renders_tools,
    tool_map,
)
from agents.transcript import Transcript
from tools import ToolRegistry, ToolResult, default_registry
from tools.sandbox import Limits, warn_once

log = logging.getLogger(__name__)
MIN_STEP_TOKENS = 32  # below this a step cannot say anything useful: stop with "context"
REPEATS_TO_STOP = 1  # steps in a row made only of repeated calls that stop the run ("repeated"): a
# model that repeats a call with nothing changed is looping (the 1.5B then repeats again, or shows
# code without a path), and the checks' output is the better next prompt
# a planning turn starts the model's reply with the list (the 0.5B answered the request for a
# plan by writing the code at once)
PLAN_OPENING = "Plan:\n1. "
_DATA_KEYS = ("path", "exit_code", "timed_out", "cancelled", "created", "bytes_written", "replacements",
              "lines_added", "lines_removed", "content_truncated", "denied", "malformed", "sandboxed", "repeated")


class AgentError(MlxtermError):
    """An agent cannot run with this engine, workspace or session."""


@dataclass
class AgentLimits:
    """Per-run limits; None falls back to the profile (steps) or means no limit."""

    steps: int | None = None
    tokens: int | None = None  # completion tokens over the whole run
    wall_s: float | None = None


@dataclass
class AgentOptions:
    """How the agent runs; every None falls back to the profile's ``agent:`` / ``sampling:``."""

    system_prompt: str | None = None  # base prompt (the tools block is added when needed)
    examples: bool = True  # few-shot example turns at the start of a new session
    tools: tuple[str, ...] | None = None
    approvals: Mapping[str, str] | None = None
    allow: tuple[str, ...] = ()  # tools allowed without asking (headless --allow)
    unconfined_allow: tuple[str, ...] | None = None  # explicit consent to run unsandboxed (None: allow)
    interactive: bool = True  # False: "ask" means deny (nobody to ask)
    constrained: bool | None = None
    temperature: float | None = None
    seed: int | None = None  # step n samples with seed + n
    max_tokens_per_step: int | None = None
    network: bool = False  # bash (and task checks) may reach the network from the sandbox
    edit_format: str | None = None  # whole | diff | json (profile agent.edit_format)
    corrective_turns: int = 1  # per run: "nothing was written" nudges before a final answer counts
    protected: tuple[str, ...] = ()  # workspace paths (globs) write_file / edit_file may not change
    sandbox_hide: tuple[str, ...] = ()  # host paths bash must not see (a task run's own directory)
    sandbox_limits: Limits | None = None  # a task's sandbox limits (None: the defaults)


@dataclass
class _Totals:
    prompt: int = 0
    cached: int = 0
    completion: int = 0


@dataclass
class _Pending:
    """A call (or malformed call) waiting for its result, in reply order."""

    id: str
    name: str
    call: ToolCall | None = None
    error: str | None = None
    raw: str = ""


_MASK_CACHE: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def shared_masks(engine, schemas: list[dict[str, Any]]) -> ToolCallMasks:
    """One ToolCallMasks per (tokenizer, tool set): its mask cache outlives single runs."""
    tok = engine.tokenizer
    per_tok = _MASK_CACHE.setdefault(tok, {})
    key = tuple(sorted(s["function"]["name"] for s in schemas))
    masks = per_tok.get(key)
    if masks is None:
        grammar = ToolCallGrammar.from_schemas(schemas, close_marker=CLOSE)
        masks = per_tok[key] = ToolCallMasks(grammar, TokenTable(tok, table_width(engine)), OPEN)
    return masks


class AgentSession:
    """An agent bound to one stored session, one workspace and one engine."""

    def __init__(self, engine, store: SessionStore, session_id: str, *,
                 options: AgentOptions | None = None, transcript: Transcript | None = None):
        if engine.completion_mode:
            raise AgentError(f"profile {engine.profile.name} has no chat template (chat.template: none); "
                             "agents need a chat model")
        session = store.get(session_id)
        if session.kind != "agent" or not session.workspace:
            raise AgentError(f"session {session.id} is not an agent session with a workspace")
        workspace = Path(session.workspace)
        if not workspace.is_dir():
            raise AgentError(f"workspace {workspace} of session {session.id} does not exist")
        self.engine = engine
        self.store = store
        self.session_id = session.id
        self.workspace = workspace
        self.options = options or AgentOptions()
        self.transcript = transcript or Transcript(None)
        agent_cfg = engine.profile.agent
        names = self.options.tools or agent_cfg.tools
        self.sandbox = agent_sandbox(network=self.options.network, hide=self.options.sandbox_hide,
                                     limits=self.options.sandbox_limits)
        base = default_registry(workspace, sandbox=self.sandbox)
        self.registry = ToolRegistry(base.workspace, [base.get(n) for n in names if base.get(n)])
        edit_format = self.options.edit_format or agent_cfg.edit_format
        writes = {"write_file", "edit_file"} & set(self.registry.names())
        # text edits run as write_file / edit_file: without those tools there is nothing to write with
        self.edit_format = edit_format if writes else "json"
        unconfined = () if self.sandbox.active else ("bash",)
        # Said once per process (the TUI shows it; logs and transcripts keep it).
        self.sandbox_notice = warn_once(self.sandbox.status) if "bash" in self.registry.names() else None
        if self.sandbox_notice:
            log.warning("%s", self.sandbox_notice)
        # in a text edit format, files are written as text: the JSON tools offered are the others
        # (a JSON write_file call still parses; the grammar only offers what the prompt does)
        text_only = ("write_file", "edit_file") if self.edit_format != "json" else ()
        self.schemas = [s for s in self.registry.schemas() if s["function"]["name"] not in text_only]
        self.tool_params = tool_map(self.registry.schemas())
        self.native_tools = template_renders_tools(engine.render)
        self.ledger = TokenLedger(engine, self.schemas if self.native_tools else None)
        self.constrained = (agent_cfg.constrained_tool_calls if self.options.constrained is None
                            else self.options.constrained) and bool(self.schemas)
        self.masks = shared_masks(engine, self.schemas) if self.constrained else None
        self.policy = ApprovalPolicy(self.options.approvals or agent_cfg.approval,
                                     allow=self.options.allow, interactive=self.options.interactive,
                                     unsandboxed=unconfined, unconfined_allow=self.options.unconfined_allow)
        self.changed_files: list[str] = []  # written or edited in the current run
        self.corrective_turns = 0
        # a step whose calls all wrote files ends the run ("wrote"): set by run_with_repair when the
        # checks run right after each write (profile agent.test_after_write)
        self.end_on_write = False
        self._last_written: list[str] = []  # files of the last run that ended at its write
        # a planned run (agents.planned): the planning turn answers in text (no forced call, no
        # corrective turn); each item's run opens its file for the model
        self.plan_turn = False
        self.next_file: str | None = None
        self.seed_offset = 0  # added to each step's seed (a plan item's retry samples new tokens)
        self._seen_calls: dict[tuple[str, str], int] = {}
        self._commands_run = 0
        self._targets: list[str] | None = None  # files the task names (set by the first run)
        self._cancel = threading.Event()
        self._stop_reason: str | None = None
        self._handle = None
        self._lock = threading.Lock()

    # -- construction -------------------------------------------------------------------------
    @classmethod
    def create(cls, engine, store: SessionStore, workspace: str | Path, *, title: str | None = None,
               options: AgentOptions | None = None, transcript: Transcript | None = None,
               meta: Mapping[str, Any] | None = None, session_id: str | None = None) -> AgentSession:
        """A new agent session in ``workspace``: system prompt (and example turns) stored.
        ``session_id`` names the session (else the store generates an id)."""
        ws = Path(workspace).expanduser().resolve()
        if not ws.is_dir():
            raise AgentError(f"workspace {ws} is not a directory")
        session = store.create(title=title or "Agent run", profile=engine.profile.name, kind="agent",
                               workspace=str(ws), meta=dict(meta or {}), session_id=session_id)
        agent = cls(engine, store, session.id, options=options, transcript=transcript)
        agent._bootstrap()
        return agent

    @classmethod
    def open(cls, engine, store: SessionStore, session_id: str, *, options: AgentOptions | None = None,
             transcript: Transcript | None = None) -> AgentSession:
        """Continue a stored agent session (a headless run, or an earlier interactive one)."""
        return cls(engine, store, session_id, options=options, transcript=transcript)

    def _bootstrap(self) -> None:
        text = system_prompt(self.options.system_prompt, self.schemas, self.native_tools, self.edit_format)
        self._append([{"role": "system", "content": text}], generation_prompt=False, metas=[{}])
        if not self.options.examples:
            return
        for m in example_messages(self.registry.names(), self.edit_format):
            meta: dict[str, Any] = {"example": True}
            calls = None
            if "call" in m:
                name, args = m["call"]
                calls = [ToolCall(m["call_id"], name, args).as_message_call()]
                meta["raw_text"] = m["content"]
            msg = {k: m[k] for k in ("role", "content", "tool_call_id", "name") if k in m}
            self._append([msg], generation_prompt=m["role"] in ("user", "tool"), metas=[meta],
                         tool_calls=[calls])
        self.store.set_meta(self.session_id, {"agent": self.describe()})

    def describe(self) -> dict[str, Any]:
        return {
            "protocol": "native" if self.native_tools else "text",
            "edit_format": self.edit_format,
            "tools": self.registry.names(),
            "constrained": self.constrained,
            "approval": {n: self.policy.decide(n) for n in self.registry.names()},
            "sandbox": {"backend": self.sandbox.status.backend, "active": self.sandbox.active,
                        "network": self.sandbox.policy.network, "detail": self.sandbox.status.describe()},
        }

    # -- control ------------------------------------------------------------------------------
    def cancel(self, reason: str = "cancelled") -> None:
        """Stop the run (or the next one, if none is running): generation ends within a token,
        a running tool is killed, pending approvals count as denied. The transcript stays
        valid (every call gets a result)."""
        with self._lock:
            if self._stop_reason is None:
                self._stop_reason = reason
            self._cancel.set()
            handle = self._handle
        if handle is not None:
            handle.cancel()

    @property
    def cancelled(self) -> bool:
        return self._cancel.is_set()

    # -- running ------------------------------------------------------------------------------
    def run(self, prompt: str, limits: AgentLimits | None = None, *,
            temperature: float | None = None) -> Iterator[AgentEvent]:
        """Add ``prompt`` as a user message and run steps until done; yields AgentEvents.

        An ``ApprovalNeeded`` must be answered before iteration continues (or from another
        thread while this one waits); ``cancel()`` may be called from any thread.
        """
        limits = limits or AgentLimits()
        timer = None
        if limits.wall_s is not None:
            timer = threading.Timer(limits.wall_s, self.cancel, kwargs={"reason": "wall_time"})
            timer.daemon = True
            timer.start()
        try:
            yield from self._run(prompt, limits, temperature)
        finally:
            if timer is not None:
                timer.cancel()
            with self._lock:  # a cancel applies to one run; the next starts afresh
                self._cancel.clear()
                self._stop_reason = None

    async def run_async(self, prompt: str, limits: AgentLimits | None = None) -> AsyncIterator[AgentEvent]:
        """``run`` on a worker thread, events delivered to the running event loop."""
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue = asyncio.Queue()
        end = object()

        def work() -> None:
            try:
                for ev in self.run(prompt, limits):
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
                self.cancel()

    def _run(self, prompt: str, limits: AgentLimits, temperature: float | None = None) -> Iterator[AgentEvent]:
        t0 = time.monotonic()
        totals = _Totals()
        step, final_text, reason, error = 0, "", None, None
        max_steps = limits.steps or self.engine.profile.agent.max_steps
        self.changed_files: list[str] = []  # written or edited in this run (tool results that succeeded)
        self.corrective_turns = 0
        self._seen_calls: dict[tuple[str, str], int] = {}  # calls since the last file change -> step
        self._commands_run = 0  # bash calls that ran in this run
        repeats = 0
        if self._targets is None:
            self._targets = self._task_files(prompt)
        self.transcript.write("run", 0, session_id=self.session_id, profile=self.engine.profile.name,
                              workspace=str(self.workspace), prompt=prompt, limits=asdict(limits),
                              agent=self.describe(), tools=self.schemas)
        try:
            self._close_interrupted_turn()
            self._append([{"role": "user", "content": prompt}], generation_prompt=True, metas=[{}])
            while reason is None:
                if self._cancel.is_set():
                    reason = self._stop_reason or "cancelled"
                    break
                if step >= max_steps:
                    reason = "max_steps"
                    break
                left = None if limits.tokens is None else limits.tokens - totals.completion
                if left is not None and left <= 0:
                    reason = "max_tokens"
                    break
                step += 1
                budget = yield from self._budget(step, left)
                if budget is None:
                    reason = "context"
                    break
                done, parser = yield from self._generate(step, budget, temperature)
                totals.prompt += done.usage.prompt_tokens
                totals.cached += done.usage.cached_tokens
                totals.completion += done.usage.completion_tokens
                if done.error:
                    reason, error = "error", done.error
                    break
                pending = _pending(parser)
                if not pending and done.finish_reason == "stop" and not self._cancel.is_set():
                    nudge = self._correction(prompt, parser)
                    if nudge is not None:
                        yield nudge
                        continue
                if not pending:
                    final_text = parser.visible_text.strip()
                    if done.finish_reason == "cancelled":
                        reason = self._stop_reason or "cancelled"
                    elif done.finish_reason == "length" and left is not None and totals.completion >= limits.tokens:
                        reason = "max_tokens"  # cut off by the run's budget, not a finished answer
                    else:
                        reason = "answered"
                    break
                all_repeated, wrote = yield from self._run_tools(step, pending)
                repeats = repeats + 1 if all_repeated else 0
                if repeats >= REPEATS_TO_STOP:
                    reason = "repeated"
                elif wrote:
                    reason = "wrote"  # the step wrote the files: the checks take over
                    self._last_written = list(dict.fromkeys(self.changed_files))
        except MlxtermError as e:
            reason, error = "error", str(e)
        except Exception as e:  # a bug must end the run with a record, not a silent stop
            log.exception("agent run failed")
            reason, error = "error", f"{type(e).__name__}: {e}"
        wall = time.monotonic() - t0
        summary = {"reason": reason, "steps": step, "prompt_tokens": totals.prompt,
                   "cached_tokens": totals.cached, "completion_tokens": totals.completion,
                   "changed_files": self.changed_files, "corrective_turns": self.corrective_turns,
                   "wall_s": round(wall, 3), "error": error}
        self.transcript.write("done", step, **summary, final_text=final_text)
        try:
            self.store.set_meta(self.session_id, {"last_run": summary})
        except MlxtermError as e:
            log.warning("could not record the run in session %s: %s", self.session_id, e)
        yield AgentDone(step, reason, final_text, totals.prompt, totals.cached, totals.completion,
                        round(wall, 3), error,
                        {"changed_files": list(self.changed_files), "corrective_turns": self.corrective_turns})

    def _correction(self, prompt: str, parser: ToolCallParser) -> Corrective | None:
        """One corrective turn per run when a final answer shows code for a file without
        writing it, or the task asks for changes and nothing changed (see prompts)."""
        if self.corrective_turns >= self.options.corrective_turns or self.plan_turn:
            return None
        # a shell command may have changed files too: only "nothing ran, nothing written" counts
        acted = bool(self.changed_files) or self._commands_run > 0
        message = corrective_message(prompt, parser.visible_text, acted, self.edit_format)
        if message is None:
            return None
        self.corrective_turns += 1
        step = self.store.messages(self.session_id, tokens=False)[-1].meta.get("step", 0)
        self.transcript.write("corrective", step, message=message)
        self._append([{"role": "user", "content": message}], generation_prompt=True,
                     metas=[{"corrective": True, "step": step}], step=step)
        return Corrective(step, message)

    # -- drafts from outside the loop (agents.candidates) ---------------------------------------
    def prompt_with(self, message: str) -> list[int]:
        """The context as it would be after a user ``message`` (nothing is stored)."""
        fed, new = self._tokens_after([{"role": "user", "content": message}], True)
        return fed + new[0]

    def close_turn(self) -> None:
        """End a turn a run left open after tool results, so a user message may follow."""
        self._close_interrupted_turn()

    def ends_with_answer(self) -> bool:
        """Whether the context ends with a finished turn (a new user message may follow): an
        assistant reply, or the results of a step that ended the run at its writes."""
        last = self.store.messages(self.session_id, tokens=False)[-1:]
        return bool(last) and (last[0].role == "assistant" or bool(last[0].meta.get("ends_run")))

    def step_budget(self, prompt_tokens: int) -> int:
        """max_tokens for one step after a prompt of this length (the loop's rule, without compaction)."""
        return max(1, min(self._step_tokens(), self.engine.profile.context.max_context - prompt_tokens))

    def _step_tokens(self) -> int:
        profile = self.engine.profile
        return self.options.max_tokens_per_step or profile.agent.max_tokens_per_step or profile.sampling.max_tokens

    def file_opening(self) -> str:
        """What the next step's reply starts with (the file's path line and fence, or nothing)."""
        return self._file_opening()

    def adopt(self, message: str, done: Done, parser: ToolCallParser, handle,
              opening_ids: list[int] | None = None) -> Iterator[AgentEvent]:
        """Store ``message`` and a reply generated for it elsewhere (``prompt_with(message)`` and
        ``opening_ids`` were its prompt, ``handle`` its request; ``done`` holds the opening too),
        then run the reply's calls as if the loop had made it. Returns the files they changed."""
        msgs = self.store.messages(self.session_id, tokens=False)
        step = max((m.meta.get("step", 0) for m in msgs), default=0) + 1
        self._append([{"role": "user", "content": message}], generation_prompt=True, metas=[{"step": step}], step=step)
        partial = PartialReply(self.store, self.session_id, _Opened(handle, opening_ids or []),
                               meta={"step": step, "candidate": True})
        self._record_reply(step, done, parser, None, 0.0, partial, {"candidate": True})
        for call in parser.calls:
            yield ToolCallParsed(step, call)
        self.changed_files = []
        pending = _pending(parser)
        if pending:
            _, wrote = yield from self._run_tools(step, pending)
            if wrote:
                self._last_written = list(dict.fromkeys(self.changed_files))
        return list(self.changed_files)

    # -- one step -----------------------------------------------------------------------------
    def _budget(self, step: int, tokens_left: int | None) -> Iterator[AgentEvent]:
        """max_tokens for this step, compacting old tool output when the context is short."""
        limit = self.engine.profile.context.max_context
        want = self._step_tokens()
        if tokens_left is not None:
            want = min(want, tokens_left)
        used = self.store.get(self.session_id).token_count
        if limit - used < want:
            ev = self._compact(step, want - (limit - used), limit - want)
            if ev is not None:
                yield ev
            used = self.store.get(self.session_id).token_count
        room = min(want, limit - used)
        return room if room >= MIN_STEP_TOKENS else None

    def _generate(self, step: int, max_new: int, temperature: float | None = None) -> Iterator[AgentEvent]:
        prompt_ids = self.store.context_tokens(self.session_id)
        # a plan item's run (``next_file``) opens its file at every step: a retry after a block cut
        # off by a loop is the same file again (the 0.5B answered it with prose); so does a run that
        # ends at its write: a step past the first means no write changed the file yet, and a free
        # step there answered "is_even now passes all tests" and wrote the example's parity.py (1.5B, etl)
        every_step = self.next_file or self.end_on_write
        opening = (PLAN_OPENING if self.plan_turn else self._file_opening()) if step == 1 or every_step else ""
        opening_ids = self.engine.tokenizer.encode(opening) if opening else []
        prompt_ids = prompt_ids + opening_ids
        force = step == 1 and self.engine.profile.agent.first_step_tool_call and not self.plan_turn
        constraint = ToolCallConstraint(self.masks, force_call=force, max_tokens=max_new) if self.masks else None
        mask_ms0 = self.masks.mask_ms if self.masks else 0.0
        seed = None if self.options.seed is None else self.options.seed + step + self.seed_offset
        temperature = self.options.temperature if temperature is None else temperature
        params = self.engine.sampling(max_tokens=max_new, temperature=temperature, seed=seed,
                                      repetition_penalty=self.engine.profile.agent.repetition_penalty)
        request = GenerationRequest(prompt_ids, params, session_id=self.session_id,
                                    split_reasoning=self.engine.profile.chat.reasoning, constraint=constraint,
                                    priority=Priority.AGENT)
        self.transcript.write("request", step, prompt_tokens=len(prompt_ids), max_tokens=max_new,
                              constrained=constraint is not None,
                              sampling={"temperature": params.temperature, "top_p": params.top_p, "seed": seed})
        yield StepStart(step, len(prompt_ids), max_new, constraint is not None)
        text_edits = self.edit_format != "json"
        parser = ToolCallParser(self.tool_params, id_prefix=f"call_{step}", text_edits=text_edits,
                                infer_path=self.infer_path if text_edits else None)
        with self._lock:
            self._handle = handle = self.engine.submit(request)
            if self._cancel.is_set():
                handle.cancel()
        partial = PartialReply(self.store, self.session_id, _Opened(handle, opening_ids), meta={"step": step})
        done: Done | None = None
        guard, raw, early, file_closed = LoopGuard(), opening, None, False
        for pe in parser.feed(opening):
            yield _event(step, pe)
        try:
            for ev in handle:
                if isinstance(ev, EngineTextDelta):
                    closed = False
                    for pe in parser.feed(ev.text):
                        closed = closed or (bool(opening) and isinstance(pe, Parsed) and not self.plan_turn)
                        yield _event(step, pe)
                    partial.update(parser.visible_text)  # a kill keeps the step's reply so far
                    raw += ev.text
                    if closed and early is None and not file_closed:
                        # the opened file's block closed: the checks take over; what the model
                        # would add (an explanation, the test file) costs decode time for nothing
                        file_closed = True
                        handle.cancel()
                    if early is None and not file_closed:
                        early = self._stop_early(parser, guard, raw)
                        if early is not None:
                            handle.cancel()  # the rest of the budget would be wasted
                elif isinstance(ev, Done):
                    done = ev
            for pe in parser.finish():
                if early is not None and early[0] == "planned" and isinstance(pe, Malformed):
                    continue  # the file block the plan stopped at: not a call
                yield _event(step, pe)
        finally:
            with self._lock:
                self._handle = None
            if done is None:
                partial.close()
        assert done is not None
        if opening_ids:  # the reply is the opening and what the model wrote after it
            done = replace(done, text=opening + done.text,
                           completion_token_ids=opening_ids + list(done.completion_token_ids))
        if file_closed and done.finish_reason == "cancelled" and not self._cancel.is_set():
            done = replace(done, finish_reason="stop")
        elif early is not None and early[0] == "planned" and done.finish_reason == "cancelled" \
                and not self._cancel.is_set():
            # the plan is the reply: the block it went on to open stays in the context as generated
            # (exact tokens), and is no call; its file gets its own turn
            done = replace(done, finish_reason="stop")
            parser.malformed = []
            self.transcript.write("stopped_early", step, reason="planned", note=early[1],
                                  completion_tokens=done.usage.completion_tokens)
        elif early is not None and done.finish_reason == "cancelled" and not self._cancel.is_set():
            reason, note = early
            done = replace(done, finish_reason=reason)
            parser.malformed = [replace(m, error=f"{m.error} ({note})") for m in parser.malformed]
            self.transcript.write("stopped_early", step, reason=reason, note=note,
                                  completion_tokens=done.usage.completion_tokens)
        self._record_reply(step, done, parser, constraint, mask_ms0, partial)
        yield StepDone(step, done.finish_reason, done.usage.prompt_tokens, done.usage.cached_tokens,
                       done.usage.completion_tokens, done.timings.decode_tps, done.timings.ttft_ms,
                       done.cache_source, parser.visible_text.strip())
        return done, parser

    def _record_reply(self, step: int, done: Done, parser: ToolCallParser, constraint, mask_ms0: float,
                      partial: PartialReply, extra_meta: dict[str, Any] | None = None) -> None:
        tok = self.engine.tokenizer
        ids = list(done.completion_token_ids)
        body = ids[:-1] if ids and ids[-1] in tok.eos_ids else ids
        raw = tok.decode(body)
        usage = {"prompt_tokens": done.usage.prompt_tokens, "cached_tokens": done.usage.cached_tokens,
                 "completion_tokens": done.usage.completion_tokens}
        cinfo = None
        if constraint is not None:
            cinfo = {"tokens": constraint.tokens, "overhead_ms": round(constraint.overhead_s * 1000, 2),
                     "mask_build_ms": round(self.masks.mask_ms - mask_ms0, 2), "wound_up": constraint.wound_up}
        self.transcript.write("response", step, text=done.text, raw_text=raw, finish_reason=done.finish_reason,
                              usage=usage, timings=asdict(done.timings), cache_source=done.cache_source,
                              error=done.error, constraint=cinfo,
                              lane=done.lane, batch_max=done.batch_max)
        calls = []
        for p in _pending(parser):
            if p.call is not None:
                calls.append(p.call.as_message_call())
            else:
                calls.append({"id": p.id, "type": "function", "function": {"name": p.name, "arguments": {}},
                              "error": p.error, "raw": p.raw})
        meta = {"step": step, "finish_reason": done.finish_reason, "usage": usage, "timings": asdict(done.timings),
                "cache": {"source": done.cache_source, "restore_ms": done.timings.restore_ms}, "raw_text": raw}
        if cinfo is not None:
            meta["constraint"] = cinfo
        if done.error:
            meta["error"] = done.error
        meta.update(extra_meta or {})
        msg = partial.finish(parser.visible_text.strip(), tool_calls=calls or None, token_ids=ids, meta=meta)
        self.transcript.message(msg, step)

    # -- tools --------------------------------------------------------------------------------
    def _run_tools(self, step: int, pending: list[_Pending]) -> Iterator[AgentEvent]:
        """Run the step's calls; returns (whether every one repeated an earlier call (a loop),
        whether the run ends here because every call wrote a file and ``end_on_write`` is set)."""
        messages, metas = [], []
        repeated = 0
        changed = len(self.changed_files)
        for p in pending:
            earlier = self._repeat_of(p)
            if earlier is not None:
                repeated += 1
                result, approval = ToolResult.failure(
                    f"Not run: this {p.name} call is the same as in step {earlier} and nothing changed since, so "
                    "its result would be the same. Do something else: fix the code, run the tests, or give "
                    "your final answer.", repeated=True), "repeated"
            else:
                result, approval = yield from self._one_tool(step, p)
            data = result.data
            diff = data.get("diff") if p.name in ("write_file", "edit_file") else None
            if p.name == "bash" and approval not in ("deny", "malformed", "cancelled", "repeated"):
                self._commands_run += 1
            if diff is not None and result.ok and (diff or data.get("created") or data.get("diff_skipped")):
                self.changed_files.append(data["path"])
                self._seen_calls.clear()  # after a change, the same test run means something new
            elif diff is not None and result.ok and self.end_on_write:
                # the 1.5B answers a failing test run with the same file, then "The checks passed."
                result = replace(result, content=f"{result.content} This is the same code that failed the checks: "
                                                 "change it to fix the failures.")
            if earlier is None:
                self._seen_calls.setdefault(_pending_key(p), step)
            yield ToolFinished(step, p.id, p.name, result, approval, int(data.get("duration_ms", 0)),
                               data.get("exit_code") if p.name == "bash" else None, diff)
            self.transcript.write("tool_result", step, call_id=p.id, name=p.name, ok=result.ok,
                                  content=result.content, error=result.error, approval=approval,
                                  duration_ms=data.get("duration_ms"), data=data)
            messages.append({"role": "tool", "content": result.content, "tool_call_id": p.id, "name": p.name})
            meta = {"ok": result.ok, "approval": approval, "step": step,
                    **{k: data[k] for k in _DATA_KEYS if k in data}}
            if result.error:
                meta["error"] = result.error
            if "duration_ms" in data:
                meta["duration_ms"] = data["duration_ms"]
            metas.append(meta)
        # every call a file edit and at least one changed a file (a refused edit of the task's
        # tests beside the solution does not keep the run going: the checks report on it)
        wrote = (self.end_on_write and len(self.changed_files) > changed
                 and all(p.name in ("write_file", "edit_file") for p in pending))
        if wrote:  # the run ends here: the turn stays open for the repair message (no generation prompt)
            metas = [{**m, "ends_run": True} for m in metas]
        self._append(messages, generation_prompt=not wrote, metas=metas, step=step)
        return repeated == len(pending), wrote

    def _repeat_of(self, p: _Pending) -> int | None:
        """The step of an earlier identical call (or identical malformed one) with no file change
        since, or None."""
        return self._seen_calls.get(_pending_key(p))

    def _one_tool(self, step: int, p: _Pending) -> Iterator[AgentEvent]:
        if p.call is None and p.name in ("write_file", "edit_file") and self.edit_format != "json":
            content = f"Error: {p.error or 'the edit is malformed'}. Nothing was written."  # a text edit
            return ToolResult(False, content, {"malformed": True, "raw": p.raw}, p.error), "malformed"
        if p.call is None:
            content = malformed_result(p.error or "the tool call is malformed", self.tool_params)
            return ToolResult(False, content, {"malformed": True, "raw": p.raw}, p.error), "malformed"
        call = p.call
        refusal = self.refuses(call)
        if refusal:
            return ToolResult.failure(refusal, denied=True), "deny"
        if self._cancel.is_set():
            return ToolResult.failure(f"{call.name} was not run: the run was cancelled", cancelled=True), "cancelled"
        verdict = self.policy.decide(call.name)
        approval, reason = verdict, None
        if verdict == "ask":
            request = ApprovalRequest(call)
            yield ApprovalNeeded(step, call, request)
            approval = request.wait(self._cancel)
            reason = request.reason
            if approval == "always":
                self.policy.remember(call.name)
        if verdict != "allow":
            self.transcript.write("approval", step, call_id=call.id, tool=call.name, policy=verdict,
                                  decision=approval, reason=reason)
        if approval == "deny":
            message = self.policy.denial_message(call.name) if reason != "cancelled" else \
                f"{call.name} was not run: the run was cancelled"
            if reason and reason != "cancelled":
                message += f" ({reason})"
            return ToolResult.failure(message, denied=True), "deny"
        yield ToolStarted(step, call)
        return self.registry.run(call.name, call.arguments, self._cancel), approval

    def refuses(self, call: ToolCall) -> str | None:
        """Why the agent would refuse this call before running it (protected path, an inferred
        path whose block is no whole file), or None."""
        return self._protected(call) or (self._not_whole(call) if call.inferred_path else None)

    def _stop_early(self, parser: ToolCallParser, guard: LoopGuard, raw: str) -> tuple[str, str] | None:
        """(finish reason, note) when the step should stop now: the reply loops, it started
        writing a file its edit may not change (a task's tests: it would be refused anyway), or
        a planning reply went on from the plan to a file (each file gets its own turn)."""
        if guard.update(raw):
            return "looped", ("the reply kept repeating the same lines and was stopped; write the whole file "
                              "again, each line once")
        path = parser.open_edit_path
        if path and self.plan_turn:
            return "planned", f"the planning reply stopped where it began writing {path}"
        if path and self._protected_path(path):
            return "protected", f"stopped: {path} is protected by the task and cannot be changed"
        return None

    def _task_files(self, prompt: str) -> list[str]:
        """Existing, unprotected workspace files the task prompt names: where a fenced block
        with no path line may go (``infer_path``)."""
        ws = self.registry.workspace
        out = []
        for token in dict.fromkeys(PATH_TOKEN.findall(prompt)):
            try:
                real = ws.resolve(token)
            except Exception:  # noqa: BLE001 (outside the workspace or malformed: not a target)
                continue
            name = ws.display(real)
            if real.is_file() and not self._protected_path(name):
                out.append(name)
        return out

    def _file_opening(self) -> str:
        """In a run that ends at its write (``end_on_write``), each step opens the
        one file to write: a path line and the fence, so it cannot answer in prose instead (the
        1.5B did in 1 of 3 exercises) and the block's header is well-formed. The file: the one
        the last run wrote, else the one task file; none (free reply) when that is not one file."""
        if not self.end_on_write or self.edit_format != "whole" or self.plan_turn:
            return ""
        files = [self.next_file] if self.next_file else (self._last_written or self._targets or [])
        if len(files) != 1:
            return ""
        ext = files[0].rsplit(".", 1)[-1].lower() if "." in files[0] else ""
        lang = next((lang for lang, exts in LANG_EXTS.items() if ext in exts and len(lang) > 2), "")
        return f"{files[0]}\n```{lang}\n"

    def infer_path(self, lang: str) -> str | None:
        """The one task file a ``lang`` fenced block can be, or None."""
        exts = LANG_EXTS.get(lang.lower(), ())
        matches = [t for t in self._targets or [] if t.rsplit(".", 1)[-1].lower() in exts]
        return matches[0] if len(matches) == 1 else None

    def _not_whole(self, call: ToolCall) -> str | None:
        """Why a block with no path line is not written over its inferred file (it does not look
        like the whole file: an excerpt in an explanation), or None."""
        path = call.arguments["path"]
        try:
            old = self.registry.workspace.resolve(path).read_text(encoding="utf-8", errors="replace")
        except OSError:
            return None
        new = call.arguments["content"]
        if path.endswith(".py"):
            missing = [n for n in _top_level_names(old) if n not in _top_level_names(new)]
            if not missing:
                return None
            what = f"it lacks {', '.join(missing[:5])} of {path}"
        elif len(new.splitlines()) * 2 >= len(old.splitlines()):
            return None
        else:
            what = f"it is much shorter than {path}"
        return (f"Not written: the code block has no path line and does not look like the whole file ({what}). "
                f"To write {path}, put its path on the line before the block and give the whole file.")

    def _protected(self, call: ToolCall) -> str | None:
        """Why a write to a protected path (a task's tests) is refused, or None."""
        if call.name not in ("write_file", "edit_file"):
            return None
        return self._protected_path(call.arguments.get("path", ""))

    def _protected_path(self, path: str) -> str | None:
        if not self.options.protected:
            return None
        try:
            rel = self.registry.workspace.display(self.registry.workspace.resolve(path))
        except Exception:  # noqa: BLE001 (an invalid path: the tool itself says why)
            return None
        if any(fnmatch.fnmatch(rel, pattern) for pattern in self.options.protected):
            return (f"{rel} is protected by the task (it holds the tests): it cannot be changed. "
                    "Change the solution instead.")
        return None

    # -- messages -----------------------------------------------------------------------------
    def _append(self, messages: list[dict[str, Any]], *, generation_prompt: bool, metas: list[dict[str, Any]],
                step: int = 0, tool_calls: list | None = None) -> list[Message]:
        _, ids = self._tokens_after(messages, generation_prompt)
        stored = []
        for i, (m, tokens, meta) in enumerate(zip(messages, ids, metas, strict=True)):
            calls = tool_calls[i] if tool_calls else None
            msg = self.store.add_message(self.session_id, m["role"], m["content"], tool_calls=calls,
                                         tool_call_id=m.get("tool_call_id"), name=m.get("name"),
                                         token_ids=tokens, meta=meta)
            self.transcript.message(msg, step)
            stored.append(msg)
        return stored

    def _tokens_after(self, messages: list[dict[str, Any]], generation_prompt: bool) -> tuple[list[int], list[list[int]]]:
        """(the stored context's tokens, each of ``messages``' tokens appended after it). A run
        that ended at its write (``ends_run``) left no generation prompt after its results."""
        history = self.store.messages(self.session_id)
        fed = [t for m in history for t in m.token_ids]
        prompted = False if history and history[-1].meta.get("ends_run") else None
        return fed, self.ledger.tokens_for([render_dict(m) for m in history], fed, messages, generation_prompt,
                                           prompted)

    def _close_interrupted_turn(self) -> None:
        """A run stopped after tool results (or a crash after the user message) leaves the
        context ending in a generation prompt; close that turn with an empty assistant reply
        so the next user message follows a complete turn. A reply left streaming by a killed
        process is marked interrupted and kept (its exact tokens stay in the context)."""
        recover_interrupted(self.store, self.session_id)
        last = self.store.messages(self.session_id, tokens=False)[-1:]
        if last and last[0].role in ("user", "tool") and not last[0].meta.get("ends_run"):
            self._append([{"role": "assistant", "content": ""}], generation_prompt=False,
                         metas=[{"interrupted": True}])

    def _compact(self, step: int, tokens_over: int, room: int) -> Compacted | None:
        """Shorten old tool results so the prompt fits ``room`` with some slack."""
        messages = self.store.messages(self.session_id)
        before = sum(m.token_count for m in messages)
        target = int(room * compaction.TARGET_FRACTION)
        need = max(tokens_over, before - target)
        tok = self.engine.tokenizer
        plan = compaction.plan(messages, need, lambda text: len(tok.encode(text)) + 8)
        if not plan.indices:
            return None
        first = plan.indices[0]
        self.store.delete_last(self.session_id, len(messages) - first)
        removed = sum(len(_renderable(messages[i])) - len(plan.new_content[i]) for i in plan.indices)
        superseded = [{"index": i, "path": path} for i, path in plan.superseded.items()]
        self.transcript.write("compaction", step, from_index=first, messages=list(plan.indices),
                              tokens_before=before, chars_removed=removed, superseded=superseded)
        roles = [m.role for m in messages]
        for m in messages[first:]:
            following = roles[m.index + 1] if m.index + 1 < len(roles) else None
            self._readd(m, plan.new_content.get(m.index), step, following)
        after = self.store.get(self.session_id).token_count
        record = {"step": step, "messages": list(plan.indices), "tokens_before": before,
                  "tokens_after": after, "chars_removed": removed, "superseded": superseded}
        history = self.store.get_meta(self.session_id).get("compactions", [])
        self.store.set_meta(self.session_id, {"compactions": [*history, record]})
        self.transcript.write("compaction_done", step, tokens_after=after)
        return Compacted(step, plan.indices, before, after, removed)

    def _readd(self, m: Message, new_content: str | None, step: int, following: str | None) -> None:
        """Put message ``m`` back after a compaction (assistant turns keep their exact tokens
        unless an older file version in them is replaced: then their raw text is re-rendered)."""
        if m.role == "assistant" and new_content is not None:
            old_raw = m.meta.get("raw_text", m.content)
            meta = {**m.meta, "raw_text": new_content,
                    "compacted": {"original_chars": len(old_raw), "step": step, "superseded": True}}
            content = _replace_block(m.content, old_raw, new_content)
            history = self.store.messages(self.session_id)
            fed = [t for h in history for t in h.token_ids]
            ids = self.ledger.tokens_for([render_dict(h) for h in history], fed,
                                         [{"role": "assistant", "content": new_content}], False)[0]
            msg = self.store.add_message(self.session_id, "assistant", content, reasoning=m.reasoning,
                                         tool_calls=m.tool_calls, token_ids=ids, meta=meta)
            self.transcript.message(msg, step)
            return
        if m.role == "assistant":
            msg = self.store.add_message(self.session_id, "assistant", m.content, reasoning=m.reasoning,
                                         tool_calls=m.tool_calls, token_ids=m.token_ids, meta=m.meta)
            self.transcript.message(msg, step)
            return
        meta = dict(m.meta)
        content = m.content
        if new_content is not None:
            meta["compacted"] = {"original_chars": len(m.content), "step": step}
            content = new_content
        history = self.store.messages(self.session_id)
        gp = m.role in ("user", "tool") and following in (None, "assistant")
        fed = [t for h in history for t in h.token_ids]
        d = {"role": m.role, "content": content}
        if m.tool_call_id:
            d["tool_call_id"] = m.tool_call_id
        if m.name:
            d["name"] = m.name
        ids = self.ledger.tokens_for([render_dict(h) for h in history], fed, [d], gp)[0]
        msg = self.store.add_message(self.session_id, m.role, content, tool_calls=m.tool_calls,
                                     tool_call_id=m.tool_call_id, name=m.name, token_ids=ids, meta=meta)
        self.transcript.message(msg, step)


def _renderable(m: Message) -> str:
    return m.meta.get("raw_text", m.content) if m.role == "assistant" else m.content


def _replace_block(content: str, old_raw: str, new_raw: str) -> str:
    """The visible text of an assistant turn after its raw text changed from ``old_raw`` to
    ``new_raw``: the same replacement where the changed part appears in it, else as it was."""
    start = len(os.path.commonprefix([old_raw, new_raw]))
    end = len(os.path.commonprefix([old_raw[start:][::-1], new_raw[start:][::-1]]))
    removed, added = old_raw[start:len(old_raw) - end], new_raw[start:len(new_raw) - end]
    return content.replace(removed, added, 1) if removed and removed in content else content


_TOP_LEVEL = re.compile(r"^(?:async\s+)?(?:def|class)\s+(\w+)", re.MULTILINE)


def _top_level_names(source: str) -> list[str]:
    """Top-level function and class names of Python source (by line, so broken code still counts)."""
    return list(dict.fromkeys(_TOP_LEVEL.findall(source)))


def _pending_key(p: _Pending) -> tuple[str, str]:
    """What makes two calls the same: name and arguments (a malformed one: its error and raw text;
    the 1.5B started the protected test file 20 times in a row, each stopped at its first line)."""
    if p.call is None and p.name in ("write_file", "edit_file"):
        # a file block cut off (by a loop or a protected path): how far it streamed before the
        # stop landed varies, and so does the note on the error; the file and the cause do not
        return f"malformed:{p.name}", (p.error or "").split(" (")[0]
    if p.call is None:
        return f"malformed:{p.name}", f"{p.error}\n{p.raw}"
    return p.call.name, json.dumps(p.call.arguments, sort_keys=True, ensure_ascii=False)


def _pending(parser: ToolCallParser) -> list[_Pending]:
    items = [_Pending(c.id, c.name, call=c, raw=c.raw) for c in parser.calls]
    items += [_Pending(b.id, b.name or call_name(b.raw) or "", error=b.error, raw=b.raw) for b in parser.malformed]
    items.sort(key=lambda p: int(p.id.rsplit("_", 1)[1]))  # reply order
    return items


def _event(step: int, pe: ParseEvent) -> AgentEvent:
    if isinstance(pe, Text):
        return TextDelta(step, pe.text)
    if isinstance(pe, Forming):
        return ToolCallForming(step, pe.index, pe.text, pe.name)
    if isinstance(pe, Parsed):
        return ToolCallParsed(step, pe.call)
    assert isinstance(pe, Malformed)
    return ToolCallMalformed(step, pe.id, pe.raw, pe.error)


class _Opened:
    """A generation handle whose ``token_ids`` start with the reply's forced opening, so a
    partial reply saved mid-stream holds the exact tokens that were fed."""

    def __init__(self, handle, opening_ids: list[int]):
        self._handle, self._opening = handle, opening_ids

    @property
    def token_ids(self) -> list[int]:
        return self._opening + list(self._handle.token_ids)

    def __getattr__(self, name: str):
        return getattr(self._handle, name)
