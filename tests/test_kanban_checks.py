"""The kanban-app task's browser checks, validated on a reference app and seeded defects.

A real headless Chromium scores tests/fixtures/kanban_ref (it must pass all 18 categories),
copies of it with one small defect each (each must fail exactly its own category and pass the
other 17), and an empty workspace (0/18, every category blocked with a readable reason). One
browser serves the whole module. Six defects run by default (five here, "Enter does not open a
card" through the `--checks-only` CLI test); the other twelve cost ~3 more minutes and run
with MLXTERM_OPTIN=1.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest

from tests.browser import REFERENCE_APP, TASK_YAML, kanban_check

check = kanban_check()
needs_browser = pytest.mark.skipif(check.browser_missing() is not None,
                                   reason=f"no headless browser: {check.browser_missing()}")

# category -> (file, text in the reference, replacement): one small patch each.
DEFECTS = {
    "create_card": ("app.js", "  clearForm();\n  commit();", "  commit();"),
    "edit_card": ("app.js", '    card.description = document.getElementById("edit-description").value.trim();\n', ""),
    "delete_card": ("app.js", "const col = columnOf(card.id); col.cards = col.cards.filter((k) => k.id !== card.id); commit();",
                    "commit();"),
    "columns": ("app.js", "{ col.name = input.value.trim(); commit(); }", "{ commit(); }"),
    "drag_between_columns": ("app.js", "  moveCard(id, colId, beforeId);\n",
                             "  if (columnOf(id).id !== colId) return;\n  moveCard(id, colId, beforeId);\n"),
    "reorder_within_column": ("app.js", "  moveCard(id, colId, beforeId);\n",
                              "  if (columnOf(id).id === colId) return;\n  moveCard(id, colId, beforeId);\n"),
    "keyboard_move": ("app.js", "  e.preventDefault();\n  commit(cardId);", "  e.preventDefault();\n  commit();"),
    "open_with_keyboard": ("app.js", '(e.key === "Enter" || e.key === " ")', '(e.key === " ")'),
    "archive_restore": ("app.js", "state.archive.splice(i, 1)", "state.archive.slice(i, i + 1)"),
    "search": ("app.js", '(card.title + " " + card.description).toLowerCase()', "card.title.toLowerCase()"),
    "filter_label": ("index.html", '      <option value="feature">feature</option>\n', '      <option value="features">feature</option>\n'),
    "filter_assignee": ("index.html", '      <option value="carol">carol</option>\n', '      <option value="Carol">carol</option>\n'),
    "filter_combined": ("app.js", "  if (filters.label && card.label !== filters.label) return false;\n",
                        "  if (filters.label && filters.assignee) return card.label === filters.label || card.assignee === filters.assignee;\n"
                        "  if (filters.label && card.label !== filters.label) return false;\n"),
    "filter_reset": ("app.js", "filters.label = e.target.value;", "filters.label = e.target.value || filters.label;"),
    "persistence": ("app.js", "function save() { localStorage.setItem(KEY, JSON.stringify(state)); }", "function save() {}"),
    "themes": ("style.css", 'html[data-theme="dark"] {', 'html[data-theme="night"] {'),
    "console_errors": ("app.js", "\nrender();\n", "\nrender();\nsetTimeout(() => { null.render(); });\n"),
    "accessible_names": ("app.js", '"data-testid": "delete-card", "aria-label": "Delete card", ', '"data-testid": "delete-card", '),
}
# The CLI test below scores the open_with_keyboard defect end to end, so it is not repeated here.
DEFAULT_DEFECTS = ("filter_reset", "persistence", "drag_between_columns", "console_errors", "accessible_names")


def seeded_copy(dest, category):
    """The reference app with the one defect for ``category``."""
    shutil.copytree(REFERENCE_APP, dest)
    name, old, new = DEFECTS[category]
    text = (dest / name).read_text(encoding="utf-8")
    assert text.count(old) == 1, f"defect patch for {category} no longer matches the reference {name}"
    (dest / name).write_text(text.replace(old, new), encoding="utf-8")
    return dest


@pytest.fixture(scope="module")
def driver(tmp_path_factory):
    d = check.launch_browser(tmp_path_factory.mktemp("chrome-profile"))
    yield d
    d.quit()


def statuses(report):
    return {c["name"]: c["status"] for c in report["categories"]}


def test_every_category_has_a_defect_and_a_check():
    names = [n for n, _ in check.CATEGORIES]
    assert len(names) == 18 and set(DEFECTS) == set(names)
    assert set(check.CHECKS) == set(names) - {"console_errors"}


@needs_browser
def test_reference_app_passes_all_18(driver, tmp_path):
    report = check.score(REFERENCE_APP, tmp_path / "quality.json", driver=driver)
    failing = {c["name"]: c["evidence"] for c in report["categories"] if c["status"] != "pass"}
    assert failing == {}
    assert (report["passed"], report["failed"], report["blocked"], report["total"]) == (18, 0, 0, 18)
    assert json.loads((tmp_path / "quality.json").read_text()) == report
    shots = [c["screenshot"] for c in report["categories"] if c["screenshot"]]
    assert len(shots) == 17  # console_errors is watched over the whole session, no page of its own
    assert all(open(s, "rb").read(8) == b"\x89PNG\r\n\x1a\n" for s in shots)


# the rest of the seeded-defect matrix (~3 more minutes of browser time) is opt-in
OPTIN = pytest.mark.optin


@pytest.mark.parametrize("category", [
    pytest.param(c, marks=() if c in DEFAULT_DEFECTS else OPTIN) for c in DEFECTS])
@needs_browser
def test_seeded_defect_fails_exactly_its_category(driver, tmp_path, category):
    app = seeded_copy(tmp_path / "app", category)
    report = check.score(app, tmp_path / "out" / "quality.json", driver=driver)
    got = statuses(report)
    assert got[category] == "fail", report["categories"]
    assert {n for n, s in got.items() if s != "pass"} == {category}, [
        (c["name"], c["status"], c["evidence"]) for c in report["categories"] if c["status"] != "pass"]
    entry = next(c for c in report["categories"] if c["name"] == category)
    assert entry["evidence"]
    if category != "console_errors":
        assert entry["screenshot"] and (tmp_path / "out" / "screenshots" / f"{category}.png").is_file()


def test_empty_workspace_scores_zero_with_reasons(tmp_path):
    (tmp_path / "ws").mkdir()
    report = check.score(tmp_path / "ws", tmp_path / "quality.json")
    assert (report["passed"], report["blocked"], report["total"]) == (0, 18, 18)
    assert all("no index.html in the workspace" in c["evidence"] for c in report["categories"])


@needs_browser
def test_app_that_crashes_on_load_is_blocked_with_its_console_error(driver, tmp_path):
    """A page without the board (its script throws first) scores 0/18: 17 categories blocked
    with the reason, and the thrown error fails "no console errors"."""
    (tmp_path / "app").mkdir()
    (tmp_path / "app" / "index.html").write_text(
        "<!doctype html><title>k</title><script>window.boardState.columns.map(String)</script>")
    report = check.score(tmp_path / "app", tmp_path / "quality.json", driver=driver)
    got = statuses(report)
    assert got.pop("console_errors") == "fail"
    assert set(got.values()) == {"blocked"} and report["passed"] == 0
    evidence = {c["name"]: c["evidence"] for c in report["categories"]}
    assert "no [data-testid=column]" in evidence["create_card"] and "Uncaught TypeError" in evidence["console_errors"]
    # every category loads the page again: the same error counted each time, quoted once, with
    # the page's line that threw
    assert ", 1 distinct: " in evidence["console_errors"] and evidence["console_errors"].count("Uncaught TypeError") == 1
    assert "[index.html:1: <!doctype html>" in evidence["console_errors"]


@needs_browser
def test_a_console_error_quotes_the_line_of_the_script_it_points_at(driver, tmp_path):
    """Chrome reports a script error as URL LINE:COL: the evidence quotes that line of the
    workspace's file, so a repair round sees the code that threw, not only its line number."""
    app = tmp_path / "app"
    app.mkdir()
    (app / "index.html").write_text('<!doctype html><title>k</title><div id="to-do"></div><script src="app.js"></script>')
    (app / "app.js").write_text("const columns = {toDo: []};\n"
                                "document.getElementById('toDo').appendChild(document.createElement('p'));\n")
    report = check.score(app, tmp_path / "quality.json", driver=driver)
    evidence = {c["name"]: c["evidence"] for c in report["categories"]}["console_errors"]
    assert "app.js 1:" in evidence  # ChromeDriver's lines are 0-based
    assert "[app.js:2: document.getElementById('toDo').appendChild(document.createElement('p'));]" in evidence


