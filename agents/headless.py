"""Headless task runs: workspace, agent loop, acceptance checks, ``result.json``.

``HeadlessRun(task, ...).run()`` returns the result dict (also written to
``RUN_DIR/result.json``, atomically); ``transcript.jsonl`` is written as the run goes.
``cancel()`` stops the agent (the run reports "cancelled" and skips the checks). After the
agent's final answer the checks run and failures go back for up to ``repair_rounds`` rounds
(``agents.repair``). ``status``: passed, failed, unchecked (no checks), error, cancelled.
Checks write evidence into ``RUN_DIR/evidence``; the run directory itself is never mounted in
the sandbox and may not lie inside the workspace (the agent could rewrite the transcript). A
task bigger than one file is planned first and worked through item by item (``agents.planned``);
``resume=True`` continues the latest run of the same task in the same workspace after a crash.
The result fields and resume rules: docs/agents.md, "Headless runs".
"""

from __future__ import annotations

import json
import secrets
import shutil
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from engine import paths
from engine.atomic import atomic_write_text
from engine.errors import MlxtermError
from engine.sessions import SessionStore

from agents.checks import agent_sandbox, run_check
from agents.events import (
    AgentDone,
    AgentEvent,
    AgentEventHandler,
    Corrective,
    StepDone,
    ToolCallMalformed,
    ToolCallParsed,
    ToolFinished,
)
from agents.evidence import Evidence
from agents.planned import PlanOutcome, load_plan, names_new_files, work_through_plan
from agents.progress import Progress
from agents.repair import (
    RepairOutcome,
    changed_paths,
    check_status,
    run_with_repair,
    workspace_fingerprint,
)
from agents.session import AgentLimits, AgentOptions, AgentSession
from agents.taskfile import Check, TaskSpec
from agents.transcript import Transcript


def new_run_id() -> str:
    return time.strftime("%Y%m%d-%H%M%S") + "-" + secrets.token_hex(3)


