"""Test-driven repair inside one attempt: run, check, send the failures back, run again.

After the agent's final answer the task's checks run; while some fail and rounds are left, their
output (trimmed to the failures and the summary) goes back into the same session as a user
message and the agent continues from its cached context. A round that changes no file ends the
repairs (the 1.5B rewrites the identical failing file, even sampled at 0.7). The first check result (before any
check output reached the model) is kept apart from the final one, so a run reports both its
first try and its result after repair. ``mlxterm run`` and the board's attempts both use this.
With ``candidates`` > 1 each round first drafts that many replies at once and keeps one that
passes (``agents.candidates``); when none does, a run that ends at its write keeps the best
failing draft as the round's reply (checked and repaired like any other), and other runs fall
back to the ordinary round.

Status words: ``passed`` only when at least one check ran and every one passed; ``unchecked``
when a task has no checks; ``failed`` otherwise (``error`` / ``cancelled`` come from the run).
"""

from __future__ import annotations

import hashlib
import os
import re
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from agents.candidates import CandidateRound, candidate_round, checks_tests_passed
from agents.events import AgentDone, AgentEvent
from agents.session import AgentLimits, AgentSession
from agents.test_output import failures_only
from agents.transcript import Transcript

REPAIR_OUTPUT_CHARS = 3000  # of check output per round: the head (first failure) and the tail (summary)
REPAIRABLE = ("answered", "max_steps", "repeated", "wrote")  # runs that ended on their own; others stop the attempt
FINGERPRINT_MAX_FILES = 5000
_SKIP_DIRS = {".git", "__pycache__", ".pytest_cache", "node_modules", ".venv"}


def check_status(checks: list[dict[str, Any]]) -> str:
    """passed (at least one check, all passed), failed, or unchecked (no checks)."""
    if not checks:
        return "unchecked"
    return "passed" if all(c["passed"] for c in checks) else "failed"


def check_summary(checks: list[dict[str, Any]]) -> dict[str, Any]:
    passed = sum(1 for c in checks if c["passed"])
    return {"status": check_status(checks), "checks_passed": passed, "checks_failed": len(checks) - passed}


def trim_output(text: str, workspace: Path | None = None, limit: int = REPAIR_OUTPUT_CHARS) -> str:
    """Check output as the model should see it: workspace paths relative, the middle cut when
    long (the head holds the first failure, the tail the summary)."""
    if workspace is not None:
        for root in {str(workspace), str(Path(workspace).resolve())}:
            text = text.replace(root.rstrip("/") + "/", "")
    text = text.strip()
    if len(text) <= limit:
        return text
    head = limit // 2
    tail = limit - head
    cut = len(text) - head - tail
    return f"{text[:head].rstrip()}\n[... {cut} characters cut ...]\n{text[-tail:].lstrip()}"