@needs_browser
def test_a_field_that_is_no_text_field_is_named_in_the_evidence(driver, tmp_path):
    """A model that writes ``<div id="new-card-title">`` gets told so, not Selenium's
    "InvalidElementStateException: invalid element state" (round 21's 1.5B run, 16 categories)."""
    app = shutil.copytree(REFERENCE_APP, tmp_path / "app")
    html = (app / "index.html").read_text(encoding="utf-8")
    (app / "index.html").write_text(html.replace('<input id="new-card-title">', '<div id="new-card-title"></div>'),
                                    encoding="utf-8")
    report = check.score(app, tmp_path / "quality.json", driver=driver)
    evidence = {c["name"]: c["evidence"] for c in report["categories"]}["create_card"]
    assert "#new-card-title is a <div>, not a text field" in evidence and "InvalidElementState" not in evidence


def test_source_line_stays_inside_the_workspace(tmp_path):
    (tmp_path / "ws").mkdir()
    (tmp_path / "ws" / "app.js").write_text("a\nb()\n")
    (tmp_path / "secret.js").write_text("token = 1\n")
    line = check.webcheck.source_line
    assert line("http://127.0.0.1:8123/app.js 1:0 Uncaught ReferenceError: b is not defined", tmp_path / "ws") == \
        " [app.js:2: b()]"
    assert line("http://127.0.0.1:8123/../secret.js 0:1 x", tmp_path / "ws") == ""
    assert line("http://127.0.0.1:8123/app.js 9:1 x", tmp_path / "ws") == ""  # past the end
    assert line("Uncaught SyntaxError: no location", tmp_path / "ws") == ""


