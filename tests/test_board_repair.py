"""Board attempts with repair rounds and honest status, on the scripted engine.

Cards added with ``mlxterm tasks add FILE.yaml`` whose checks are scripts next to the YAML
(``python3 "$MLXTERM_TASK_DIR/check.py"`` or ``python3 /abs/path/check.py``): the task folder
is readable to the checks (inside the sandbox where there is one), the card's evidence folder
is writable as ``$MLXTERM_RUN_DIR``; failing output goes back to the same session for the
card's repair rounds; a card without checks ends ``unchecked`` (review, never passed or done);
an attempt that changed nothing is flagged in the attempt, the review tab and the report.
"""

from __future__ import annotations

import json
import sqlite3
from pathlib import Path

from engine.sessions import SessionStore

import pytest

from agents.board import actions
from agents.board import workspace as ws_mod
from agents.board.dispatcher import Dispatcher
from agents.board.model import Card, CheckSpec
from agents.board.store import BoardStore, default_path
from agents.checks import agent_sandbox, run_check
from agents.scripted import scripted_profile
from agents.taskfile import Check
from tests.board_engine import RoutedEngine, answer, write
from tests.ci_strict import sandbox_skip_reason
from tools import sandbox as sb

STATUS = sb.probe()
# a missing bwrap is an install step (CI strict fails the skip); a container that cannot make
# user namespaces is a fact about the machine (tests/ci_strict.py ENVIRONMENT_FACTS)
needs_sandbox = pytest.mark.skipif(
    not STATUS.available,
    reason=sandbox_skip_reason(STATUS),
)

CHECK_PY = """\
import os, pathlib, sys
want = {want!r}
got = pathlib.Path({name!r}).read_text() if pathlib.Path({name!r}).exists() else None
assert os.environ["MLXTERM_WORKSPACE"] == os.getcwd(), (os.environ["MLXTERM_WORKSPACE"], os.getcwd())
assert os.path.exists(os.environ["MLXTERM_PYTHON"])
pathlib.Path(os.environ["MLXTERM_RUN_DIR"], {name!r} + ".seen").write_text(str(got))  # evidence
if got != want:
    print(f"{name}: expected {{want!r}}, got {{got!r}}")
    sys.exit(1)
print("{name} ok")
"""


def cli(*argv):
    from app.cli import main

    return main(list(argv))


def task_folder(root: Path, key: str, *, run: str | None, extra: str = "") -> Path:
    """tasks/<key>/<key>.yaml with a check.py beside it (``run`` names how the check calls it;
    None: a task without checks)."""
    folder = root / "tasks" / key
    folder.mkdir(parents=True)
    (folder / "check.py").write_text(CHECK_PY.format(want=key, name=f"{key}.txt"))
    checks = f"checks:\n  - name: script\n    run: {json.dumps(run.format(dir=folder))}\n" if run else ""
    (folder / f"{key}.yaml").write_text(f"name: card {key}\nprompt: \"[card-{key}] create {key}.txt containing "
                                        f"{key}\"\nlimits: {{steps: 4}}\n{extra}{checks}")
    return folder / f"{key}.yaml"


