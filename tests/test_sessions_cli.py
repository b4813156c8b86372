"""``mlxterm sessions ...`` run as a real subprocess against the store in $MLXTERM_HOME."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from engine.sessions import SessionStore

import pytest

REPO = Path(__file__).resolve().parents[1]


def _cli(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "app", "sessions", *args], cwd=REPO,
                          capture_output=True, text=True, input=stdin, timeout=60)


@pytest.fixture
def chats():
    with SessionStore() as st:  # $MLXTERM_HOME is the test's own dir (conftest)
        a = st.create(title="Pasta night", profile="chef")
        st.add_message(a.id, "user", "How long to boil spaghetti?", token_ids=[1, 2, 3])
        st.add_message(a.id, "assistant", "About nine minutes.", reasoning="al dente",
                       token_ids=[4, 5])
        b = st.create(title="Shell help", kind="agent")
        st.add_message(b.id, "user", "list files", token_ids=[6])
        st.add_message(b.id, "assistant", "", token_ids=[7, 8],
                       tool_calls=[{"id": "c1", "function": {"name": "bash", "arguments": {}}}])
        return st.get(a.id), st.get(b.id)


def test_list_and_show(chats):
    a, b = chats
    r = _cli("list", "--json")
    assert r.returncode == 0, r.stderr
    rows = json.loads(r.stdout)
    assert [x["id"] for x in rows] == [b.id, a.id]
    assert rows[1] | {"created": None, "updated": None} == {
        "id": a.id, "title": "Pasta night", "profile": "chef", "kind": "chat", "created": None,
        "updated": None, "message_count": 2, "token_count": 5, "preview": "About nine minutes."}
    r = _cli("list", "--query", "spaghetti", "--json")
    assert [x["id"] for x in json.loads(r.stdout)] == [a.id]
    r = _cli("list")
    assert r.returncode == 0 and "Pasta night" in r.stdout and b.id in r.stdout

    r = _cli("show", b.id[:10])
    assert r.returncode == 0, r.stderr
    assert "Shell help" in r.stdout and "[tool calls] bash" in r.stdout and "2 messages" in r.stdout
    r = _cli("show", a.id, "--json")
    doc = json.loads(r.stdout)
    assert doc["session"]["id"] == a.id and doc["messages"][1]["reasoning"] == "al dente"


def test_export_fork_rename_delete(chats, tmp_path):
    a, b = chats
    out = tmp_path / "deep" / "a.md"
    r = _cli("export", a.id, "--format", "md", "--output", str(out))
    assert r.returncode == 0, r.stderr
    md = out.read_text()
    assert md.startswith("# Pasta night") and "About nine minutes." in md and "<details>" in md
    r = _cli("export", a.id, "--format", "json", "--tokens")
    assert [t for m in json.loads(r.stdout)["messages"] for t in m["token_ids"]] == [1, 2, 3, 4, 5]

    r = _cli("fork", a.id, "--at", "1", "--title", "Just the question", "--json")
    assert r.returncode == 0, r.stderr
    fork = json.loads(r.stdout)
    assert (fork["parent_id"], fork["fork_at"], fork["message_count"], fork["title"]) == (
        a.id, 1, 1, "Just the question")
    r = _cli("fork", a.id, "--at", "7")
    assert r.returncode == 2 and r.stderr.startswith("mlxterm: cannot fork") and "Traceback" not in r.stderr

    r = _cli("rename", fork["id"], "Renamed")
    assert r.returncode == 0 and "Renamed" in r.stdout
    r = _cli("delete", b.id, stdin="")  # not a terminal and no --yes: refuses
    assert r.returncode == 2 and "--yes" in r.stderr
    r = _cli("delete", b.id, "--yes")
    assert r.returncode == 0, r.stderr
    with SessionStore() as st:
        assert {s.title for s in st.list()} == {"Pasta night", "Renamed"}
        assert st.context_tokens(fork["id"]) == [1, 2, 3]


def test_unknown_id_is_one_line_error(chats):
    r = _cli("show", "zzzzzz")
    assert r.returncode == 2
    assert r.stderr.strip() == "mlxterm: no session with id 'zzzzzz'."
