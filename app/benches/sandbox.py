"""Sandbox overhead per bash call: the same commands with and without bubblewrap.

Arms alternate in one run (plain, sandboxed, sandboxed, plain per round) so load on a
shared machine hits both alike. Commands: ``true`` (the launch cost alone) and a short
Python one-liner (a typical agent call). Reports per-arm medians and the added milliseconds.
"""

from __future__ import annotations

import os
import shlex
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

# The Python one-liner names this interpreter: a bare "python3" can resolve differently inside
# (a pyenv shim under the hidden home falls through to /usr/bin/python3) and skew the arms.
COMMANDS = {"true": "true", "python": f"{shlex.quote(sys.executable)} -c 'print(sum(range(1000)))'"}


def add_arguments(p) -> None:
    p.add_argument("--rounds", type=int, default=10, help="rounds per command (each runs every arm twice)")


def run(args) -> dict:
    from agents.checks import agent_sandbox
    from tools.bash import execute

    box = agent_sandbox()
    if not box.active:
        return {"available": False, "reason": box.status.reason,
                "summary": f"sandbox unavailable: {box.status.reason}"}
    ws = Path(tempfile.mkdtemp(prefix="mlxterm-bench-sandbox-"))
    try:
        arms = {"plain": None, "sandboxed": box}
        results: dict[str, dict] = {}
        for name, command in COMMANDS.items():
            times: dict[str, list[float]] = {"plain": [], "sandboxed": []}
            execute(command, ws, 60, None, box)  # warm the page cache for bwrap and the command
            for _ in range(args.rounds):
                for arm in ("plain", "sandboxed", "sandboxed", "plain"):
                    t0 = time.perf_counter()
                    data = execute(command, ws, 60, None, arms[arm])
                    times[arm].append((time.perf_counter() - t0) * 1000)
                    assert data["exit_code"] == 0 and data["sandboxed"] == (arm == "sandboxed"), data
            med = {arm: statistics.median(v) for arm, v in times.items()}
            results[name] = {"plain_ms": round(med["plain"], 1), "sandboxed_ms": round(med["sandboxed"], 1),
                             "overhead_ms": round(med["sandboxed"] - med["plain"], 1),
                             "ratio": round(med["sandboxed"] / med["plain"], 2), "n": len(times["plain"])}
    finally:
        shutil.rmtree(ws, ignore_errors=True)
    load = os.getloadavg()
    summary = "; ".join(f"{k}: {v['plain_ms']} -> {v['sandboxed_ms']} ms (+{v['overhead_ms']} ms)"
                        for k, v in results.items())
    return {"available": True, "backend": box.status.backend, "process_limit": box.status.process_limit,
            "commands": results, "loadavg": [round(x, 2) for x in load],
            "summary": f"sandbox overhead per bash call (median): {summary}; load {load[0]:.1f}"}
