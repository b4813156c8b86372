"""``mlxterm chat --plain`` and piped stdin: prompts line by line, same session store."""

from __future__ import annotations

import io
import os
import subprocess
import sys
from pathlib import Path

from engine.sessions import SessionStore

import pytest

from app.tui.format import clean
from app.tui.plain import run_plain

REPO = Path(__file__).resolve().parent.parent


def _run(profile, lines: str, session=None):
    out, err = io.StringIO(), io.StringIO()
    code = run_plain(str(profile), session, stdin=io.StringIO(lines), stdout=out, stderr=err)
    return code, out.getvalue(), err.getvalue()


def test_pipe_answers_each_line_and_resumes_the_session(tiny_profile):
    code, out, err = _run(tiny_profile, "hello\n\nwhat now?\n")
    assert code == 0
    assert out.count("\n") >= 2  # one reply per non-empty line, each ending in a newline
    sessions = SessionStore().list()
    assert len(sessions) == 1
    sid = sessions[0].id
    assert f"session {sid}" in err
    store = SessionStore()
    msgs = store.messages(sid)
    assert [m.role for m in msgs] == ["user", "assistant", "user", "assistant"]
    assert msgs[0].content == "hello" and msgs[2].content == "what now?"
    assert out.startswith(clean(msgs[1].content))  # printed as stored, control chars removed

    code, out, err = _run(tiny_profile, "and then?\n", session=sid[:6])  # a prefix works
    assert code == 0
    msgs = store.messages(sid)
    assert [m.content for m in msgs if m.role == "user"] == ["hello", "what now?", "and then?"]
    # The follow-up extends the stored context exactly: prompt = all earlier tokens.
    assert msgs[-1].meta["usage"]["prompt_tokens"] == sum(m.token_count for m in msgs[:-1])


def test_pipe_slash_new_starts_another_session(tiny_profile):
    code, _, _ = _run(tiny_profile, "one\n/new\ntwo\n")
    assert code == 0
    titles = sorted(s.title for s in SessionStore().list())
    assert titles == ["one", "two"]


def test_pipe_rejects_tui_only_commands(tiny_profile):
    from engine.errors import MlxtermError

    with pytest.raises(MlxtermError, match="only available in the full-screen TUI"):
        _run(tiny_profile, "/fork 1\n")


def test_cli_pipe_and_bad_session_exit_cleanly(tiny_profile):
    env = dict(os.environ)
    cmd = [sys.executable, "-m", "app", "chat", "--profile", str(tiny_profile)]
    done = subprocess.run(cmd, input="hi\n", capture_output=True, text=True, env=env,
                          cwd=REPO, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip()
    assert "session " in done.stderr

    bad = subprocess.run([*cmd, "--session", "zzzz"], input="hi\n", capture_output=True,
                         text=True, env=env, cwd=REPO, timeout=120)
    assert bad.returncode == 2
    assert bad.stderr.strip() == "mlxterm: no session with id 'zzzz'."
