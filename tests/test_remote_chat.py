"""Chat on a remote profile (``model.remote``): the plain REPL, the session store, cancel and
errors, against a real ``mlxterm serve`` on loopback with a tiny model and against a closed port.
The TUI side is in tests/test_tui_remote.py."""

from __future__ import annotations

import io
import socket
import time

from engine.errors import MlxtermError
from engine.serving.events import Done, TextDelta
from engine.serving.remote_engine import RemoteEngine
from engine.sessions import SessionStore
from engine.sessions.chat import ChatService, remote_mark
from engine.sessions.remote_chat import RemoteChatService

import openai
import pytest
import yaml

from app.tui.controller import ChatController
from app.tui.format import clean
from app.tui.plain import run_plain
from tests.serve_server import tiny_server


@pytest.fixture(scope="module")
def server(tmp_path_factory, tiny_llama_dir):
    with tiny_server(tmp_path_factory, tiny_llama_dir, "remote-chat") as s:
        yield s


def remote_profile(path, base_url: str, max_tokens: int = 16, **remote) -> str:
    data = {"name": path.stem, "model": {"remote": {"base_url": base_url, "model": "tiny", **remote}},
            "sampling": {"temperature": 0.0, "max_tokens": max_tokens}}
    path.write_text(yaml.safe_dump(data))
    return str(path)


def closed_port() -> int:
    with socket.socket() as s:  # bound, never listening: connections are refused
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def plain(profile: str, lines: str, session: str | None = None) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    code = run_plain(profile, session, stdin=io.StringIO(lines), stdout=out, stderr=err)
    return code, out.getvalue(), err.getvalue()


def test_plain_chat_streams_saves_and_resumes(server, tmp_path):
    prof = remote_profile(tmp_path / "far.yaml", server.base_url)
    code, out, err = plain(prof, "hello there\n")
    assert code == 0, err
    store = SessionStore()
    (summary,) = store.list()
    session = store.get(summary.id)
    assert session.profile == "far" and session.kind == "chat"
    assert remote_mark(session) == {"base_url": server.base_url, "model": "tiny"}
    msgs = store.messages(session.id)
    assert [m.role for m in msgs] == ["user", "assistant"]
    assert all(m.token_ids == () for m in msgs) and session.token_count == 0  # no tokenizer here
    sdk = openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0)
    direct = sdk.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hello there"}],
                                         max_tokens=16, temperature=0)
    assert msgs[1].content == direct.choices[0].message.content
    assert out == clean(msgs[1].content) + "\n"  # printed as stored, control characters removed
    meta = msgs[1].meta
    assert meta["finish_reason"] == "length" and "streaming" not in meta
    assert meta["usage"]["completion_tokens"] == direct.usage.completion_tokens == 16
    assert meta["timings"]["ttft_ms"] > 0 and meta["timings"]["decode_tps"] > 0

    # Resume by id: the whole conversation goes to the server, which reuses its cached prefix.
    code, out, err = plain(prof, "go on\n", session=session.id[:6])
    assert code == 0, err
    msgs = store.messages(session.id)
    assert [m.content for m in msgs if m.role == "user"] == ["hello there", "go on"]
    follow = sdk.chat.completions.create(
        model="tiny", max_tokens=16, temperature=0,
        messages=[{"role": "user", "content": "hello there"},
                  {"role": "assistant", "content": msgs[1].content}, {"role": "user", "content": "go on"}])
    assert msgs[3].content == follow.choices[0].message.content
    usage = msgs[3].meta["usage"]
    assert usage["cached_tokens"] >= meta["usage"]["prompt_tokens"] and msgs[3].meta["cache"]["source"] == "server"
    assert ChatController(store).context_used(session.id) == usage["prompt_tokens"] + usage["completion_tokens"]


def test_a_local_model_refuses_a_remote_session(server, tmp_path, tiny_llama_dir):
    from engine.runtime import Engine

    from tests.tiny_models import write_profile

    # the remote profile and the local one share the name "tiny": only the session's mark tells
    (tmp_path / "far").mkdir()
    prof = remote_profile(tmp_path / "far" / "tiny.yaml", server.base_url)
    assert plain(prof, "hi\n")[0] == 0
    store = SessionStore()
    sid = store.list()[0].id
    with Engine.load(str(write_profile(tmp_path / "tiny.yaml", tiny_llama_dir))) as eng:
        chat = ChatService(eng, store)
        with pytest.raises(MlxtermError, match="ran on a remote server .*http://127.0.0.1"):
            chat.send(sid, "more")
        with pytest.raises(MlxtermError, match="ran on a remote server"):
            chat.retry(sid)
    assert [m.role for m in store.messages(sid)] == ["user", "assistant"]  # nothing added, nothing lost
    # a fork keeps the mark (its messages have no token ids either)
    assert remote_mark(store.fork(sid, 2)) is not None


