"""The chat TUI on a remote profile (``model.remote``) under Textual's pilot: streaming, Esc,
timings in the status bar, the session store, and a server that is down. The server is a real
``mlxterm serve`` on loopback with the tiny random model."""

from __future__ import annotations

import json
import time
import urllib.request

from engine.sessions.chat import remote_mark

import pytest

from tests.serve_server import tiny_server
from tests.test_remote_chat import closed_port, remote_profile
from tests.test_tui_app import (
    SIZE,
    escape_mid_reply,
    loaded,
    main_screen,
    make_app,
    send,
    views,
    wait_for,
)


@pytest.fixture(scope="module")
def server(tmp_path_factory, tiny_llama_dir):
    with tiny_server(tmp_path_factory, tiny_llama_dir, "tui-remote") as s:
        yield s


def notes(app) -> list[str]:
    return [n.message for n in app._notifications]


async def test_tui_chat_streams_from_the_server_and_saves_the_session(server, tmp_path):
    app = make_app(remote_profile(tmp_path / "far.yaml", server.base_url))
    async with app.run_test(size=SIZE) as pilot:
        await loaded(pilot)
        screen = main_screen(app)
        label = screen.status.query_one("#status-model")
        assert label.render().plain == "far · remote" and server.base_url in str(label.tooltip)
        await send(pilot, "hi there")
        user, reply = views(app)
        assert reply.state == "done" and reply.number == 2 and reply.content
        stored = app.controller.messages(screen.session_id)
        assert [m.role for m in stored] == ["user", "assistant"]
        assert remote_mark(app.controller.session(screen.session_id))["base_url"] == server.base_url
        first = screen.status.turn_text
        assert "TTFT" in first and "tok/s" in first and first.startswith("prefilled ")
        await send(pilot, "and then?")
        assert len(views(app)) == 4 and views(app)[3].state == "done"
        meta = app.controller.messages(screen.session_id)[3].meta
        assert meta["usage"]["cached_tokens"] > 0
        assert screen.status.turn_text.startswith(
            f"server reused {meta['usage']['cached_tokens']:,}/{meta['usage']['prompt_tokens']:,} prompt tokens")
        used = meta["usage"]["prompt_tokens"] + meta["usage"]["completion_tokens"]
        limit = app.controller.info().max_context  # the profile's context.max_context
        assert screen.status.query_one("#status-context").render().plain == f"ctx {used:,}/{limit:,}"
        assert not any("does not answer" in n for n in notes(app))


async def test_escape_hangs_up_a_remote_reply(tmp_path):
    """Esc mid-reply hangs up: the reply is stopped and the server counts the disconnect. The
    server here is the serve app over a scripted model that streams a token every 5 ms (15 s for
    the 3000 asked for), so the key lands mid-reply however busy the machine is: the tiny model
    streams 3000 tokens in ~3 s, and under CI's load a key behind its render queue came after
    the last one."""
    from agents.scripted import Reply
    from tests.test_agent_remote import ScriptedServer

    server = ScriptedServer([Reply("word " * 1000, end=False, delay_s=0.005)])

    def health() -> dict:
        with urllib.request.urlopen(f"http://127.0.0.1:{server.port}/health", timeout=10) as r:
            return json.loads(r.read())

    try:
        app = make_app(remote_profile(tmp_path / "long.yaml", server.base_url, max_tokens=3000, model="scripted"))
        async with app.run_test(size=SIZE) as pilot:
            await loaded(pilot)
            screen = main_screen(app)
            before = health()["disconnected"]
            reply = await escape_mid_reply(pilot, app)
            assert reply.state == "stopped"
            last = app.controller.messages(screen.session_id)[-1]
            assert last.meta["finish_reason"] == "cancelled" and last.meta["usage"]["completion_tokens"] < 3000
            assert screen.status.turn_text.startswith("stopped · ")
            end = time.monotonic() + 15
            while health()["disconnected"] == before and time.monotonic() < end:
                await pilot.pause(0.05)
            assert health()["disconnected"] == before + 1 and health()["active"] == 0
    finally:
        server.close()


async def test_a_server_that_is_down_is_named_and_the_chat_is_kept(tmp_path):
    down = f"http://127.0.0.1:{closed_port()}/v1"
    app = make_app(remote_profile(tmp_path / "gone.yaml", down))
    async with app.run_test(size=SIZE) as pilot:
        await loaded(pilot)
        await wait_for(pilot, lambda: any("does not answer" in n for n in notes(app)),
                       what="the server check")
        assert any(f"{down}: connection refused" in n for n in notes(app))
        screen = main_screen(app)
        await send(pilot, "anyone?")
        user, reply = views(app)
        assert reply.state == "error"
        assert f"The model could not answer: {down}: connection refused (is the server running?)" in notes(app)
        stored = app.controller.messages(screen.session_id)
        assert [m.content for m in stored if m.role == "user"] == ["anyone?"]
        assert [s.title for s in app.controller.sessions()] == ["anyone?"]


async def test_agent_mode_on_a_remote_profile(tmp_path):
    """/agent on a remote profile: the server (the serve app over a scripted model) runs the
    agent in the text protocol; the tool card, the file and the final answer are as on a local
    model."""
    from tests.test_agent_remote import ScriptedServer
    from tests.test_agent_remote import remote_profile as agent_profile
    from tests.test_tui_agent import cards, idle, replies, start_agent, task

    server = ScriptedServer(['notes.txt\n```text\nremote hello\n```', "notes.txt is written."])
    try:
        app = make_app(agent_profile(tmp_path / "far.yaml", server.base_url))
        async with app.run_test(size=SIZE) as pilot:
            await loaded(pilot)
            await start_agent(pilot)
            screen = main_screen(app)
            await task(pilot, "write remote hello into notes.txt")
            await idle(pilot)
            (card,) = cards(app)
            assert card.tool == "write_file" and card.state == "done"
            assert (screen.agent_actions.agent.workspace / "notes.txt").read_text() == "remote hello\n"
            assert replies(app)[-1] == "notes.txt is written."
    finally:
        server.close()
