"""Session store: CRUD, token ids, forks, search, export, schema and rollback."""

from __future__ import annotations

import json
import os
import random
import sqlite3
import struct

from engine.errors import MlxtermError
from engine.sessions import (
    SessionError,
    SessionNotFound,
    SessionStore,
    suggest_title,
)
from engine.sessions.naming import ALPHABET, ID_LENGTH, new_id
from engine.sessions.schema import SCHEMA_VERSION

import numpy as np
import pytest


@pytest.fixture(params=["fts", "like"])
def store(request, tmp_path):
    s = SessionStore(tmp_path / "sessions.sqlite3", fts=None if request.param == "fts" else False)
    assert s.uses_fts == (request.param == "fts")
    yield s
    s.close()


@pytest.fixture
def fts_store(tmp_path):
    with SessionStore(tmp_path / "sessions.sqlite3") as s:
        yield s


def _chat(store, n=4, prefix="msg"):
    s = store.create(title="chat", profile="p1")
    for i in range(n):
        store.add_message(s.id, "user" if i % 2 == 0 else "assistant", f"{prefix} {i}",
                          token_ids=[i * 10 + k for k in range(i + 1)])
    return store.get(s.id)


# -- ids and titles -------------------------------------------------------------------------

def test_ids_are_short_sortable_and_unique():
    ids = [new_id(1_700_000_000 + i * 0.001) for i in range(300)]
    assert all(len(i) == ID_LENGTH and set(i) <= set(ALPHABET) for i in ids)
    assert ids == sorted(ids)  # one per millisecond: order follows time
    assert new_id(1_700_000_000) < new_id(1_700_000_001) < new_id(4_000_000_000)


def test_sessions_created_in_a_burst_have_distinct_ids(fts_store):
    ids = {fts_store.create().id for _ in range(300)}
    assert len(ids) == 300


def test_suggest_title():
    assert suggest_title("") == "New chat"
    assert suggest_title("\n\n  ## Fix the *parser* bug  \nmore") == "Fix the parser bug"
    assert suggest_title("keep snake_case names") == "keep snake_case names"
    long = suggest_title("word " * 40)
    assert len(long) <= 60 and long.endswith("…") and not long[:-1].endswith(" ")
    assert suggest_title("x" * 200).startswith("x" * 50)


# -- sessions --------------------------------------------------------------------------------

def test_create_get_defaults_and_options(store, tmp_path):
    s = store.create()
    assert (s.title, s.profile, s.kind, s.message_count, s.token_count, s.meta) == (
        "New chat", "", "chat", 0, 0, {})
    a = store.create(title="  My\n agent ", profile="coder", kind="agent",
                     workspace=tmp_path, meta={"k": [1, 2]})
    got = store.get(a.id)
    assert got == a
    assert (got.title, got.kind, got.workspace, got.meta) == ("My agent", "agent", str(tmp_path),
                                                              {"k": [1, 2]})
    child = store.create(parent_id=a.id, fork_at=0)
    assert child.parent_id == a.id
    with pytest.raises(SessionError, match="unknown session kind 'robot'"):
        store.create(kind="robot")
    with pytest.raises(SessionNotFound):
        store.create(parent_id="zzzzzzzzzzzz")


def test_get_accepts_unique_prefix_like_git(store):
    a, b = store.create(title="a"), store.create(title="b")
    common = os.path.commonprefix([a.id, b.id])
    assert len(common) >= 4  # created in the same second: same time prefix
    with pytest.raises(SessionNotFound, match="ambiguous"):
        store.get(common)
    assert store.get(a.id[: len(common) + 1]).id == a.id
    assert store.get(b.id.upper()).id == b.id
    for bad in ("", "zzzz", "not-an-id!", a.id + "0"):
        with pytest.raises(SessionNotFound, match="no session"):
            store.get(bad)
    assert issubclass(SessionNotFound, MlxtermError)