def test_cancel_hangs_up_the_stream_at_once(server, tmp_path):
    prof = remote_profile(tmp_path / "long.yaml", server.base_url, max_tokens=3000)
    store = SessionStore()
    with RemoteEngine.load(prof) as eng:
        chat = RemoteChatService(eng, store)
        session = chat.create()
        before = server.health()["disconnected"]
        turn = chat.send(session.id, "tell me everything")
        pieces = 0
        t_cancel = None
        for ev in turn:
            if isinstance(ev, TextDelta):
                pieces += 1
                if pieces == 40:  # past SAVE_EVERY_TOKENS: the reply was saved while streaming
                    assert turn.partial.saves >= 1
                    (_, saving) = store.messages(session.id)
                    assert "streaming" in saving.meta and saving.token_ids == () and saving.content
                    t_cancel = time.perf_counter()
                    turn.cancel()
            elif isinstance(ev, Done):
                t_done = time.perf_counter()
        done = turn.result()
        assert done.finish_reason == "cancelled" and done.error is None
        assert t_done - t_cancel < 0.5, "the turn did not end promptly after cancel"
        assert eng.active_requests == 0
    health = server.wait_for(lambda h: h["active"] == 0 and h["disconnected"] > before)
    assert health["active"] == 0 and health["disconnected"] == before + 1  # the server stopped too
    (user, reply) = store.messages(session.id)
    assert reply.meta["finish_reason"] == "cancelled" and reply.content == done.text
    assert 40 <= done.usage.completion_tokens < 3000 and reply.token_ids == ()


def test_server_down_or_erroring_is_one_line_and_the_session_survives(server, tmp_path):
    down = f"http://127.0.0.1:{closed_port()}/v1"
    prof = remote_profile(tmp_path / "gone.yaml", down)
    code, out, err = plain(prof, "are you there?\n")
    assert code == 0
    assert f"mlxterm: {down}: connection refused (is the server running?)\n" in err
    store = SessionStore()
    sid = store.list()[0].id
    user, reply = store.messages(sid)
    assert user.content == "are you there?"
    assert reply.meta["finish_reason"] == "error" and "connection refused" in reply.meta["error"]

    # The same chat, continued once a server answers: the failed reply is left out of the request.
    eng = RemoteEngine.load(remote_profile(tmp_path / "gone.yaml", server.base_url))
    chat = RemoteChatService(eng, store)
    assert chat.conversation(sid) == [{"role": "user", "content": "are you there?"}]
    done = chat.retry(sid).result()  # Ctrl+R: the failed reply is replaced
    assert done.error is None and done.text
    assert [m.role for m in store.messages(sid)] == ["user", "assistant"]
    assert remote_mark(store.get(sid))["base_url"] == server.base_url
    eng.close()

    # A server that answers with an error: its status and message, with the URL.
    wrong = remote_profile(tmp_path / "wrong.yaml", server.base_url, model="no-such-model")
    code, _, err = plain(wrong, "hi\n")
    assert code == 0
    line = [e for e in err.splitlines() if e.startswith("mlxterm: ")]
    assert len(line) == 1 and line[0].startswith(f"mlxterm: {server.base_url}: the server answered 404: ")
    assert "no-such-model" in line[0]


def test_remote_profiles_make_text_protocol_agents(server, tmp_path):
    controller = ChatController(SessionStore(), remote_profile(tmp_path / "far.yaml", server.base_url))
    info = controller.load()
    try:
        assert info.remote == server.base_url and controller.remote and controller.probe() is None
        agent = controller.new_agent(tmp_path)  # the server runs it (tests/test_agent_remote.py)
        assert agent.remote and not agent.constrained and agent.describe()["protocol"] == "text"
        assert controller.new_session().meta["remote"]["base_url"] == server.base_url
    finally:
        controller.close()
    down = ChatController(SessionStore(), remote_profile(tmp_path / "down.yaml",
                                                          f"http://127.0.0.1:{closed_port()}/v1"))
    down.load()  # nothing is contacted to load
    assert "connection refused" in down.probe()
    down.close()


def test_cancel_while_the_server_has_not_answered_yet(tmp_path):
    """A server that accepts and stays silent (a long prefill, a stall): cancel still ends the
    turn at once instead of waiting model.remote.timeout_s for the first byte."""
    with socket.create_server(("127.0.0.1", 0)) as silent:
        url = f"http://127.0.0.1:{silent.getsockname()[1]}/v1"
        with RemoteEngine.load(remote_profile(tmp_path / "mute.yaml", url, timeout_s=60)) as eng:
            handle = eng.submit_messages([{"role": "user", "content": "hi"}], eng.sampling())
            time.sleep(0.3)  # the request is sent; the read waits for an answer
            assert eng.active_requests == 1
            t0 = time.perf_counter()
            handle.cancel()
            done = handle.result(timeout=5)
            assert time.perf_counter() - t0 < 0.5
            assert done.finish_reason == "cancelled" and done.error is None and done.text == ""
            handle.thread.join(1)
            assert eng.active_requests == 0


def test_generate_session_on_a_remote_profile(server, tmp_path, capsys):
    import json

    from app.cli import main

    prof = remote_profile(tmp_path / "far.yaml", server.base_url)
    outs = []
    for prompt in ("hello there", "go on"):
        assert main(["generate", "--profile", prof, "--session", "talk", "--prompt", prompt, "--json"]) == 0
        outs.append(json.loads(capsys.readouterr().out))
    assert [o["session"] for o in outs] == ["talk", "talk"]
    msgs = SessionStore().messages("talk")
    assert [m.content for m in msgs] == ["hello there", outs[0]["text"], "go on", outs[1]["text"]]
    assert remote_mark(SessionStore().get("talk"))["base_url"] == server.base_url
    assert outs[1]["usage"]["cached_tokens"] >= outs[0]["usage"]["prompt_tokens"]
