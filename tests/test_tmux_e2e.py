"""End to end: the real ``mlxterm`` TUI on SmolLM2, driven through tmux like a person would.

Ask a question, see the answer, quit, start ``mlxterm`` again, open the chat from the
sidebar, ask a follow-up, and see the status bar report the context restored from the SSD
checkpoint tier (the RAM cache of the first process is gone).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.skipif(shutil.which("tmux") is None, reason="needs tmux"),
]

MLXTERM = Path(sys.executable).parent / "mlxterm"
RESTORED = re.compile(r"restored ([\d,]+) tokens from (RAM|SSD) in (\d+) ms")


class Tmux:
    """One detached tmux session on a private server socket."""

    def __init__(self, name: str, env: dict[str, str], width: int = 160, height: int = 40):
        self.base = ["tmux", "-L", name, "-f", os.devnull]
        self.target = "mlx"
        env_args = [a for k, v in env.items() for a in ("-e", f"{k}={v}")]
        subprocess.run([*self.base, "new-session", "-d", "-s", self.target, "-x", str(width),
                        "-y", str(height), *env_args, "bash --noprofile --norc"], check=True)

    def keys(self, *keys: str) -> None:
        subprocess.run([*self.base, "send-keys", "-t", self.target, *keys], check=True)

    def type(self, text: str) -> None:
        subprocess.run([*self.base, "send-keys", "-t", self.target, "-l", text], check=True)

    def screen(self) -> str:
        return subprocess.run([*self.base, "capture-pane", "-p", "-t", self.target],
                              capture_output=True, text=True, check=True).stdout

    def wait_for(self, pattern: str | re.Pattern, timeout: float = 120.0) -> re.Match:
        regex = re.compile(pattern) if isinstance(pattern, str) else pattern
        deadline = time.monotonic() + timeout
        while True:
            screen = self.screen()
            match = regex.search(screen)
            if match:
                return match
            if time.monotonic() > deadline:
                raise AssertionError(f"timed out waiting for {regex.pattern!r}; screen:\n{screen}")
            time.sleep(0.25)

    def wait_for_absence(self, pattern: str, timeout: float = 60.0) -> None:
        regex = re.compile(pattern)
        deadline = time.monotonic() + timeout
        while regex.search(screen := self.screen()):
            if time.monotonic() > deadline:
                raise AssertionError(f"timed out waiting for {regex.pattern!r} to go; screen:\n{screen}")
            time.sleep(0.1)

    def kill(self) -> None:
        subprocess.run([*self.base, "kill-server"], capture_output=True)


@pytest.fixture
def tmux(_isolated_home, tmp_path):
    env = {"MLXTERM_HOME": os.environ["MLXTERM_HOME"],
           "MLXTERM_MODELS_DIR": os.environ["MLXTERM_MODELS_DIR"],
           "HOME": str(tmp_path), "TERM": "xterm-256color", "LANG": "C.UTF-8"}
    t = Tmux(f"mlxterm-e2e-{os.getpid()}", env)
    yield t
    t.kill()


def _launch(tmux: Tmux) -> None:
    tmux.type(f"{MLXTERM}; echo EXIT=$?")
    tmux.keys("Enter")
    tmux.wait_for(r"smollm2-135m · KV fp16")  # the status bar once the model is loaded


def _ask(tmux: Tmux, question: str) -> str:
    tmux.type(question)
    tmux.keys("Enter")
    match = tmux.wait_for(r"tok/s", timeout=240)  # the last turn's speed: the reply is done
    return match.string


def _quit(tmux: Tmux) -> None:
    tmux.keys("C-q")
    tmux.wait_for(r"EXIT=0", timeout=60)
    tmux.keys("clear", "Enter")


def test_ask_quit_resume_and_restore_from_ssd(tmux):
    from engine.sessions import SessionStore

    _launch(tmux)
    screen = _ask(tmux, "What is the capital of France?")
    assert "What is the capital of France?" in screen
    assert re.search(r"Assistant #3", screen)  # system prompt #1, question #2, answer #3
    _quit(tmux)

    (session,) = SessionStore().list()
    first = SessionStore().messages(session.id)
    assert [m.role for m in first] == ["system", "user", "assistant"]
    assert first[-1].content.strip()

    _launch(tmux)
    tmux.wait_for(r"\^j Newline")  # the footer lists the message box's keys while it has focus
    tmux.keys("C-l")  # go to the chat list; the footer drops those keys once focus has moved...
    tmux.wait_for_absence(r"\^j Newline")
    tmux.keys("Enter")  # ...and open the newest chat
    tmux.wait_for(r"opened “")
    screen = _ask(tmux, "And what is its population?")
    _quit(tmux)

    messages = SessionStore().messages(session.id)
    assert [m.role for m in messages] == ["system", "user", "assistant", "user", "assistant"]
    restored = RESTORED.search(screen)
    assert restored, f"no restore report in the status bar:\n{screen}"
    cached = int(restored.group(1).replace(",", ""))
    assert cached == messages[-1].meta["usage"]["cached_tokens"] > 0
    assert restored.group(2) == "SSD", f"expected the SSD tier after a restart: {restored[0]}"


def test_chat_while_an_agent_works_on_the_same_engine(tmux):
    """Start an agent task, open a new chat while it works and ask a question there: both
    stream on the one engine (the status bar counts them), the chat answers, and reopening
    the agent session shows its run, which completes; both transcripts are stored."""
    from engine.sessions import SessionStore

    tmux.type(f"{MLXTERM} chat --profile qwen2.5-coder-0.5b; echo EXIT=$?")
    tmux.keys("Enter")
    tmux.wait_for(r"qwen2.5-coder-0.5b · KV", timeout=240)
    tmux.type("/agent")
    tmux.keys("Enter")
    tmux.wait_for(r"agent · ")  # the message box's border title in agent mode
    tmux.type("Write a file named zebra.txt that says hi.")
    tmux.keys("Enter")
    tmux.wait_for(r"agent · step 1")
    tmux.keys("C-n")  # a new chat; the agent keeps working in its hidden pane
    tmux.wait_for_absence(r"agent · step")
    tmux.type("Name one colour.")
    tmux.keys("Enter")
    shared = tmux.wait_for(r"2 requests share the engine", timeout=240).string
    assert "streaming · agent" in shared  # the sidebar marks the hidden, working agent session
    screen = tmux.wait_for(r"tok/s", timeout=600).string  # the chat's reply is done
    assert re.search(r"Assistant #3", screen)  # this chat's pane: system, question, answer
    tmux.keys("C-f")  # filter the sidebar down to the agent session and open it
    tmux.type("zebra")
    tmux.wait_for(r"◆ Write a file named zebra")  # the list has been filtered...
    tmux.keys("Enter")  # ...the filter hands focus to the list...
    tmux.wait_for_absence(r"\^j Newline")  # (the message box's keys leave the footer)
    tmux.keys("Enter")  # ...which opens the session
    # still working (then its summary once done) or, if it already finished, the stored run
    done = r"agent (answered|hit|failed|ran out).* after \d+ step|opened “.*” · \d+ messages"
    screen = tmux.wait_for(done, timeout=900).string
    assert "zebra.txt" in screen
    _quit(tmux)

    store = SessionStore()
    kinds = {s.kind: s for s in store.list()}
    chat = [m for m in store.messages(kinds["chat"].id) if m.role != "system"]
    assert [m.role for m in chat] == ["user", "assistant"] and chat[1].content.strip()
    assert chat[1].meta["finish_reason"] in ("stop", "length")
    agent = store.messages(kinds["agent"].id)
    assert any(m.role == "user" and "zebra.txt" in m.content for m in agent)
    assert agent[-1].role in ("assistant", "tool")
