"""Task board: wall time of the same cards run serially vs concurrently, first-step reuse.

Each arm runs the demo cards (``assets/tasks/board/*.yaml``) on a fresh board, session store
and checkpoint store, in its own process (a fresh engine per arm, its load not timed; the
process returns the model's memory), arms alternated
(1, N, N, 1 for ``--rounds 1``). Reported per arm: the dispatcher's wall time, every card's
final state and checks, and each attempt's first-step cached ratio (the shared system prompt,
tools and example turns restored from the prefix checkpoint instead of prefilled).
"""

from __future__ import annotations

import statistics
import tempfile
import time
from pathlib import Path

from app.benches import scratch_profile

TASKS = Path(__file__).resolve().parents[2] / "assets" / "tasks" / "board"


def add_arguments(p) -> None:
    p.add_argument("--profile", help="default: the best installed agent-capable profile")
    p.add_argument("--concurrency", type=int, default=2, help="the concurrent arm's limit (default 2)")
    p.add_argument("--rounds", type=int, default=1, help="each round runs serial, N, N, serial")
    p.add_argument("--tasks", default=str(TASKS), help="directory of task YAMLs (one card each)")
    p.add_argument("--arm", type=int, help=argparse_hidden())


def argparse_hidden():
    import argparse

    return argparse.SUPPRESS


def run_arm(profile: str, tasks: list[Path], concurrency: int) -> dict:
    """One arm on a fresh board / sessions / checkpoint store; engine load not timed."""
    from engine.runtime import Engine
    from engine.sessions import SessionStore

    from agents.board.actions import card_from_task
    from agents.board.dispatcher import Dispatcher
    from agents.board.store import BoardStore
    from agents.taskfile import load_task

    # the board (cards, workspaces, transcripts) stays for a look afterwards; the checkpoints go
    tmp = Path(tempfile.mkdtemp(prefix="mlxterm-bench-board-"))
    with scratch_profile(profile, "mlxterm-bench-board-profile-") as prof_path:
        engine = Engine.load(str(prof_path))
        try:
            board, sessions = BoardStore(tmp / "board.sqlite3"), SessionStore(tmp / "sessions.sqlite3")
            ids = [board.add(card_from_task(load_task(t), state="queued", profile=None)).id for t in tasks]
            d = Dispatcher(board, sessions, lambda p: engine, concurrency=concurrency, default_profile=profile)
            t0 = time.monotonic()
            d.drain()
            wall = time.monotonic() - t0
            cards = []
            for cid in ids:
                c = board.get(cid)
                atts = board.attempts(cid)
                cards.append({"id": cid, "title": c.title, "state": c.state, "attempts": len(atts),
                              "checks_passed": all(ch["passed"] for ch in atts[-1].checks) if atts else False,
                              "first_step_cached_ratio": [a.first_step_cached_ratio for a in atts],
                              "first_step": [a.steps[0] if a.steps else None for a in atts],
                              "wall_s": [a.wall_s for a in atts]})
            board.close()
            return {"concurrency": concurrency, "wall_s": round(wall, 2), "cards": cards, "board_dir": str(tmp)}
        finally:
            engine.close()


def _arm_in_subprocess(profile: str, tasks: str, concurrency: int) -> dict:
    """Each arm in its own process: a fresh engine whose memory is returned when it ends."""
    import json
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-m", "app", "bench", "board", "--json", "--profile", profile,
                           "--tasks", tasks, "--arm", str(concurrency)], capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"bench arm (concurrency {concurrency}) failed: {proc.stderr[-2000:]}")
    return json.loads(proc.stdout)


def run(args) -> dict:
    import os

    from agents.choose import best_agent_profile

    profile = args.profile or best_agent_profile()
    tasks = sorted(Path(args.tasks).glob("*.yaml"))
    if args.arm is not None:  # one arm, in the child process the parent started
        return run_arm(profile, tasks, args.arm)
    order = [1, args.concurrency, args.concurrency, 1] * args.rounds
    arms = [_arm_in_subprocess(profile, args.tasks, n) for n in order]
    serial = [a["wall_s"] for a in arms if a["concurrency"] == 1]
    conc = [a["wall_s"] for a in arms if a["concurrency"] == args.concurrency]
    ratio = statistics.median(serial) / statistics.median(conc)
    ok = all(c["state"] in ("review", "done") and c["checks_passed"] for a in arms for c in a["cards"])
    return {
        "profile": profile, "tasks": [t.name for t in tasks], "order": order, "arms": arms,
        "serial_wall_s_median": statistics.median(serial), "concurrent_wall_s_median": statistics.median(conc),
        "speedup": round(ratio, 3), "all_cards_passed": ok, "loadavg": os.getloadavg(),
        "summary": (f"{len(tasks)} cards on {profile}: serial {statistics.median(serial):.1f} s, "
                    f"concurrency {args.concurrency} {statistics.median(conc):.1f} s (x{ratio:.2f}); "
                    f"all passed: {ok}"),
    }