def test_rename_profile_meta_and_delete(store):
    s = _chat(store)
    assert store.rename(s.id, "New title").title == "New title"
    with pytest.raises(SessionError, match="empty"):
        store.rename(s.id, "  ")
    assert store.set_profile(s.id, "p2").profile == "p2"
    assert store.messages(s.id)[0].profile == "p1"  # messages keep the profile they had
    assert store.set_meta(s.id, {"a": 1, "b": {"c": 2}}) == {"a": 1, "b": {"c": 2}}
    assert store.set_meta(s.id, {"a": None, "d": "x"}) == {"b": {"c": 2}, "d": "x"}
    assert store.get_meta(s.id) == {"b": {"c": 2}, "d": "x"}
    with pytest.raises(SessionError, match="plain JSON"):
        store.set_meta(s.id, {"bad": object()})
    assert store.delete(s.id[:10]) == s.id
    with pytest.raises(SessionNotFound):
        store.get(s.id)
    with sqlite3.connect(store.path) as raw:  # cascade removed the messages
        assert raw.execute("SELECT COUNT(*) FROM messages WHERE session_id = ?",
                           (s.id,)).fetchone() == (0,)


# -- messages and tokens ----------------------------------------------------------------------

def test_add_message_round_trips_every_field(store):
    s = store.create(profile="p1")
    calls = [{"id": "c1", "type": "function",
              "function": {"name": "read_file", "arguments": {"path": "a.py"}}}]
    store.add_message(s.id, "system", "be brief", token_ids=[1, 2])
    m = store.add_message(s.id, "assistant", "", reasoning="think…", tool_calls=calls,
                          token_ids=[3, 4, 5], meta={"usage": {"out": 3}, "finish_reason": "tool"})
    t = store.add_message(s.id, "tool", '{"ok": true}', tool_call_id="c1", name="read_file",
                          token_ids=[6], profile="other")
    got = store.messages(s.id)
    assert got[1] == m and got[2] == t
    assert (m.index, m.role, m.reasoning, m.tool_calls, m.token_ids, m.context_start) == (
        1, "assistant", "think…", calls, (3, 4, 5), 2)
    assert m.meta == {"usage": {"out": 3}, "finish_reason": "tool"}
    assert (t.tool_call_id, t.name, t.profile, t.context_start, t.context_end) == (
        "c1", "read_file", "other", 5, 6)
    assert got[0].profile == "p1"
    s2 = store.get(s.id)
    assert (s2.message_count, s2.token_count) == (3, 6)
    assert s2.updated >= t.created >= s.created
    assert [m.token_ids for m in store.messages(s.id, tokens=False)] == [(), (), ()]


def test_bad_message_input_is_a_clear_error(store):
    s = store.create()
    with pytest.raises(SessionError, match="unknown message role 'bot'"):
        store.add_message(s.id, "bot", "x")
    with pytest.raises(SessionError, match="must be text"):
        store.add_message(s.id, "user", None)
    with pytest.raises(SessionError, match="32-bit"):
        store.add_message(s.id, "user", "x", token_ids=[2**31])
    with pytest.raises(SessionError, match="tool calls must be plain JSON"):
        store.add_message(s.id, "assistant", "x", tool_calls=[{"f": {1, 2}}])
    with pytest.raises(SessionNotFound):
        store.add_message("0000000000zz", "user", "x")
    assert store.get(s.id).message_count == 0


def test_token_ids_round_trip_as_int32_le_blobs(fts_store):
    rng = random.Random(7)
    s = fts_store.create()
    lists = [[rng.randrange(0, 2**31) for _ in range(n)] for n in (1, 0, 70_000, 513)]
    lists[0] = [65_535, 65_536, 262_143, 2**31 - 1, 0]
    for i, ids in enumerate(lists):
        fts_store.add_message(s.id, "user" if i % 2 == 0 else "assistant", f"m{i}", token_ids=ids)
    # numpy arrays of either width are accepted
    fts_store.add_message(s.id, "user", "np32", token_ids=np.arange(100_000, 100_300, dtype=np.int32))
    fts_store.add_message(s.id, "assistant", "np64", token_ids=np.array([1, 99_999], dtype=np.int64))
    lists += [list(range(100_000, 100_300)), [1, 99_999]]
    msgs = fts_store.messages(s.id)
    assert [list(m.token_ids) for m in msgs] == lists
    flat = [t for ids in lists for t in ids]
    assert fts_store.context_tokens(s.id) == flat
    assert fts_store.get(s.id).token_count == len(flat)
    starts = [0]
    for ids in lists[:-1]:
        starts.append(starts[-1] + len(ids))
    assert [m.context_start for m in msgs] == starts
    for m in msgs:  # context_start slices the context exactly
        assert flat[m.context_start:m.context_end] == list(m.token_ids)
    assert fts_store.context_tokens(s.id, upto=3) == flat[: starts[3]]
    with sqlite3.connect(fts_store.path) as raw:
        blob = raw.execute("SELECT token_ids FROM messages WHERE idx = 0 AND session_id = ?",
                           (s.id,)).fetchone()[0]
    assert blob == struct.pack("<5i", *lists[0])