def repair_message(checks: list[dict[str, Any]], test_command: str | None, workspace: Path | None,
                   round_no: int, rounds: int, written: list[str] | None = None,
                   protected: Callable[[str], object] | None = None) -> str:
    """The user turn that hands failing checks back to the agent. ``written``: the files the
    last run wrote when it ended at the write (``agent.test_after_write``): the turn asks for
    those again, whole, instead of a test run the checks have just done. The workspace files
    the output points at are named, except ``protected`` ones (the task's tests)."""
    failed = [c for c in checks if not c["passed"]]
    parts = [f"The checks failed ({len(failed)} of {len(checks)}; repair round {round_no} of {rounds})."]
    # Checks failing the same way are quoted once (a page missing one field fails 16 of the
    # Kanban task's 18 categories with one sentence), so the turn is about the fault.
    groups: dict[str, list[dict[str, Any]]] = {}
    for c in failed:
        groups.setdefault(_failure_key(c), []).append(c)
    limit = max(800, REPAIR_OUTPUT_CHARS // max(1, len(groups)))
    outputs: list[tuple[str, int]] = []  # (output, how many checks failed with it)
    for same in groups.values():
        c = same[0]
        what = test_command if test_command and len(failed) == 1 else c["name"]
        code = "timed out" if c.get("exit_code") is None else f"exit code {c['exit_code']}"
        output = trim_output(failures_only(c.get("output", "")), workspace, limit)
        outputs.append((output, len(same)))
        if len(same) > 1:
            names = ", ".join(f"`{x['name']}`" for x in same[1:])
            code += f"; {names} failed the same way"
        parts.append(f"Output of `{what}` ({code}):\n```\n{output}\n```")
    pointed = implicated_files(outputs, workspace) if workspace is not None else []
    pointed = [p for p in pointed if not (protected and protected(p))]
    if pointed:
        parts.append(f"The failures point at {', '.join(pointed)}.")
    if written:
        names = ", ".join(dict.fromkeys(written))
        parts.append(f"Read the failures and fix the code: write the whole of {names} again, the path on a line "
                     "of its own and then one fenced block. Only the solution: the tests stay where they are.")
    else:
        parts.append("Read the failures, fix the code and write the file again; run the tests before you answer.")
    return "\n\n".join(parts)


def _failure_key(check: dict[str, Any]) -> str:
    """A check's output without its own name and screenshot lines: equal for checks that
    failed the same way."""
    lines = (check.get("output") or "").replace(f"{check['name']}: ", "").splitlines()
    return "\n".join(line for line in lines if not line.startswith("screenshot:")).strip()


_FILE_LINE = re.compile(r"([\w./-]+\.\w+):\d+")
_ELEMENT_ID = re.compile(r"#([A-Za-z][\w-]*)")
_MARKUP_SUFFIXES = (".html", ".htm", ".js", ".mjs", ".jsx", ".ts", ".tsx", ".vue", ".svelte")


def implicated_files(outputs: list[tuple[str, int]], workspace: Path) -> list[str]:
    """Workspace files the failure outputs (each with the number of checks that failed with
    it) point at, most failing checks first: ``file:line`` references, and the files that
    declare an element an output names as ``#id`` (``id="new-card-title"``). A model told
    "#new-card-title is a <div>" rewrote app.js twice; the element was in index.html."""
    root = Path(workspace)
    markup: list[Path] | None = None  # read once, when an output names an element
    bodies: dict[Path, str] = {}
    weight: dict[str, int] = {}
    for text, n in outputs:
        hit: set[str] = set()
        for name in _FILE_LINE.findall(text):
            rel = name if (root / name).is_file() else name.rsplit("/", 1)[-1]
            if (root / rel).is_file():
                hit.add(rel)
        for i in set(_ELEMENT_ID.findall(text)):
            if markup is None:
                markup = [p for p in _workspace_files(root)
                          if p.suffix in _MARKUP_SUFFIXES and p.stat().st_size <= 1_000_000]
            for path in markup:
                body = bodies.setdefault(path, path.read_text(encoding="utf-8", errors="replace"))
                if f'id="{i}"' in body or f"id='{i}'" in body:
                    hit.add(str(path.relative_to(root)))
        for rel in hit:
            weight[rel] = weight.get(rel, 0) + n
    return sorted(weight, key=lambda rel: (-weight[rel], rel))[:8]


def _workspace_files(root: Path) -> Iterator[Path]:
    """The workspace's files in path order: at most ``FINGERPRINT_MAX_FILES``, no symlinks,
    caches and VCS folders skipped."""
    seen = 0
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in _SKIP_DIRS)
        for name in sorted(filenames):
            path = Path(dirpath) / name
            if path.is_symlink():
                continue
            seen += 1
            if seen > FINGERPRINT_MAX_FILES:
                return
            yield path


def workspace_fingerprint(root: Path) -> dict[str, str]:
    """relative path -> content hash of the workspace's files (bounded; skips caches and VCS)."""
    out: dict[str, str] = {}
    for path in _workspace_files(root):
        try:
            out[str(path.relative_to(root))] = hashlib.sha1(path.read_bytes()).hexdigest()
        except OSError:
            continue
    return out


def changed_paths(before: dict[str, str], after: dict[str, str]) -> list[str]:
    """Files added, removed or changed between two fingerprints."""
    return sorted(p for p in before.keys() | after.keys() if before.get(p) != after.get(p))


@dataclass
class RepairOutcome:
    """All runs of one attempt: ``done`` is the last run's, the totals cover every run."""

    done: AgentDone
    checks: list[dict[str, Any]]
    first_try: dict[str, Any] | None  # check_summary at the first final answer (None: checks never ran)
    rounds: list[dict[str, Any]] = field(default_factory=list)
    runs: list[AgentDone] = field(default_factory=list)
    candidates: list[dict[str, Any]] = field(default_factory=list)  # candidate rounds that kept nothing

    @property
    def steps(self) -> int:
        return sum(d.step for d in self.runs)

    def tokens(self) -> dict[str, int]:
        return {"prompt": sum(d.prompt_tokens for d in self.runs), "cached": sum(d.cached_tokens for d in self.runs),
                "completion": sum(d.completion_tokens for d in self.runs)}

    @property
    def agent_wall_s(self) -> float:
        return round(sum(d.wall_s for d in self.runs), 3)

    @property
    def corrective_turns(self) -> int:
        return sum(d.extra.get("corrective_turns", 0) for d in self.runs)


