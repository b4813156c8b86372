"""``mlxterm run TASK.yaml``: run an agent task headless and check the result.

Writes ``transcript.jsonl`` and ``result.json`` to the run directory (default
``<data_dir>/runs/<id>``); the run is also a stored agent session that can be continued.
Exit status: 0 passed (or unchecked: the task has no checks), 1 failed or error, 130 cancelled
(Ctrl-C), 2 bad input.
"""

from __future__ import annotations

import json
import signal
import sys
from pathlib import Path

EXIT = {"passed": 0, "unchecked": 0, "failed": 1, "error": 1, "cancelled": 130}


def register(sub) -> None:
    p = sub.add_parser("run", help="run an agent task file headless (checks, transcript, result.json)")
    p.add_argument("task", type=Path, help="task YAML file (prompt, limits, checks...)")
    p.add_argument("--workspace", type=Path, help="directory the agent works in (default: RUN_DIR/workspace)")
    p.add_argument("--profile", help="profile name or path (default: the task's, else the best installed "
                   "agent-capable profile)")
    p.add_argument("--allow", action="append", default=[], metavar="TOOL",
                   help="let TOOL run without approval (repeatable; e.g. --allow bash)")
    p.add_argument("--run-dir", type=Path, help="where transcript.jsonl and result.json go")
    p.add_argument("--json", action="store_true", help="print result.json to stdout instead of progress")
    p.add_argument("--checks-only", action="store_true",
                   help="only re-run the task's checks on --workspace (no agent); writes result.json")
    p.add_argument("--resume", action="store_true",
                   help="continue the latest run of TASK in --workspace (after a crash or kill): same session, "
                        "run dir and transcript; a planned run goes on with its first item not yet done")
    p.set_defaults(func=run)


def run(args) -> int:
    from agents.headless import HeadlessRun, describe_event
    from agents.taskfile import TaskError, load_task
    from tools import TOOL_NAMES

    task = load_task(args.task)
    for tool in args.allow:
        if tool not in TOOL_NAMES:
            raise TaskError(f"--allow {tool}: unknown tool (tools: {', '.join(TOOL_NAMES)})")

    def progress(ev) -> None:
        line = describe_event(ev, headless.progress)
        if line:
            print(line, file=sys.stderr if args.json else sys.stdout, flush=True)

    from agents.choose import best_agent_profile
    from tools.sandbox import probe

    sandbox = probe()
    if not sandbox.available:
        print(f"mlxterm: no sandbox ({sandbox.reason}): checks run unconfined and bash only runs "
              "with --allow bash, unconfined", file=sys.stderr, flush=True)
    profile = args.profile or task.profile or best_agent_profile()  # no capable one: says how to get one
    headless = HeadlessRun(task, profile=profile, workspace=args.workspace, allow=tuple(args.allow),
                           run_dir=args.run_dir, on_event=progress, resume=args.resume)
    if args.checks_only and args.resume:
        raise TaskError("--checks-only and --resume do not go together (--checks-only runs no agent)")
    if args.checks_only:
        if args.workspace is None:
            raise TaskError("--checks-only needs --workspace DIR (the workspace to check)")
        result = headless.checks_only()
        _print_result(result, args.json)
        return EXIT[result["status"]]

    def on_sigint(signum, frame) -> None:
        # First Ctrl-C: stop the agent cleanly (the running tool is killed, the transcript
        # stays valid); a second one interrupts at once.
        signal.signal(signal.SIGINT, signal.default_int_handler)
        print("\nmlxterm: cancelling the run (Ctrl-C again to abort)", file=sys.stderr, flush=True)
        headless.cancel()

    previous = signal.signal(signal.SIGINT, on_sigint)
    try:
        result = headless.run()
    finally:
        signal.signal(signal.SIGINT, previous)
    _print_result(result, args.json)
    return EXIT[result["status"]]


def _print_result(result: dict, as_json: bool) -> None:
    if as_json:
        print(json.dumps(result, indent=2, ensure_ascii=False))
        return
    for check in result["checks"]:
        print(f"check {check['name']}: {'passed' if check['passed'] else 'FAILED'}")
    line = f"{result['status']}: {result['checks_passed']}/{len(result['checks'])} checks passed, "
    if result.get("checks_only"):
        line += f"checks only, {result['wall_s']:.1f} s"
    else:
        line += (f"{result['steps']} steps, {result['tokens']['completion']} tokens, {result['wall_s']:.1f} s "
                 f"(cached {result['cached_ratio']:.0%} of prompt tokens)")
    print(f"{line}; run dir {result['run_dir']}")
    first, rounds = result.get("first_try"), result.get("repair_rounds") or []
    if first and rounds:
        trail = " -> ".join([first["status"], *(r["status"] for r in rounds)])
        print(f"first try {first['status']}; {len(rounds)} repair round{'s' if len(rounds) != 1 else ''}: {trail}")
    if result.get("workspace_changed") is False:
        print("note: no file in the workspace changed")
    if result.get("error"):
        print(f"mlxterm: {result['error']}", file=sys.stderr)
