"""The bash tool: exit codes, timeouts, cancellation, output caps and env scrubbing."""

from __future__ import annotations

import os
import threading
import time
import tracemalloc
from pathlib import Path

import pytest

from tools import default_registry
from tools.bash import scrub_env


@pytest.fixture
def ws(tmp_path):
    root = tmp_path / "ws"
    root.mkdir()
    return root


@pytest.fixture
def reg(ws):
    # the tool's own mechanics (timeouts, pipes, process groups seen from the host), unconfined
    # on purpose; the sandboxed default is tested below and in test_tools_sandbox.py
    return default_registry(ws, unconfined=True)


def _dead(pid: int) -> bool:
    """Gone, or a zombie waiting for a reaper (PID 1 in some containers never reaps)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return True
    return state in ("Z", "X")


def _wait_dead(pid: int, within: float = 2.0) -> bool:
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        if _dead(pid):
            return True
        time.sleep(0.05)
    return _dead(pid)


def test_exit_codes_and_streams(reg):
    ok = reg.run("bash", {"command": "echo out; echo err >&2"})
    assert ok.ok and ok.data["exit_code"] == 0
    assert ok.data["stdout"] == "out\n" and ok.data["stderr"] == "err\n"
    assert ok.content.startswith("exit code 0 (")
    assert "stdout:\nout" in ok.content and "stderr:\nerr" in ok.content
    failed = reg.run("bash", {"command": "exit 7"})
    assert failed.ok and failed.data["exit_code"] == 7  # the call worked; the command failed
    assert failed.content.startswith("exit code 7") and "(no output)" in failed.content
    killed = reg.run("bash", {"command": "kill -9 $$"})
    assert killed.data["exit_code"] == -9 and "killed by signal 9" in killed.content
    assert isinstance(ok.data["duration_ms"], int)


def test_cwd_is_workspace_and_files_persist(ws, reg):
    reg.run("bash", {"command": "mkdir -p d && echo hi > d/f.txt"})
    assert (ws / "d/f.txt").read_text() == "hi\n"
    assert reg.run("bash", {"command": "cat < /dev/stdin; echo done"}).data["stdout"] == "done\n"


def test_timeout_kills_the_whole_process_group(ws, reg):
    t0 = time.monotonic()
    result = reg.run("bash", {"command": "sleep 300 & echo $! > bg.pid; sleep 30", "timeout_s": 1})
    elapsed = time.monotonic() - t0
    assert elapsed < 20, elapsed  # 1 s plus the kill; generous: a loaded 2-core machine
    assert not result.ok and result.data["timed_out"] and not result.data["cancelled"]
    assert result.content.startswith("timed out after 1 s")
    assert _wait_dead(int((ws / "bg.pid").read_text()))


def test_timeout_escalates_to_sigkill_when_sigterm_is_ignored(ws, reg):
    t0 = time.monotonic()
    result = reg.run("bash", {"command": "trap '' TERM; echo $$ > sh.pid; sleep 30; sleep 30", "timeout_s": 1})
    elapsed = time.monotonic() - t0
    assert result.data["timed_out"]
    assert 1.9 < elapsed < 20, elapsed  # 1 s timeout + 1 s SIGTERM grace (lower bound: it waited)
    assert _wait_dead(int((ws / "sh.pid").read_text()))


def test_cancel_from_another_thread(ws, reg):
    cancel = threading.Event()
    stop = threading.Event()

    def cancel_once_running() -> None:  # gated on the command having started, not on a sleep
        while not stop.is_set() and not (ws / "sh.pid").exists():
            time.sleep(0.01)
        cancel.set()

    canceller = threading.Thread(target=cancel_once_running)
    canceller.start()
    t0 = time.monotonic()
    try:
        result = reg.run("bash", {"command": "echo started; echo $$ > sh.pid; sleep 30"}, cancel=cancel)
    finally:
        stop.set()
        canceller.join()
    elapsed = time.monotonic() - t0
    assert elapsed < 20, elapsed  # far below the 30 s sleep
    assert not result.ok and result.data["cancelled"] and not result.data["timed_out"]
    assert result.content.startswith("cancelled after")
    assert "started" in result.data["stdout"]
    assert _wait_dead(int((ws / "sh.pid").read_text()))


def test_ten_megabytes_of_output_keep_head_and_tail_in_bounded_memory(reg):
    command = "echo FIRST; head -c 10000000 /dev/zero | tr '\\0' 'x'; echo; echo LAST; echo E >&2"
    tracemalloc.start()
    try:
        result = reg.run("bash", {"command": command})
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert result.ok and result.data["exit_code"] == 0
    out = result.data["stdout"]
    assert result.data["stdout_bytes"] == 10_000_000 + len("FIRST\n\nLAST\n")
    assert result.data["stdout_truncated"] and not result.data["stderr_truncated"]
    assert out.startswith("FIRST\nxxx") and out.endswith("xxx\nLAST\n")
    assert "bytes omitted …]" in out
    assert len(out) < 17_000 and len(result.content) < 18_000
    assert peak < 2 * 1024 * 1024, peak  # 10 MB went through, never held


def test_background_child_holding_the_pipes_does_not_hang(ws, reg):
    t0 = time.monotonic()
    result = reg.run("bash", {"command": "sleep 30 & echo $! > bg.pid; echo started"})
    assert time.monotonic() - t0 < 20  # far below the 30 s the child would hold the pipes
    assert result.ok and result.data["exit_code"] == 0 and result.data["background_killed"]
    assert "started" in result.content
    assert _wait_dead(int((ws / "bg.pid").read_text()))


def test_detached_background_process_with_redirected_output_is_left_alone(ws, reg):
    result = reg.run("bash", {"command": "sleep 30 > /dev/null 2>&1 & echo $!"})
    pid = int(result.data["stdout"])
    try:
        assert result.ok and not result.data["background_killed"]
        assert not _dead(pid)
    finally:
        os.kill(pid, 9)


def test_secrets_are_scrubbed_from_the_environment(ws, reg, monkeypatch):
    monkeypatch.setenv("FOO_TOKEN", "tok-value-1")
    monkeypatch.setenv("MY_API_KEY", "key-value-2")
    monkeypatch.setenv("AWS_REGION", "aws-value-3")
    monkeypatch.setenv("GITHUB_ACTOR", "gh-value-4")
    monkeypatch.setenv("db_password", "pw-value-5")
    monkeypatch.setenv("HF_HOME", "hf-value-6")
    monkeypatch.setenv("PLAIN_SETTING", "hidden-7")
    monkeypatch.setenv("HTTPS_PROXY", "http://user:pw-value-8@proxy:3128")
    monkeypatch.setenv("DB_DSN", "postgres://u:dsn-value-9@db/x")
    monkeypatch.setenv("SENTRY_DSN", "https://sentry-value-10@o.ingest")
    monkeypatch.setenv("SMTP_PASS", "pass-value-11")
    monkeypatch.setenv("LC_TIME", "C.UTF-8")
    monkeypatch.setenv("TZ", "UTC")
    result = reg.run("bash", {"command": "echo \"[$FOO_TOKEN]\"; env"})
    out = result.data["stdout"]
    assert out.startswith("[]\n")
    for value in ("tok-value-1", "key-value-2", "aws-value-3", "gh-value-4", "pw-value-5", "hf-value-6",
                  "hidden-7", "pw-value-8", "dsn-value-9", "sentry-value-10", "pass-value-11"):
        assert value not in out
    assert f"HOME={ws}" in out and "PATH=" in out and "LC_TIME=C.UTF-8" in out and "TZ=UTC" in out


def test_scrub_env_function():
    env = {"PATH": "/bin", "SSH_AUTH_SOCK": "/s", "OPENAI_BASE": "x", "Anthropic_x": "y", "LANG": "C",
           "LC_ALL": "C", "VIRTUAL_ENV": "/v", "PYTHONPATH": "/p", "LD_PRELOAD": "/x.so", "USER": "root"}
    clean = scrub_env(env, "/w")
    assert {k: clean[k] for k in ("PATH", "LANG", "LC_ALL", "HOME")} == {"PATH": "/bin", "LANG": "C", "LC_ALL": "C",
                                                                         "HOME": "/w"}
    assert set(clean) == {"PATH", "LANG", "LC_ALL", "HOME", "PAGER", "GIT_PAGER", "GIT_TERMINAL_PROMPT", "TERM",
                          "NO_COLOR", "PYTHONDONTWRITEBYTECODE"}


def test_ansi_escapes_are_stripped(reg):
    result = reg.run("bash", {"command": "printf '\\033[31mred\\033[0m\\n'"})
    assert result.data["stdout"] == "red\n"


@pytest.mark.parametrize(
    "args,needle",
    [
        ({}, "missing required argument 'command'"),
        ({"command": "true", "timeout_s": 601}, "'timeout_s' must be <= 600"),
        ({"command": "true", "timeout_s": 0}, "'timeout_s' must be >= 1"),
        ({"command": "true", "timeout_s": "5"}, "'timeout_s' must be integer, got string"),
        ({"command": ["ls"]}, "'command' must be string, got array"),
        ({"command": "true", "cwd": "/"}, "unknown argument 'cwd'"),
    ],
)
def test_schema_validation_errors(reg, args, needle):
    result = reg.run("bash", args)
    assert not result.ok and needle in result.error
    assert "bash(command: string, timeout_s?: integer 1..600 = 30)" in result.error or "<=" in needle or ">=" in needle
