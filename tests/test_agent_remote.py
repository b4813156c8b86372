"""Agents on a remote profile (``model.remote``): ``mlxterm run``'s headless agent and a board card
talk to an OpenAI-compatible server over HTTP, in the text protocol (no tokenizer, template or
constrained decoding here). The server is this project's own ``serve`` app on loopback, in
process, over a scripted model (so its replies are known); the client is the remote profile's
``RemoteEngine``."""

from __future__ import annotations

import socket
import threading
import time
from pathlib import Path

from engine.serving.remote_engine import RemoteEngine
from engine.sessions import SessionStore

import pytest
import yaml

from agents.headless import HeadlessRun
from agents.protocol import format_call
from agents.scripted import ScriptedEngine, scripted_profile
from agents.taskfile import load_task
from agents.transcript import read_transcript
from app.serve.app import ServerState, build_app

TASK = """\
prompt: "Make double(x) in solver.py return twice x."
workspace_template: tmpl
checks:
  - name: tests
    run: python3 -c "import solver; assert solver.double(2) == 4, solver.double(2)"
"""


class ScriptedServer:
    """The serve app over a scripted engine, on a loopback port, in a thread."""

    def __init__(self, replies):
        import uvicorn

        self.engine = ScriptedEngine(replies, profile=scripted_profile(max_tokens=600))
        self.engine.active_requests = 0
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        self.port = sock.getsockname()[1]
        config = uvicorn.Config(build_app(ServerState(self.engine)), log_level="warning", lifespan="off")
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [sock]}, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 20
        while not self.server.started:
            assert time.monotonic() < deadline, "the server did not start"
            time.sleep(0.02)

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    def close(self) -> None:
        self.server.should_exit = True
        self.thread.join(10)


@pytest.fixture
def serve_script():
    servers = []

    def start(replies):
        servers.append(ScriptedServer(replies))
        return servers[-1]

    yield start
    for s in servers:
        s.close()


def remote_profile(path, base_url: str) -> str:
    data = {"name": "far", "model": {"remote": {"base_url": base_url, "model": "scripted"}},
            "sampling": {"temperature": 0.0, "max_tokens": 600},
            "agent": {"capable": True, "edit_format": "whole", "repair_rounds": 1}}
    path.write_text(yaml.safe_dump(data))
    return str(path)


def edit(body: str) -> str:
    return f"solver.py\n```python\ndef double(x):\n    return {body}\n```"


def test_a_headless_run_on_a_remote_profile_writes_checks_and_repairs(tmp_path, serve_script):
    # first try: a wrong file, then an answer; the checks fail and go back; the repair writes it right
    server = serve_script([edit("x + 5"), "Done.", edit("x * 2"), "Fixed."])
    (tmp_path / "tmpl").mkdir()
    (tmp_path / "tmpl" / "solver.py").write_text("def double(x):\n    pass\n")
    (tmp_path / "task.yaml").write_text(TASK)
    engine = RemoteEngine.load(remote_profile(tmp_path / "far.yaml", server.base_url))
    store = SessionStore(tmp_path / "sessions.sqlite3")
    result = HeadlessRun(load_task(tmp_path / "task.yaml"), engine=engine, run_dir=tmp_path / "run",
                         store=store).run()
    assert result["status"] == "passed" and result["first_try"]["status"] == "failed", result
    assert (tmp_path / "run" / "workspace" / "solver.py").read_text().endswith("return x * 2\n")
    # the server got messages (no tokens were made here): the system prompt with the text
    # protocol's tool descriptions, the task, and in the repair round the failing check's output
    requests = [server.engine.tokenizer.decode(r.prompt_ids) for r in server.engine.requests]
    assert len(requests) == 4 and "Make double(x)" in requests[0] and "<tool_call>" in requests[0]
    assert "The checks failed" in requests[2] and "AssertionError: 7" in requests[2]
    assert "return x + 5" in requests[2]  # the earlier reply went back as the text it was
    stored = store.messages(store.list()[0].id)
    assert not any(m.token_ids for m in stored), [m.token_ids for m in stored]  # messages only: no tokenizer here
    records = read_transcript(tmp_path / "run" / "transcript.jsonl")
    assert [r["name"] for r in records if r["type"] == "tool_result"] == ["write_file", "write_file"]
    run = next(r for r in records if r["type"] == "run")
    assert run["agent"]["constrained"] is False and run["agent"]["protocol"] == "text"


