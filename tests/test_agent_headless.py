"""Headless task runs (`mlxterm run`): task files, checks, result.json, transcript, the CLI."""

import argparse
import json
import textwrap

from engine.sessions import SessionStore

import pytest

from agents.headless import HeadlessRun
from agents.protocol import format_call
from agents.scripted import Reply, ScriptedEngine
from agents.session import AgentSession
from agents.taskfile import TaskError, load_task
from agents.transcript import read_transcript, replay_messages

HELLO = """
prompt: "create hello.txt containing exactly: hello world"
limits: {steps: 3, tokens: 400, wall_s: 60}
sampling: {temperature: 0.2, seed: 0}
checks:
  - name: content
    run: test "$(cat hello.txt)" = "hello world"
"""


def write_task(tmp_path, text, name="task.yaml"):
    path = tmp_path / name
    path.write_text(textwrap.dedent(text))
    return path


def good_engine():
    return ScriptedEngine([format_call("write_file", {"content": "hello world", "path": "hello.txt"}),
                           "The file hello.txt now contains: hello world"])


@pytest.mark.parametrize("text, message", [
    ("limits: {steps: 2}\n", "prompt: required"),
    ("prompt: hi\npromt: x\n", "promt: unknown key (did you mean 'prompt'?)"),
    ("prompt: hi\nlimits: {steps: two}\n", "limits.steps: expected an integer, got 'two'"),
    ("prompt: hi\nlimits: {step: 2}\n", "limits.step: unknown key (did you mean 'steps'?)"),
    ("prompt: hi\nlimits: {wall_s: 0}\n", "limits.wall_s: must be >= 0.001"),
    ("prompt: hi\nsampling: {temperature: hot}\n", "sampling.temperature: expected a number"),
    ("prompt: hi\nworkspace_template: nowhere\n", "workspace_template:"),
    ("prompt: hi\nallow: [bsh]\n", "allow: unknown tool 'bsh' (did you mean 'bash'?)"),
    ("prompt: hi\nchecks: {name: x}\n", "checks: expected a list"),
    ("prompt: hi\nchecks: [{name: x}]\n", "checks[0].run: required"),
    ("prompt: hi\nchecks: [{run: x, timeout: 3}]\n", "checks[0].timeout: unknown key"),
    ("prompt: hi\nsandbox: {workspace: 3}\n", "sandbox: unknown sandbox limit 'workspace'"),
    ("prompt: hi\nsandbox: {workspace_bytes: -1}\n", "sandbox: sandbox limit 'workspace_bytes' must be a positive number"),
    ("prompt: hi\nsandbox: 5\n", "sandbox: expected a mapping of limits"),
    ("prompt: hi\nread: notes.md\n", "read: expected a list of paths"),
    ("prompt: hi\nread: [../secret.txt]\n", "read: '../secret.txt' must be a path inside the workspace"),
    ("prompt: hi\nread: [/etc/passwd]\n", "read: '/etc/passwd' must be a path inside the workspace"),
    ("prompt: [unclosed\n", "not valid YAML at line"),
    ("- a list\n", "must be a mapping"),
])
def test_task_validation_names_file_and_key(tmp_path, text, message):
    path = write_task(tmp_path, text)
    with pytest.raises(TaskError) as err:
        load_task(path)
    assert str(err.value).startswith(f"{path}: ") and message in str(err.value)
    assert "\n" not in str(err.value)


def test_missing_task_file(tmp_path):
    with pytest.raises(TaskError, match="task file not found"):
        load_task(tmp_path / "nope.yaml")


def test_task_defaults_and_values(tmp_path):
    (tmp_path / "tpl").mkdir()
    path = write_task(tmp_path, HELLO + "workspace_template: tpl\nallow: [bash]\n", "hello.yaml")
    task = load_task(path)
    assert task.name == "hello" and task.steps == 3 and task.tokens == 400 and task.wall_s == 60
    assert task.temperature == 0.2 and task.seed == 0 and task.max_tokens is None
    assert task.workspace_template == (tmp_path / "tpl").resolve() and task.allow == ("bash",)
    assert task.checks[0].name == "content" and task.checks[0].timeout_s == 60
    assert task.sandbox_limits is None
    capped = load_task(write_task(tmp_path, HELLO + "sandbox: {workspace_bytes: 1000000, cpus: 1}\n", "capped.yaml"))
    assert capped.sandbox_limits.workspace_bytes == 1_000_000 and capped.sandbox_limits.cpus == 1.0


