"""Repair rounds and parallel candidates on a scripted model, through headless runs and real checks."""

import json

from engine.sessions import SessionStore

from agents.headless import HeadlessRun
from agents.repair import check_status, repair_message, trim_output
from agents.scripted import Reply, ScriptedEngine, scripted_profile
from agents.taskfile import load_task
from agents.transcript import read_transcript

TASK = """\
prompt: "Make double(x) in solver.py return twice x."
workspace_template: tmpl
test_command: python3 -c "import solver; assert solver.double(2) == 4, solver.double(2)"
checks:
  - name: tests
    run: python3 -c "import solver; assert solver.double(2) == 4, solver.double(2)"
"""


def edit(body):
    return f"solver.py\n```python\ndef double(x):\n    return {body}\n```"


def rest(body):
    """A reply after the forced opening of a test-after-write step (``solver.py`` + fence)."""
    return f"def double(x):\n    return {body}\n```"


def make_task(tmp_path, extra=""):
    (tmp_path / "tmpl").mkdir()
    (tmp_path / "tmpl" / "solver.py").write_text("def double(x):\n    pass\n")
    (tmp_path / "task.yaml").write_text(TASK + extra)
    return load_task(tmp_path / "task.yaml")


def run(tmp_path, replies, extra="", candidates=None, store=None, task=None, **agent):
    engine = ScriptedEngine(replies, profile=scripted_profile(edit_format="whole", **agent))
    task = task or make_task(tmp_path, extra)
    result = HeadlessRun(task, engine=engine, run_dir=tmp_path / "run", candidates=candidates, store=store).run()
    return result, engine


UNITTEST_TASK = """\
prompt: "Make double(x) in solver.py return twice x."
workspace_template: tmpl
test_command: python3 -m unittest -q test_solver
checks:
  - name: tests
    run: python3 -m unittest -q test_solver
"""
UNITTESTS = """\
import unittest
import solver


class DoubleTest(unittest.TestCase):
    def test_two(self):
        self.assertEqual(solver.double(2), 4)

    def test_three(self):
        self.assertEqual(solver.double(3), 6)
"""


def test_failing_checks_go_back_to_the_same_session_until_they_pass(tmp_path):
    result, engine = run(tmp_path, [edit("x + 5"), "Done.", edit("x + x + 1"), "Fixed.", edit("x * 2"), "Fixed now."])
    assert result["status"] == "passed" and result["first_try"]["status"] == "failed"
    assert [r["status"] for r in result["repair_rounds"]] == ["failed", "passed"]
    assert (tmp_path / "run" / "workspace" / "solver.py").read_text().endswith("return x * 2\n")
    # the failure output reached the model in the same session (the prompt extends the last one)
    third = engine.requests[2]
    assert third.session_id == engine.requests[0].session_id
    text = engine.tokenizer.decode(third.prompt_ids)
    assert "The checks failed" in text and "AssertionError: 7" in text and "repair round 1 of 3" in text
    records = read_transcript(tmp_path / "run" / "transcript.jsonl")
    assert [r["round"] for r in records if r["type"] == "repair"] == [1, 2]


def test_rounds_are_bounded_and_first_try_is_kept(tmp_path):
    replies = [edit("x + 5"), "Done.", edit("x + 6"), "Done.", edit("x + 7"), "Done."]
    result, _ = run(tmp_path, replies, extra="repair_rounds: 2\n")
    assert result["status"] == "failed" and result["first_try"] == {"status": "failed", "checks_passed": 0,
                                                                   "checks_failed": 1}
    assert len(result["repair_rounds"]) == 2 and result["steps"] == 6


def test_no_repair_without_rounds_and_passing_first_try(tmp_path):
    result, engine = run(tmp_path, [edit("x * 2"), "Done."])
    assert result["status"] == "passed" and result["first_try"]["status"] == "passed"
    assert result["repair_rounds"] == [] and len(engine.requests) == 2 and result["workspace_changed"] is True


