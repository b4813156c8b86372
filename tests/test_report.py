"""`mlxterm report`: one standalone HTML page for task runs, board cards and bench JSONs.

Task runs are real headless runs on the scripted engine (real result.json and transcript),
with a model reply and a written file that carry hostile HTML; board cards use the board's
export shape with nulls; bench inputs have the shapes `mlxterm bench` writes. A headless
Chromium opens the page: no console errors, the "expand all" control works, screenshot saved.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import textwrap

import pytest

from agents.headless import HeadlessRun
from agents.protocol import format_call
from agents.scripted import ScriptedEngine
from agents.taskfile import load_task
from app.report import ReportError, build_report, write_report
from tests.browser import kanban_check

HOSTILE = '<script>alert("pwned")</script><img src=x onerror=alert(1)>'


@pytest.fixture
def task_run(tmp_path):
    """A finished headless run whose reply, tool arguments and check output carry HOSTILE,
    plus the kanban quality.json its checks would write (empty workspace: 0/18 blocked)."""
    task = tmp_path / "task.yaml"
    task.write_text(textwrap.dedent("""
        name: hostile
        prompt: "write page.html"
        limits: {steps: 3, tokens: 400, wall_s: 60}
        checks:
          - name: page exists
            run: test -f page.html && cat page.html
          - name: never passes
            run: "false"
    """))
    engine = ScriptedEngine([format_call("write_file", {"content": HOSTILE, "path": "page.html"}),
                             f"Done. I wrote {HOSTILE}"])
    run_dir = tmp_path / "run"
    result = HeadlessRun(load_task(task), engine=engine, run_dir=run_dir).run()
    assert result["status"] == "failed" and result["checks_passed"] == 1
    kanban_check().score(tmp_path / "run" / "workspace", run_dir / "quality.json")
    return run_dir / "result.json"


BOARD_CARD = {
    "kind": "board_card",
    "card": {"id": "c1", "title": "Kanban <b>app</b>", "description": HOSTILE, "profile": "qwen2.5-coder-0.5b"},
    "attempts": [
        {"number": 1, "session_id": "s1", "status": "failed", "started_at": "2026-12-03T10:00:00Z",
         "finished_at": None, "wall_s": 812.5, "tokens": {"prompt": 9000, "cached": 6000, "completion": 700},
         "requests": 3, "ttft_s_sum": 21.5, "tool_errors": 1,
         "checks": [{"name": "create card", "passed": False, "output": HOSTILE}],
         "workspace": "/w/1", "diff": "+<script>x()</script>",
         "steps": [{"request": 1, "prompt_tokens": 3000, "cached_tokens": 0, "completion_tokens": 300,
                    "cache_source": None, "ttft_s": 12.0, "tool_calls": [{"name": "write_file", "ok": True}]},
                   {"request": 2, "prompt_tokens": 3100, "cached_tokens": 3000, "completion_tokens": None,
                    "cache_source": "ram", "ttft_s": None, "tool_calls": 2}]},
        {"number": 2, "session_id": None, "status": "passed", "started_at": None, "finished_at": None,
         "wall_s": None, "tokens": {"prompt": None, "cached": None, "completion": None}, "requests": None,
         "ttft_s_sum": None, "tool_errors": None, "checks": [], "workspace": None, "diff": None, "steps": []},
    ],
}
BENCH_ENGINE = {
    "bench": "engine", "profile": "smollm2-135m", "model": "m.gguf", "backend": "cpu", "machine": "x86_64 Linux",
    "prompt_tokens": 500, "max_tokens": 128, "rounds": 2,
    "arms": {"engine": {"prefill_tps": 121.5, "decode_tps": 6.82, "ttft_ms": 4128.0, "tokens": [128], "runs": 4},
             "stock_same": {"prefill_tps": 124.5, "decode_tps": 6.74, "ttft_ms": 4016.0, "tokens": [128], "runs": 4}},
    "ratios": {"decode_vs_stock_same": 1.01, "prefill_vs_stock_same": 0.98},
    "summary": "| arm | ... |",
}
BENCH_RESUME = {"bench": "resume", "profile": "smollm2-135m", "summary": "t", "rows": [
    {"context_tokens": 1024, "cold_ttft_ms": 5980.0, "ram_ttft_ms": 298.0, "ssd_ttft_ms": 483.0,
     "ram_speedup": 20.1, "ssd_speedup": 12.4, "restored_tokens": 1024, "runs": {"cold": [5980.0]}}]}
BENCH_SPEECH = {"model": "whisper-tiny.en", "beam_size": 1, "load_s": 0.65, "machine": "x86_64", "load_avg_1m": 3.6,
                "clips": [{"clip": "short", "audio_s": 2.87, "windows": 1, "total_ms": 4503.4, "real_time_factor": 1.57,
                           "wer": 0.0, "text": "hello", "stream": {"finish_latency_median_s": 0.01}}],
                "stream": {"repeats": 3}, "summary": "s"}
BENCH_SPEC = {"bench": "spec", "profile": "p", "draft": "d", "acceptance_rate": 0.61, "speedup_vs_plain": 1.42,
              "tokens_per_step": [1.0, 2.5, 3.25, 2.0], "rows": [{"k": 2, "tps": 9.1}, {"k": 4, "tps": 10.4}],
              "note": "<script>bad()</script>",
              "scenarios": {"copy_edit": {"plain_tps": 1.5, "spec_tps": 4.15, "speedup": 2.77, "runs_tps": [4.0, 4.3]},
                            "free_form": {"plain_tps": 2.0, "spec_tps": None, "speedup": None, "runs_tps": [2.1, 2.0]}}}


def scripts_in(page: str) -> list[str]:
    return re.findall(r"<script\b", page, flags=re.I)


def test_task_run_renders_escaped_with_transcript_and_quality(task_run):
    page = build_report([task_run])
    assert scripts_in(page) == ["<script"]  # only the report's own script
    assert "<img" not in page
    assert "&lt;script&gt;alert(&quot;pwned&quot;)&lt;/script&gt;" in page  # reply, arguments, check output
    assert "task run: hostile" in page and "per-request records (4)" in page  # two runs (a repair round), 2 steps each
    assert "write_file" in page and "tool call(s)" in page
    # quality.json beside result.json: 18 blocked categories with their reasons
    assert page.count("no index.html in the workspace") == 18
    assert "0 of 18 categories passed" in page
    # the run failed its checks: no throughput figure
    assert "not counted (failed)" in page
    # evidence hashes of the transcript and quality.json
    for name in ("transcript.jsonl", "quality.json", "result.json"):
        assert name in page
    assert re.search(r"[0-9a-f]{64}", page)


def test_board_card_unknowns_and_plots(tmp_path):
    page = build_report([BOARD_CARD])
    assert scripts_in(page) == ["<script"]
    assert "Kanban &lt;b&gt;app&lt;/b&gt;" in page and "+&lt;script&gt;x()&lt;/script&gt;" in page
    assert "attempt 1" in page and "attempt 2" in page
    # attempt 2 recorded nothing: unknown, never zero
    overview = page.split('id="overview"')[1].split("</table>")[0]
    row2 = overview.split("attempt 2")[1].split("</tr>")[0]
    assert row2.count('class="unknown"') >= 6 and ">0<" not in row2 and "0 s" not in row2
    row1 = overview.split("attempt 1")[1].split("</tr>")[0]
    assert "700" in row1 and "812.5 s" in row1 and "67%" in row1 and "21.50 s" in row1
    assert "not counted (failed)" in row1  # a failed attempt has no throughput
    assert "<svg" in page and "TTFT per request" in page and "cache hits per request" in page
    assert "unknown</text>" in page  # an unknown bar is drawn as unknown


def test_unchecked_unchanged_and_repaired_runs_say_so(tmp_path):
    """A run without checks is "unchecked" (amber, never passed); an unchanged workspace and a
    pass after repair rounds are flagged; an old result.json without these fields is unknown."""
    task = tmp_path / "t.yaml"
    task.write_text('prompt: "say hi"\n')
    unchecked = HeadlessRun(load_task(task), engine=ScriptedEngine(["hi"]), run_dir=tmp_path / "r1").run()
    assert unchecked["status"] == "unchecked" and unchecked["workspace_changed"] is False
    task2 = tmp_path / "t2.yaml"
    task2.write_text('prompt: "create a.txt"\nchecks:\n  - {name: a, run: test "$(cat a.txt)" = a}\n')
    replies = [format_call("write_file", {"path": "a.txt", "content": "b"}), "Done.",
               format_call("write_file", {"path": "a.txt", "content": "a"}), "Fixed."]
    repaired = HeadlessRun(load_task(task2), engine=ScriptedEngine(replies), run_dir=tmp_path / "r2").run()
    assert repaired["status"] == "passed" and repaired["first_try"]["status"] == "failed"
    page = build_report([tmp_path / "r1" / "result.json", tmp_path / "r2" / "result.json"])
    overview = page.split('id="overview"')[1].split("</table>")[0]
    row1, row2 = overview.split("<tr>")[2:4]
    assert 'class="badge warn">unchecked<' in row1 and "no checks ran" in row1 and "workspace unchanged" in row1
    assert 'class="badge ok">passed<' in row2 and "first try failed, 1 repair round" in row2
    assert "workspace unchanged" not in row2
    assert "round 1" in page and "no: no file in the workspace changed" in page
    # the repair round's steps are their own requests (3 and 4), each write with its diff size
    steps = re.findall(r"<summary>request (\d+)( \(repair round 1\))? ·", page)
    assert [n for n, r in steps if r] == ["3", "4"] and [n for n, r in steps if not r] == ["1", "1", "2"]
    assert page.count('<span class="path">a.txt</span> +1 −0 lines') == 1  # created: one line
    assert page.count('<span class="path">a.txt</span> +1 −1 lines') == 1  # the fix: one line changed
    old = {k: v for k, v in repaired.items() if k not in ("first_try", "repair_rounds", "workspace_changed",
                                                          "corrective_turns")}
    page = build_report([old])
    assert "first try" not in page.split('id="overview"')[1].split("</table>")[0]


def test_bench_kinds_known_and_generic():
    page = build_report([BENCH_ENGINE, BENCH_RESUME, BENCH_SPEECH, BENCH_SPEC])
    assert scripts_in(page) == ["<script"]
    for text in ("bench engine", "decode tok/s per arm", "decode_vs_stock_same", "stock_same",
                 "bench resume", "speed-up over cold prefill", "20.1",
                 "bench speech", "real-time factor", "whisper-tiny.en",
                 "bench spec", "a benchmark kind this report has no special view for", "acceptance_rate",
                 "tokens_per_step", "speedup_vs_plain", "&lt;script&gt;bad()&lt;/script&gt;"):
        assert text.lower() in page.lower(), text
    assert page.count("<svg") >= 8
    # a mapping of named rows is one table, with bars for its ratio and tok/s columns
    assert "<td class='n'>copy_edit</td>" in page and "scenarios: speedup" in page and "scenarios: spec_tps" in page
    table = page.split("<td class='n'>free_form</td>")[1].split("</tr>")[0]
    assert table.count('class="unknown"') == 2  # spec_tps and speedup of free_form are unknown
    assert "scenarios: nested fields and series per row" in page


def test_bench_engine_standard_set_shows_the_cpu_and_each_model():
    one = dict(BENCH_ENGINE, profile="qwen2.5-coder-1.5b")
    page = build_report([{"bench": "engine", "cpu": {"model": "AMD EPYC 7B13", "family": "avx2", "kernel_isa": "avx2",
                                                     "cores": 2}, "runs": [BENCH_ENGINE, one], "summary": "x"}])
    assert "AMD EPYC 7B13" in page and "qwen2.5-coder-1.5b" in page and "smollm2-135m" in page
    single = build_report([BENCH_ENGINE]).lower().count("decode tok/s per arm")
    assert single and page.lower().count("decode tok/s per arm") == 2 * single


def test_cli_writes_one_standalone_file_and_names_bad_inputs(tmp_path, task_run):
    bench = tmp_path / "engine.json"
    bench.write_text(json.dumps(BENCH_ENGINE))
    card = tmp_path / "card.json"
    card.write_text(json.dumps(BOARD_CARD))
    out = tmp_path / "report.html"
    proc = subprocess.run([sys.executable, "-m", "app", "report", str(task_run), str(card), str(bench), "--out", str(out)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    page = out.read_text()
    assert page.startswith("<!doctype html>") and "task run: hostile" in page and "board card" in page
    assert not re.search(r"""(src|href)=["']?(https?:)?//""", page)  # nothing fetched from anywhere
    bad = tmp_path / "bad.json"
    bad.write_text('{"bench": ')
    proc = subprocess.run([sys.executable, "-m", "app", "report", str(bad), "--out", str(out)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and f"{bad}:1: not valid JSON" in proc.stderr
    with pytest.raises(ReportError, match="file not found"):
        write_report([tmp_path / "missing.json"], out)


@pytest.mark.skipif(kanban_check().browser_missing() is not None, reason="no headless browser")
def test_report_loads_in_a_browser_without_console_errors(tmp_path, task_run):
    out = write_report([task_run, BOARD_CARD, BENCH_ENGINE, BENCH_RESUME, BENCH_SPEECH, BENCH_SPEC],
                       tmp_path / "report.html")
    driver = kanban_check().launch_browser(tmp_path / "profile")
    try:
        driver.set_window_size(1400, 1000)
        driver.get(out.as_uri())
        assert driver.execute_script("return document.querySelectorAll('section').length") >= 7
        closed = driver.execute_script("return document.querySelectorAll('details:not([open])').length")
        assert closed > 5
        driver.find_element("css selector", "button[data-expand=open]").click()
        assert driver.execute_script("return document.querySelectorAll('details:not([open])').length") == 0
        assert driver.execute_script("return window.__pwned === undefined && !document.querySelector('img[src=x]')")
        errors = [e for e in driver.get_log("browser") if e["level"] in ("SEVERE", "WARNING")]
        assert errors == []
        shot = tmp_path / "report.png"
        driver.save_screenshot(str(shot))
        assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    finally:
        driver.quit()
