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

import logging
import threading
import time
from collections.abc import AsyncIterator, Iterator, Mapping
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from engine.errors import MlxtermError
from engine.runtime import GenerationRequest, Priority
from engine.serving.events import Done
from engine.serving.events import TextDelta as EngineTextDelta
from engine.sessions import SessionStore
from engine.sessions.partial import PartialReply

from agents import replies
from agents.checks import agent_sandbox
from agents.constrained import ToolCallConstraint, shared_masks
from agents.context import SessionContext
from agents.edits import LANG_EXTS
from agents.events import (
    AgentDone,
    AgentEvent,
    ApprovalNeeded,
    ApprovalRequest,
    Corrective,
    StepDone,
    StepStart,
    ToolCallParsed,
    ToolFinished,
    ToolStarted,
)
from agents.ledger import MessageLedger, TokenLedger, messages_for
from agents.loops import LoopGuard
from agents.native_calls import NativeCalls, remote_tool_calls
from agents.options import AgentError, AgentLimits, AgentOptions
from agents.parser import Malformed, Parsed, ToolCallParser
from agents.policy import ApprovalPolicy
from agents.prompts import corrective_message, example_messages, system_prompt
from agents.protocol import (
    ToolCall,
    malformed_result,
    template_renders_tools,
    tool_map,
)
from agents.targets import TaskFiles
from agents.threaded import on_a_thread
from agents.transcript import Transcript
from tools import ToolRegistry, ToolResult, default_registry
from tools.sandbox import warn_once

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