def test_candidates_keep_the_draft_that_passes(tmp_path):
    # first try fails; then 3 drafts decoded together: only the second passes and is adopted
    replies = [edit("x + 5"), "Done.", edit("x + 3"), edit("2 * x"), edit("x - 1")]
    result, engine = run(tmp_path, replies, candidates=3)
    assert result["status"] == "passed" and result["first_try"]["status"] == "failed"
    (rnd,) = result["repair_rounds"]
    assert rnd["stop_reason"] == "candidate" and rnd["candidates"]["chosen"] == 1
    assert [d["passed"] for d in rnd["candidates"]["drafts"]] == [False, True, False]
    drafts = engine.requests[2:]
    assert len(drafts) == 3 and len({tuple(r.prompt_ids) for r in drafts}) == 1  # one shared prompt
    assert len({r.params.seed for r in drafts}) == 3
    ws = tmp_path / "run" / "workspace"
    assert ws.joinpath("solver.py").read_text().endswith("return 2 * x\n")
    assert sorted(p.name for p in ws.iterdir() if p.name != "__pycache__") == ["solver.py"]  # scratch stays elsewhere
    records = read_transcript(tmp_path / "run" / "transcript.jsonl")
    assert any(r["type"] == "candidates" and r["chosen"] == 1 for r in records)


def test_candidates_that_all_fail_fall_back_to_an_ordinary_round(tmp_path):
    replies = [edit("x + 5"), "Done.", edit("x + 3"), edit("x + 4"), edit("x * 2"), "Fixed."]
    result, engine = run(tmp_path, replies, candidates=2, repair_rounds=1)
    assert result["status"] == "passed"
    assert result["candidate_rounds"][0]["chosen"] is None and result["repair_rounds"][0]["stop_reason"] == "answered"


def test_status_words_and_repair_message():
    assert check_status([]) == "unchecked"
    assert check_status([{"passed": True}]) == "passed"
    assert check_status([{"passed": True}, {"passed": False}]) == "failed"
    long = "Traceback first\n" + "x" * 9000 + "\nFAILED (failures=3)"
    trimmed = trim_output(f"/ws/a/solver.py: {long}", "/ws/a", limit=1000)
    assert trimmed.startswith("solver.py: Traceback first") and trimmed.endswith("FAILED (failures=3)")
    assert "characters cut" in trimmed and len(trimmed) < 1100
    msg = repair_message([{"name": "tests", "passed": False, "exit_code": 1, "output": "boom"}],
                         "python3 -m unittest t", None, 1, 3)
    assert "`python3 -m unittest t` (exit code 1)" in msg and "boom" in msg
    assert json.dumps(msg)


def test_repair_message_quotes_a_shared_failure_once_and_names_the_files_it_points_at(tmp_path):
    """Checks failing the same way are quoted once; the turn names the workspace files the
    output points at (``file:line``, and the file declaring an ``#id`` it names), those of most
    failing checks first, never a protected one."""
    (tmp_path / "index.html").write_text('<form><div id="new-card-title"></div></form>')
    (tmp_path / "app.js").write_text("render();\n")
    (tmp_path / "app_test.js").write_text("check();\n")
    (tmp_path / "style.css").write_text("#new-card-title { color: red }\n")
    field = "#new-card-title is a <div>, not a text field"
    checks = [{"name": n, "passed": False, "exit_code": 1, "output": f"fail: {n}: {field}\nscreenshot: /run/{n}.png"}
              for n in ("create card", "edit card", "search")]
    checks += [{"name": "no console errors", "passed": False, "exit_code": 1,
                "output": "fail: no console errors: ReferenceError [app.js:29: x()] at app_test.js:3"},
               {"name": "themes", "passed": True, "exit_code": 0, "output": ""}]
    msg = repair_message(checks, None, tmp_path, 1, 3, protected=lambda p: p.endswith("_test.js"))
    assert msg.count("Output of") == 2 and msg.count(field) == 1
    assert "`edit card`, `search` failed the same way" in msg
    # most failing checks first; not the test, not the stylesheet
    assert "The failures point at index.html, app.js." in msg


