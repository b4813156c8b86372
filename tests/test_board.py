"""The task board: transitions, store, dispatcher (order, WIP, dependencies, retries, review,
crash recovery) and the CLI, on the scripted engine."""

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from engine.sessions import SessionStore

import pytest

from agents.board import actions
from agents.board.dispatcher import Dispatcher, request_cancel
from agents.board.model import STATES, TRANSITIONS, BoardError, Card, CheckSpec, check_move
from agents.board.store import BoardStore
from tests.board_engine import RoutedEngine, answer, write

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def board(tmp_path):
    b = BoardStore(tmp_path / "board.sqlite3")
    yield b
    b.close()


@pytest.fixture
def sessions(tmp_path):
    return SessionStore(tmp_path / "sessions.sqlite3")


def card(key: str, *, checks=(), **kw) -> Card:
    return Card(id=0, title=f"card {key}", prompt=f"[card-{key}] create {key}.txt containing {key}",
                state=kw.pop("state", "queued"), checks=[CheckSpec(f"c{i}", c) for i, c in enumerate(checks)],
                limits={"steps": 4}, **kw)


def ok_script(key: str, delay_s: float = 0.0) -> list:
    return [write(f"{key}.txt", key, delay_s), answer(f"Wrote {key}.txt.", delay_s)]


def dispatcher(board, sessions, engine, **kw) -> Dispatcher:
    return Dispatcher(board, sessions, lambda profile: engine, default_profile="scripted", **kw)


# -- the transitions table ----------------------------------------------------------------------

def test_transitions_table_is_the_only_gate(board):
    assert set(TRANSITIONS) == set(STATES)
    for old in STATES:
        for new in STATES:
            if new in TRANSITIONS[old]:
                check_move(1, old, new)
            else:
                with pytest.raises(BoardError, match=f"cannot move from {old} to {new}"):
                    check_move(1, old, new)
    c = board.add(card("a", state="backlog"))
    with pytest.raises(BoardError, match="cannot move from backlog to done"):
        board.move(c.id, "done")
    with pytest.raises(BoardError, match="use move"):
        board.update(c.id, state="done")
    with pytest.raises(BoardError, match="unknown state 'doing'"):
        board.move(c.id, "doing")
    board.move(c.id, "queued")
    with pytest.raises(BoardError, match="is queued, not backlog"):
        board.move(c.id, "running", expect="backlog")
    assert board.get(c.id).state == "queued"
    assert [e["event"] for e in board.events(c.id)] == ["created", "moved"]


def test_store_validates_and_persists(board, tmp_path):
    with pytest.raises(BoardError, match="depends on card 7, which does not exist"):
        board.add(card("a", depends_on=[7]))
    with pytest.raises(BoardError, match="no card 9"):
        board.get(9)
    a = board.add(card("a", labels=["x"], priority=3))
    again = BoardStore(tmp_path / "board.sqlite3")
    got = again.get(a.id)
    assert got.labels == ["x"] and got.priority == 3 and got.checks == a.checks
    assert again._conn.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    again.close()


# -- the dispatcher ------------------------------------------------------------------------------

def test_order_is_priority_then_age_and_wip_limits(board, sessions):
    keys = ["a", "b", "c", "d"]
    engine = RoutedEngine({k: ok_script(k, delay_s=0.002) for k in keys})
    board.add(card("a", priority=0))
    board.add(card("b", priority=5))
    board.add(card("c", priority=0))
    board.add(card("d", priority=5))
    peak = []
    d = dispatcher(board, sessions, engine, concurrency=2,
                   on_event=lambda run, ev: peak.append(len(d.running)))
    done = d.drain()
    assert [c.title for c in (board.get(i) for i in d.started)] == ["card b", "card d", "card a", "card c"]
    assert max(peak) == 2  # two cards in flight at once, never three
    assert all(c.state == "review" for c in done)
    # per-profile limit: at most one card of profile "slow" at a time
    board2 = BoardStore(board.path.parent / "b2.sqlite3")
    engine2 = RoutedEngine({k: ok_script(k, delay_s=0.002) for k in ("e", "f", "g")})
    for k, prof in (("e", "slow"), ("f", "slow"), ("g", "fast")):
        board2.add(card(k, profile=prof))
    seen = []
    d2 = Dispatcher(board2, sessions, lambda p: engine2, concurrency=3, per_profile={"slow": 1},
                    on_event=lambda run, ev: seen.append(sorted(d2.profile_of(r.card) for r in d2.running.values())))
    d2.drain()
    assert max(s.count("slow") for s in seen) == 1 and any(len(s) == 2 for s in seen)
    board2.close()