class HeadlessRun:
    def __init__(self, task: TaskSpec, *, engine=None, profile: str | None = None, workspace: str | Path | None = None,
                 allow: tuple[str, ...] = (), run_dir: str | Path | None = None, store: SessionStore | None = None,
                 on_event: Callable[[AgentEvent], None] | None = None, candidates: int | None = None,
                 resume: bool = False):
        self.task = task
        self.run_id = new_run_id()
        self._store = store
        self.resume_id: str | None = None
        if resume:
            if workspace is None:
                raise MlxtermError("--resume needs --workspace DIR (the workspace of the run to continue)")
            self.resume_id, earlier_dir = find_run(self._sessions(), task, Path(workspace))
            run_dir = run_dir if run_dir is not None else earlier_dir
        self.run_dir = Path(run_dir) if run_dir is not None else paths.data_dir() / "runs" / self.run_id
        self.workspace = Path(workspace) if workspace is not None else self.run_dir / "workspace"
        real_ws, real_run = self.workspace.resolve(), self.run_dir.resolve()
        if real_run == real_ws or real_ws in real_run.parents:
            raise MlxtermError(f"{self.run_dir}: the run directory must lie outside the workspace {self.workspace} "
                               "(the agent could rewrite its transcript and result there)")
        self.evidence = Evidence.for_run(self.run_dir)
        self.profile = profile or task.profile
        self.allow = tuple(dict.fromkeys((*task.allow, *allow)))
        self.cli_allow = tuple(allow)  # the person's own --allow: the only consent to run unconfined
        self._engine = engine
        self.on_event = on_event
        self.progress = Progress()
        self.candidates = candidates  # None: the profile's agent.candidates
        self.agent: AgentSession | None = None
        self._cancelled = threading.Event()

    def _sessions(self) -> SessionStore:
        if self._store is None:
            self._store = SessionStore()
        return self._store

    def cancel(self) -> None:
        self._cancelled.set()
        if self.agent is not None:
            self.agent.cancel()

    def run(self) -> dict[str, Any]:
        t0 = time.monotonic()
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.evidence.prepare()
        if self.resume_id is None:
            self._prepare_workspace()
        transcript = Transcript(self.run_dir / "transcript.jsonl")
        own_engine = self._engine is None
        engine = self._engine
        try:
            if self.resume_id is None:
                transcript.write("task", 0, task=str(self.task.path), name=self.task.name, prompt=self.task.prompt,
                                 workspace=str(self.workspace), profile=self.profile, allow=list(self.allow),
                                 checks=[{"name": c.name, "run": c.run} for c in self.task.checks])
            else:
                transcript.write("resume", 0, session_id=self.resume_id, profile=self.profile,
                                 progress=self._sessions().get_meta(self.resume_id).get("progress"))
            if engine is None:  # a local model, or a remote profile's server (the text protocol)
                from engine.serving.remote_engine import load_engine

                engine = load_engine(self.profile)
            store = self._sessions()
            before = workspace_fingerprint(self.workspace)
            outcome = self._run_agent(engine, store, transcript)
            changed = changed_paths(before, workspace_fingerprint(self.workspace))
            result = self._result(engine, outcome, changed, transcript, time.monotonic() - t0)
            store.set_meta(self.agent.session_id, {"run": {k: result[k] for k in ("status", "run_dir", "task")}})
        except MlxtermError as e:
            result = self._error_result(str(e), time.monotonic() - t0)
        finally:
            if own_engine and engine is not None:
                engine.close()
        transcript.write("result", result.get("steps") or 0, result=result)
        transcript.close()
        self._add_quality(result)
        atomic_write_text(self.run_dir / "result.json", json.dumps(result, indent=2, ensure_ascii=False) + "\n")
        return result

    def checks_only(self) -> dict[str, Any]:
        """Re-run the task's checks on an existing workspace (no agent, no engine).

        Writes ``result.json`` (agent fields are None: unknown, not zero) but no transcript, so a
        ``--run-dir`` of an earlier run keeps that run's transcript.
        """
        t0 = time.monotonic()
        if not self.workspace.is_dir():
            raise MlxtermError(f"{self.workspace}: workspace directory not found")
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.evidence.prepare()
        checks = [self._check(c, None) for c in self.task.checks]
        result = {
            "status": check_status(checks),
            "task": str(self.task.path), "name": self.task.name, "checks_only": True,
            "session_id": None, "run_dir": str(self.run_dir), "workspace": str(self.workspace),
            "profile": None, "stop_reason": "checks_only", "error": None, "final_text": None,
            "checks": checks, "checks_passed": sum(1 for c in checks if c["passed"]),
            "checks_failed": sum(1 for c in checks if not c["passed"]),
            "steps": None, "tool_calls": None, "malformed_calls": None, "tokens": None,
            "cached_ratio": None, "agent_wall_s": None, "wall_s": round(time.monotonic() - t0, 3),
        }
        self._add_quality(result)
        atomic_write_text(self.run_dir / "result.json", json.dumps(result, indent=2, ensure_ascii=False) + "\n")
        return result

    def _add_quality(self, result: dict[str, Any]) -> None:
        """Copy the ``quality.json`` this run's checks left in their evidence folder into the
        run directory and summarise it in ``result``."""
        quality = self.evidence.collect()
        if quality is not None:
            result["quality"] = quality

    # -- pieces ---------------------------------------------------------------------------------
    def _prepare_workspace(self) -> None:
        self.workspace.mkdir(parents=True, exist_ok=True)
        template = self.task.workspace_template
        if template is not None:
            shutil.copytree(template, self.workspace, dirs_exist_ok=True, symlinks=True)

    def _run_agent(self, engine, store: SessionStore, transcript: Transcript) -> RepairOutcome:
        task = self.task
        options = AgentOptions(system_prompt=task.system, examples=task.examples, allow=self.allow,
                               unconfined_allow=self.cli_allow, protected=task.protected,
                               interactive=False, temperature=task.temperature, seed=task.seed,
                               max_tokens_per_step=task.max_tokens, network=task.network,
                               sandbox_hide=self.evidence.protect(), sandbox_limits=task.sandbox_limits)
        if self.resume_id is not None:
            self.agent = AgentSession.open(engine, store, self.resume_id, options=options, transcript=transcript)
            meta = store.get_meta(self.resume_id)
            self.progress = Progress(meta.get("progress"))
            store.set_meta(self.resume_id, {"resumes": int(meta.get("resumes", 0)) + 1})
        else:
            self.agent = AgentSession.create(engine, store, self.workspace, title=f"run: {task.name}",
                                             options=options, transcript=transcript,
                                             meta={"task": str(task.path), "run_dir": str(self.run_dir)})
        if self._cancelled.is_set():
            self.agent.cancel()
        if self.agent.sandbox_notice or not self.agent.sandbox.active:
            what = ("bash and the checks run unsandboxed (--allow bash)" if "bash" in self.cli_allow
                    else "the checks are refused and bash is denied (no sandbox; --allow bash runs both unconfined)")
            transcript.write("warning", 0, message=f"{what}: {self.agent.sandbox.status.describe()}")
        ignored = self.agent.policy.ignored_allows()
        if ignored:
            transcript.write("warning", 0, message=f"--allow has no effect on tools the profile denies: {', '.join(ignored)}")
        wall = None if task.wall_s is None else max(1.0, task.wall_s - self.progress.elapsed_s)
        limits = AgentLimits(steps=task.steps, tokens=task.tokens, wall_s=wall)
        rounds = engine.profile.agent.repair_rounds if task.repair_rounds is None else task.repair_rounds
        outcome = None
        agent_cfg = engine.profile.agent
        t0 = time.monotonic()
        prompt, prior = task.full_prompt(self.workspace), None
        if self._planned():
            for ev in work_through_plan(self.agent, prompt, limits, transcript=transcript,
                                        cancelled=self._cancelled.is_set,
                                        retry_temperature=agent_cfg.repair_temperature):
                if isinstance(ev, PlanOutcome):
                    # no plan (the reply held none, the task names no new file): an ordinary run
                    stopped = bool(ev.runs) and ev.runs[-1].reason in ("cancelled", "error")
                    prior = ev.runs if ev.plan is not None or stopped or self._cancelled.is_set() else None
                else:
                    self._emit(ev)
            if wall is not None:
                limits = AgentLimits(steps=task.steps, tokens=task.tokens,
                                     wall_s=max(0.001, wall - (time.monotonic() - t0)))
        elif self.resume_id is not None:
            prompt = f"The run was interrupted. Go on with the task where you left off.\n\n{prompt}"
        for ev in run_with_repair(self.agent, prompt, limits,
                                  lambda: [self._check(c, transcript) for c in task.checks], rounds,
                                  test_command=task.test_command, transcript=transcript,
                                  cancelled=self._cancelled.is_set,
                                  run_checks_in=lambda ws: [self._check(c, None, ws) for c in task.checks],
                                  candidates=agent_cfg.candidates if self.candidates is None else self.candidates,
                                  candidate_temperature=agent_cfg.candidate_temperature,
                                  repair_temperature=agent_cfg.repair_temperature, seed=task.seed or 0,
                                  prior=prior):
            if isinstance(ev, RepairOutcome):
                outcome = ev
            else:
                self._emit(ev)
        assert outcome is not None
        return outcome

    def _planned(self) -> bool:
        """Plan first: the task says so, or (by default) its prompt names two or more files the
        workspace lacks; a resumed run that was planned goes on with its plan."""
        if self.resume_id is not None and load_plan(self.agent) is not None:
            return True
        if self.task.plan is not None:
            return self.task.plan
        return names_new_files(self.task.prompt, self.workspace)

    def _emit(self, ev) -> None:
        """Count the event in the progress (saved in the session's meta at each step) and pass it on."""
        self.progress.observe(ev, self.agent.next_file if self.agent is not None else None)
        if isinstance(ev, StepDone) and self.agent is not None:
            self.agent.store.set_meta(self.agent.session_id, {"progress": self.progress.state()})
        if self.on_event is not None:
            self.on_event(ev)

    def _check_env(self, workspace: Path) -> dict[str, str]:
        """What a check script may need besides its evidence folder: where the task's files are,
        the workspace and the Python running mlxterm (it has selenium when the browser extra is
        installed)."""
        return {"MLXTERM_TASK_DIR": str(self.task.path.parent.resolve()),
                "MLXTERM_WORKSPACE": str(workspace.resolve()), "MLXTERM_PYTHON": sys.executable}

    def _check(self, check: Check, transcript: Transcript | None, workspace: Path | None = None) -> dict[str, Any]:
        # checks run model-written code: the agent's sandbox, or the task's own for --checks-only;
        # they write only their evidence folder (quality.json, screenshots), never the run dir;
        # ``workspace``: another folder to check (a candidate's scratch copy)
        sandbox = self.agent.sandbox if self.agent is not None else agent_sandbox(network=self.task.network, limits=self.task.sandbox_limits)
        workspace = workspace or self.workspace
        return run_check(check, workspace, sandbox, env=self._check_env(workspace),
                         unconfined_ok="bash" in self.cli_allow, evidence=self.evidence,
                         readable=(str(self.task.path.parent.resolve()),), transcript=transcript)

    def _result(self, engine, outcome: RepairOutcome, changed: list[str], transcript: Transcript,
                wall: float) -> dict[str, Any]:
        done, checks = outcome.done, outcome.checks
        if done.reason == "cancelled" or self._cancelled.is_set():
            status = "cancelled"
        elif done.reason == "error":
            status = "error"
        elif not self.task.checks:
            status = "unchecked" if done.reason == "answered" else "failed"
        else:
            status = check_status(checks)
        calls = transcript.of_type("tool_result")
        parsed = sum(1 for r in calls if not r["data"].get("malformed"))
        return {
            "status": status,
            "task": str(self.task.path),
            "name": self.task.name,
            "session_id": self.agent.session_id,
            "run_dir": str(self.run_dir),
            "workspace": str(self.workspace),
            "profile": engine.profile.name,
            "stop_reason": done.reason,
            "error": done.error,
            "final_text": done.final_text,
            "checks": checks,
            "sandbox": self.agent.describe()["sandbox"],
            "checks_passed": sum(1 for c in checks if c["passed"]),
            "checks_failed": sum(1 for c in checks if not c["passed"]),
            "first_try": outcome.first_try,
            "repair_rounds": outcome.rounds,
            "candidate_rounds": outcome.candidates,
            "workspace_changed": bool(changed),
            "changed_files": changed[:200],
            "corrective_turns": outcome.corrective_turns,
            "steps": outcome.steps,
            "tool_calls": parsed,
            "malformed_calls": len(calls) - parsed,
            "tokens": (tokens := outcome.tokens()),
            "cached_ratio": round(tokens["cached"] / tokens["prompt"], 4) if tokens["prompt"] else 0.0,
            "agent_wall_s": outcome.agent_wall_s,
            "wall_s": round(wall, 3),
            "plan": (plan.to_dict() if (plan := load_plan(self.agent)) else None),
            "resumed": self.resume_id is not None,
            "progress": self.progress.state(),
        }

    def _error_result(self, message: str, wall: float) -> dict[str, Any]:
        return {
            "status": "error", "task": str(self.task.path), "name": self.task.name,
            "session_id": self.agent.session_id if self.agent else None, "run_dir": str(self.run_dir),
            "workspace": str(self.workspace), "profile": self.profile, "stop_reason": "error", "error": message,
            "final_text": "", "checks": [], "checks_passed": 0, "checks_failed": 0, "first_try": None,
            "repair_rounds": [], "workspace_changed": None, "corrective_turns": 0, "steps": 0,
            "tool_calls": 0, "malformed_calls": 0, "tokens": {"prompt": 0, "cached": 0, "completion": 0},
            "cached_ratio": 0.0, "agent_wall_s": 0.0, "wall_s": round(wall, 3),
        }