def test_repair_rounds_sample_at_the_repair_temperature(tmp_path):
    result, engine = run(tmp_path, [edit("x + 5"), "Done.", edit("x * 2"), "Fixed."], repair_temperature=0.9)
    assert result["status"] == "passed"
    assert [r.params.temperature for r in engine.requests] == [0.0, 0.0, 0.9, 0.9]


def test_a_round_that_changes_nothing_ends_the_repairs(tmp_path):
    replies = [edit("x + 5"), "Done.", edit("x + 5"), "Done.", "Still done.", "unreached", "unreached"]
    result, engine = run(tmp_path, replies)
    assert result["status"] == "failed" and len(result["repair_rounds"]) == 1
    assert len(engine.requests) == 5  # first try 2 steps; round 1: same file, answer, the corrective turn


def test_test_after_write_ends_the_turn_at_the_write_and_asks_for_the_file_again(tmp_path):
    # no "Done." replies: each write ends the run and the checks run at once
    result, engine = run(tmp_path, [rest("x + 5"), rest("x * 2")], test_after_write=True)
    assert result["status"] == "passed" and result["first_try"]["status"] == "failed"
    assert result["stop_reason"] == "wrote" and len(engine.requests) == 2
    assert result["repair_rounds"][0]["stop_reason"] == "wrote"
    text = engine.tokenizer.decode(engine.requests[1].prompt_ids)
    assert "write the whole of solver.py again" in text and "run the tests before you answer" not in text
    # the repair message follows the write's result directly: no empty assistant turn between
    tail = text[text.index("Updated solver.py"):]
    assert "assistant" not in tail[: tail.index("The checks failed")]


def test_test_after_write_says_when_the_file_did_not_change(tmp_path):
    result, engine = run(tmp_path, [rest("x + 5"), rest("x + 5"), rest("x * 2")], test_after_write=True)
    assert result["status"] == "passed" and len(engine.requests) == 3
    text = engine.tokenizer.decode(engine.requests[2].prompt_ids)
    assert "content unchanged. This is the same code that failed the checks" in text
    # the step after the unchanged write opens the file again (no free step to answer in prose)
    assert text.endswith("solver.py\n```python\n")


def test_without_a_test_command_a_write_does_not_end_the_turn(tmp_path):
    engine = ScriptedEngine([edit("x * 2"), "Done."], profile=scripted_profile(edit_format="whole",
                                                                              test_after_write=True))
    task = make_task(tmp_path)
    task = type(task)(**{**task.__dict__, "test_command": None})
    result = HeadlessRun(task, engine=engine, run_dir=tmp_path / "run").run()
    assert result["status"] == "passed" and result["stop_reason"] == "answered" and len(engine.requests) == 2


def test_candidates_follow_a_run_that_ended_at_its_write(tmp_path):
    # each draft starts with the file's opening and stops at its closing fence (what follows is cut)
    replies = [rest("x + 5"), rest("x + 3") + "\nThe tests pass now.", rest("2 * x") + "\nsolver_test.py"]
    store = SessionStore(tmp_path / "sessions")
    result, engine = run(tmp_path, replies, candidates=2, store=store, test_after_write=True,
                         max_tokens_per_step=2048)
    assert result["status"] == "passed" and result["first_try"]["status"] == "failed"
    assert result["repair_rounds"][0]["candidates"]["chosen"] == 1 and len(engine.requests) == 3
    # the drafts' prompt continues the stored context exactly (the write's result, then the repair
    # turn) and ends with the file's forced opening
    first, draft = engine.requests[0].prompt_ids, engine.requests[1].prompt_ids
    assert draft[: len(first)] == first and engine.tokenizer.decode(draft).endswith("solver.py\n```python\n")
    assert engine.requests[1].params.stop == ("\n```\n",)
    assert engine.requests[1].params.max_tokens == 512  # twice the file, at least 512: not the step's 2048
    # the adopted reply is stored with its opening and cut at the fence, its tokens exactly as fed
    last = [m for m in store.messages(store.list()[0].id) if m.role == "assistant"][-1]
    assert last.meta["candidate"] and "The tests pass" not in last.content and "solver_test" not in last.content
    assert engine.tokenizer.decode(last.token_ids).startswith("solver.py\n```python\ndef double(x):")


