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
           "MLXTERM_GGUF_CACHE": os.environ.get("MLXTERM_GGUF_CACHE", "0"),
           "HOME": str(tmp_path), "TERM": "xterm-256color", "LANG": "C.UTF-8"}
    # a server socket per test: kill-server returns before the old server has gone, and a
    # new-session on its name can then meet it dying ("server exited unexpectedly")
    t = Tmux(f"mlxterm-e2e-{os.getpid()}-{tmp_path.name}", env)
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


# A user profile over the shipped Qwen 0.5B model whose agent has only write_file (no bash, so
# no approval prompt takes the run off the engine), must call it at step 1, and decodes greedily:
# its first step writes ~300 lines in one tool call, still generating when the chat question
# arrives.
WRITER_PROFILE = """\
name: qwen-writer
model:
  source: qwen2.5-coder-0.5b
sampling:
  temperature: 0
  max_tokens: 1024
context:
  max_context: 8192
agent:
  tools: [write_file]
  max_steps: 3
  first_step_tool_call: true  # else it answers "The file ... now contains" without the call
  capable: true
"""


def test_chat_while_an_agent_works_on_the_same_engine(tmux):
    """Start an agent task that writes a long file, open a new chat while it generates and ask a
    question there: both stream on the one engine (the status bar counts them, the sidebar marks
    the hidden agent session), the chat answers, the agent's call is answered by its tool, and
    both transcripts are stored."""
    from engine import paths
    from engine.sessions import SessionStore

    profiles = paths.config_dir() / "profiles"
    profiles.mkdir(parents=True, exist_ok=True)
    (profiles / "qwen-writer.yaml").write_text(WRITER_PROFILE)
    tmux.type(f"{MLXTERM} chat --profile qwen-writer; echo EXIT=$?")
    tmux.keys("Enter")
    tmux.wait_for(r"qwen-writer · KV", timeout=240)
    tmux.type("/agent")
    tmux.keys("Enter")
    tmux.wait_for(r"agent · ")  # the message box's border title in agent mode
    tmux.type("Write the numbers from 1 to 300 into numbers.txt, one number per line.")
    tmux.keys("Enter")
    tmux.wait_for(r"agent · step 1 · (writing|generating)", timeout=240)
    tmux.keys("C-n")  # a new chat; the agent keeps working in its hidden pane
    tmux.wait_for_absence(r"agent · step")
    tmux.type("Write four sentences about the sea.")
    tmux.keys("Enter")
    shared = tmux.wait_for(r"2 requests share the engine", timeout=240).string
    assert "streaming · agent" in shared  # the sidebar marks the hidden, working agent session
    tmux.wait_for(r"tok/s", timeout=600)  # the chat's reply is done
    tmux.wait_for_absence(r"streaming · ", timeout=900)  # ...and the agent's run too
    _quit(tmux)

    store = SessionStore()
    kinds = {s.kind: s for s in store.list()}
    chat = [m for m in store.messages(kinds["chat"].id) if m.role != "system"]
    assert [m.role for m in chat] == ["user", "assistant"] and chat[1].content.strip()
    assert chat[1].meta["finish_reason"] in ("stop", "length")
    assert chat[1].meta["batch"]["lane"] == "batched" and chat[1].meta["batch"]["max"] == 2
    agent = store.get(kinds["agent"].id)
    transcript = store.messages(agent.id)
    # the task: the first user message after the few-shot turns (a corrective turn may follow it)
    task = next(i for i, m in enumerate(transcript) if m.role == "user" and not m.meta.get("example"))
    assert "numbers.txt" in transcript[task].content
    # The forced first step is a write_file call whatever the 0.5B puts in it (its content is
    # not this test's subject): a tool result answers it in the agent's transcript.
    steps = [(m.role, m.content[:200]) for m in transcript[task:]]
    assert any(m.role == "tool" for m in transcript[task:]), steps