def test_dependencies_wait_block_and_release(board, sessions, tmp_path):
    engine = RoutedEngine({"a": ok_script("a"), "b": ok_script("b"),
                           "c": [answer("I give up.")] * 3, "d": ok_script("d")})
    a = board.add(card("a", checks=["test -f a.txt"], auto_accept=True))
    b = board.add(card("b", depends_on=[a.id], priority=9))
    c = board.add(card("c", checks=["test -f c.txt"], max_retries=0))
    d_ = board.add(card("d", depends_on=[c.id]))
    d = dispatcher(board, sessions, engine)
    assert {x.id for x in d.runnable()} == {a.id, c.id}
    assert board.get(b.id).state == "blocked" and "waiting for card" in board.get(b.id).reason
    d.drain()
    assert d.started.index(a.id) < d.started.index(b.id)  # b (priority 9) still waited for a
    assert board.get(a.id).state == "done" and board.get(b.id).state == "review"
    assert board.get(c.id).state == "failed"
    assert board.get(d_.id).state == "blocked" and "dependency card" in board.get(d_.id).reason
    assert d_.id not in d.started


def test_retry_feeds_the_failed_check_back(board, sessions):
    engine = RoutedEngine({"a": [write("wrong.txt", "a"), answer(), write("a.txt", "a"), answer()]})
    c = board.add(card("a", checks=["test -f a.txt || { echo 'a.txt is missing'; exit 3; }"], max_retries=1,
                       repair_rounds=0))  # no repair inside the attempt: the retry is a new attempt
    dispatcher(board, sessions, engine).drain()
    first, second = board.attempts(c.id)
    assert first.status == "failed" and first.checks[0]["exit_code"] == 3
    assert second.kind == "retry" and second.status == "passed"
    assert "a.txt is missing" in second.prompt and "exit code 3" in second.prompt
    user = [m.content for m in sessions.messages(second.session_id) if m.role == "user"][-1]
    assert "a.txt is missing" in user  # the agent saw it
    got = board.get(c.id)
    assert got.state == "review" and got.retries_used == 1
    assert "+++ b/a.txt" in second.diff and "+++ b/wrong.txt" in second.diff


def test_retries_exhausted_fail_and_manual_retry(board, sessions):
    engine = RoutedEngine({"a": [answer("no")] * 4 + ok_script("a")})  # each attempt: "no", sent back, "no"
    c = board.add(card("a", checks=["test -f a.txt"], max_retries=1, repair_rounds=0))
    d = dispatcher(board, sessions, engine)
    d.drain()
    assert board.get(c.id).state == "failed" and len(board.attempts(c.id)) == 2
    actions.retry(board, c.id)
    d.drain()
    assert board.get(c.id).state == "review" and board.attempts(c.id)[-1].status == "passed"


def test_review_reject_continues_the_session_then_approve(board, sessions):
    engine = RoutedEngine({"a": ok_script("a") + [write("a.txt", "A!"), answer("Changed it.")]})
    c = board.add(card("a", checks=["test -f a.txt"]))
    d = dispatcher(board, sessions, engine)
    d.drain()
    assert board.get(c.id).state == "review"
    with pytest.raises(BoardError, match="needs a comment"):
        actions.reject(board, c.id, " ")
    actions.reject(board, c.id, "use capital A and an exclamation mark")
    d.drain()
    first, second = board.attempts(c.id)
    assert second.kind == "followup" and second.session_id == first.session_id
    assert "capital A" in second.prompt
    assert second.steps[0]["cached_tokens"] > 0.9 * second.steps[0]["prompt_tokens"]  # same KV
    assert (Path(board.get(c.id).workspace_dir) / "a.txt").read_text() == "A!"
    actions.approve(board, c.id)
    assert board.get(c.id).state == "done"
    with pytest.raises(BoardError, match="only cards in review"):
        actions.approve(board, c.id)
    assert [e["event"] for e in board.events(c.id)].count("rejected") == 1


def test_concurrent_cards_reuse_the_shared_prefix(board, sessions):
    engine = RoutedEngine({k: ok_script(k, delay_s=0.003) for k in "abc"})
    ids = [board.add(card(k, checks=[f"test -f {k}.txt"])).id for k in "abc"]
    d = dispatcher(board, sessions, engine, concurrency=2)
    d.drain()
    keys = [k for k, _ in engine.log]
    assert keys[:2] in (["a", "b"], ["b", "a"]) and sorted(keys) == sorted("aabbcc")
    assert engine.warmups == 1
    for cid in ids:
        att = board.attempts(cid)[0]
        assert board.get(cid).state == "review" and att.status == "passed"
        assert att.first_step_cached_ratio > 0.8, att.steps[0]
        exported = actions.export_card(board, cid)
        a = exported["attempts"][0]
        assert exported["kind"] == "board_card" and exported["card"]["id"] == cid
        assert set(a) >= {"number", "session_id", "status", "started_at", "finished_at", "wall_s", "tokens",
                          "requests", "ttft_s_sum", "tool_errors", "checks", "workspace", "diff", "steps"}
        assert a["requests"] == 2 and a["tokens"]["completion"] > 0 and a["tool_errors"] == 0
        assert a["steps"][0]["tool_calls"] == 1 and a["steps"][1]["tool_calls"] == 0
        assert a["ttft_s_sum"] is None  # the scripted engine reports no TTFT: unknown, not 0