def test_a_remote_agent_runs_bash_through_the_text_protocol(tmp_path, serve_script):
    server = serve_script([format_call("bash", {"command": "echo hello > out.txt && cat out.txt"}),
                           "out.txt says hello."])
    (tmp_path / "task.yaml").write_text('prompt: "Write hello into out.txt with bash."\nallow: [bash]\n')
    engine = RemoteEngine.load(remote_profile(tmp_path / "far.yaml", server.base_url))
    result = HeadlessRun(load_task(tmp_path / "task.yaml"), engine=engine, run_dir=tmp_path / "run",
                         store=SessionStore(tmp_path / "s.sqlite3")).run()
    assert result["stop_reason"] == "answered" and result["final_text"] == "out.txt says hello."
    assert (tmp_path / "run" / "workspace" / "out.txt").read_text() == "hello\n"
    # the tool's output went back to the server as a tool turn
    second = server.engine.tokenizer.decode(server.engine.requests[1].prompt_ids)
    assert "hello" in second[second.rindex("echo hello"):]


def test_a_board_card_on_a_remote_profile(tmp_path, serve_script):
    from agents.board.dispatcher import Dispatcher
    from agents.board.model import Card, CheckSpec
    from agents.board.store import BoardStore

    server = serve_script([format_call("write_file", {"path": "a.txt", "content": "a"}), "Wrote a.txt."])
    engine = RemoteEngine.load(remote_profile(tmp_path / "far.yaml", server.base_url))
    board = BoardStore(tmp_path / "board.sqlite3")
    card = board.add(Card(id=0, title="a", prompt="create a.txt containing a", state="queued",
                          checks=[CheckSpec("content", 'test "$(cat a.txt)" = a')]))
    Dispatcher(board, SessionStore(tmp_path / "s.sqlite3"), lambda p: engine, default_profile="far").drain()
    (att,) = board.attempts(card.id)
    assert att.status == "passed", (att.status, att.error, att.checks)
    assert board.get(card.id).state == "review"
    assert (Path(board.get(card.id).workspace_dir) / "a.txt").read_text() == "a"
    board.close()


def test_mlxterm_run_with_a_remote_profile(tmp_path, serve_script, capsys):
    from app.cli import main

    server = serve_script([edit("x * 2"), "Done."])
    (tmp_path / "tmpl").mkdir()
    (tmp_path / "tmpl" / "solver.py").write_text("def double(x):\n    pass\n")
    (tmp_path / "task.yaml").write_text(TASK)
    profile = remote_profile(tmp_path / "far.yaml", server.base_url)
    code = main(["run", str(tmp_path / "task.yaml"), "--profile", profile, "--run-dir", str(tmp_path / "run"),
                 "--json"])
    assert code == 0, capsys.readouterr()
    assert (tmp_path / "run" / "workspace" / "solver.py").read_text().endswith("return x * 2\n")


def test_native_tool_calls_go_as_tools_and_come_back_as_tool_calls(tmp_path, serve_script):
    """``model.remote.tool_calls: native``: the tools are offered in the request's ``tools``, the
    server parses the model's calls and streams ``tool_calls``, which the agent reads as calls;
    the next request carries them as the assistant's ``tool_calls`` with the results as
    ``tool`` turns of the same ids. Files are written by JSON calls (no text edit format)."""
    server = serve_script([
        format_call("write_file", {"path": "solver.py", "content": "def double(x):\n    return x * 2\n"}),
        format_call("bash", {"command": "python3 -c 'import solver; print(solver.double(21))'"}),
        "double(21) is 42.",
    ])
    (tmp_path / "tmpl").mkdir()
    (tmp_path / "tmpl" / "solver.py").write_text("def double(x):\n    pass\n")
    (tmp_path / "task.yaml").write_text(TASK + "allow: [bash]\n")
    path = tmp_path / "far.yaml"
    data = yaml.safe_load(open(remote_profile(path, server.base_url)))
    data["model"]["remote"]["tool_calls"] = "native"
    path.write_text(yaml.safe_dump(data))
    engine = RemoteEngine.load(str(path))
    seen = []
    chat = engine.chat
    stream = chat.stream

    def spy(messages, params, should_stop=None, hangup=None, tools=None):
        seen.append((list(messages), tools))
        yield from stream(messages, params, should_stop, hangup, tools)

    chat.stream = spy
    result = HeadlessRun(load_task(tmp_path / "task.yaml"), engine=engine, run_dir=tmp_path / "run",
                         store=SessionStore(tmp_path / "s.sqlite3")).run()
    assert result["status"] == "passed" and result["final_text"] == "double(21) is 42.", (result.get("error"), result)
    assert (tmp_path / "run" / "workspace" / "solver.py").read_text() == "def double(x):\n    return x * 2\n"
    messages, tools = seen[0]
    assert {t["function"]["name"] for t in tools} >= {"write_file", "bash", "read_file"}
    assert "<tool_call>" not in messages[0]["content"]  # the server renders the tools, not our prompt
    assert "Write file content exactly" not in messages[0]["content"]  # the work rules, not the toy ones
    # the example episode and the run's own calls go back as tool_calls paired with tool turns
    last, _ = seen[-1]
    calls = [c for m in last if m["role"] == "assistant" for c in m.get("tool_calls") or []]
    results = [m for m in last if m["role"] == "tool"]
    assert [c["id"] for c in calls] == [m["tool_call_id"] for m in results]
    assert all(isinstance(c["function"]["arguments"], str) for c in calls)
    mine = [m for m in last if m["role"] == "assistant" and m.get("tool_calls")][-2:]
    assert [m["tool_calls"][0]["function"]["name"] for m in mine] == ["write_file", "bash"]
    assert all("<tool_call>" not in m["content"] for m in last if m["role"] == "assistant")
    assert "42" in results[-1]["content"]
    records = read_transcript(tmp_path / "run" / "transcript.jsonl")
    run = next(r for r in records if r["type"] == "run")
    assert run["agent"]["protocol"] == "native" and run["agent"]["edit_format"] == "json"
    assert [r["name"] for r in records if r["type"] == "tool_result"] == ["write_file", "bash"]
    # the server was asked with tools and answered with tool_calls: its prompt had the calls written back
    assert "tool_call" in server.engine.tokenizer.decode(server.engine.requests[1].prompt_ids)