def test_update_last_assistant_message(store):
    s = store.create()
    store.add_message(s.id, "user", "q", token_ids=[1, 2])
    store.add_message(s.id, "assistant", "partial", reasoning="r", token_ids=[3, 4, 5],
                      meta={"finish_reason": None})
    m = store.update_message(s.id, content="full answer", token_ids=[7, 8, 9, 10, 11],
                             meta={"finish_reason": "stop"})
    assert (m.content, m.reasoning, m.token_ids, m.meta) == (
        "full answer", "r", (7, 8, 9, 10, 11), {"finish_reason": "stop"})
    assert store.update_message(s.id, reasoning=None).reasoning is None
    assert store.get(s.id).token_count == 7
    assert store.context_tokens(s.id) == [1, 2, 7, 8, 9, 10, 11]
    store.add_message(s.id, "user", "next")
    with pytest.raises(SessionError, match="is a user message"):
        store.update_message(s.id, content="x")
    with pytest.raises(SessionError, match="no messages"):
        store.update_message(store.create().id, content="x")


def test_delete_last(store):
    s = _chat(store, n=5)  # token counts 1..5
    assert store.delete_last(s.id, 2) == 2
    got = store.get(s.id)
    assert (got.message_count, got.token_count) == (3, 6)
    assert [m.content for m in store.messages(s.id)] == ["msg 0", "msg 1", "msg 2"]
    m = store.add_message(s.id, "assistant", "again", token_ids=[42])
    assert (m.index, m.context_start) == (3, 6)
    assert store.context_tokens(s.id)[-1] == 42
    assert store.delete_last(s.id, 0) == 0
    assert store.delete_last(s.id, 99) == 4
    assert store.get(s.id).token_count == 0 and store.context_tokens(s.id) == []
    with pytest.raises(SessionError):
        store.delete_last(s.id, -1)


def test_fork_copies_prefix_and_is_independent(store):
    src = _chat(store, n=5)
    src = store.set_profile(src.id, "p9")
    store.set_meta(src.id, {"pinned": True})
    f = store.fork(src.id[:11], 3)
    assert (f.parent_id, f.fork_at, f.title, f.profile, f.meta) == (
        src.id, 3, "chat", "p9", {"pinned": True})
    assert (f.message_count, f.token_count) == (3, 6)
    src_msgs, f_msgs = store.messages(src.id), store.messages(f.id)
    strip = [(m.index, m.role, m.content, m.token_ids, m.context_start, m.profile, m.meta)
             for m in src_msgs[:3]]
    assert [(m.index, m.role, m.content, m.token_ids, m.context_start, m.profile, m.meta)
            for m in f_msgs] == strip
    assert store.context_tokens(f.id) == store.context_tokens(src.id, upto=3)
    # independent both ways
    store.add_message(f.id, "assistant", "fork only", token_ids=[999])
    store.delete_last(src.id, 3)
    store.add_message(src.id, "assistant", "src only", token_ids=[555])
    assert [m.content for m in store.messages(f.id)] == ["msg 0", "msg 1", "msg 2", "fork only"]
    assert [m.content for m in store.messages(src.id)] == ["msg 0", "msg 1", "src only"]
    assert store.context_tokens(f.id)[-1] == 999
    # edges and deleting the parent
    assert store.fork(src.id, 0, title="empty").message_count == 0
    assert store.fork(src.id, 3).token_count == store.get(src.id).token_count
    with pytest.raises(SessionError, match="use 0 to 3"):
        store.fork(src.id, 4)
    store.delete(src.id)
    orphan = store.get(f.id)
    assert orphan.parent_id is None and orphan.fork_at == 3 and orphan.message_count == 4