def test_when_no_draft_passes_the_best_one_is_the_rounds_reply(tmp_path):
    # first try fails both tests; the drafts pass none / one / none of them: the one that passes
    # one test is kept (no ordinary round decoded after it), then round 2's second draft passes
    (tmp_path / "tmpl").mkdir()
    (tmp_path / "tmpl" / "solver.py").write_text("def double(x):\n    pass\n")
    (tmp_path / "tmpl" / "test_solver.py").write_text(UNITTESTS)
    (tmp_path / "task.yaml").write_text(UNITTEST_TASK + "protected: [test_solver.py]\n")
    replies = [rest("x + 5"), rest("x + 7"), rest("4 if x == 2 else 0"), rest("None"),
               rest("x + 1"), rest("x * 2"), rest("x - 1")]
    result, engine = run(tmp_path, replies, task=load_task(tmp_path / "task.yaml"), candidates=3,
                         test_after_write=True)
    assert result["status"] == "passed" and result["first_try"]["status"] == "failed"
    first, second = result["repair_rounds"]
    assert first["stop_reason"] == "candidate_best" and first["status"] == "failed"
    assert first["candidates"]["chosen"] == 1
    assert [d["tests_passed"] for d in first["candidates"]["drafts"]] == [0, 1, 0]
    assert second["stop_reason"] == "candidate" and second["candidates"]["chosen"] == 1
    assert len(engine.requests) == 1 + 3 + 3 and result["candidate_rounds"] == []
    # round 2's drafts see the kept draft as the last reply, and its failure
    text = engine.tokenizer.decode(engine.requests[4].prompt_ids)
    assert "repair round 2 of 3" in text and "return 4 if x == 2 else 0" in text
    assert (tmp_path / "run" / "workspace" / "solver.py").read_text().endswith("return x * 2\n")


def test_a_refused_test_file_beside_the_solution_still_ends_the_run_at_the_write(tmp_path):
    both = rest("x * 2") + "\n\nsolver_test.py\n```python\nimport solver\nassert solver.double(1) == 2\n```"
    result, engine = run(tmp_path, [both], extra="protected: [solver_test.py]\n", test_after_write=True)
    assert result["status"] == "passed" and result["stop_reason"] == "wrote" and len(engine.requests) == 1
    assert not (tmp_path / "run" / "workspace" / "solver_test.py").exists()


def test_a_test_after_write_step_opens_the_file_and_the_context_keeps_its_exact_tokens(tmp_path):
    result, engine = run(tmp_path, [rest("x + 5"), rest("x * 2")], test_after_write=True)
    assert result["status"] == "passed"
    tok = engine.tokenizer
    first, second = engine.requests[0].prompt_ids, engine.requests[1].prompt_ids
    assert tok.decode(first).endswith("solver.py\n```python\n")  # the opening is fed, not generated
    assert second[: len(first)] == first  # the stored reply is the opening + the generated tokens
    assert tok.decode(second).endswith("solver.py\n```python\n")  # the repair round opens the written file
    assert (tmp_path / "run" / "workspace" / "solver.py").read_text() == "def double(x):\n    return x * 2\n"


def test_a_test_after_write_step_stops_when_the_opened_file_closes(tmp_path):
    from agents.scripted import Reply
    chatter = rest("x * 2") + "\n\nThis doubles x." + " It returns twice the input." * 200
    result, engine = run(tmp_path, [Reply(chatter, delay_s=0.001)], test_after_write=True)
    assert result["status"] == "passed" and result["stop_reason"] == "wrote"
    records = read_transcript(tmp_path / "run" / "transcript.jsonl")
    (resp,) = [r for r in records if r["type"] == "response"]
    assert resp["finish_reason"] == "stop" and resp["usage"]["completion_tokens"] < 200