def test_passing_run_writes_result_transcript_and_session(tmp_path):
    (tmp_path / "tpl").mkdir()
    (tmp_path / "tpl" / "README").write_text("template file")
    task = load_task(write_task(tmp_path, HELLO + "workspace_template: tpl\n"))
    store = SessionStore()
    run = HeadlessRun(task, engine=good_engine(), run_dir=tmp_path / "run", store=store)
    result = run.run()
    assert result["status"] == "passed" and result["stop_reason"] == "answered"
    assert result["checks_passed"] == 1 and result["checks_failed"] == 0
    assert result["steps"] == 2 and result["tool_calls"] == 1 and result["malformed_calls"] == 0
    assert 0 < result["cached_ratio"] < 1 and result["tokens"]["cached"] > 0
    ws = tmp_path / "run" / "workspace"
    assert (ws / "README").read_text() == "template file" and (ws / "hello.txt").read_text() == "hello world"
    assert json.loads((tmp_path / "run" / "result.json").read_text()) == result

    records = read_transcript(tmp_path / "run" / "transcript.jsonl")
    types = [r["type"] for r in records]
    assert types[0] == "task" and types[-1] == "result" and "check" in types and "done" in types
    session = store.get(result["session_id"])
    assert session.kind == "agent" and session.workspace == str(ws.resolve())
    assert session.meta["run"]["status"] == "passed"
    exported = json.loads(store.export(session.id, "json"))["messages"]
    assert replay_messages(records) == exported

    # the run is a session like any other: continue it
    engine = ScriptedEngine([format_call("read_file", {"path": "hello.txt"}), "It says hello world."])
    agent = AgentSession.open(engine, store, session.id)
    events = list(agent.run("what does hello.txt say?"))
    assert events[-1].reason == "answered" and events[-1].final_text == "It says hello world."
    assert engine.requests[0].prompt_ids[: session.token_count] == store.context_tokens(session.id)[: session.token_count]


def test_read_files_go_before_the_prompt_read_only(tmp_path):
    """``read:`` shows workspace files (as the run starts) before the prompt; a file that escapes
    the workspace by a symlink or is missing is named, never read."""
    (tmp_path / "tpl").mkdir()
    (tmp_path / "tpl" / "hello_test.sh").write_text('test "$(cat hello.txt)" = "hello world"\n')
    (tmp_path / "outside.txt").write_text("SECRET outside the workspace")
    (tmp_path / "tpl" / "link.txt").symlink_to(tmp_path / "outside.txt")
    task = load_task(write_task(tmp_path, HELLO + "workspace_template: tpl\n"
                                "read: [hello_test.sh, link.txt, gone.txt]\nprotected: [hello_test.sh]\n"))
    assert task.read == ("hello_test.sh", "link.txt", "gone.txt")
    engine = good_engine()
    result = HeadlessRun(task, engine=engine, run_dir=tmp_path / "run", store=SessionStore()).run()
    assert result["status"] == "passed"
    prompt = engine.tokenizer.decode(engine.requests[0].prompt_ids)
    shown = prompt.index('hello_test.sh\n```\ntest "$(cat hello.txt)" = "hello world"\n```')
    assert prompt.index("Read-only files") < shown < prompt.index("create hello.txt containing exactly")
    assert "link.txt: not shown (outside the workspace)" in prompt and "SECRET" not in prompt
    assert "gone.txt: not shown (No such file or directory)" in prompt
    # without a workspace (nothing to read yet) the prompt is the task's own
    assert task.full_prompt() == task.prompt


def test_failed_and_error_and_cancelled_runs(tmp_path):
    task = load_task(write_task(tmp_path, HELLO))
    wrong = ScriptedEngine([format_call("write_file", {"content": "Hello, World!", "path": "hello.txt"}), "Done."])
    result = HeadlessRun(task, engine=wrong, run_dir=tmp_path / "r1").run()
    assert result["status"] == "failed" and result["checks"][0]["passed"] is False

    broken = ScriptedEngine([Reply("", error="model exploded")])
    result = HeadlessRun(task, engine=broken, run_dir=tmp_path / "r2").run()
    assert result["status"] == "error" and result["error"] == "model exploded"

    slow = ScriptedEngine([Reply("thinking " * 200, delay_s=0.01)])
    holder = {}

    def on_event(ev):
        if type(ev).__name__ == "StepStart":
            holder["run"].cancel()

    run = holder["run"] = HeadlessRun(task, engine=slow, run_dir=tmp_path / "r3", on_event=on_event)
    result = run.run()
    assert result["status"] == "cancelled" and result["checks"] == []
    assert json.loads((tmp_path / "r3" / "result.json").read_text())["status"] == "cancelled"


def test_no_checks_means_unchecked_when_the_agent_answers(tmp_path):
    # "passed" needs a check that ran: an answer alone proves nothing
    task = load_task(write_task(tmp_path, 'prompt: "say hi"\n'))
    result = HeadlessRun(task, engine=ScriptedEngine(["hi"]), run_dir=tmp_path / "r").run()
    assert result["status"] == "unchecked" and result["checks"] == [] and result["first_try"]["status"] == "unchecked"
    assert result["workspace_changed"] is False
    task2 = load_task(write_task(tmp_path, 'prompt: "loop"\nlimits: {steps: 2}\n', "t2.yaml"))
    result = HeadlessRun(task2, engine=ScriptedEngine([format_call("read_file", {"path": f"f{i}"}) for i in range(5)]), run_dir=tmp_path / "r3").run()
    assert result["status"] == "failed" and result["stop_reason"] == "max_steps"