def test_cancel_running_card_goes_to_backlog(board, sessions):
    engine = RoutedEngine({"a": [write("a.txt", "a" * 200, delay_s=0.02)] + ok_script("a")})
    c = board.add(card("a"))
    d = dispatcher(board, sessions, engine)
    d.start(poll_s=0.05)
    for _ in range(200):
        if c.id in d.running and d.running[c.id].step:
            break
        time.sleep(0.02)
    request_cancel(board, board.get(c.id))  # what `tasks cancel` does from another process
    for _ in range(300):
        if board.get(c.id).state == "backlog":
            break
        time.sleep(0.02)
    d.stop()
    got = board.get(c.id)
    assert got.state == "backlog" and got.next_attempt == {"kind": "resume"}
    assert board.attempts(c.id)[0].status == "cancelled"


# -- crash recovery -------------------------------------------------------------------------------

CRASH_SCRIPT = """
import sys, time
sys.path.insert(0, {root!r})
from engine.sessions import SessionStore
from agents.board.dispatcher import Dispatcher
from agents.board.store import BoardStore
from tests.board_engine import RoutedEngine, write
engine = RoutedEngine({{"a": [write("a.txt", "a" * 400, delay_s=0.05)]}})
d = Dispatcher(BoardStore({board!r}), SessionStore({sessions!r}), lambda p: engine, default_profile="scripted")
d.drain()
"""


def test_kill_9_mid_run_requeues_on_restart(board, sessions, tmp_path):
    c = board.add(card("a", checks=["test -f a.txt"]))
    code = CRASH_SCRIPT.format(root=str(ROOT), board=str(board.path), sessions=str(sessions.path))
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen([sys.executable, "-c", code], env=env)
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            att = board.last_attempt(c.id)
            if att is not None and att.session_id and att.status == "running":
                msgs = sessions.messages(att.session_id, tokens=False)
                if msgs and msgs[-1].role == "user":
                    break
            time.sleep(0.05)
        else:
            pytest.fail("the subprocess never started the attempt")
        time.sleep(0.3)  # mid-generation
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert board.get(c.id).state == "running"
    engine = RoutedEngine({"a": ok_script("a")})
    d = dispatcher(board, sessions, engine)
    assert d.recovered == [c.id]
    first = board.attempts(c.id)[0]
    assert first.status == "interrupted" and "is gone" in first.error
    assert board.get(c.id).state == "queued"
    d.drain()
    second = board.attempts(c.id)[1]
    assert second.kind == "resume" and second.session_id == first.session_id
    assert board.get(c.id).state == "review"
    events = [e["event"] for e in board.events(c.id)]
    assert "attempt_interrupted" in events and events.count("attempt_started") == 2


# -- the CLI --------------------------------------------------------------------------------------

def cli(*argv):
    from app.cli import main

    return main(list(argv))


def test_cli_add_list_move_export(tmp_path, capsys):
    task = tmp_path / "t.yaml"
    task.write_text('prompt: "create x.txt"\nchecks:\n  - {name: x, run: test -f x.txt}\n')
    assert cli("board", "add", str(task), "--priority", "2", "--label", "demo", "--json") == 0
    added = json.loads(capsys.readouterr().out)
    assert added["state"] == "queued" and added["checks"][0]["run"] == "test -f x.txt" and added["priority"] == 2
    assert cli("board", "add", "--prompt", "say hi", "--backlog", "--after", str(added["id"])) == 0
    capsys.readouterr()
    assert cli("tasks", "list", "--json") == 0  # "tasks": the old name, kept as an alias
    listed = json.loads(capsys.readouterr().out)
    assert [(c["id"], c["state"]) for c in listed] == [(1, "queued"), (2, "backlog")]
    assert cli("tasks", "move", "2", "done") == 2
    assert "cannot move from backlog to done" in capsys.readouterr().err
    assert cli("tasks", "cancel", "1", "--json") == 0
    assert json.loads(capsys.readouterr().out)["state"] == "backlog"
    out = tmp_path / "card.json"
    assert cli("tasks", "export", "1", "-o", str(out)) == 0
    data = json.loads(out.read_text())
    assert data["kind"] == "board_card" and data["attempts"] == [] and data["card"]["labels"] == ["demo"]
    report = tmp_path / "board.html"
    assert cli("tasks", "report", "--out", str(report), "--json") == 0
    assert json.loads(capsys.readouterr().out)["cards"] == [1, 2]
    assert "create x.txt" in report.read_text() and "say hi" in report.read_text()
    assert cli("tasks", "archive", "1") == 0
    capsys.readouterr()
    assert cli("tasks", "list") == 0
    assert "archived" not in capsys.readouterr().out
    assert cli("tasks", "add") == 2
    assert "give a task YAML file or --prompt" in capsys.readouterr().err


