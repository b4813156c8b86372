"""Agent: Exercism-layout exercises as agent tasks, scored by their own unit tests.

Every exercise of ``--exercises DIR`` (one folder each: ``INSTRUCTIONS.md``,
``exercise.json``, stub and unittest files) becomes a headless agent task
(``agents/exercises.py``) in a fresh workspace, all on ONE engine loaded once, with a fresh
session store in a temp dir per bench run. After each run the bench restores the original test
files and runs them once more in the agent sandbox: that is the authoritative
``passed_after_repair``. ``passed_first_try`` is the checks' verdict at the agent's first final
answer (``result.json`` -> ``first_try``), before any check output went back to it.

Split (fixed, independent of the set): an exercise is in ``tune`` when
``int(sha1(slug).hexdigest(), 16) % 3 == 0``, else in ``report``; ``--split`` defaults to
``report``. ``--only`` picks slugs whatever their split; ``--limit N`` keeps the first N by slug.
Run directories (transcript, ``result.json``, workspace) stay in the bench's temp dir
(``bench_dir`` in the JSON).
"""

from __future__ import annotations

import math
import os
import re
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from app.benches.agent_plain import ARMS as PLAIN_ARMS

# aider's code-editing leaderboard (133 Exercism Python exercises, whole-file edits), in
# percent: first try / after one round of test output
AIDER_REFERENCE = {
    "0.5b": (14.3, 14.3),
    "1.5b": (28.6, 31.6),
    "3b": (33.8, 39.1),
    "7b": (51.9, 57.9),
}
AIDER_SOURCE = "aider code-editing leaderboard, Qwen2.5-Coder-{size}-Instruct (whole edit format)"
_QWEN_CODER = re.compile(r"qwen2\.5-coder-(0\.5b|1\.5b|3b|7b)", re.IGNORECASE)


def add_arguments(p) -> None:
    p.add_argument("--exercises", required=True, type=Path, help="directory of exercises in Exercism's layout")
    p.add_argument("--profile", help="default: the best installed agent-capable profile")
    p.add_argument("--split", choices=("tune", "report", "all"), default="report",
                   help="which exercises: tune (sha1(slug) %% 3 == 0), report (the rest; default) or all")
    p.add_argument("--only", help="comma-separated slugs to run (whatever their split)")
    p.add_argument("--limit", type=int, help="run the first N exercises of the selection (by slug)")
    p.add_argument("--repair-rounds", type=int, default=None,
                   help="rounds of test output given back after a failed first try (default: the profile's)")
    p.add_argument("--steps", type=int, help="agent step limit per exercise (default: the profile's)")
    p.add_argument("--wall-s", type=float, help="agent wall-time limit per exercise in seconds")
    p.add_argument("--seed", type=int, default=0,
                   help="sampling seed of every exercise's run (step n samples with seed + n); default 0, so a "
                        "run repeats; a negative value samples unseeded")
    p.add_argument("--temperature", type=float, default=None,
                   help="sampling temperature of the agent's steps (default: the profile's; 0 = greedy, as aider's runs)")
    p.add_argument("--arms", default="agent",
                   help="comma-separated: agent (the agent loop; default), plain (the model alone: one "
                        "greedy whole-file reply, as aider's benchmark asks, written and scored the same way) "
                        "and/or plain_tests (the same with the unit tests shown beside the stub)")
    p.add_argument("--show-tests", action="store_true",
                   help="the agent gets the exercise's test files with its prompt (read-only files, as a task's read: key)")
    p.add_argument("--files-first", action="store_true",
                   help="the agent's prompt shows the stub file(s) before the instructions (as the plain arm does)")
    p.add_argument("--candidates", type=int, default=None,
                   help="drafts decoded together per repair round, one that passes kept (default: the profile's)")


def select(exercises: list, split: str, only: str | None, limit: int | None) -> tuple[list, str]:
    """The exercises to run and the split's label (``only`` when ``--only`` picked them)."""
    from agents.exercises import ExerciseError, split_of

    if only:
        wanted = [s.strip() for s in only.split(",") if s.strip()]
        by_slug = {e.slug: e for e in exercises}
        unknown = [s for s in wanted if s not in by_slug]
        if unknown:
            raise ExerciseError(f"--only: no exercise {', '.join(unknown)} in the exercises directory")
        chosen, label = sorted((by_slug[s] for s in dict.fromkeys(wanted)), key=lambda e: e.slug), "only"
    else:
        chosen = [e for e in exercises if split == "all" or split_of(e.slug) == split]
        label = split
    if limit is not None:
        chosen = chosen[:max(limit, 0)]
    return chosen, label