def test_check_timeout_fails_the_check(tmp_path):
    task = load_task(write_task(tmp_path, 'prompt: "x"\nchecks: [{name: slow, run: "sleep 5", timeout_s: 0.2}]\n'))
    result = HeadlessRun(task, engine=ScriptedEngine(["ok"]), run_dir=tmp_path / "r").run()
    assert result["status"] == "failed" and "timed out" in result["checks"][0]["output"]


def test_default_run_dir_is_under_the_data_dir(tmp_path):
    from engine import paths

    task = load_task(write_task(tmp_path, 'prompt: "x"\n'))
    run = HeadlessRun(task, engine=ScriptedEngine(["ok"]))
    result = run.run()
    assert run.run_dir.parent == paths.data_dir() / "runs" and result["run_dir"] == str(run.run_dir)


def test_cli_json_and_exit_codes(tmp_path, monkeypatch, capsys):
    from engine import runtime

    from app.commands import run as run_cmd

    monkeypatch.setattr(runtime.Engine, "load", classmethod(lambda cls, profile=None: good_engine()))
    parser = argparse.ArgumentParser()
    run_cmd.register(parser.add_subparsers())
    task = write_task(tmp_path, HELLO)
    args = parser.parse_args(["run", str(task), "--json", "--run-dir", str(tmp_path / "out"),
                              "--workspace", str(tmp_path / "ws"), "--allow", "bash"])
    assert args.func(args) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["status"] == "passed" and out["workspace"] == str(tmp_path / "ws")
    assert (tmp_path / "ws" / "hello.txt").exists()

    args = parser.parse_args(["run", str(task), "--allow", "sudo"])
    with pytest.raises(TaskError, match="--allow sudo: unknown tool"):
        args.func(args)

    monkeypatch.setattr(runtime.Engine, "load", classmethod(lambda cls, profile=None: ScriptedEngine(["no file"])))
    args = parser.parse_args(["run", str(task), "--run-dir", str(tmp_path / "out2")])
    assert args.func(args) == 1
    text = capsys.readouterr().out
    assert "check content: FAILED" in text and "failed: 0/1 checks passed" in text


def test_cli_run_under_a_real_sigint_cancels_cleanly(tmp_path, tiny_llama_dir):
    """``mlxterm run`` as a real process; SIGINT once the model is generating (gated on the
    store holding part of the reply): exit 130, result.json "cancelled", checks skipped, a
    complete transcript and a session whose last reply is stored (not left streaming)."""
    import os
    import signal
    import sqlite3
    import subprocess
    import sys
    import time
    from pathlib import Path

    from engine.paths import data_dir

    from tests.tiny_models import write_profile

    repo = Path(__file__).resolve().parents[1]
    profile = write_profile(tmp_path / "tiny-agent.yaml", tiny_llama_dir, context={"max_context": 4096},
                            sampling={"max_tokens": 4000})
    task = write_task(tmp_path, """
        prompt: "write a very long story"
        limits: {steps: 1}
        sampling: {max_tokens: 3800}
        checks:
          - name: never
            run: touch checked.txt
    """)
    run_dir, ws = tmp_path / "run", tmp_path / "ws"
    proc = subprocess.Popen([sys.executable, "-m", "app", "run", str(task), "--profile", str(profile), "--json",
                             "--run-dir", str(run_dir), "--workspace", str(ws)],
                            cwd=repo, env={**os.environ, "PYTHONPATH": str(repo)},
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    db = data_dir() / "sessions.sqlite3"

    def generating() -> bool:
        if not db.exists():
            return False
        try:
            with sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=5) as conn:
                row = conn.execute("SELECT token_count, meta FROM messages WHERE role = 'assistant' "
                                   "ORDER BY id DESC LIMIT 1").fetchone()
        except sqlite3.OperationalError:
            return False
        return bool(row) and row[0] >= 16 and "streaming" in json.loads(row[1] or "{}")

    deadline = time.monotonic() + 180
    while not generating():
        assert proc.poll() is None, proc.communicate()[1][-2000:]
        assert time.monotonic() < deadline, "the agent never started generating"
        time.sleep(0.05)
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err[-2000:]
    assert "cancelling the run" in err
    result = json.loads(out)
    assert result["status"] == "cancelled" and result["stop_reason"] == "cancelled"
    assert result["checks"] == [] and not (ws / "checked.txt").exists()
    assert json.loads((run_dir / "result.json").read_text()) == result
    records = read_transcript(run_dir / "transcript.jsonl")
    assert records[-1]["type"] == "result" and records[-1]["result"]["status"] == "cancelled"
    assert [r["reason"] for r in records if r["type"] == "done"] == ["cancelled"]
    last = SessionStore(db).messages(result["session_id"])[-1]
    assert last.role == "assistant" and last.meta["finish_reason"] == "cancelled"
    assert "streaming" not in last.meta and last.token_count >= 16
