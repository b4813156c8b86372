"""Agent-capable profiles: the flag, the default for cards / `mlxterm run` / `/agent`, the
message when none is installed; `mlxterm --continue` and F3 reopening the last session."""

from __future__ import annotations

import time

from engine.profiles import load_profile
from engine.sessions import SessionStore

import pytest

from agents import choose
from agents.scripted import ScriptedEngine, scripted_profile
from app.cli import _default_command
from app.tui.app import MlxtermApp
from app.tui.widgets.prompt import PromptInput


def test_shipped_flags():
    assert load_profile("qwen2.5-coder-0.5b").agent.capable
    assert not load_profile("smollm2-135m").agent.capable
    assert not load_profile("gemma3-270m").agent.capable


def test_best_profile_and_the_install_hint(monkeypatch):
    monkeypatch.setattr(choose, "agent_profiles", lambda: [])
    with pytest.raises(choose.NoAgentProfile, match="mlxterm models install qwen2.5-coder-0.5b"):
        choose.best_agent_profile()
    monkeypatch.setattr(choose, "agent_profiles", lambda: [("big", 9), ("small", 1)])
    assert choose.best_agent_profile() == "big"


def test_agent_profiles_only_lists_installed_capable_ones(tmp_path, monkeypatch):
    from engine.model import catalog

    names = [n for n, _ in choose.agent_profiles()]
    assert "smollm2-135m" not in names and "mlx-qwen2.5-7b-apple" not in names  # not capable / not installed
    assert ("qwen2.5-coder-0.5b" in names) == catalog.model_status("qwen2.5-coder-0.5b").installed


def test_run_without_profile_says_how_to_install_one(tmp_path, monkeypatch, capsys):
    from app.cli import main

    monkeypatch.setattr(choose, "agent_profiles", lambda: [])
    task = tmp_path / "t.yaml"
    task.write_text("prompt: hi\n")
    assert main(["run", str(task)]) == 2
    err = capsys.readouterr().err
    assert "no agent-capable profile is installed" in err and "mlxterm models install qwen2.5-coder-0.5b" in err


def test_default_command_is_chat():
    assert _default_command(["--continue"]) == ["chat", "--continue"]
    assert _default_command(["-v", "--profile", "x"]) == ["-v", "chat", "--profile", "x"]
    assert _default_command(["tasks", "list"]) == ["tasks", "list"]
    assert _default_command(["--help"]) == ["--help"]


def test_continue_picks_the_most_recent_session(monkeypatch):
    from app.cli import main

    store = SessionStore()
    store.create("old")
    time.sleep(0.01)
    new = store.create("new")
    opened = {}
    monkeypatch.setattr("app.tui.plain.run_plain", lambda profile, session: opened.setdefault("s", session) and 0)
    main(["--continue", "--plain"])
    assert opened["s"] == new.id


class _Engine(ScriptedEngine):
    weight_format = "scripted"
    load_ms = 0.0


@pytest.mark.timeout(300)  # it waits on the app in loops: fail, never hang
async def test_agent_mode_loads_the_best_capable_profile(monkeypatch):
    loaded = []

    def factory(spec):
        loaded.append(spec)
        capable = spec != "chatty"
        profile = scripted_profile(capable=capable)
        profile = type(profile)(**{**profile.__dict__, "name": spec})
        return _Engine([], profile=profile)

    monkeypatch.setattr("agents.choose.agent_profiles", lambda: [("coder", 1)])
    app = MlxtermApp("chatty", engine_factory=factory, store=SessionStore(), memory_probe=lambda: 1)
    async with app.run_test(size=(120, 40)) as pilot:
        while not app.controller.loaded:
            await pilot.pause(0.02)
        app.query_one(PromptInput).focus()
        await pilot.press(*"/agent", "enter")
        deadline = time.monotonic() + 10
        while not app.screen_stack[0].agent_actions.agent_mode:
            assert time.monotonic() < deadline, loaded
            await pilot.pause(0.02)
        assert loaded == ["chatty", "coder"] and app.controller.engine.profile.name == "coder"


async def test_f3_reopens_the_most_recent_session():
    store = SessionStore()
    s = store.create("last one")
    app = MlxtermApp("scripted", engine_factory=lambda spec: _Engine([]), store=store, memory_probe=lambda: 1)
    async with app.run_test(size=(120, 40)) as pilot:
        await pilot.pause(0.1)
        assert app.screen_stack[0].session_id is None
        await pilot.press("f3")
        await pilot.pause(0.1)
        assert app.screen_stack[0].session_id == s.id