def reference_for(*names: str | None) -> dict[str, Any] | None:
    """aider's numbers for the model a profile runs, when it is a Qwen2.5-Coder size they list."""
    for name in names:
        m = _QWEN_CODER.search(str(name or ""))
        if m:
            size = m.group(1).lower()
            first, after = AIDER_REFERENCE[size]
            return {"model": f"Qwen2.5-Coder-{size.upper()}-Instruct", "pct_first_try": first,
                    "pct_after_repair": after, "source": AIDER_SOURCE.format(size=size.upper())}
    return None


def percentile(values: list[float], q: float) -> float | None:
    """Nearest-rank percentile (``q`` in 0..1); None for no values."""
    if not values:
        return None
    s = sorted(values)
    return s[max(math.ceil(q * len(s)) - 1, 0)]


def score(ex, workspace: Path) -> dict[str, Any]:
    """Restore the original tests, run them once in the agent sandbox: the bench's verdict."""
    from agents.checks import agent_sandbox, run_check
    from agents.exercises import CHECK_TIMEOUT_S, restore_tests
    from agents.taskfile import Check

    try:
        restore_tests(ex, workspace)
    except OSError as e:
        return {"passed": False, "exit_code": None, "output": f"could not restore the tests: {e}", "sandboxed": None}
    return run_check(Check("score", ex.test_command, CHECK_TIMEOUT_S), workspace, agent_sandbox(),
                     env={"MLXTERM_TASK_DIR": str(ex.dir), "MLXTERM_WORKSPACE": str(workspace)},
                     readable=(str(ex.dir),))


def _first_try(result: dict[str, Any]) -> tuple[bool | None, str | None]:
    first = result.get("first_try")
    if not isinstance(first, dict):
        return None, None
    status = first.get("status")
    return (None if status not in ("passed", "failed") else status == "passed"), status


def run_exercise(ex, task, engine, store, run_dir: Path, candidates: int | None = None) -> dict[str, Any]:
    from agents.headless import HeadlessRun

    t0 = time.monotonic()
    error = None
    try:
        result = HeadlessRun(task, engine=engine, run_dir=run_dir, store=store, candidates=candidates).run()
    except Exception as e:  # one broken exercise must not end the bench
        result = {"status": "error", "stop_reason": "error", "error": f"{type(e).__name__}: {e}"}
    workspace = Path(result.get("workspace") or run_dir / "workspace")
    verdict = score(ex, workspace) if workspace.is_dir() else {"passed": False, "exit_code": None,
                                                              "output": "no workspace", "sandboxed": None}
    wall = time.monotonic() - t0
    first, first_status = _first_try(result)
    rounds = result.get("repair_rounds")
    tokens = result.get("tokens") if isinstance(result.get("tokens"), dict) else {}
    error = result.get("error") or error
    return {
        "slug": ex.slug,
        "passed_first_try": first,
        "passed_after_repair": bool(verdict["passed"]),
        "first_try_status": first_status,
        "run_status": result.get("status"),
        "rounds": len(rounds) if isinstance(rounds, list) else None,
        "corrective_turns": result.get("corrective_turns"),
        "workspace_changed": result.get("workspace_changed"),
        "steps": result.get("steps"),
        "tool_calls": result.get("tool_calls"),
        "prompt_tokens": tokens.get("prompt"),
        "cached_tokens": tokens.get("cached"),
        "completion_tokens": tokens.get("completion"),
        "agent_wall_s": result.get("agent_wall_s"),
        "wall_s": round(wall, 3),
        "stop_reason": result.get("stop_reason"),
        "error": error,
        "run_dir": str(run_dir),
        "score_exit_code": verdict.get("exit_code"),
        "score_sandboxed": verdict.get("sandboxed"),
        "score_output": (verdict.get("output") or "")[-1500:],
        "repair_rounds": rounds if isinstance(rounds, list) else None,
        "candidate_rounds": result.get("candidate_rounds"),
    }


