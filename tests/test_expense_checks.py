"""The expense-app task's browser checks, validated on a reference app and seeded defects.

A real headless Chromium scores tests/fixtures/expense_ref (it must pass all 13 categories),
copies of it with one small defect each (each must fail exactly its own category and pass the
other 12), an app that crashes before rendering, and an empty workspace (0/13, every category
blocked with a readable reason). One browser serves the whole module. Two defects run by
default (~2 minutes of browser time in all on 2 cores); the other eleven cost ~6 more minutes
and run with MLXTERM_OPTIN=1. The generic half of the checker (assets/tasks/webcheck.py) is
shared with the Kanban task, whose tests (test_kanban_checks.py) also run it through
`mlxterm run --checks-only`.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest

from tests.browser import EXPENSE_REFERENCE_APP, EXPENSE_TASK_YAML, expense_check

check = expense_check()
needs_browser = pytest.mark.skipif(check.browser_missing() is not None,
                                   reason=f"no headless browser: {check.browser_missing()}")

# category -> (file, text in the reference, replacement): one small patch each.
DEFECTS = {
    "add_expense": ("app.js", '  document.getElementById("expense-description").value = "";\n', ""),
    "validation": ("app.js", "if (!(amount > 0)) { showError", "if (isNaN(amount)) { showError"),
    "total": ("app.js", '"total").textContent = money(shown', '"total").textContent = String(shown'),
    "delete_expense": ("app.js", "expenses = expenses.filter((x) => x.id !== e.id); commit();", "commit();"),
    "edit_expense": ("app.js", "    if (amount > 0) e.amount = Math.round(amount * 100) / 100;\n", ""),
    "filter_category": ("app.js", "view.category = ev.target.value;", "view.category = ev.target.value || view.category;"),
    "filtered_total": ("app.js", "const shown = expenses.filter((e) => !view.category || e.category === view.category);",
                       "const shown = expenses;"),
    "sort_date": ("app.js", "b.date.localeCompare(a.date) || b.id - a.id", "a.id - b.id"),
    "sort_amount": ("app.js", "(a, b) => b.amount - a.amount", "(a, b) => String(b.amount).localeCompare(String(a.amount))"),
    "category_totals": ("app.js", "sums[e.category] = (sums[e.category] || 0) + e.amount;", "sums[e.category] = e.amount;"),
    "persistence": ("app.js", "function save() { localStorage.setItem(KEY, JSON.stringify(expenses)); }", "function save() {}"),
    "console_errors": ("app.js", "\nrender();\n", "\nrender();\nsetTimeout(() => { null.render(); });\n"),
    "accessible_names": ("app.js", '"data-testid": "delete-expense", "aria-label": "Delete " + e.description }, "\\u00d7")',
                         '"data-testid": "delete-expense" })'),
}
DEFAULT_DEFECTS = ("validation", "total")


def seeded_copy(dest, category):
    """The reference app with the one defect for ``category``."""
    shutil.copytree(EXPENSE_REFERENCE_APP, dest)
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


def test_every_category_has_a_defect_a_check_and_a_task_check():
    from agents.taskfile import load_task

    names = [n for n, _ in check.CATEGORIES]
    assert len(names) == 13 and set(DEFECTS) == set(names)
    assert set(check.CHECKS) == set(names) - {"console_errors"}
    task = load_task(EXPENSE_TASK_YAML)
    # one task check per category, in order; the first one scores, the others read quality.json
    runs = [c.run for c in task.checks]
    assert [r.split("check.py", 1)[1].split()[-1] for r in runs] == names
    assert "--score" in runs[0] and not any("--score" in r for r in runs[1:])


def test_prompt_plans_the_three_files_and_names_every_hook():
    """The prompt names index.html, app.js and style.css (so the run is planned, one file per
    item) and every id / data-testid the checker uses."""
    import re

    from agents.plan import plan_from_task
    from agents.taskfile import load_task

    prompt = load_task(EXPENSE_TASK_YAML).prompt
    assert [i.path for i in plan_from_task(prompt, lambda p: False).items] == ["index.html", "app.js", "style.css"]
    with open(check.__file__, encoding="utf-8") as f:
        source = f.read()
    hooks = set(re.findall(r"#([a-z][a-z-]+)", source)) | set(re.findall(r"data-testid=([a-z-]+)", source))
    assert {"expense-list", "form-error", "category-total", "sort"} <= hooks
    missing = sorted(h for h in hooks if h not in prompt)
    assert missing == []


@needs_browser
def test_reference_app_passes_all_13(driver, tmp_path):
    report = check.score(EXPENSE_REFERENCE_APP, tmp_path / "quality.json", driver=driver)
    failing = {c["name"]: c["evidence"] for c in report["categories"] if c["status"] != "pass"}
    assert failing == {}
    assert report["kind"] == "expense_quality"
    assert (report["passed"], report["failed"], report["blocked"], report["total"]) == (13, 0, 0, 13)
    assert json.loads((tmp_path / "quality.json").read_text()) == report
    shots = [c["screenshot"] for c in report["categories"] if c["screenshot"]]
    assert len(shots) == 12  # console_errors is watched over the whole session, no page of its own
    assert all(open(s, "rb").read(8) == b"\x89PNG\r\n\x1a\n" for s in shots)


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
    assert (report["passed"], report["blocked"], report["total"]) == (0, 13, 13)
    assert all("no index.html in the workspace" in c["evidence"] for c in report["categories"])


@needs_browser
def test_app_that_crashes_on_load_is_blocked_with_its_console_error(driver, tmp_path):
    """A page without the app (its script throws before building it) scores 0/13: 12 categories
    blocked with the reason, and the thrown error fails "no console errors"."""
    (tmp_path / "app").mkdir()
    (tmp_path / "app" / "index.html").write_text(
        "<!doctype html><title>e</title><script>window.expenses.forEach(String)</script>")
    report = check.score(tmp_path / "app", tmp_path / "quality.json", driver=driver)
    got = statuses(report)
    assert got.pop("console_errors") == "fail"
    assert set(got.values()) == {"blocked"} and report["passed"] == 0
    evidence = {c["name"]: c["evidence"] for c in report["categories"]}
    assert "no #expense-list element" in evidence["total"] and "Uncaught TypeError" in evidence["console_errors"]


def test_check_script_runs_from_its_folder_and_reports_each_category(tmp_path):
    """The script as the task runs it (a bare interpreter, by path, importing ../webcheck.py):
    `--score CATEGORY` on a workspace without index.html writes quality.json and reports that
    category blocked; `CATEGORY` alone reads the verdict (exit 0 only for a pass)."""
    (tmp_path / "ws").mkdir()
    out = tmp_path / "run" / "quality.json"
    run = lambda *args: subprocess.run([sys.executable, "-I", check.__file__, *args, "--out", str(out)],  # noqa: E731
                                       capture_output=True, text=True, timeout=60, cwd=tmp_path / "ws")
    proc = run("--score", "total")
    assert proc.returncode == 1, proc.stderr
    assert "expense quality: 0/13 passed, 0 failed, 13 blocked" in proc.stdout
    assert "blocked: total with two decimals: no index.html in the workspace" in proc.stdout
    report = json.loads(out.read_text())
    report["categories"][2] |= {"status": "pass", "evidence": "ok"}
    out.write_text(json.dumps(report))
    assert run("total").returncode == 0 and run("validation").returncode == 1
    bad = run("sort")
    assert bad.returncode == 2 and "unknown category 'sort'" in bad.stderr


def test_report_shows_an_expense_quality_json(tmp_path):
    from app.report import build_report

    (tmp_path / "ws").mkdir()
    check.score(tmp_path / "ws", tmp_path / "quality.json")
    page = build_report([tmp_path / "quality.json"])
    assert "0 of 13 categories passed" in page and "per-category totals" in page
