"""Agents on a real llama.cpp server: a remote profile (``model.remote``) pointed at llama.cpp's
own HTTP server (PyPI ``xllamacpp``, started as ``bench serve`` starts it) on Qwen2.5-Coder 0.5B's
GGUF, in the text protocol and with native tool calls. A headless task writes a file and passes
its check, and a board card reaches review. (With the tools offered natively, Qwen2.5-Coder 0.5B
and 1.5B answer with the call as a JSON object in text, not in their template's ``<tool_call>``
form, so llama.cpp streams it as content, not ``tool_calls``; the agent's parser reads it as a
call whose marker was dropped.)

Opt-in: needs the 0.5B (``./setup.sh --with-qwen``) and the ``peer`` extra."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path

from engine.serving.remote_engine import RemoteEngine
from engine.sessions import SessionStore

import pytest
import yaml

from agents.headless import HeadlessRun
from agents.taskfile import load_task
from agents.transcript import read_transcript

pytestmark = pytest.mark.optin
REPO = Path(__file__).resolve().parents[1]
TASK = """\
prompt: "Create the file hello.txt containing exactly: hi there"
checks:
  - name: content
    run: test "$(cat hello.txt)" = "hi there"
limits: {steps: 6, wall_s: 300}
sampling: {temperature: 0.0, seed: 0}
"""


@pytest.fixture(scope="module")
def llama_server(tmp_path_factory):
    pytest.importorskip("xllamacpp", reason="the peer extra (xllamacpp) is not installed")
    from tests.conftest import link_shared_models

    home = tmp_path_factory.mktemp("llama-home")
    link_shared_models(home)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("MLXTERM_HOME", str(home))
        from engine.model.catalog import model_path

        gguf = model_path("qwen2.5-coder-0.5b")
    proc = subprocess.Popen([sys.executable, "-m", "app.benches.serve_child", "llama_cpp", str(gguf), "8192", "1", "2"],
                            cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    deadline = time.monotonic() + 120
    url = None
    while url is None and time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            break
        m = re.search(r" on (http://\S+)/v1", line)
        url = m.group(1) if m else None
    if url is None:
        proc.kill()
        pytest.fail("llama.cpp's server did not announce itself")
    yield f"{url}/v1"
    proc.terminate()
    proc.wait(30)


def remote_profile(path: Path, base_url: str, tool_calls: str) -> str:
    path.write_text(yaml.safe_dump({
        "name": f"llama-{tool_calls}",
        "model": {"remote": {"base_url": base_url, "model": "qwen", "tool_calls": tool_calls}},
        "sampling": {"temperature": 0.0, "max_tokens": 512},
        "context": {"max_context": 8192},
        "agent": {"capable": True, "edit_format": "whole", "repair_rounds": 1},
    }))
    return str(path)


@pytest.mark.parametrize("tool_calls", ["text", "native"])
def test_a_task_on_llama_cpp_writes_and_passes(tmp_path, llama_server, tool_calls):
    (tmp_path / "task.yaml").write_text(TASK)
    engine = RemoteEngine.load(remote_profile(tmp_path / "far.yaml", llama_server, tool_calls))
    try:
        result = HeadlessRun(load_task(tmp_path / "task.yaml"), engine=engine, run_dir=tmp_path / "run",
                             store=SessionStore(tmp_path / "s.sqlite3")).run()
    finally:
        engine.close()
    assert result["status"] == "passed", (result["stop_reason"], result.get("error"), result.get("checks"))
    assert (tmp_path / "run" / "workspace" / "hello.txt").read_text().strip() == "hi there"
    records = read_transcript(tmp_path / "run" / "transcript.jsonl")
    run = next(r for r in records if r["type"] == "run")
    assert run["agent"]["protocol"] == tool_calls
    writes = [r for r in records if r["type"] == "tool_result" and r["name"] == "write_file"]
    assert writes and writes[0]["ok"]
    # timings and usage come from llama.cpp's stream
    responses = [r for r in records if r["type"] == "response"]
    assert responses[0]["usage"]["prompt_tokens"] > 0 and responses[0]["timings"]["ttft_ms"] > 0
    if os.environ.get("MLXTERM_TEST_VERBOSE"):
        print(tool_calls, [r["raw_text"][:200] for r in responses])


def test_a_board_card_on_llama_cpp_reaches_review(tmp_path, llama_server):
    """A board card (text protocol) on llama.cpp's server: written, checked, in review."""
    from agents.board.dispatcher import Dispatcher
    from agents.board.model import Card, CheckSpec
    from agents.board.store import BoardStore

    engine = RemoteEngine.load(remote_profile(tmp_path / "far.yaml", llama_server, "text"))
    board = BoardStore(tmp_path / "board.sqlite3")
    try:
        card = board.add(Card(id=0, title="hi", prompt="Create the file hello.txt containing exactly: hi there",
                              state="queued", checks=[CheckSpec("content", 'test "$(cat hello.txt)" = "hi there"')]))
        Dispatcher(board, SessionStore(tmp_path / "s.sqlite3"), lambda p: engine, default_profile="far").drain()
        (att,) = board.attempts(card.id)
        assert att.status == "passed", (att.status, att.error, att.checks)
        assert board.get(card.id).state == "review"
        assert (Path(board.get(card.id).workspace_dir) / "hello.txt").read_text().strip() == "hi there"
    finally:
        board.close()
        engine.close()


def test_plain_chat_on_llama_cpp_streams_saves_and_resumes(tmp_path, llama_server):
    """Chat (the plain REPL) on llama.cpp's server: the reply is the server's own greedy answer,
    stored with usage and stream timings; the resumed session sends the whole conversation."""
    import openai

    from tests.test_remote_chat import plain

    prof = remote_profile(tmp_path / "far.yaml", llama_server, "text")
    code, out, err = plain(prof, "What is 2 + 3? Answer with one number.\n")
    assert code == 0, err
    store = SessionStore()
    (summary,) = store.list()
    msgs = store.messages(summary.id)
    assert [m.role for m in msgs] == ["user", "assistant"] and msgs[1].content.strip()
    sdk = openai.OpenAI(base_url=llama_server, api_key="unused", max_retries=0)
    direct = sdk.chat.completions.create(model="qwen", temperature=0, max_tokens=512,
                                         messages=[{"role": "user", "content": "What is 2 + 3? Answer with one number."}])
    assert msgs[1].content == direct.choices[0].message.content
    meta = msgs[1].meta
    assert meta["usage"]["prompt_tokens"] > 0 and meta["timings"]["ttft_ms"] > 0 and meta["timings"]["decode_tps"] > 0
    code, out, err = plain(prof, "And 4 + 4?\n", session=summary.id[:6])
    assert code == 0, err
    msgs = store.messages(summary.id)
    assert [m.role for m in msgs] == ["user", "assistant", "user", "assistant"] and msgs[3].content.strip()
    assert msgs[3].meta["usage"]["prompt_tokens"] > meta["usage"]["prompt_tokens"]