def test_a_remote_session_compacts_by_characters_when_the_context_runs_short(tmp_path, serve_script):
    """No tokens here: the context's size is estimated from its characters at the ratio the
    server's usage showed; when the next step would not fit, old tool output is shortened and
    the server gets the shortened messages."""
    big = "python3 -c \"print('x' * 9000)\""
    server = serve_script([format_call("bash", {"command": big}),
                           format_call("bash", {"command": "echo small"}), "Done: printed both."])
    (tmp_path / "task.yaml").write_text('prompt: "Print nine thousand x, then small."\nallow: [bash]\n')
    path = tmp_path / "far.yaml"
    data = yaml.safe_load(open(remote_profile(path, server.base_url)))
    data["context"] = {"max_context": 7000}  # the scripted server's tokens are bytes
    data["agent"]["max_tokens_per_step"] = 400
    path.write_text(yaml.safe_dump(data))
    engine = RemoteEngine.load(str(path))
    result = HeadlessRun(load_task(tmp_path / "task.yaml"), engine=engine, run_dir=tmp_path / "run",
                         store=SessionStore(tmp_path / "s.sqlite3")).run()
    assert result["stop_reason"] == "answered", (result["stop_reason"], result.get("error"))
    records = read_transcript(tmp_path / "run" / "transcript.jsonl")
    (compaction,) = [r for r in records if r["type"] == "compaction"]
    done = next(r for r in records if r["type"] == "compaction_done")
    assert compaction["chars_removed"] > 8000 and compaction["tokens_before"] > done["tokens_after"] > 0
    # the step after the output was compacted first: the server never got the whole of it
    assert compaction["step"] == 2
    prompts = [server.engine.tokenizer.decode(r.prompt_ids) for r in server.engine.requests]
    assert len(prompts) == 3 and not any("x" * 9000 in p for p in prompts)
    assert "characters of tool output removed to fit the context" in prompts[1]
    assert len(prompts[1]) < 7000


def test_bench_agent_plain_arm_on_a_remote_profile(tmp_path, serve_script):
    """``mlxterm bench agent --profile REMOTE --arms plain``: the one-shot request goes to the
    profile's server as chat messages (its own template), is written and scored the same way."""
    import argparse
    import json

    from app.commands import bench

    fixtures = Path(__file__).parent / "fixtures" / "exercises"
    good = "double_it.py\n```python\ndef double(n):\n    return 2 * n\n```\n"
    server = serve_script([good])
    parser = argparse.ArgumentParser()
    bench.register(parser.add_subparsers())
    args = parser.parse_args(["bench", "agent", "--exercises", str(fixtures), "--only", "double-it",
                              "--arms", "plain", "--out", str(tmp_path / "bench.json"),
                              "--profile", remote_profile(tmp_path / "far.yaml", server.base_url)])
    assert args.func(args) == 0
    data = json.loads((tmp_path / "bench.json").read_text())
    assert data["passed_plain"] == 1 and data["results"][0]["plain"]["wrote"] == ["double_it.py"]
    sent = server.engine.tokenizer.decode(server.engine.requests[0].prompt_ids)
    assert "Use the instructions above to change double_it.py" in sent and server.engine.requests[0].params.temperature == 0.0