def find_run(store: SessionStore, task: TaskSpec, workspace: Path) -> tuple[str, Path]:
    """(session id, run directory) of the latest run of ``task`` in ``workspace`` (to resume)."""
    ws = str(workspace.expanduser().resolve())
    for summary in store.list(kind="agent", limit=1000):
        session = store.get(summary.id)
        if session.workspace == ws and session.meta.get("task") == str(task.path) and session.meta.get("run_dir"):
            return session.id, Path(session.meta["run_dir"])
    raise MlxtermError(f"--resume: no run of {task.path} in {ws} to continue (run it first without --resume)")


def describe_event(ev: AgentEvent, progress: Progress | None = None) -> str | None:
    """One progress line for the terminal (None: nothing worth a line). ``progress``: the run's
    ``Progress`` (it has already observed ``ev``): steps counted over the whole run, the file,
    elapsed time, the plan."""
    return _EventLine(progress).handle(ev)


class _EventLine(AgentEventHandler):
    def __init__(self, progress: Progress | None) -> None:
        self.progress = progress

    def on_plan_updated(self, ev) -> str | None:
        return self.progress.line_for(ev) if self.progress is not None else None

    def on_tool_call_parsed(self, ev: ToolCallParsed) -> str:
        args = json.dumps(ev.call.arguments, ensure_ascii=False)
        return f"[step {ev.step}] call {ev.call.name} {args[:200]}"

    def on_tool_call_malformed(self, ev: ToolCallMalformed) -> str:
        return f"[step {ev.step}] malformed tool call: {ev.error}"

    def on_tool_finished(self, ev: ToolFinished) -> str:
        first = ev.result.content.splitlines()[0] if ev.result.content else ""
        return f"[step {ev.step}] {ev.name} -> {'ok' if ev.result.ok else 'error'} ({ev.duration_ms} ms): {first[:160]}"

    def on_step_done(self, ev: StepDone) -> str | None:
        if self.progress is not None:
            return self.progress.line_for(ev)
        return (f"[step {ev.step}] {ev.completion_tokens} tokens, {ev.cached_tokens}/{ev.prompt_tokens} prompt tokens "
                f"cached, {ev.finish_reason}" + (f": {ev.text[:200]}" if ev.text else ""))

    def on_corrective(self, ev: Corrective) -> str:
        return f"[step {ev.step}] sent back: {ev.message[:160]}"

    def on_agent_done(self, ev: AgentDone) -> str:
        return f"agent stopped: {ev.reason} after {ev.step} steps ({ev.wall_s:.1f} s)"