def test_failing_fork_rolls_back_completely(fts_store):
    src = _chat(fts_store, n=5)
    before = [s.id for s in fts_store.list()]
    with sqlite3.connect(fts_store.path) as raw:  # make the 3rd copied message fail
        raw.execute(f"""CREATE TRIGGER fail_copy BEFORE INSERT ON messages
                        WHEN new.idx = 2 AND new.session_id != '{src.id}'
                        BEGIN SELECT RAISE(ABORT, 'disk on fire'); END""")
    with pytest.raises(sqlite3.DatabaseError, match="disk on fire"):
        fts_store.fork(src.id, 4)
    assert [s.id for s in fts_store.list()] == before
    with sqlite3.connect(fts_store.path) as raw:
        assert raw.execute("SELECT COUNT(*) FROM messages").fetchone() == (5,)
        raw.execute("DROP TRIGGER fail_copy")
    assert fts_store.fork(src.id, 4).message_count == 4  # the store is still usable


# -- list and search ---------------------------------------------------------------------------

def test_list_order_counts_and_preview(store):
    a = store.create(title="alpha")
    b = store.create(title="beta", kind="agent")
    c = store.create(title="gamma")
    store.add_message(a.id, "user", "first question", token_ids=[1, 2, 3])
    store.add_message(a.id, "assistant", "  the\n answer  ", token_ids=[4])
    store.add_message(a.id, "tool", "tool output is not a preview")
    rows = store.list()
    assert [r.id for r in rows] == [a.id, c.id, b.id]
    top = rows[0]
    assert (top.title, top.message_count, top.token_count, top.preview) == ("alpha", 3, 4, "the answer")
    assert [r.id for r in store.list(kind="agent")] == [b.id]
    assert [r.id for r in store.list(limit=1)] == [a.id]
    store.rename(b.id, "beta 2")  # renaming does not reorder
    assert [r.id for r in store.list()][0] == a.id
    store.add_message(b.id, "user", "x" * 300)
    row = store.list()[0]
    assert row.id == b.id and len(row.preview) == 80 and row.preview.endswith("…")


def test_search_matches_titles_and_message_text(store):
    a = store.create(title="Rust borrow checker")
    b = store.create(title="Cooking")
    c = store.create(title="Misc")
    store.add_message(b.id, "user", "How long do I boil pasta?")
    store.add_message(b.id, "assistant", "About ten minutes, then drain the pasta.")
    store.add_message(c.id, "user", "Explain the borrow rules briefly")
    ids = lambda q: {r.id for r in store.list(q)}  # noqa: E731
    assert ids("borrow") == {a.id, c.id}
    assert ids("pasta") == {b.id}
    assert ids("PASTA boil") == {b.id}  # all words, case-insensitive, in one message
    assert ids("pasta drain") == {b.id}
    assert ids("boil drain") == set()  # words in different messages do not combine
    assert ids("rust checker") == {a.id}
    assert ids("nothing-like-this") == set()
    for odd in ('"', "%", "_", "a AND OR NOT (", "*", "\\"):
        store.list(odd)  # user text never breaks the query
    assert ids("%") == set()
    store.delete(b.id)
    assert ids("pasta") == set()  # deleted messages leave the index
    store.add_message(c.id, "assistant", "placeholder")
    store.update_message(c.id, content="noodles instead")
    assert ids("noodles") == {c.id} and ids("placeholder") == set()


# -- export ----------------------------------------------------------------------------------

def _rich_session(store):
    s = store.create(title="Export me", profile="coder", kind="agent", workspace="/tmp/w")
    store.add_message(s.id, "system", "You are helpful.", token_ids=[1])
    store.add_message(s.id, "user", "Show code:\n```py\nx = 1\n```", token_ids=[2, 3])
    calls = [{"id": "call_1", "function": {"name": "bash", "arguments": {"cmd": "ls"}}}]
    store.add_message(s.id, "assistant", "Let me look.", reasoning="User wants files.",
                      tool_calls=calls, token_ids=[4, 5, 6], meta={"finish_reason": "tool_calls"})
    store.add_message(s.id, "tool", '{"stdout": "a.py"}', tool_call_id="call_1", name="bash",
                      token_ids=[7])
    store.add_message(s.id, "tool", "plain text with ``` fence", tool_call_id="call_2", name="cat")
    store.add_message(s.id, "assistant", "There is a.py.", token_ids=[8, 9])
    return store.get(s.id)


