"""Pilot tests of the chat TUI: real keystrokes into the app running the tiny random model."""

from __future__ import annotations

import time
from pathlib import Path

from engine.sessions import SessionStore

import pytest

from app.tui.app import MlxtermApp
from app.tui.format import clean
from app.tui.screens.dialogs import ConfirmScreen, TextScreen
from app.tui.screens.error import ErrorScreen
from app.tui.screens.help import HelpScreen
from app.tui.screens.profiles import ProfileScreen
from app.tui.widgets.message import MessageView
from app.tui.widgets.prompt import PromptInput
from tests.tiny_models import write_profile
from tests.tui_helpers import palette_offers

SIZE = (120, 36)


def make_app(profile, **kwargs) -> MlxtermApp:
    kwargs.setdefault("memory_probe", lambda: 300 << 20)
    return MlxtermApp(str(profile), **kwargs)


async def wait_for(pilot, condition, timeout: float = 30.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await pilot.pause(0.02)


async def loaded(pilot) -> None:
    await wait_for(pilot, lambda: pilot.app.controller.loaded, what="the model to load")
    await pilot.pause()


async def idle(pilot) -> None:
    await wait_for(pilot, lambda: not pilot.app.screen_stack[0].generating, what="the reply")
    await pilot.pause()


async def send(pilot, text: str) -> None:
    """Type ``text`` into the message box and press Enter; wait for the whole reply."""
    pilot.app.query_one(PromptInput).focus()
    await pilot.press(*text, "enter")
    await idle(pilot)


def main_screen(app):
    return app.screen_stack[0]


def views(app) -> list[MessageView]:
    return main_screen(app).conversation.views()


@pytest.fixture
def long_profile(tmp_path, tiny_llama_dir):
    """Replies long enough (2,000 tokens, a few seconds) to stop one half way."""
    return write_profile(tmp_path / "long.yaml", tiny_llama_dir, sampling={"max_tokens": 2000},
                         context={"max_context": 2048})


async def test_send_shows_streamed_reply_and_saves_it(tiny_profile):
    app = make_app(tiny_profile)
    async with app.run_test(size=SIZE) as pilot:
        await loaded(pilot)
        screen = main_screen(app)
        assert screen.status.query_one("#status-model").render().plain == "tiny · KV fp16"
        await send(pilot, "hi there")
        user, reply = views(app)
        assert (user.role, user.content, user.number) == ("user", "hi there", 1)
        assert reply.role == "assistant" and reply.state == "done" and reply.number == 2
        stored = app.controller.messages(screen.session_id)
        assert [m.role for m in stored] == ["user", "assistant"]
        assert reply.content and reply.content == clean(stored[1].content)
        body = reply.query_one(".message-body")
        assert body.source == reply.content  # streamed through Markdown.append, not set at the end
        assert "tok/s" in screen.status.turn_text and "TTFT" in screen.status.turn_text
        ctx = screen.status.query_one("#status-context").render().plain
        assert ctx == f"ctx {app.controller.session(screen.session_id).token_count}/512"
        assert app.query_one(PromptInput).text == ""
        # The sidebar lists the new chat under the title taken from the first message.
        assert [s.title for s in app.controller.sessions()] == ["hi there"]


async def test_enter_sends_ctrl_j_newline_and_up_recalls(tiny_profile):
    app = make_app(tiny_profile, autoload=False)
    async with app.run_test(size=SIZE) as pilot:
        prompt = app.query_one(PromptInput)
        await pilot.press("a", "ctrl+j", "b")
        assert prompt.text == "a\nb"
        await pilot.press("enter")  # no model loaded: the text stays and a warning shows
        assert prompt.text == "a\nb"
        prompt.sent("a\nb")
        await pilot.press("x", "up")
        assert prompt.text == "a\nb"
        await pilot.press("down")
        assert prompt.text == "x"


async def test_new_rename_open_and_delete_sessions(tiny_profile):
    app = make_app(tiny_profile)
    async with app.run_test(size=SIZE) as pilot:
        await loaded(pilot)
        screen = main_screen(app)
        await send(pilot, "first")
        first = screen.session_id
        await pilot.press("f2")
        assert isinstance(app.screen, TextScreen)
        await pilot.press("ctrl+u", *"Alpha", "enter")
        assert app.controller.session(first).title == "Alpha"

        await pilot.press("ctrl+n")
        assert screen.session_id is None and views(app) == []
        await send(pilot, "second")
        assert screen.session_id != first
        assert [s.title for s in app.controller.sessions()] == ["second", "Alpha"]

        # Filter the sidebar by message text, then open the match from the list.
        await pilot.press("ctrl+f", *"first")
        options = app.query_one("#session-list")
        assert options.option_count == 1
        await pilot.press("enter", "enter")  # filter box -> list, list -> open
        assert screen.session_id == first
        assert [v.content for v in views(app)][0] == "first"

        await pilot.press("f8")
        assert isinstance(app.screen, ConfirmScreen)
        await pilot.press("y")
        await pilot.pause()
        assert screen.session_id is None
        assert [s.title for s in app.controller.sessions()] == ["second"]


async def test_fork_at_message_reuses_kv_prefix(tiny_profile):
    app = make_app(tiny_profile)
    async with app.run_test(size=SIZE) as pilot:
        await loaded(pilot)
        screen = main_screen(app)
        await send(pilot, "one")
        await send(pilot, "two")
        parent = screen.session_id
        assert len(views(app)) == 4
        views(app)[1].focus()  # the first reply
        await pilot.press("f")
        await pilot.pause()
        assert screen.session_id != parent
        fork = app.controller.session(screen.session_id)
        assert (fork.parent_id, fork.message_count) == (parent, 2)
        assert [v.number for v in views(app)] == [1, 2]
        await send(pilot, "three")
        assert screen.status.turn_text.startswith("restored ")
        assert "tokens from RAM" in screen.status.turn_text


async def test_resume_session_after_restart_restores_context(tiny_profile, tmp_path):
    app = make_app(tiny_profile)
    async with app.run_test(size=SIZE) as pilot:
        await loaded(pilot)
        await send(pilot, "remember me")
        sid = main_screen(app).session_id
    # As after a restart: the session comes back from the store, its KV from the SSD
    # checkpoint tier written when the first app closed its engine.
    app = make_app(tiny_profile)
    async with app.run_test(size=SIZE) as pilot:
        await loaded(pilot)
        screen = main_screen(app)
        await pilot.press("ctrl+l", "enter")  # open the newest chat from the list
        assert screen.session_id == sid
        assert [v.content for v in views(app)][0] == "remember me"
        await send(pilot, "again")
        stored = app.controller.messages(sid)
        assert [m.role for m in stored] == ["user", "assistant", "user", "assistant"]
        meta = stored[-1].meta
        assert meta["usage"]["prompt_tokens"] == sum(m.token_count for m in stored[:3])
        assert meta["cache"]["source"] == "ssd"  # the first app's RAM cache is gone
        cached = meta["usage"]["cached_tokens"]
        assert 0 < cached < meta["usage"]["prompt_tokens"]
        assert screen.status.turn_text.startswith(f"restored {cached:,} tokens from SSD in ")


async def escape_mid_reply(pilot, app):
    """Send "go", press Esc once the reply's first text has streamed; the reply's view when the
    app is idle again."""
    await pilot.press(*"go", "enter")
    await wait_for(pilot, lambda: len(views(app)) == 2 and views(app)[1].content,
                   what="the first streamed text")
    await pilot.press("escape")
    await idle(pilot)
    return views(app)[1]


async def test_escape_stops_generation_and_keeps_partial_reply(long_profile):
    app = make_app(long_profile)
    async with app.run_test(size=SIZE) as pilot:
        await loaded(pilot)
        screen = main_screen(app)
        reply = await escape_mid_reply(pilot, app)
        assert reply.state == "stopped"
        assert "stopped" in str(reply.query_one(".message-header").render())
        last = app.controller.messages(screen.session_id)[-1]
        assert last.meta["finish_reason"] == "cancelled"
        assert last.meta["usage"]["completion_tokens"] < 2000
        assert clean(last.content) == reply.content
        assert screen.status.turn_text.startswith("stopped · ")


async def test_retry_replaces_last_answer(tiny_profile):
    app = make_app(tiny_profile)
    async with app.run_test(size=SIZE) as pilot:
        await loaded(pilot)
        screen = main_screen(app)
        await send(pilot, "hello")
        before = app.controller.messages(screen.session_id)[-1]
        await pilot.press("ctrl+r")
        await idle(pilot)
        after = app.controller.messages(screen.session_id)
        assert [m.role for m in after] == ["user", "assistant"]
        assert after[-1].content == before.content  # greedy decoding: the same answer
        assert before.meta["cache"]["source"] == "none"
        assert after[-1].meta["cache"]["source"] == "ram"  # the retry reused the prompt's KV
        assert after[-1].meta["usage"]["cached_tokens"] > 0
        assert len(views(app)) == 2 and views(app)[1].number == 2


async def test_switch_profile_from_the_picker(tiny_llama_dir, tiny_gemma_dir):
    from engine.paths import config_dir

    profiles = config_dir() / "profiles"
    profiles.mkdir(parents=True, exist_ok=True)
    write_profile(profiles / "tiny-a.yaml", tiny_llama_dir)
    write_profile(profiles / "tiny-b.yaml", tiny_gemma_dir)
    write_profile(profiles / "tiny-broken.yaml", Path("/nonexistent/model"))
    app = make_app("tiny-a")
    async with app.run_test(size=SIZE) as pilot:
        await loaded(pilot)
        screen = main_screen(app)
        await send(pilot, "hi")
        await pilot.press("ctrl+o")
        assert isinstance(app.screen, ProfileScreen)
        await wait_for(pilot, lambda: app.screen.choices, what="profile checks")
        names = [c.name for c in app.screen.choices]
        status = {c.name: c.status for c in app.screen.choices}
        assert {"tiny-a", "tiny-b", "tiny-broken", "smollm2-135m"} <= set(names)
        assert status["tiny-a"] == "ok" and status["tiny-broken"] == "invalid"
        await pilot.press("home", *["down"] * names.index("tiny-b"), "enter")
        await wait_for(pilot, lambda: app.controller.info().profile == "tiny-b",
                       what="tiny-b to load")
        await pilot.pause()
        assert screen.status.query_one("#status-model").render().plain.startswith("tiny-b ")
        # The old chat's tokens belong to tiny-a: a new chat starts for tiny-b.
        assert screen.session_id is None
        await send(pilot, "hey")
        assert app.controller.session(screen.session_id).profile == "tiny-b"
        # Reopening the tiny-a chat loads tiny-a again.
        await pilot.press("ctrl+l", "end", "enter")
        await wait_for(pilot, lambda: app.controller.info().profile == "tiny-a",
                       what="tiny-a to load")


async def test_missing_model_shows_error_screen(tmp_path):
    broken = write_profile(tmp_path / "broken.yaml", Path("/nonexistent/mlxterm-model"))
    app = make_app(broken)
    async with app.run_test(size=SIZE) as pilot:
        await wait_for(pilot, lambda: isinstance(app.screen, ErrorScreen)
                       and app.screen.query("#error-message"), what="the error screen")
        text = str(app.screen.query_one("#error-message").render())
        assert text == ("Profile broken cannot be used: model not found at "
                        "/nonexistent/mlxterm-model.")
        await pilot.press("enter")  # "Choose a profile" has focus
        assert isinstance(app.screen, ProfileScreen)
        await pilot.press("escape")
        assert not app.controller.loaded


async def test_slash_commands(tiny_profile):
    from engine.paths import data_dir

    app = make_app(tiny_profile)
    async with app.run_test(size=SIZE) as pilot:
        await loaded(pilot)
        screen = main_screen(app)
        await send(pilot, "/system Be terse.")
        sid = screen.session_id
        assert [(m.role, m.content) for m in app.controller.messages(sid)] == [
            ("system", "Be terse.")]
        await send(pilot, "hi")
        assert [m.role for m in app.controller.messages(sid)] == ["system", "user", "assistant"]
        await send(pilot, "/export json")
        exported = list((data_dir() / "exports").glob("*.json"))
        assert len(exported) == 1 and '"Be terse."' in exported[0].read_text()
        await send(pilot, "/fork 2")
        assert app.controller.session(screen.session_id).message_count == 2
        await send(pilot, "/nonsense")
        assert screen.session_id and app.query_one(PromptInput).text == "/nonsense"
        await pilot.press("ctrl+u")
        await send(pilot, "/clear")
        assert isinstance(app.screen, ConfirmScreen)
        await pilot.press("y")
        await pilot.pause()
        assert [m.role for m in app.controller.messages(screen.session_id)] == ["system"]
        await send(pilot, "/help")
        assert isinstance(app.screen, HelpScreen)
        await pilot.press("escape")
        await send(pilot, "/new")
        assert screen.session_id is None


async def test_copy_message_and_code_block(tiny_profile):
    store = SessionStore()
    s = store.create("code", profile="tiny")
    store.add_message(s.id, "user", "show code")
    store.add_message(s.id, "assistant", "Here:\n\n```python\nprint(1)\n```\n\nand\n\n```sh\nls\n```\n")
    app = make_app(tiny_profile, session_id=s.id, store=store, autoload=False)
    async with app.run_test(size=SIZE) as pilot:
        await pilot.pause()
        reply = views(app)[1]
        reply.focus()
        await pilot.press("c")
        assert app.clipboard == reply.content
        await pilot.press("y")
        await pilot.press("down", "enter")  # two blocks: pick the second
        assert app.clipboard == "ls"


async def test_command_palette_runs_chat_actions(tiny_profile):
    from engine.paths import data_dir

    store = SessionStore()
    s = store.create("palette", profile="tiny")
    store.add_message(s.id, "user", "exported words")
    app = make_app(tiny_profile, session_id=s.id, store=store, autoload=False)
    async with app.run_test(size=SIZE) as pilot:
        await pilot.pause()
        await pilot.press("ctrl+p", *"export as markdown")
        await wait_for(pilot, lambda: palette_offers(app, "export as markdown"), what="the export command")
        await pilot.press("enter")
        await wait_for(pilot, lambda: list((data_dir() / "exports").glob("*.md")),
                       what="the export file")
        (path,) = (data_dir() / "exports").glob("*.md")
        assert path.name == f"palette-{s.id}.md" and "exported words" in path.read_text()
