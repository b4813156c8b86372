"""``mlxterm run --resume`` after a SIGKILL: the same session, workspace and transcript, the plan
going on from its first item not done, no step lost or run twice."""

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

from engine.paths import data_dir
from engine.sessions import SessionStore

import pytest

from agents.transcript import read_transcript
from tests.scripted_run import FILES, body

REPO = Path(__file__).resolve().parents[1]
TASK = """
prompt: "Build the app: index.html, app.js, style.css and notes.md."
limits: {steps: 20, wall_s: 300}
checks:
  - name: all files
    run: for f in index.html app.js style.css notes.md; do test -s $f || exit 1; done
"""


def start(task, ws, *extra):
    return subprocess.Popen([sys.executable, "-m", "tests.scripted_run", "run", str(task), "--workspace", str(ws),
                             "--profile", "scripted", "--allow", "bash", *extra],
                            cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)},
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def ticked(store_path):
    """Plan items ticked so far (read from the session store the run writes)."""
    if not store_path.exists():
        return 0
    try:
        store = SessionStore(store_path)
        sessions = store.list(kind="agent")
        plan = store.get_meta(sessions[0].id).get("plan") if sessions else None
    except Exception:  # noqa: BLE001 (the writer holds the database: ask again)
        return 0
    return sum(1 for i in plan["items"] if i["done"]) if plan else 0


def test_resume_after_sigkill_finishes_with_no_step_lost_or_repeated(tmp_path):
    task, ws, run_dir = tmp_path / "task.yaml", tmp_path / "ws", tmp_path / "run"
    task.write_text(textwrap.dedent(TASK))
    db = data_dir() / "sessions.sqlite3"
    proc = start(task, ws, "--run-dir", str(run_dir))
    deadline = time.monotonic() + 120
    while ticked(db) < 2:
        assert proc.poll() is None, proc.communicate()[1][-3000:]
        assert time.monotonic() < deadline, "the run never wrote two files"
        time.sleep(0.02)
    proc.send_signal(signal.SIGKILL)
    proc.communicate(timeout=60)
    assert proc.returncode == -signal.SIGKILL
    assert not (run_dir / "result.json").exists()
    written_before = [p.name for p in ws.iterdir()]
    assert 2 <= len(written_before) < len(FILES)

    # the run dir comes from the session: --resume needs only the task and the workspace
    proc = start(task, ws, "--resume")
    out, err = proc.communicate(timeout=180)
    assert proc.returncode == 0, err[-3000:] + out[-3000:]
    result = json.loads((run_dir / "result.json").read_text())
    assert result["status"] == "passed" and result["resumed"] is True
    assert all(i["done"] for i in result["plan"]["items"])
    assert [i["attempts"] for i in result["plan"]["items"]][:2] == [1, 1]
    for name in FILES:
        assert (ws / name).read_text() == body(name)

    records = read_transcript(run_dir / "transcript.jsonl")
    types = [r["type"] for r in records]
    assert types.count("task") == 1 and types.count("resume") == 1 and types.count("plan") == 1
    writes = [r["data"]["path"] for r in records if r["type"] == "tool_result" and r["name"] == "write_file"]
    assert writes == list(FILES)  # every file written once, in plan order
    assert [r["path"] for r in records if r["type"] == "plan_tick"] == list(FILES)
    # one session across both processes; the step count goes on from the killed process
    store = SessionStore(db)
    assert len(store.list(kind="agent")) == 1
    session = store.get(result["session_id"])
    assert session.meta["resumes"] == 1
    steps = [m.meta["step"] for m in store.messages(session.id) if m.role == "assistant" and "step" in m.meta]
    finished = [m for m in store.messages(session.id) if m.role == "assistant" and m.meta.get("finish_reason") == "stop"]
    assert len(finished) == 1 + len(FILES)  # the plan and one reply per file
    assert result["progress"]["steps"] >= len(steps) - 1  # at most the killed reply is not counted
    lines = [ln for ln in out.splitlines() if ln.startswith("[step ")]
    assert any("notes.md:" in ln and "tokens" in ln and " s" in ln for ln in lines), out


def test_resume_without_a_run_says_so(tmp_path):
    from agents.headless import HeadlessRun
    from agents.taskfile import load_task

    task = tmp_path / "task.yaml"
    task.write_text(textwrap.dedent(TASK))
    with pytest.raises(Exception, match="no run of .* to continue"):
        HeadlessRun(load_task(task), workspace=tmp_path / "ws", resume=True)
    with pytest.raises(Exception, match="--resume needs --workspace"):
        HeadlessRun(load_task(task), resume=True)