def parse_arms(text: str) -> tuple[str, ...]:
    arms = tuple(dict.fromkeys(a.strip() for a in text.split(",") if a.strip()))
    bad = [a for a in arms if a not in ("agent", *PLAIN_ARMS)]
    if bad or not arms:
        from agents.exercises import ExerciseError

        raise ExerciseError(f"--arms: expected agent, plain and/or plain_tests, got {text!r}")
    return arms


def _pct(n: int, d: int) -> float | None:
    return round(100.0 * n / d, 1) if d else None


def _yes_no(v: bool | None) -> str:
    return "?" if v is None else ("pass" if v else "fail")


def summarize(records: list[dict[str, Any]]) -> dict[str, Any]:
    plain_summary = {}
    for arm in PLAIN_ARMS:
        done = [r[arm] for r in records if isinstance(r.get(arm), dict)]
        passed = sum(1 for p in done if p["passed"])
        plain_summary.update({f"{arm}_count": len(done), f"passed_{arm}": passed if done else None,
                              f"pct_{arm}": _pct(passed, len(done)) if done else None})
    records = [r for r in records if "passed_after_repair" in r]  # the agent arm's
    n = len(records)
    known_first = [r for r in records if r["passed_first_try"] is not None]
    first = sum(1 for r in known_first if r["passed_first_try"])
    after = sum(1 for r in records if r["passed_after_repair"])
    walls = [r["wall_s"] for r in records]
    tokens = {k: sum(r[f"{k}_tokens"] or 0 for r in records) for k in ("prompt", "cached", "completion")}
    return {
        "count": n,
        "passed_first_try": first if known_first else None,
        "first_try_known": len(known_first),
        "pct_first_try": _pct(first, len(known_first)) if known_first else None,
        "passed_after_repair": after,
        "pct_after_repair": _pct(after, n),
        "wall_s_median": round(statistics.median(walls), 3) if walls else None,
        "wall_s_p90": percentile(walls, 0.9),
        "tokens": tokens,
        **plain_summary,
    }


def progress_line(rec: dict[str, Any]) -> str:
    parts = []
    if "passed_after_repair" in rec:
        parts.append(f"first try {_yes_no(rec['passed_first_try'])}, after repair "
                     f"{_yes_no(rec['passed_after_repair'])}, {rec['wall_s']:.1f} s"
                     + (f" ({rec['stop_reason']}: {rec['error']})" if rec["error"] else ""))
    for arm in PLAIN_ARMS:
        if arm in rec:
            p = rec[arm]
            parts.append(f"{arm} {_yes_no(p['passed'])}, {p['wall_s']:.1f} s" + (f" ({p['error']})" if p["error"] else ""))
    return "; ".join(parts)


def _load_engine(profile: str, checkpoints: Path):
    """The local engine, its SSD checkpoints under ``checkpoints`` (the bench's own, removed at
    the end: hundreds of MB that would otherwise evict the user's sessions from their store), or
    a remote profile's server (``model.remote``: both arms run on it)."""
    from dataclasses import replace

    from engine.profiles import ProfileError, load_profile
    from engine.runtime import Engine
    from engine.serving.remote_engine import RemoteEngine

    try:
        prof = load_profile(profile)
    except ProfileError:
        return Engine.load(profile)  # it says what is wrong with the profile
    if prof.model.remote is not None:
        return RemoteEngine.load(profile)
    return Engine.load(replace(prof, cache=replace(prof.cache, ssd_dir=str(checkpoints))))