def test_yaml_cards_with_check_scripts_repair_and_unchecked(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    task_folder(tmp_path, "a", run='python3 "$MLXTERM_TASK_DIR/check.py"')
    task_folder(tmp_path, "b", run="python3 {dir}/check.py", extra="test_command: python3 check.py\n")
    task_folder(tmp_path, "c", run='"$MLXTERM_PYTHON" "$MLXTERM_TASK_DIR/check.py"')
    task_folder(tmp_path, "d", run=None)
    for key in "abcd":  # relative paths, as typed: the card keeps the absolute task folder
        extra = ["--auto-accept"] if key == "d" else []
        assert cli("tasks", "add", f"tasks/{key}/{key}.yaml", *extra) == 0
    board = BoardStore(default_path())
    cards = {c.title[-1]: c for c in board.cards()}
    assert cards["a"].task_dir == str(tmp_path / "tasks" / "a") and cards["b"].test_command == "python3 check.py"
    monkeypatch.chdir("/")  # the dispatcher runs from anywhere

    engine = RoutedEngine({
        "a": [write("a.txt", "a", 0.002), answer("Wrote a.txt.")],
        # b's first answer fails its check; the check output goes back to the same session
        "b": [write("b.txt", "B", 0.002), answer("Wrote b.txt."), write("b.txt", "b"), answer("Fixed b.txt.")],
        "c": [write("c.txt", "c", 0.002), answer("Wrote c.txt.")],
        "d": [answer("Nothing to write; the answer is d.")] * 2,  # the second after the corrective turn
    })
    sessions = SessionStore(tmp_path / "sessions.sqlite3")
    peak, seen = [], []

    def on_event(run, ev) -> None:
        peak.append(len(d.running))
        seen.append((run.card.title[-1], type(ev).__name__, run.round))

    d = Dispatcher(board, sessions, lambda p: engine, default_profile="scripted", concurrency=2,
                   on_event=on_event)
    d.drain()
    assert max(peak) == 2
    assert ("d", "Corrective", 0) in seen  # the live status gets the corrective turn...
    assert ("b", "StepStart", 1) in seen and ("a", "StepStart", 1) not in seen  # ...and the repair round
    got = {k: board.get(c.id) for k, c in cards.items()}
    assert {k: c.state for k, c in got.items()} == {"a": "review", "b": "review", "c": "review", "d": "review"}

    for key in "abc":
        (att,) = board.attempts(got[key].id)  # one attempt each: repair happens inside it
        assert att.status == "passed", (key, att.checks)
        assert att.checks[0]["passed"] and f"{key}.txt ok" in att.checks[0]["output"]
        assert att.checks[0]["sandboxed"] is STATUS.available
        assert att.workspace_changed is True and att.changed_files == [f"{key}.txt"]
        evidence = Path(att.evidence_dir)
        assert evidence == ws_mod.evidence_dir(board, got[key].id)
        assert (evidence / f"{key}.txt.seen").read_text() == key
    a, c = board.attempts(got["a"].id)[0], board.attempts(got["c"].id)[0]
    for att in (a, c):
        assert att.first_try == {"status": "passed", "checks_passed": 1, "checks_failed": 0}
        assert att.repair_rounds == [] and att.notes() == []

    # b: failed on its first answer, repaired in round 1 of the same attempt and session
    (b,) = board.attempts(got["b"].id)
    assert b.first_try == {"status": "failed", "checks_passed": 0, "checks_failed": 1}
    assert [(r["round"], r["status"]) for r in b.repair_rounds] == [(1, "passed")]
    assert "Run the tests with: python3 check.py" in b.prompt
    users = [m.content for m in sessions.messages(b.session_id) if m.role == "user"]
    assert users[-1].startswith("The checks failed (1 of 1; repair round 1 of 3)")
    assert "b.txt: expected 'b', got 'B'" in users[-1] and "`python3 check.py`" in users[-1]
    assert [s["round"] for s in b.steps] == [0, 0, 1, 1]
    assert "first try failed (0/1 checks), 1 repair round" in got["b"].reason
    assert (Path(got["b"].workspace_dir) / "b.txt").read_text() == "b"

    # d: no checks -> unchecked (review even with auto_accept), nothing changed -> flagged
    (dd,) = board.attempts(got["d"].id)
    assert dd.status == "unchecked" and dd.checks == [] and dd.first_try["status"] == "unchecked"
    assert dd.workspace_changed is False and dd.changed_files == []
    assert dd.corrective_turns == 1  # "create d.txt" with nothing changed was sent back once
    assert "unchecked" in got["d"].reason and "no file in the workspace changed" in got["d"].reason
    events = [e["event"] for e in board.events(got["d"].id)]
    assert "corrective" in events

    # the review tab, the board card and the report say so
    from app.report import write_report
    from app.tui.screens.board import checks_text
    from app.tui.widgets.board_card import card_status

    review = checks_text(got["d"], dd)
    assert "unchecked: this card has no checks" in review and "no file in the workspace changed" in review
    assert card_status(got["d"], dd, None) == "attempt 1 unchecked · no changes"
    assert card_status(got["b"], b, None) == "attempt 1 passed ✓ 1/1 · 1 repair round"
    review_b = checks_text(got["b"], b)
    assert "first try: failed (0 passed, 1 failed)" in review_b and "repair round 1: passed" in review_b
    out = tmp_path / "report.html"
    write_report([actions.export_card(board, got[k].id) for k in "bd"], out)
    html = out.read_text()
    assert "no checks ran" in html and "workspace unchanged" in html and "first try" in html
    assert 'class="badge warn">unchecked<' in html
    assert cli("tasks", "show", str(got["d"].id)) == 0
    board.close()


@needs_sandbox
def test_yaml_card_checks_read_their_task_folder_inside_the_sandbox(tmp_path):
    """The bug this fixes: a check script next to the YAML is outside the workspace, so the
    sandbox hides it unless the card's task folder is made readable."""
    yaml = task_folder(tmp_path, "a", run="python3 {dir}/check.py")
    ws = tmp_path / "ws"
    ws.mkdir()
    (ws / "a.txt").write_text("a")
    hidden = run_check(Check("script", f"python3 {yaml.parent}/check.py", 30), ws, agent_sandbox())
    assert not hidden["passed"] and "can't open file" in hidden["output"]  # the sandbox confines

    board = BoardStore(tmp_path / "board.sqlite3")
    from agents.taskfile import load_task

    card = board.add(actions.card_from_task(load_task(yaml), state="queued"))
    engine = RoutedEngine({"a": [write("a.txt", "a"), answer()]})
    Dispatcher(board, SessionStore(tmp_path / "s.sqlite3"), lambda p: engine, default_profile="scripted").drain()
    (att,) = board.attempts(card.id)
    assert att.status == "passed", att.checks
    assert att.checks[0]["sandboxed"] is True and "a.txt ok" in att.checks[0]["output"]
    board.close()


@needs_sandbox
def test_a_yaml_cards_sandbox_limits_cap_its_checks(tmp_path):
    """``sandbox: {workspace_bytes: ...}`` in the task YAML goes with the card (stored) to the
    sandbox its attempt's checks run in: a check that writes past the cap is stopped at it."""
    cap = 24 << 20
    yaml = task_folder(tmp_path, "a", run="head -c 30000000 /dev/zero > big; exit 0",
                       extra=f"sandbox: {{workspace_bytes: {cap}}}\n")
    board = BoardStore(tmp_path / "board.sqlite3")
    from agents.taskfile import load_task

    card = board.add(actions.card_from_task(load_task(yaml), state="queued"))
    assert board.get(card.id).sandbox == {"workspace_bytes": cap}
    engine = RoutedEngine({"a": [write("a.txt", "a"), answer()]})
    Dispatcher(board, SessionStore(tmp_path / "s.sqlite3"), lambda p: engine, default_profile="scripted").drain()
    att = board.attempts(card.id)[0]
    check = att.checks[0]
    # stopped at the cap (the kernel's file-size limit, or the cap's own watch), not at the
    # defaults' 1 GiB per file / 8 GiB per workspace
    assert check["sandboxed"] and ("File size limit exceeded" in check["output"] or "size cap" in check["output"])
    assert (Path(board.get(card.id).workspace_dir) / "big").stat().st_size <= cap
    board.close()


def test_a_cards_repair_round_drafts_candidates_and_keeps_the_one_that_passes(tmp_path):
    """With the profile's ``agent.candidates``, a card's repair round drafts that many replies
    at once; each is checked on a scratch copy and the passing one is adopted in the card's
    workspace (as ``mlxterm run`` does)."""
    board = BoardStore(tmp_path / "board.sqlite3")
    card = board.add(Card(id=0, title="a", prompt="[card-a] create a.txt containing a", state="queued",
                          checks=[CheckSpec("content", 'test "$(cat a.txt)" = a')], repair_rounds=1))
    engine = RoutedEngine({"a": [write("a.txt", "b"), answer(), write("a.txt", "c"), write("a.txt", "a")]},
                          profile=scripted_profile(candidates=2))
    Dispatcher(board, SessionStore(tmp_path / "s.sqlite3"), lambda p: engine, default_profile="scripted").drain()
    (att,) = board.attempts(card.id)
    assert att.status == "passed", att.checks
    assert (Path(board.get(card.id).workspace_dir) / "a.txt").read_text() == "a"
    drafts = [r for r in engine.requests if r.session_id is None and "[card-a]" in engine.tokenizer.decode(r.prompt_ids)]
    assert len(drafts) == 2 and len({r.params.seed for r in drafts}) == 2
    board.close()


def test_prompt_cards_and_old_boards(tmp_path):
    """A card without a YAML gets no $MLXTERM_TASK_DIR but an evidence folder; rows written
    before these fields existed still load (unknown stays None), and an old YAML card finds
    its task folder from task_file."""
    board = BoardStore(tmp_path / "board.sqlite3")
    card = board.add(Card(id=0, title="p", prompt="[card-p] create p.txt", state="queued", limits={"steps": 3},
                          checks=[CheckSpec("env", 'test -z "${MLXTERM_TASK_DIR+x}" && test -d "$MLXTERM_RUN_DIR" '
                                                   '&& touch "$MLXTERM_RUN_DIR/ok" && test -f p.txt')]))
    engine = RoutedEngine({"p": [write("p.txt", "p"), answer()]})
    Dispatcher(board, SessionStore(tmp_path / "s.sqlite3"), lambda p: engine, default_profile="scripted").drain()
    (att,) = board.attempts(card.id)
    assert att.status == "passed", att.checks
    assert (Path(att.evidence_dir) / "ok").exists()

    con = sqlite3.connect(board.path)
    old_card = {"id": 0, "title": "old", "prompt": "x", "state": "review", "task_file": str(tmp_path / "t" / "t.yaml")}
    cur = con.execute("INSERT INTO cards(state, priority, created, updated, data) VALUES ('review', 0, 0, 0, ?)",
                      (json.dumps(old_card),))
    cid = cur.lastrowid
    con.execute("UPDATE cards SET data = ? WHERE id = ?", (json.dumps({**old_card, "id": cid}), cid))
    old_att = {"card_id": cid, "number": 1, "kind": "first", "prompt": "x", "status": "passed",
               "checks": [{"name": "c", "run": "true", "passed": True, "exit_code": 0}]}
    con.execute("INSERT INTO attempts(card_id, number, status, data) VALUES (?, 1, 'passed', ?)",
                (cid, json.dumps(old_att)))
    con.commit()
    con.close()
    old = board.get(cid)
    assert old.task_dir is None and old.repair_rounds is None and old.test_command is None
    assert ws_mod.task_dir(old) == str(tmp_path / "t")
    (a,) = board.attempts(cid)
    assert (a.first_try, a.repair_rounds, a.corrective_turns, a.workspace_changed) == (None, [], None, None)
    assert a.notes() == []
    exported = actions.export_card(board, cid)
    assert exported["attempts"][0]["workspace_changed"] is None
    board.close()


def test_cli_repair_rounds_option(tmp_path, capsys):
    yaml = task_folder(tmp_path, "a", run="python3 {dir}/check.py", extra="repair_rounds: 1\n")
    assert cli("tasks", "add", str(yaml), "--json") == 0
    assert json.loads(capsys.readouterr().out)["repair_rounds"] == 1
    assert cli("tasks", "add", "--prompt", "hi", "--repair-rounds", "0", "--json") == 0
    assert json.loads(capsys.readouterr().out)["repair_rounds"] == 0
    assert cli("tasks", "add", "--prompt", "hi", "--repair-rounds", "-1") == 2
    assert "--repair-rounds must be >= 0" in capsys.readouterr().err
