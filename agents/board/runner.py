"""One attempt of a card: its workspace, its agent session, its checks and its record.

``AttemptRun(...).run()`` runs the agent (a new session for the first attempt and automatic
retries, the same session for a follow-up or a resume) through ``agents.repair.run_with_repair``:
the card's checks run after the final answer (``agents.checks.run_check``) and failing output
goes back for up to ``repair_rounds`` rounds. The attempt is scored ``passed`` (at least one
check ran, all passed), ``unchecked`` (no checks, the agent answered) or ``failed`` (or
``error`` / ``cancelled``). The ``Attempt`` (per-step tokens, cache source, TTFT, tool errors,
checks, first try, rounds, diff) is saved after every step, so a crash keeps what was done.
Checks get what ``mlxterm run`` gives them (``$MLXTERM_TASK_DIR``, ``$MLXTERM_RUN_DIR``,
``$MLXTERM_WORKSPACE``, ``$MLXTERM_PYTHON``). Before the first step the prefix every card
shares is prefilled once per engine (``warm_prefix``). Details: docs/board.md.
"""

from __future__ import annotations

import hashlib
import sys
import threading
import time
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import Any

from engine.runtime import GenerationRequest

from agents.board import workspace as ws_mod
from agents.board.model import Attempt, Card
from agents.checks import run_check
from agents.events import (
    AgentDone,
    AgentEvent,
    AgentEventHandler,
    ApprovalNeeded,
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
from agents.evidence import Evidence
from agents.repair import (
    RepairOutcome,
    changed_paths,
    check_status,
    run_with_repair,
    workspace_fingerprint,
)
from agents.session import AgentLimits, AgentOptions, AgentSession
from agents.taskfile import Check
from agents.transcript import Transcript
from tools.sandbox import Limits

FEEDBACK_CHARS = 2000  # check output given back to the next attempt
_WARM_LOCK = threading.Lock()
_WARMED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # engine -> {prefix hash: Event}


def attempt_prompt(card: Card, kind: str, feedback: str | None) -> str:
    """What the agent is told: the card's prompt, the failed checks of the previous attempt
    (retry), the reviewer's comment (follow-up) or a nudge to finish (resume)."""
    if kind == "retry" and feedback:
        return (f"{task_prompt(card)}\n\nA previous attempt did not pass the acceptance checks. The files it "
                f"left are in the workspace. Check output:\n{feedback}\nFix the work so the checks pass.")
    if kind == "followup":
        return (f"The reviewer rejected the result: {feedback or 'no comment'}\n"
                "Change the work accordingly.")
    if kind == "resume":
        return f"The run was interrupted. Continue the task and finish it: {card.prompt}"
    return task_prompt(card)


def task_prompt(card: Card) -> str:
    """The card's prompt, plus how to run its tests when it names a test command (as
    ``TaskSpec.full_prompt``)."""
    if not card.test_command or card.test_command in card.prompt:
        return card.prompt
    return f"{card.prompt.rstrip()}\n\nRun the tests with: {card.test_command}"


def check_feedback(checks: list[dict[str, Any]]) -> str:
    """The failed checks of an attempt as text for the next attempt's prompt."""
    parts = []
    for c in checks:
        if not c["passed"]:
            out = (c.get("output") or "").strip()[-FEEDBACK_CHARS:]
            parts.append(f"- check {c['name']} (`{c['run']}`) failed with exit code {c['exit_code']}:\n{out}")
    return "\n".join(parts)


def warm_prefix(engine, agent: AgentSession) -> bool:
    """Prefill the session's context so far (the shared prefix of every card) once per engine
    and prefix, so every card's first step reuses its KV checkpoint. Threads asking for the
    same prefix wait for the first one. Returns True when this call did the prefill."""
    prefix = agent.store.context_tokens(agent.session_id)
    if len(prefix) < 2:
        return False
    key = hashlib.sha1(repr(prefix).encode()).hexdigest()
    with _WARM_LOCK:
        per_engine = _WARMED.setdefault(engine, {})
        done = per_engine.get(key)
        mine = done is None
        if mine:
            done = per_engine[key] = threading.Event()
    if not mine:
        done.wait(600)
        return False
    try:
        handle = engine.submit(GenerationRequest(prefix, engine.sampling(max_tokens=1, temperature=0.0)))
        handle.result(600)
    finally:
        done.set()
    return True


class AttemptRun:
    """Runs one attempt; ``cancel()`` and the ``status`` fields may be used from any thread."""

    def __init__(self, board, sessions, engine, card: Card, attempt: Attempt, *, interactive: bool = False,
                 on_event: Callable[[AttemptRun, AgentEvent], None] | None = None, warm: bool = True):
        self.board, self.sessions, self.engine = board, sessions, engine
        self.card, self.attempt = card, attempt
        self.interactive = interactive
        self.on_event = on_event
        self.warm = warm
        self.agent: AgentSession | None = None
        self.pending_approval: ApprovalNeeded | None = None
        self._cancelled = threading.Event()
        # live status for the board
        self.step = 0
        self.round = 0  # 0: the agent's first run; n: repair round n (check output sent back)
        self.tool: str | None = None  # the tool being called, or "checks" while they run
        self.step_tokens = 0
        self.t0 = time.monotonic()

    def cancel(self) -> None:
        self._cancelled.set()
        if self.agent is not None:
            self.agent.cancel()

    @property
    def cancelled(self) -> bool:
        return self._cancelled.is_set()

    @property
    def elapsed_s(self) -> float:
        return time.monotonic() - self.t0

    def run(self) -> Attempt:
        card, att = self.card, self.attempt
        att.workspace = card.workspace_dir
        t0 = time.monotonic()
        transcript = Transcript(ws_mod.board_dir(self.board) / "cards" / str(card.id) / f"attempt-{att.number}.jsonl")
        before: dict[str, str] | None = None
        try:
            self._open_agent(transcript)
            att.session_id = self.agent.session_id
            att.evidence_dir = str(self.evidence.folder)
            self.evidence.prepare()
            self.board.save_attempt(att)
            if self.cancelled:
                self.agent.cancel()
            if self.warm and att.kind in ("first", "retry"):
                warm_prefix(self.engine, self.agent)
            before = workspace_fingerprint(Path(card.workspace_dir))
            outcome = self._run_agent(transcript)
            done = outcome.done
            att.stop_reason, att.error, att.final_text = done.reason, done.error, done.final_text
            att.checks, att.first_try, att.repair_rounds = outcome.checks, outcome.first_try, outcome.rounds
            att.corrective_turns = outcome.corrective_turns
            att.status = self._score(outcome)
        except Exception as e:  # noqa: BLE001 (the attempt must end with a record, not vanish)
            att.status, att.error = "error", f"{type(e).__name__}: {e}"
        finally:
            transcript.close()
        quality = self.evidence.collect() if att.checks else None
        if before is not None:
            try:
                changed = changed_paths(before, workspace_fingerprint(Path(card.workspace_dir)))
                att.workspace_changed, att.changed_files = bool(changed), changed[:200]
            except OSError:
                pass  # unknown stays None
        try:
            att.diff = ws_mod.diff(card)
        except Exception as e:  # noqa: BLE001
            att.diff, att.error = None, att.error or f"diff failed: {e}"
        att.finished_at = time.time()
        att.wall_s = round(time.monotonic() - t0, 3)
        self.board.save_attempt(att)
        self.board.log(card.id, "attempt_finished", number=att.number, status=att.status,
                       stop_reason=att.stop_reason, error=att.error, wall_s=att.wall_s,
                       tokens=att.tokens, first_step_cached_ratio=att.first_step_cached_ratio,
                       checks=[{"name": c["name"], "passed": c["passed"]} for c in att.checks],
                       first_try=att.first_try, repair_rounds=len(att.repair_rounds),
                       corrective_turns=att.corrective_turns, workspace_changed=att.workspace_changed,
                       **({"quality": quality} if quality else {}))
        return att

    @property
    def evidence(self) -> Evidence:
        """The card's evidence folder, collected into the card's own folder (``agents.evidence``)."""
        folder = ws_mod.evidence_dir(self.board, self.card.id)
        return Evidence(folder, folder.parent)

    def _score(self, outcome: RepairOutcome) -> str:
        """passed only when at least one check ran and all passed; a card without checks whose
        agent answered is unchecked (never passed)."""
        done = outcome.done
        if done.reason == "cancelled" or self.cancelled:
            return "cancelled"
        if done.reason == "error":
            return "error"
        if not self.card.checks:
            return "unchecked" if done.reason == "answered" else "failed"
        return check_status(outcome.checks)

    def check_env(self) -> dict[str, str]:
        """What a check script may need, as under ``mlxterm run``: the task folder (when the card
        came from a YAML), the evidence folder, the workspace and the Python running mlxterm."""
        card = self.card
        env = {**self.evidence.env(),
               "MLXTERM_WORKSPACE": str(Path(card.workspace_dir).resolve()), "MLXTERM_PYTHON": sys.executable}
        task_dir = ws_mod.task_dir(card)
        if task_dir is not None:
            env["MLXTERM_TASK_DIR"] = task_dir
        return env

    def run_checks(self, transcript: Transcript | None = None, workspace: Path | None = None) -> list[dict[str, Any]]:
        """The card's checks in its workspace (or ``workspace``: a candidate draft's scratch
        copy), in the agent's sandbox; the task folder readable, the evidence folder writable."""
        card = self.card
        evidence = self.evidence
        evidence.folder.mkdir(parents=True, exist_ok=True)
        task_dir = ws_mod.task_dir(card)
        env = self.check_env()
        folder = workspace or Path(card.workspace_dir)
        if workspace is not None:
            env["MLXTERM_WORKSPACE"] = str(workspace.resolve())
        tool, self.tool = self.tool, "checks"
        try:
            return [run_check(Check(c.name, c.run, c.timeout_s), folder, self.agent.sandbox,
                              env=env, evidence=evidence, readable=(task_dir,) if task_dir else (),
                              transcript=transcript)
                    for c in card.checks]
        finally:
            self.tool = tool

    def _open_agent(self, transcript: Transcript) -> None:
        card, att = self.card, self.attempt
        s = card.sampling
        options = AgentOptions(system_prompt=card.system, examples=card.examples, allow=tuple(card.allow),
                               interactive=self.interactive, temperature=s.get("temperature"),
                               seed=s.get("seed"), max_tokens_per_step=s.get("max_tokens"),
                               sandbox_limits=Limits.from_mapping(card.sandbox) if card.sandbox else None)
        if att.kind in ("followup", "resume") and att.session_id:
            self.agent = AgentSession.open(self.engine, self.sessions, att.session_id, options=options,
                                           transcript=transcript)
        else:
            self.agent = AgentSession.create(self.engine, self.sessions, card.workspace_dir,
                                             title=f"card {card.id}: {card.title}", options=options,
                                             transcript=transcript,
                                             meta={"board": {"card": card.id, "attempt": att.number}})


    def _run_agent(self, transcript: Transcript) -> RepairOutcome:
        att, card = self.attempt, self.card
        limits = AgentLimits(steps=card.limits.get("steps"), tokens=card.limits.get("tokens"),
                             wall_s=card.limits.get("wall_s"))
        rounds = card.repair_rounds if card.repair_rounds is not None else self.engine.profile.agent.repair_rounds
        record = _AttemptEvents(self)
        outcome: RepairOutcome | None = None
        self.round = 0
        agent_cfg = self.engine.profile.agent
        for ev in run_with_repair(self.agent, att.prompt, limits, lambda: self.run_checks(transcript), rounds,
                                  test_command=card.test_command, transcript=transcript,
                                  cancelled=self._cancelled.is_set,
                                  run_checks_in=lambda ws: self.run_checks(None, ws),
                                  candidates=agent_cfg.candidates, candidate_temperature=agent_cfg.candidate_temperature,
                                  repair_temperature=agent_cfg.repair_temperature, seed=card.sampling.get("seed") or 0):
            if isinstance(ev, RepairOutcome):
                outcome = ev
                continue
            record.handle(ev)
            if self.on_event is not None:
                self.on_event(self, ev)
        assert outcome is not None
        att.tool_errors = record.tool_errors
        return outcome


class _AttemptEvents(AgentEventHandler):
    """Records an attempt's agent events on its ``AttemptRun``: the live status (step, tool,
    tokens, pending approval), a record per step (saved after every step), tool errors, the
    board log's approval and corrective lines, and which repair round is running."""

    def __init__(self, run: AttemptRun):
        self.run = run
        self.tokens = {"prompt": 0, "cached": 0, "completion": 0}
        self.ttft, self.ttft_known = 0.0, True
        self.tool_errors = 0
        self.calls = 0  # tool calls in the current step

    def on_step_start(self, ev: StepStart) -> None:
        self.run.step, self.run.tool, self.run.step_tokens, self.calls = ev.step, None, 0, 0

    def on_text_delta(self, ev: TextDelta) -> None:
        self.run.step_tokens += 1

    def on_tool_call_forming(self, ev: ToolCallForming) -> None:
        self.run.step_tokens += 1
        if ev.name:
            self.run.tool = ev.name

    def on_tool_call_parsed(self, ev: ToolCallParsed | ToolCallMalformed) -> None:
        self.calls += 1

    on_tool_call_malformed = on_tool_call_parsed

    def on_step_done(self, ev: StepDone) -> None:
        att, tokens = self.run.attempt, self.tokens
        tokens["prompt"] += ev.prompt_tokens
        tokens["cached"] += ev.cached_tokens
        tokens["completion"] += ev.completion_tokens
        if not ev.ttft_ms:  # 0.0 is the engine's "not measured" default
            self.ttft_known = False
        else:
            self.ttft += ev.ttft_ms / 1000
        att.steps.append({"request": len(att.steps) + 1, "round": self.run.round,
                          "prompt_tokens": ev.prompt_tokens,
                          "cached_tokens": ev.cached_tokens, "completion_tokens": ev.completion_tokens,
                          "cache_source": ev.cache_source,
                          "ttft_s": round(ev.ttft_ms / 1000, 4) if ev.ttft_ms else None,
                          "tool_calls": self.calls, "decode_tps": ev.decode_tps or None})
        att.tokens, att.requests = dict(tokens), len(att.steps)
        att.ttft_s_sum = round(self.ttft, 4) if self.ttft_known else None
        att.tool_errors = self.tool_errors
        self.run.board.save_attempt(att)

    def on_tool_started(self, ev: ToolStarted) -> None:
        self.run.tool = ev.call.name
        self.run.pending_approval = None

    def on_tool_finished(self, ev: ToolFinished) -> None:
        if not ev.result.ok:
            self.tool_errors += 1
        self.run.attempt.tool_errors = self.tool_errors
        self.run.pending_approval = None

    def on_approval_needed(self, ev: ApprovalNeeded) -> None:
        self.run.pending_approval = ev
        self.run.board.log(self.run.card.id, "approval_needed", number=self.run.attempt.number, tool=ev.call.name)

    def on_corrective(self, ev: Corrective) -> None:
        self.run.board.log(self.run.card.id, "corrective", number=self.run.attempt.number, step=ev.step,
                           message=ev.message[:500])

    def on_agent_done(self, ev: AgentDone) -> None:
        self.run.round += 1  # the next run (if any) is a repair round