@needs_browser
def test_checks_only_cli_scores_a_workspace(tmp_path):
    """`mlxterm run TASK --workspace DIR --checks-only --json`: no agent, 18 checks (one per
    category; the first drives the browser), result.json and quality.json in the run dir."""
    ws = seeded_copy(tmp_path / "ws", "open_with_keyboard")
    run_dir = tmp_path / "run"
    proc = subprocess.run([sys.executable, "-m", "app", "run", str(TASK_YAML), "--workspace", str(ws),
                           "--checks-only", "--json", "--run-dir", str(run_dir)],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 1, proc.stderr
    result = json.loads(proc.stdout)
    assert result == json.loads((run_dir / "result.json").read_text())
    assert result["status"] == "failed" and result["checks_only"] is True
    assert result["tokens"] is None and result["steps"] is None  # unknown, not zero
    assert (result["checks_passed"], result["checks_failed"]) == (17, 1)
    failed = [c for c in result["checks"] if not c["passed"]]
    assert [c["name"] for c in failed] == ["open a focused card with Enter or Space"]
    assert "Enter on a focused card did not show #card-dialog" in failed[0]["output"]
    assert result["quality"] | {"path": None} == {"passed": 17, "failed": 1, "blocked": 0, "total": 18, "path": None}
    assert (run_dir / "quality.json").is_file() and (run_dir / "screenshots").is_dir()
    assert not (ws / "quality.json").exists()  # evidence goes to the run dir, not the workspace
    assert not (run_dir / "transcript.jsonl").exists()
    # the report of this run: 18 categories, the failed one's screenshot inline, hashes of each
    from app.report import build_report

    page = build_report([run_dir / "result.json"])
    assert page.count('<span class="badge ok">pass</span>') == 17 and page.count("data:image/png;base64,") == 1
    assert "screenshots/open_with_keyboard.png" in page and "task run: kanban-app · checks only" in page


def test_checks_only_needs_a_workspace(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "app", "run", str(TASK_YAML), "--checks-only"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "--checks-only needs --workspace" in proc.stderr


def test_check_script_reports_blocked_without_quality_json(tmp_path):
    proc = subprocess.run([sys.executable, str(check.__file__), "search", "--out", str(tmp_path / "q.json")],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 1 and "blocked: no readable" in proc.stdout


def test_checks_only_works_for_any_task(tmp_path):
    """--checks-only is not kanban-specific: the hello task's check on a hand-made workspace,
    with the check environment (task dir, run dir, python) a task script can rely on."""
    from agents.headless import HeadlessRun
    from agents.taskfile import load_task

    task = tmp_path / "t.yaml"
    task.write_text('prompt: "create hello.txt"\nchecks:\n'
                    '  - name: content\n    run: test "$(cat hello.txt)" = "hello world"\n'
                    '  - name: env\n    run: test -f "$MLXTERM_TASK_DIR/t.yaml" && test -d "$MLXTERM_RUN_DIR" '
                    '&& "$MLXTERM_PYTHON" -c "import agents" && test "$MLXTERM_WORKSPACE" = "$PWD"\n')
    ws = tmp_path / "ws"
    ws.mkdir()
    (ws / "hello.txt").write_text("hello world")
    result = HeadlessRun(load_task(task), workspace=ws, run_dir=tmp_path / "run").checks_only()
    assert result["status"] == "passed", result["checks"]
    assert json.loads((tmp_path / "run" / "result.json").read_text()) == result
    assert "quality" not in result and result["tokens"] is None
    (ws / "hello.txt").write_text("bye")
    result = HeadlessRun(load_task(task), workspace=ws, run_dir=tmp_path / "run").checks_only()
    assert (result["status"], result["checks_passed"], result["checks_failed"]) == ("failed", 1, 1)