@dataclass
class _Totals:
    prompt: int = 0
    cached: int = 0
    completion: int = 0


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
        # a remote server (engine.serving.remote_engine) has no tokenizer or template here: no
        # constrained decoding, messages sent as messages; tools in the text protocol, or offered
        # natively (model.remote.tool_calls: native), where files are written by JSON calls too
        self.remote = bool(getattr(engine, "remote", False))
        self.remote_native = self.remote and remote_tool_calls(engine) == "native"
        # text edits run as write_file / edit_file: without those tools there is nothing to write with
        self.edit_format = edit_format if writes and not self.remote_native else "json"
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
        self.native_tools = self.remote_native if self.remote else template_renders_tools(engine.render)
        self.ledger = MessageLedger() if self.remote else TokenLedger(engine, self.schemas if self.native_tools else None)
        self.files = TaskFiles(self.registry.workspace, self.options.protected)
        self.context = SessionContext(store, self.session_id, self.ledger, getattr(engine, "tokenizer", None),
                                      self.transcript)
        self.constrained = (agent_cfg.constrained_tool_calls if self.options.constrained is None
                            else self.options.constrained) and bool(self.schemas) and not self.remote
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
        text = system_prompt(self.options.system_prompt, self.schemas, self.native_tools, self.edit_format,
                             work=self.remote_native)
        self.context.append([{"role": "system", "content": text}], generation_prompt=False, metas=[{}])
        if not self.options.examples:
            return
        for m in example_messages(self.registry.names(), self.edit_format, work=self.remote_native):
            meta: dict[str, Any] = {"example": True}
            calls = None
            if "call" in m:
                name, args = m["call"]
                calls = [ToolCall(m["call_id"], name, args).as_message_call()]
                meta["raw_text"] = m["content"]
            msg = {k: m[k] for k in ("role", "content", "tool_call_id", "name") if k in m}
            self.context.append([msg], generation_prompt=m["role"] in ("user", "tool"), metas=[meta],
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

    def run_async(self, prompt: str, limits: AgentLimits | None = None) -> AsyncIterator[AgentEvent]:
        """``run`` on a worker thread, events delivered to the running event loop (an abandoned
        iteration cancels the run)."""
        return on_a_thread(lambda: self.run(prompt, limits), self.cancel)

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
            self._targets = self.files.named_in(prompt)
        self.transcript.write("run", 0, session_id=self.session_id, profile=self.engine.profile.name,
                              workspace=str(self.workspace), prompt=prompt, limits=asdict(limits),
                              agent=self.describe(), tools=self.schemas)
        try:
            self.context.close_interrupted_turn()
            self.context.append([{"role": "user", "content": prompt}], generation_prompt=True, metas=[{}])
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
                pending = replies.pending(parser)
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
        self.context.append([{"role": "user", "content": message}], generation_prompt=True,
                     metas=[{"corrective": True, "step": step}], step=step)
        return Corrective(step, message)

    # -- drafts from outside the loop (agents.candidates) ---------------------------------------
    def prompt_with(self, message: str) -> list[int]:
        """The context as it would be after a user ``message`` (nothing is stored)."""
        fed, new = self.context.tokens_after([{"role": "user", "content": message}], True)
        return fed + new[0]

    def close_turn(self) -> None:
        """End a turn a run left open after tool results, so a user message may follow."""
        self.context.close_interrupted_turn()

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

    def message_count(self) -> int:
        return len(self.store.messages(self.session_id, tokens=False))

    def task_prompt_ids(self, from_index: int) -> list[int] | None:
        """The context of a task's first step: the session up to the first user message at or
        after ``from_index`` (the task, as its run stored it), generation prompt included."""
        msgs = self.store.messages(self.session_id)
        for i in range(from_index, len(msgs)):
            if msgs[i].role == "user":
                return [t for x in msgs[: i + 1] for t in x.token_ids] or None
        return None

    def adopt(self, message: str, done: Done, parser: ToolCallParser, handle,
              opening_ids: list[int] | None = None, fresh: bool = False) -> Iterator[AgentEvent]:
        """Store ``message`` and a reply generated for it elsewhere (``prompt_with(message)`` and
        ``opening_ids`` were its prompt, ``handle`` its request; ``done`` holds the opening too),
        then run the reply's calls as if the loop had made it (``changed_files``: what they changed)."""
        msgs = self.store.messages(self.session_id, tokens=False)
        step = max((m.meta.get("step", 0) for m in msgs), default=0) + 1
        self.context.append([{"role": "user", "content": message}], generation_prompt=True, metas=[{"step": step}], step=step)
        partial = PartialReply(self.store, self.session_id, replies.Opened(handle, opening_ids or []),
                               meta={"step": step, "candidate": True})
        # a fresh draft answered the task's first prompt, not this context: its tokens are stored
        # as sampled (the context stays the exact tokens fed from here on), and marked
        self._record_reply(step, done, parser, None, 0.0, partial, {"candidate": True, **({"fresh": True} if fresh else {})})
        for call in parser.calls:
            yield ToolCallParsed(step, call)
        self.changed_files = []
        pending = replies.pending(parser)
        if pending:
            _, wrote = yield from self._run_tools(step, pending)
            if wrote:
                self._last_written = list(dict.fromkeys(self.changed_files))

    # -- one step -----------------------------------------------------------------------------
    def _budget(self, step: int, tokens_left: int | None) -> Iterator[AgentEvent]:
        """max_tokens for this step, compacting old tool output when the context is short."""
        limit = self.engine.profile.context.max_context
        want = self._step_tokens()
        if tokens_left is not None:
            want = min(want, tokens_left)
        used = self.context.used_tokens()
        if limit - used < want:
            ev = self.context.compact(step, want - (limit - used), limit - want)
            if ev is not None:
                yield ev
            used = self.context.used_tokens()
        room = min(want, limit - used)
        return room if room >= MIN_STEP_TOKENS else None

    def _generate(self, step: int, max_new: int, temperature: float | None = None) -> Iterator[AgentEvent]:
        prompt_ids = self.store.context_tokens(self.session_id)
        # a plan item's run (``next_file``) opens its file at every step: a retry after a block cut
        # off by a loop is the same file again (the 0.5B answered it with prose); so does a run that
        # ends at its write: a step past the first means no write changed the file yet, and a free
        # step there answered "is_even now passes all tests" and wrote the example's parity.py (1.5B, etl)
        every_step = self.next_file or self.end_on_write
        opening = (PLAN_OPENING if self.plan_turn else self.file_opening()) if step == 1 or every_step else ""
        opening = "" if self.remote else opening  # a server's reply cannot be given its first words
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
        messages = (messages_for(self.store.messages(self.session_id, tokens=False), native=self.remote_native)
                    if self.remote else None)
        self.transcript.write("request", step, prompt_tokens=len(prompt_ids), max_tokens=max_new,
                              constrained=constraint is not None,
                              sampling={"temperature": params.temperature, "top_p": params.top_p, "seed": seed})
        yield StepStart(step, len(prompt_ids), max_new, constraint is not None)
        text_edits = self.edit_format != "json"
        parser = ToolCallParser(self.tool_params, id_prefix=f"call_{step}", text_edits=text_edits,
                                infer_path=self.infer_path if text_edits else None)
        with self._lock:
            self._handle = handle = (self.engine.submit_messages(messages, params,
                                                                 self.schemas if self.remote_native else None)
                                     if self.remote else self.engine.submit(request))
            if self._cancel.is_set():
                handle.cancel()
        partial = PartialReply(self.store, self.session_id, replies.Opened(handle, opening_ids), meta={"step": step})
        done: Done | None = None
        guard, raw, early, file_closed = LoopGuard(), opening, None, False
        # a server's own tool calls, read as the text protocol's blocks (native remote runs only)
        native = NativeCalls() if self.remote_native else None
        for pe in parser.feed(opening):
            yield replies.event(step, pe)
        try:
            for ev in (native.as_text(handle) if native is not None else handle):
                if isinstance(ev, EngineTextDelta):
                    closed = False
                    for pe in parser.feed(ev.text):
                        closed = closed or (bool(opening) and isinstance(pe, Parsed) and not self.plan_turn)
                        yield replies.event(step, pe)
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
                    done = replace(ev, text=native.text) if native is not None and native.seen else ev
            for pe in parser.finish():
                if early is not None and early[0] == "planned" and isinstance(pe, Malformed):
                    continue  # the file block the plan stopped at: not a call
                yield replies.event(step, pe)
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
        ids = list(done.completion_token_ids)
        if self.remote:  # no tokens here: the text the server sent is the reply
            raw = done.text
        else:
            tok = self.engine.tokenizer
            raw = tok.decode(ids[:-1] if ids and ids[-1] in tok.eos_ids else ids)
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
        for p in replies.pending(parser):
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
    def _run_tools(self, step: int, pending: list[replies.Pending]) -> Iterator[AgentEvent]:
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
                self._seen_calls.setdefault(replies.pending_key(p), step)
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
        self.context.append(messages, generation_prompt=not wrote, metas=metas, step=step)
        return repeated == len(pending), wrote

    def _repeat_of(self, p: replies.Pending) -> int | None:
        """The step of an earlier identical call (or identical malformed one) with no file change
        since, or None."""
        return self._seen_calls.get(replies.pending_key(p))

    def _one_tool(self, step: int, p: replies.Pending) -> Iterator[AgentEvent]:
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
        return self.files.protected(call) or (self.files.not_whole(call) if call.inferred_path else None)

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
        if path and self.files.protected_path(path):
            return "protected", f"stopped: {path} is protected by the task and cannot be changed"
        return None

    def file_opening(self) -> str:
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

    # -- messages -----------------------------------------------------------------------------