def test_a_looping_draft_is_stopped_and_never_kept(tmp_path):
    # draft 0 repeats one line until it is stopped (it would hold the batch to its token budget);
    # draft 1 passes and is kept
    loop = "def double(x):\n" + "    x = x + 0\n" * 400
    replies = [rest("x + 5"), Reply(loop, end=False, delay_s=0.002), rest("x * 2")]
    result, engine = run(tmp_path, replies, candidates=2, test_after_write=True, max_tokens_per_step=8000)
    assert result["status"] == "passed"
    drafts = result["repair_rounds"][0]["candidates"]["drafts"]
    assert drafts[0]["finish_reason"] == "looped" and drafts[0]["completion_tokens"] < 400  # budget: 512
    assert drafts[1]["passed"]


def test_candidates_follow_a_run_that_stopped_on_repeats(tmp_path):
    # the first run writes a failing file, then repeats a test run until the loop guard stops it:
    # its turn is left open after tool results; the drafts still come (the turn is closed first)
    bash = '<tool_call>\n{"name": "bash", "arguments": {"command": "true"}}\n</tool_call>'
    replies = [edit("x + 5"), bash, bash, edit("x * 2"), edit("x + 3")]
    result, engine = run(tmp_path, replies, candidates=2)
    assert result["first_try"]["status"] == "failed" and result["status"] == "passed"
    records = read_transcript(tmp_path / "run" / "transcript.jsonl")
    assert [r["reason"] for r in records if r["type"] == "done"][0] == "repeated"
    assert result["repair_rounds"][0]["stop_reason"] == "candidate" and len(engine.requests) == 5


def test_fresh_drafts_answer_the_task_prompt_again(tmp_path):
    # the continuation draft copies the failing file; the fresh one, sampled from the first
    # step's own context (no failed file in view), passes and is adopted, marked fresh
    store = SessionStore(tmp_path / "sessions")
    replies = [rest("x + 5"), rest("x + 5"), rest("x * 2")]
    result, engine = run(tmp_path, replies, candidates=2, candidate_fresh=1, store=store, test_after_write=True)
    assert result["status"] == "passed"
    drafts = result["repair_rounds"][0]["candidates"]["drafts"]
    assert [d["fresh"] for d in drafts] == [False, True] and result["repair_rounds"][0]["candidates"]["chosen"] == 1
    first, cont, fresh = (r.prompt_ids for r in engine.requests)
    assert fresh == first  # the task's first step again, opening included
    assert cont[: len(first)] == first and len(cont) > len(first)
    assert "The checks failed" not in engine.tokenizer.decode(fresh)
    last = [m for m in store.messages(store.list()[0].id) if m.role == "assistant"][-1]
    assert last.meta["candidate"] and last.meta["fresh"] and "x * 2" in last.meta["raw_text"]


def test_a_draft_no_better_than_the_file_is_not_kept(tmp_path):
    # the first try passes one of two tests; the drafts pass none and one: neither beats the
    # file, so none replaces it and the ordinary round follows (it passes)
    (tmp_path / "tmpl").mkdir()
    (tmp_path / "tmpl" / "solver.py").write_text("def double(x):\n    pass\n")
    (tmp_path / "tmpl" / "test_solver.py").write_text(UNITTESTS)
    (tmp_path / "task.yaml").write_text(UNITTEST_TASK + "protected: [test_solver.py]\nrepair_rounds: 1\n")
    replies = [rest("4 if x == 2 else 0"), rest("None"), rest("6 if x == 3 else 0"), rest("x * 2")]
    result, engine = run(tmp_path, replies, task=load_task(tmp_path / "task.yaml"), candidates=2,
                         test_after_write=True)
    assert result["status"] == "passed" and len(engine.requests) == 4
    (rnd,) = result["repair_rounds"]
    assert rnd["stop_reason"] == "wrote" and "candidates" not in rnd
    assert [d["tests_passed"] for d in result["candidate_rounds"][0]["drafts"]] == [0, 1]