def run_with_repair(agent: AgentSession, prompt: str, limits: AgentLimits,
                    run_checks: Callable[[], list[dict[str, Any]]], rounds: int, *,
                    test_command: str | None = None, transcript: Transcript | None = None,
                    cancelled: Callable[[], bool] = lambda: False,
                    run_checks_in: Callable[[Path], list[dict[str, Any]]] | None = None,
                    candidates: int = 1, candidate_temperature: float = 0.7,
                    repair_temperature: float | None = None, seed: int = 0,
                    prior: list[AgentDone] | None = None) -> Iterator[AgentEvent | RepairOutcome]:
    """Run ``prompt``, then check and repair up to ``rounds`` times; yields the agent's events
    and, last, the ``RepairOutcome``. ``limits.wall_s`` bounds the whole attempt; steps and
    tokens apply to each run. Checks do not run after a cancelled or broken run.
    ``run_checks_in(workspace)`` runs the checks on another folder (needed for candidates);
    ``repair_temperature`` (None: the run's own) samples the repair rounds: near-greedy decoding
    tends to write the same failing file again. ``prior``: runs already made for this attempt
    (a planned run's items, ``agents.planned``): ``prompt`` is not sent, the checks run at once
    on the last one's result (an empty list: a resumed run whose work was done)."""
    t0 = time.monotonic()
    runs: list[AgentDone] = list(prior or [])
    first_try = None
    checks: list[dict[str, Any]] = []
    round_log: list[dict[str, Any]] = []
    candidate_log: list[dict[str, Any]] = []  # candidate rounds that kept nothing
    message, round_no = prompt, 0
    adopted: AgentDone | None = None  # a failing draft kept as the round's reply
    agent.end_on_write = bool(test_command) and agent.engine.profile.agent.test_after_write
    task_from = None if prior is not None else agent.message_count()  # where the task's prompt goes
    while True:
        left = None if limits.wall_s is None else max(0.001, limits.wall_s - (time.monotonic() - t0))
        done = None
        temperature = repair_temperature if round_no else None
        if adopted is not None:
            done, adopted = adopted, None
            runs.append(done)
        elif prior is not None and round_no == 0:
            done = runs[-1] if runs else AgentDone(0, "answered", "", 0, 0, 0, 0.0)
        else:
            for ev in agent.run(message, AgentLimits(steps=limits.steps, tokens=limits.tokens, wall_s=left),
                                temperature=temperature):
                if isinstance(ev, AgentDone):
                    done = ev
                yield ev
            assert done is not None
            runs.append(done)
        if done.reason in ("cancelled", "error") or cancelled():
            checks = []
            break
        checks = run_checks()
        summary = check_summary(checks)
        if first_try is None:
            first_try = summary
        else:
            entry = {"round": round_no, **summary, "steps": done.step,
                     "completion_tokens": done.completion_tokens, "stop_reason": done.reason}
            if "candidates" in done.extra:  # the round's reply was the best of its drafts
                entry.update(stop_reason="candidate_best", candidates=done.extra["candidates"])
            round_log.append(entry)
            if transcript is not None:
                transcript.write("repair_result", done.step, round=round_no, **summary)
        if summary["status"] != "failed" or round_no >= rounds or done.reason not in REPAIRABLE:
            break
        if round_no and not done.extra.get("changed_files"):
            break  # the round changed no file: the checks would fail the same way again
        if limits.wall_s is not None and time.monotonic() - t0 >= limits.wall_s:
            break
        round_no += 1
        written = done.extra.get("changed_files") if done.reason == "wrote" and agent.end_on_write else None
        message = repair_message(checks, test_command, agent.workspace, round_no, rounds, written,
                                 agent.files.protected_path)
        if transcript is not None:
            transcript.write("repair", done.step, round=round_no, message=message)
        drafts = candidates > 1 and run_checks_in is not None and not agent.remote  # drafts: local batching
        if drafts:
            agent.close_turn()  # a run that stopped after tool results (looped, repeated) left it open
        if drafts and agent.ends_with_answer():
            picked = None
            # in a run that ends at its write the best failing draft is the round's reply: an
            # ordinary round after the drafts would decode one more sample of the same kind
            keep_best = agent.end_on_write
            adopt_t0 = time.monotonic()
            for ev in candidate_round(agent, message, candidates, run_checks_in, temperature=candidate_temperature,
                                      seed=seed + 1000 * round_no, keep_best=keep_best,
                                      baseline=checks_tests_passed(checks),
                                      fresh=agent.engine.profile.agent.candidate_fresh, task_from=task_from):
                if isinstance(ev, CandidateRound):
                    picked = ev
                else:
                    yield ev
            changed = list(dict.fromkeys(agent.changed_files)) if picked.chosen is not None else []
            if transcript is not None:
                transcript.write("candidates", done.step, round=round_no, **picked.record())
            if picked.chosen is not None and picked.chosen.passed:
                checks = run_checks()
                round_log.append({"round": round_no, **check_summary(checks), "steps": 1,
                                  "completion_tokens": picked.chosen.done.usage.completion_tokens,
                                  "stop_reason": "candidate", "candidates": picked.record()})
                break  # it passed on the scratch copy; the real workspace's result is the attempt's
            if picked.chosen is not None:  # the best failing draft: checked like an ordinary round's reply
                usage = picked.chosen.done.usage
                adopted = AgentDone(1, "wrote" if changed else "answered", "", usage.prompt_tokens,
                                    usage.cached_tokens, usage.completion_tokens,
                                    round(time.monotonic() - adopt_t0, 3),
                                    extra={"changed_files": changed, "corrective_turns": 0,
                                           "candidates": picked.record()})
                continue
            candidate_log.append({"round": round_no, **picked.record()})
    agent.end_on_write = False
    outcome = RepairOutcome(runs[-1] if runs else done, checks, first_try, round_log, runs)
    outcome.candidates = candidate_log
    yield outcome