def test_threads_do_not_leak(board, sessions):
    engine = RoutedEngine({"a": ok_script("a")})
    board.add(card("a"))
    before = threading.active_count()
    dispatcher(board, sessions, engine).drain()
    time.sleep(0.1)
    assert threading.active_count() <= before + 1


# -- workspaces -----------------------------------------------------------------------------------

def test_template_and_git_workspaces_and_their_diffs(board, sessions, tmp_path):
    template = tmp_path / "tpl"
    template.mkdir()
    (template / "keep.txt").write_text("same\n")
    (template / "a.txt").write_text("old\n")
    repo = tmp_path / "repo"
    repo.mkdir()
    (repo / "b.txt").write_text("old\n")
    git = ["git", "-C", str(repo), "-c", "user.email=t@t", "-c", "user.name=t"]
    subprocess.run([*git, "init", "-q"], check=True)
    subprocess.run([*git, "add", "."], check=True)
    subprocess.run([*git, "commit", "-qm", "base"], check=True)
    engine = RoutedEngine({"a": ok_script("a"), "b": [write("b.txt", "new\n"), write("c.txt", "c"), answer()]})
    a = board.add(card("a", workspace=actions.workspace_spec(str(template))))
    b = board.add(card("b", workspace=actions.workspace_spec(None, str(repo))))
    dispatcher(board, sessions, engine).drain()
    da = board.attempts(a.id)[0].diff
    assert "--- a/a.txt\n+++ b/a.txt\n" in da and "-old\n+a\n\\ No newline at end of file\n" in da
    assert "keep.txt" not in da and (template / "a.txt").read_text() == "old\n"  # the template is untouched
    wb = Path(board.get(b.id).workspace_dir)
    branch = subprocess.run(["git", "-C", str(wb), "branch", "--show-current"], capture_output=True, text=True)
    assert branch.stdout.strip() == f"board/card-{b.id}"
    db = board.attempts(b.id)[0].diff
    assert "-old\n+new\n" in db and "+++ b/c.txt" in db
    assert (repo / "b.txt").read_text() == "old\n"
    with pytest.raises(BoardError, match="is not a git repository"):
        actions.workspace_spec(None, str(template))


def test_git_cards_keep_their_work_as_commits_when_approved_or_archived(board, sessions, tmp_path):
    repo = tmp_path / "repo"
    repo.mkdir()
    (repo / "b.txt").write_text("old\n")
    git = ["git", "-C", str(repo), "-c", "user.email=t@t", "-c", "user.name=t"]
    subprocess.run([*git, "init", "-q"], check=True)
    subprocess.run([*git, "add", "."], check=True)
    subprocess.run([*git, "commit", "-qm", "base"], check=True)

    def show(*args: str) -> str:
        return subprocess.run(["git", "-C", str(repo), *args], capture_output=True, text=True, check=True).stdout

    engine = RoutedEngine({"a": ok_script("a"), "b": [write("b.txt", "new\n"), answer()],
                           "b2": [write("more.txt", "m"), answer()]})
    a = board.add(card("a", workspace=actions.workspace_spec(None, str(repo))))
    b = board.add(card("b", workspace=actions.workspace_spec(None, str(repo))))
    dispatcher(board, sessions, engine).drain()
    # approve: the work becomes a commit on the card's branch
    actions.approve(board, a.id)
    assert show("show", f"board/card-{a.id}:a.txt") == "a"
    assert "approved" in [e["event"] for e in board.events(a.id)]
    # archive with uncommitted work: committed, worktree removed, branch kept
    wb = Path(board.get(b.id).workspace_dir)
    actions.archive(board, b.id)
    assert not wb.exists() and str(wb) not in show("worktree", "list")
    assert show("show", f"board/card-{b.id}:b.txt") == "new\n"
    assert (repo / "b.txt").read_text() == "old\n"  # the repository's own checkout is untouched
    # queued again: its branch is checked out anew, earlier work included, diff against the start
    board.move(b.id, "backlog")
    board.move(b.id, "queued", prompt="[card-b2] add more.txt")
    dispatcher(board, sessions, engine).drain()
    card_b = board.get(b.id)
    assert Path(card_b.workspace_dir, "b.txt").read_text() == "new\n"
    d = board.attempts(b.id)[-1].diff
    assert "-old\n+new\n" in d and "+++ b/more.txt" in d