def test_export_markdown(fts_store):
    s = _rich_session(fts_store)
    md = fts_store.export(s.id, "md")
    assert md.startswith("# Export me\n")
    for part in (f"`{s.id}` (agent)", "Profile: coder", "Workspace: `/tmp/w`",
                 "Messages: 6 (9 tokens)", "## System", "## User", "## Assistant",
                 "<details>\n<summary>Reasoning</summary>\n\nUser wants files.\n\n</details>",
                 "## Tool result: bash (`call_1`)", '```json\n{\n  "stdout": "a.py"\n}\n```',
                 '"name": "bash"', "````\nplain text with ``` fence\n````",
                 "Show code:\n```py\nx = 1\n```"):
        assert part in md, part
    assert md.index("## System") < md.index("## User") < md.index("There is a.py.")
    fork = fts_store.fork(s.id, 2)
    assert f"Forked from `{s.id}` at message 2" in fts_store.export(fork.id, "md")


def test_export_json(fts_store):
    s = _rich_session(fts_store)
    doc = json.loads(fts_store.export(s.id, "json"))
    assert (doc["format"], doc["format_version"]) == ("mlxterm.session", 1)
    sess = doc["session"]
    assert (sess["id"], sess["title"], sess["kind"], sess["workspace"], sess["message_count"],
            sess["token_count"]) == (s.id, "Export me", "agent", "/tmp/w", 6, 9)
    assert sess["created"].endswith("Z") and "T" in sess["created"]
    msgs = doc["messages"]
    assert [m["role"] for m in msgs] == ["system", "user", "assistant", "tool", "tool", "assistant"]
    assert [m["token_count"] for m in msgs] == [1, 2, 3, 1, 0, 2]
    assert [m["context_start"] for m in msgs] == [0, 1, 3, 6, 7, 7]
    assert msgs[2]["tool_calls"][0]["function"]["name"] == "bash"
    assert msgs[2]["reasoning"] == "User wants files." and msgs[2]["meta"]["finish_reason"] == "tool_calls"
    assert (msgs[3]["tool_call_id"], msgs[3]["name"]) == ("call_1", "bash")
    assert all("token_ids" not in m for m in msgs)
    full = json.loads(fts_store.export(s.id, "json", include_tokens=True))
    assert [t for m in full["messages"] for t in m["token_ids"]] == fts_store.context_tokens(s.id)
    with pytest.raises(SessionError, match="unknown export format"):
        fts_store.export(s.id, "html")


# -- schema and files --------------------------------------------------------------------------

def test_default_path_wal_foreign_keys_and_version(tmp_path):
    from engine.paths import data_dir

    with SessionStore() as st:
        assert st.path == data_dir() / "sessions.sqlite3"
        st.create()
    with sqlite3.connect(data_dir() / "sessions.sqlite3") as raw:
        assert raw.execute("PRAGMA journal_mode").fetchone() == ("wal",)
        assert raw.execute("SELECT version FROM schema_version").fetchall() == [(SCHEMA_VERSION,)]
    with SessionStore() as st:  # reopening does not migrate again
        assert len(st.list()) == 1
        conn = st._connection()
        assert conn.execute("PRAGMA foreign_keys").fetchone() == (1,)


def test_newer_schema_and_foreign_files_are_clear_errors(tmp_path):
    path = tmp_path / "s.db"
    SessionStore(path).close()
    with sqlite3.connect(path) as raw:
        raw.execute("UPDATE schema_version SET version = 99")
    with pytest.raises(SessionError, match="schema version 99"):
        SessionStore(path)
    junk = tmp_path / "junk.db"
    junk.write_bytes(b"this is not sqlite" * 100)
    with pytest.raises(SessionError, match="cannot open session database .*junk.db"):
        SessionStore(junk)
    with pytest.raises(SessionError, match="cannot"):
        SessionStore(tmp_path / "junk.db" / "under-a-file.db")