def run(args) -> dict:
    from engine.sessions import SessionStore

    from agents.choose import best_agent_profile
    from agents.exercises import exercise_task, find_exercises, split_of
    from app.benches.agent_plain import run_plain

    arms = parse_arms(args.arms)
    exercises = find_exercises(args.exercises)
    chosen, split = select(exercises, args.split, args.only, args.limit)
    in_split = len([e for e in exercises if args.split == "all" or split_of(e.slug) == args.split])
    print(f"bench agent: split {split}: {len(chosen)} exercise(s) to run"
          + ("" if split == "only" else f" ({in_split} of {len(exercises)} in the split)"), file=sys.stderr)
    profile = args.profile or best_agent_profile()
    tmp = Path(tempfile.mkdtemp(prefix="mlxterm-bench-agent-"))
    t_start = time.monotonic()
    print(f"bench agent: run directories under {tmp}", file=sys.stderr)
    engine = _load_engine(profile, tmp / "checkpoints")
    load_s = time.monotonic() - t_start
    records: list[dict[str, Any]] = []
    interrupted = False
    store = SessionStore(tmp / "sessions.sqlite3")
    try:
        for i, ex in enumerate(chosen, 1):
            rec: dict[str, Any] = {"slug": ex.slug}
            # arms alternate A/B, B/A from one exercise to the next (a warm cache favours neither)
            for arm in (arms if i % 2 else arms[::-1]):
                if arm in PLAIN_ARMS:
                    rec[arm] = run_plain(ex, engine, tmp / arm / ex.slug, score, show_tests=arm == "plain_tests")
                    continue
                task = exercise_task(ex, tmp / "templates", repair_rounds=args.repair_rounds,
                                     steps=args.steps, wall_s=args.wall_s, temperature=args.temperature,
                                     show_tests=args.show_tests, files_first=args.files_first,
                                     seed=None if args.seed is not None and args.seed < 0 else args.seed)
                rec.update(run_exercise(ex, task, engine, store, tmp / "runs" / ex.slug, args.candidates))
            rec["split"] = split_of(ex.slug)
            records.append(rec)
            print(f"[{i}/{len(chosen)}] {ex.slug}: " + progress_line(rec), file=sys.stderr)
    except KeyboardInterrupt:  # Ctrl-C: report the exercises that finished
        interrupted = True
        print(f"bench agent: interrupted after {len(records)} of {len(chosen)} exercise(s)", file=sys.stderr)
    finally:
        store.close()
        model = getattr(engine, "model_name", None)
        prof = getattr(engine, "profile", None)
        profile_name = getattr(prof, "name", None) or profile
        source = getattr(getattr(prof, "model", None), "source", None)
        engine.close()
        shutil.rmtree(tmp / "checkpoints", ignore_errors=True)
    total = time.monotonic() - t_start
    summary = summarize(records)
    reference = reference_for(profile_name, source, model, profile)
    first = ("unknown" if summary["pct_first_try"] is None
             else f"{summary['passed_first_try']}/{summary['first_try_known']} ({summary['pct_first_try']}%)")
    after = f"{summary['passed_after_repair']}/{summary['count']} ({summary['pct_after_repair']}%)"
    agent = "agent" in arms
    plain = "; ".join(f"{arm} (one greedy whole-file reply{', tests shown' if arm == 'plain_tests' else ''}) "
                      f"{summary[f'passed_{arm}']}/{summary[f'{arm}_count']} ({summary[f'pct_{arm}']}%)"
                      for arm in PLAIN_ARMS if summary[f"pct_{arm}"] is not None)
    ref = (f"; aider {reference['model']}: {reference['pct_first_try']}% / {reference['pct_after_repair']}%"
           if reference else "")
    return {
        "bench": "agent",
        "profile": profile_name,
        "model": str(source) if source is not None else model,
        "split": split,
        "split_rule": "tune: int(sha1(slug).hexdigest(), 16) % 3 == 0; report: the rest",
        "exercises_dir": str(Path(args.exercises).resolve()),
        "exercises": [e.slug for e in chosen],
        "interrupted": interrupted,
        "exercises_total": len(exercises),
        "repair_rounds": args.repair_rounds,
        "seed": None if args.seed < 0 else args.seed,
        "candidates": args.candidates,
        "temperature": args.temperature,
        "show_tests": args.show_tests,
        "files_first": args.files_first,
        "arms": list(arms),
        **summary,
        "reference": reference,
        "load_s": round(load_s, 3),
        "wall_s": round(total, 3),
        "bench_dir": str(tmp),
        "loadavg": list(os.getloadavg()),
        "results": records,
        "summary": f"{len(records)} exercises ({split} split) on {profile_name}: " + "; ".join(filter(None, [
            agent and f"agent first try {first}, after repair {after}, median {summary['wall_s_median']} s, "
                      f"p90 {summary['wall_s_p90']} s per exercise", plain])) + ref,
    }
