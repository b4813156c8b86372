"""Snapshot tests (pytest-textual-snapshot) of the main, help and error screens.

Everything on screen is fixed: sessions are stored with a fake clock, the app gets a fixed
"now" and memory probe, the error names fixed paths. Update the SVGs after an intended
change with ``pytest tests/test_tui_snapshots.py --snapshot-update`` and look at them.
"""

from __future__ import annotations

import time
from pathlib import Path
from types import SimpleNamespace

from engine.sessions import SessionStore

import pytest

from app.tui.app import MlxtermApp
from app.tui.widgets.prompt import PromptInput
from tests.tiny_models import write_profile

NOW = 1_750_000_000.0
SIZE = (110, 32)
REPLY = """\
A **lifetime** is the part of the program where a reference is valid. The compiler checks
that no reference outlives the value it points to:

```rust
fn longest<'a>(x: &'a str, y: &'a str) -> &'a str {
    if x.len() > y.len() { x } else { y }
}
```

The result lives as long as the *shorter* of the two inputs.
"""


@pytest.fixture
def store(tmp_path, monkeypatch) -> SessionStore:
    """Three chats stored at fixed times (3 weeks, 2 days and 3 hours before NOW)."""
    clock = SimpleNamespace(now=NOW)
    monkeypatch.setattr("engine.sessions.store.time", SimpleNamespace(time=lambda: clock.now))
    store = SessionStore(tmp_path / "sessions.sqlite3")

    def chat(title, profile, age_s, messages):
        clock.now = NOW - age_s
        s = store.create(title, profile=profile)
        for role, content, reasoning, n_tokens in messages:
            store.add_message(s.id, role, content, reasoning=reasoning,
                              token_ids=range(n_tokens))
        return s

    chat("Trip ideas", "smollm2-135m", 21 * 86400, [("user", "Where to go in May?", None, 12)])
    chat("Shopping list", "tiny", 2 * 86400, [("user", "Eggs, milk", None, 9),
                                              ("assistant", "Noted.", None, 4)])
    chat("Rust lifetimes", "tiny", 3 * 3600, [
        ("user", "What is a lifetime in Rust?", None, 21),
        ("assistant", REPLY, "The user asks about Rust. Explain briefly with one example.", 118),
    ])
    monkeypatch.setattr("engine.sessions.store.time", time)
    return store


def make_app(profile, store=None, session_id=None, **kwargs) -> MlxtermApp:
    return MlxtermApp(str(profile), session_id, store=store, clock=lambda: NOW,
                      memory_probe=lambda: 512 << 20,
                      log_path=Path("/home/me/.local/share/mlxterm/logs/tui.log"), **kwargs)


async def settle(pilot, condition, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not (pilot.app.query(PromptInput) and condition()):
        assert time.monotonic() < deadline, "the app did not settle"
        await pilot.pause(0.02)
    pilot.app.query_one(PromptInput).cursor_blink = False  # a blinking cursor is a coin toss
    await pilot.pause()


def test_main_screen(snap_compare, tiny_profile, store):
    newest = store.list()[0]
    app = make_app(tiny_profile, store, newest.id)

    async def ready(pilot):
        await settle(pilot, lambda: app.controller.loaded and app.query(".message-body"))

    assert snap_compare(app, terminal_size=SIZE, run_before=ready)


def test_help_screen(snap_compare, tiny_profile, store):
    app = make_app(tiny_profile, store, autoload=False)

    async def steady(pilot):
        await settle(pilot, lambda: app.query_one("#session-list").option_count == 3)

    assert snap_compare(app, terminal_size=SIZE, press=["f1"], run_before=steady)


def test_error_screen_for_missing_model(snap_compare, tmp_path, store):
    broken = write_profile(tmp_path / "broken.yaml", Path("/nonexistent/mlxterm-model"))
    app = make_app(broken, store)

    async def failed(pilot):
        await settle(pilot, lambda: app.screen.query("#error-message"))

    assert snap_compare(app, terminal_size=SIZE, run_before=failed)
