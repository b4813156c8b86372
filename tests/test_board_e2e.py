"""The task board on real weights (Qwen2.5-Coder-0.5B): three cards, concurrency 2, through
the CLI (`mlxterm tasks add` / `tasks run`); every card reaches review with its checks
passing, and the first step of the cards after the first reuses the shared prefix's KV."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TASKS = ROOT / "assets" / "tasks" / "board"


def _qwen_installed() -> bool:
    from engine.model.catalog import model_status

    return model_status("qwen2.5-coder-0.5b").installed


@pytest.mark.e2e
def test_three_cards_concurrency_2_on_qwen(tmp_path):
    if not _qwen_installed():
        pytest.skip("Qwen2.5-Coder-0.5B is not installed (mlxterm models install qwen2.5-coder-0.5b)")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}

    def cli(*argv, check=True):
        proc = subprocess.run([sys.executable, "-m", "app", *argv], env=env, capture_output=True, text=True,
                              timeout=900)
        if check:
            assert proc.returncode == 0, proc.stdout + proc.stderr
        return proc

    for name in ("hello", "greeting", "hi"):
        # pinned: with the 1.5B also assembled, the default would be the bigger (slower) model
        cli("tasks", "add", str(TASKS / f"{name}.yaml"), "--profile", "qwen2.5-coder-0.5b")
    run = cli("tasks", "run", "--concurrency", "2", "--until-empty", "--json")
    summary = json.loads(run.stdout)
    assert summary["failed"] == []
    assert [c["state"] for c in summary["cards"]] == ["review"] * 3, summary
    first = {a["card"]: a for a in summary["attempts"] if a["number"] == 1}
    for cid in (2, 3):  # the first card prefilled the shared prefix; the others restore it
        assert first[cid]["first_step_cached_ratio"] > 0.5, first[cid]
    exported = json.loads(cli("tasks", "export", "2").stdout)
    att = exported["attempts"][-1]
    assert att["checks"] and all(c["passed"] for c in att["checks"])
    assert att["ttft_s_sum"] > 0 and att["steps"][0]["cache_source"] in ("ram", "ssd")
    assert "+++ b/greeting.txt" in att["diff"]
