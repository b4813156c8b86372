"""`mlxterm bench agent`: Exercism-layout exercises as agent tasks, scored by their tests."""

import argparse
import hashlib
import json
import shutil
from pathlib import Path

import pytest

from agents.exercises import ExerciseError, exercise_task, find_exercises, load_exercise, split_of
from agents.protocol import format_call
from agents.scripted import ScriptedEngine

FIXTURES = Path(__file__).parent / "fixtures" / "exercises"

DOUBLE_OK = "def double(n):\n    return 2 * n\n"
VOWELS_WRONG = "def count_vowels(text):\n    return sum(1 for c in text if c in 'aeiou')\n"  # misses upper case
CHEAT_TEST = "import unittest\n\n\nclass T(unittest.TestCase):\n    def test_ok(self):\n        pass\n"


def copy_exercise(tmp_path, slug="double-it"):
    dst = tmp_path / slug
    shutil.copytree(FIXTURES / slug, dst)
    return dst


@pytest.mark.parametrize("mutate, message", [
    (lambda d: (d / "exercise.json").unlink(), "exercise.json: exercise.json not found"),
    (lambda d: (d / "exercise.json").write_text("{nope"), "exercise.json:1: not valid JSON"),
    (lambda d: (d / "exercise.json").write_text("[1]"), "expected a JSON object"),
    (lambda d: (d / "exercise.json").write_text('{"solution": ["double_it.py"], "test": ["double_it_test.py"]}'),
     "slug: required"),
    (lambda d: (d / "exercise.json").write_text('{"slug": "x", "solution": [], "test": ["double_it_test.py"]}'),
     "solution: required, a non-empty list"),
    (lambda d: (d / "double_it_test.py").unlink(), "test: double_it_test.py is missing"),
    (lambda d: (d / "exercise.json").write_text('{"slug": "x", "solution": ["../x.py"], "test": ["double_it_test.py"]}'),
     "must be a path inside the exercise folder"),
    (lambda d: (d / "INSTRUCTIONS.md").unlink(), "INSTRUCTIONS.md: INSTRUCTIONS.md not found"),
])
def test_load_errors_name_the_file(tmp_path, mutate, message):
    d = copy_exercise(tmp_path)
    mutate(d)
    with pytest.raises(ExerciseError) as err:
        load_exercise(d)
    assert str(err.value).startswith(str(d)) and message in str(err.value) and "\n" not in str(err.value)


def test_missing_folder_and_empty_directory(tmp_path):
    with pytest.raises(ExerciseError, match="exercise folder not found"):
        load_exercise(tmp_path / "nope")
    with pytest.raises(ExerciseError, match="no exercise folders"):
        find_exercises(tmp_path)


def test_split_is_deterministic_and_documented_rule():
    for slug in ("double-it", "shout", "vowel-count", "acronym", "two-fer"):
        expected = "tune" if int(hashlib.sha1(slug.encode()).hexdigest(), 16) % 3 == 0 else "report"
        assert split_of(slug) == expected == split_of(slug)
    assert [split_of(s) for s in ("double-it", "shout", "vowel-count")] == ["report", "tune", "report"]
    from app.benches.agent import select

    exs = find_exercises(FIXTURES)
    assert [e.slug for e in select(exs, "report", None, None)[0]] == ["double-it", "vowel-count"]
    assert [e.slug for e in select(exs, "tune", None, None)[0]] == ["shout"]
    assert [e.slug for e in select(exs, "all", None, 2)[0]] == ["double-it", "shout"]
    assert select(exs, "report", "shout", None) == ([exs[1]], "only")
    with pytest.raises(ExerciseError, match="--only: no exercise nope"):
        select(exs, "report", "shout,nope", None)


def test_task_from_a_fixture_exercise(tmp_path):
    ex = load_exercise(FIXTURES / "shout")
    assert ex.test_modules == ("shout_test",)  # the helper is copied, not run as a module
    task = exercise_task(ex, tmp_path / "tpl", repair_rounds=2)
    assert task.path == (FIXTURES / "shout" / "exercise.json").resolve() and task.name == "shout"
    assert "shout.py" in task.prompt and "python3 -m unittest -q shout_test" in task.prompt
    assert "upper case" in task.prompt and task.allow == ("bash",)
    assert task.test_command == "python3 -m unittest -q shout_test" and task.repair_rounds == 2
    tpl = task.workspace_template
    assert sorted(p.name for p in tpl.iterdir()) == ["INSTRUCTIONS.md", "shout.py", "shout_test.py", "test_helpers.py"]
    assert all(p.stat().st_mode & 0o600 == 0o600 for p in tpl.iterdir())
    (check,) = task.checks
    assert check.timeout_s == 60 and '"$MLXTERM_TASK_DIR"/shout_test.py' in check.run
    assert check.run.endswith("python3 -m unittest -q shout_test")
    assert exercise_task(ex, tmp_path / "tpl2").repair_rounds is None


def test_check_restores_read_only_tests(tmp_path):
    """The task's own check copies the (read-only) originals back over an edited test file."""
    from agents.checks import agent_sandbox, run_check

    exdir = copy_exercise(tmp_path / "src", "double-it")
    for p in exdir.iterdir():
        p.chmod(0o444)
    ex = load_exercise(exdir)
    task = exercise_task(ex, tmp_path / "tpl")
    ws = tmp_path / "ws"
    shutil.copytree(task.workspace_template, ws)
    (ws / "double_it_test.py").write_text(CHEAT_TEST)
    env = {"MLXTERM_TASK_DIR": str(ex.dir)}
    rec = run_check(task.checks[0], ws, agent_sandbox(), env=env, readable=(str(ex.dir),))
    assert not rec["passed"] and "test_small" in rec["output"]
    assert (ws / "double_it_test.py").read_text() == (exdir / "double_it_test.py").read_text()
    (ws / "double_it.py").write_text(DOUBLE_OK)
    rec = run_check(task.checks[0], ws, agent_sandbox(), env=env, readable=(str(ex.dir),))
    assert rec["passed"], rec["output"]
    for p in exdir.iterdir():
        p.chmod(0o644)


def _bench_args(tmp_path, *extra):
    from app.commands import bench

    parser = argparse.ArgumentParser()
    bench.register(parser.add_subparsers())
    return parser.parse_args(["bench", "agent", "--exercises", str(FIXTURES), "--profile", "scripted",
                              "--out", str(tmp_path / "bench.json"), *extra])


def test_bench_end_to_end_scores_by_the_original_tests(tmp_path, monkeypatch, capsys):
    from engine import runtime

    # double-it: a correct solution. vowel-count: a wrong one, and the agent rewrites the test
    # to pass anyway -- the bench must restore the test before scoring and fail it.
    script = [
        format_call("write_file", {"path": "double_it.py", "content": DOUBLE_OK}),
        "double_it.py now doubles its argument.",
        format_call("write_file", {"path": "vowel_count.py", "content": VOWELS_WRONG}),
        format_call("write_file", {"path": "vowel_count_test.py", "content": CHEAT_TEST}),
        "Done: the tests pass.",
    ]
    engine = ScriptedEngine(script)
    loads = []
    monkeypatch.setattr(runtime.Engine, "load", classmethod(lambda cls, profile=None: loads.append(profile) or engine))
    args = _bench_args(tmp_path, "--repair-rounds", "0")
    assert args.func(args) == 0
    assert loads == ["scripted"]  # one engine for the whole bench
    err = capsys.readouterr().err
    assert "split report: 2 exercise(s) to run (2 of 3 in the split)" in err
    assert "double-it: first try" in err and "vowel-count: first try" in err

    data = json.loads((tmp_path / "bench.json").read_text())
    assert data["bench"] == "agent" and data["split"] == "report" and data["exercises"] == ["double-it", "vowel-count"]
    assert data["count"] == 2 and data["passed_after_repair"] == 1 and data["pct_after_repair"] == 50.0
    assert data["profile"] == "scripted" and data["reference"] is None and data["repair_rounds"] == 0
    # seeded by default (step n samples with seed + n), so a bench run repeats token for token
    assert data["seed"] == 0 and [r.params.seed for r in engine.requests[:2]] == [1, 2]
    by = {r["slug"]: r for r in data["results"]}
    assert by["double-it"]["passed_after_repair"] is True and by["double-it"]["score_exit_code"] == 0
    bad = by["vowel-count"]
    assert bad["passed_after_repair"] is False and "test_mixed_case" in bad["score_output"]
    # the agent's edit of the test file was undone before scoring
    ws = Path(bad["run_dir"]) / "workspace"
    assert (ws / "vowel_count_test.py").read_text() == (FIXTURES / "vowel-count" / "vowel_count_test.py").read_text()
    assert (ws / "vowel_count.py").read_text() == VOWELS_WRONG
    for r in data["results"]:
        assert r["steps"] >= 2 and r["completion_tokens"] > 0 and r["prompt_tokens"] > 0
        assert r["stop_reason"] == "answered" and r["error"] is None and r["wall_s"] >= r["agent_wall_s"]
        assert r["split"] == "report"
    assert data["first_try_known"] == 2 and data["passed_first_try"] == 1 and data["pct_first_try"] == 50.0
    assert by["double-it"]["passed_first_try"] is True and by["vowel-count"]["passed_first_try"] is False
    assert by["double-it"]["rounds"] == 0 and by["double-it"]["workspace_changed"] is True
    assert by["double-it"]["corrective_turns"] == 0
    assert data["tokens"]["completion"] == sum(r["completion_tokens"] for r in data["results"])
    assert data["wall_s_median"] is not None and data["wall_s_p90"] == max(r["wall_s"] for r in data["results"])
    assert "2 exercises (report split) on scripted" in data["summary"]
    assert "first try 1/2 (50.0%), after repair 1/2 (50.0%)" in data["summary"]

    # the report renders this bench: summary and one row per exercise
    from app.report import build_report

    page = build_report([tmp_path / "bench.json"])
    assert "bench agent" in page and "vowel-count" in page and "double-it" in page and "50.0%" in page


def test_bench_repair_round_turns_a_failure_into_a_pass(tmp_path, monkeypatch, capsys):
    """A wrong first try, the test output goes back, the agent fixes it: first try failed,
    after repair passed, one round used."""
    from engine import runtime

    fixed = "def count_vowels(text):\n    return sum(1 for c in text.lower() if c in 'aeiou')\n"
    engine = ScriptedEngine([
        format_call("write_file", {"path": "vowel_count.py", "content": VOWELS_WRONG}),
        "Done.",
        format_call("write_file", {"path": "vowel_count.py", "content": fixed}),
        "Fixed: upper-case vowels count too.",
    ])
    monkeypatch.setattr(runtime.Engine, "load", classmethod(lambda cls, profile=None: engine))
    args = _bench_args(tmp_path, "--only", "vowel-count", "--repair-rounds", "1")
    assert args.func(args) == 0
    assert "split only: 1 exercise(s) to run" in capsys.readouterr().err
    data = json.loads((tmp_path / "bench.json").read_text())
    (rec,) = data["results"]
    assert rec["passed_first_try"] is False and rec["passed_after_repair"] is True and rec["rounds"] == 1
    assert rec["repair_rounds"][0]["status"] == "passed"
    assert data["passed_first_try"] == 0 and data["passed_after_repair"] == 1 and data["split"] == "only"
    # the failing test output reached the model in the repair turn
    assert "test_mixed_case" in engine.tokenizer.decode(engine.requests[2].prompt_ids)


def test_reference_numbers_and_percentile():
    from app.benches.agent import percentile, reference_for

    assert reference_for("qwen2.5-coder-1.5b-lookup")["pct_after_repair"] == 31.6
    assert reference_for(None, "qwen2.5-coder-0.5b")["pct_first_try"] == 14.3
    assert reference_for("smollm2-135m", "scripted") is None
    assert percentile([1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0, 9.0, 10.0], 0.9) == 9.0
    assert percentile([], 0.9) is None


def test_score_restores_the_tests_itself(tmp_path):
    """The bench's own verdict does not trust the workspace's test files."""
    from app.benches.agent import score

    ex = load_exercise(FIXTURES / "double-it")
    ws = tmp_path / "ws"
    shutil.copytree(FIXTURES / "double-it", ws)
    (ws / "double_it_test.py").write_text(CHEAT_TEST)
    verdict = score(ex, ws)
    assert not verdict["passed"] and verdict["exit_code"] == 1 and "test_negative" in verdict["output"]
    (ws / "double_it.py").write_text(DOUBLE_OK)
    (ws / "double_it_test.py").unlink()
    assert score(ex, ws)["passed"]


def test_plain_arm_scores_the_one_shot_reply_beside_the_agent(tmp_path, monkeypatch, capsys):
    """``--arms agent,plain``: per exercise the model's one greedy whole-file reply is written
    over the stub and scored by the same tests, beside the agent's run; the arms alternate."""
    from engine import runtime

    # double-it (exercise 1): agent first, then plain; vowel-count (2): plain first, then agent
    engine = ScriptedEngine([
        format_call("write_file", {"path": "double_it.py", "content": DOUBLE_OK}),
        "Done.",
        "Here it is:\n\ndouble_it.py\n```python\ndef double(n):\n    return n + n\n```\n",
        f"```python\n{VOWELS_WRONG}```\n",  # no path line: the one solution file
        format_call("write_file", {"path": "vowel_count.py", "content": VOWELS_WRONG}),
        "Done.",
    ])
    monkeypatch.setattr(runtime.Engine, "load", classmethod(lambda cls, profile=None: engine))
    args = _bench_args(tmp_path, "--repair-rounds", "0", "--arms", "agent,plain")
    assert args.func(args) == 0
    assert "double-it: first try pass, after repair pass" in capsys.readouterr().err
    data = json.loads((tmp_path / "bench.json").read_text())
    by = {r["slug"]: r for r in data["results"]}
    assert by["double-it"]["plain"]["passed"] is True and by["double-it"]["plain"]["wrote"] == ["double_it.py"]
    assert by["vowel-count"]["plain"]["passed"] is False and by["vowel-count"]["plain"]["wrote"] == ["vowel_count.py"]
    assert "test_mixed_case" in by["vowel-count"]["plain"]["score_output"]
    plain_ws = Path(by["double-it"]["plain"]["workspace"])
    assert (plain_ws / "double_it.py").read_text() == "def double(n):\n    return n + n\n"
    # greedy, one turn with the instructions and the stub, no tools
    plain_req = engine.requests[2]
    assert plain_req.params.temperature == 0.0 and plain_req.session_id is None
    prompt = engine.tokenizer.decode(plain_req.prompt_ids)
    assert "Use the instructions above to change double_it.py" in prompt and "tool_call" not in prompt
    assert prompt.index("def double(n)") < prompt.index("Use the instructions above")  # the file first
    assert data["arms"] == ["agent", "plain"] and data["passed_plain"] == 1 and data["pct_plain"] == 50.0
    assert data["passed_after_repair"] == 1 and "plain (one greedy whole-file reply) 1/2 (50.0%)" in data["summary"]

    # the plain arm alone: no agent numbers, no agent runs
    engine2 = ScriptedEngine([f"double_it.py\n```python\n{DOUBLE_OK}```\n", "no code here"])
    monkeypatch.setattr(runtime.Engine, "load", classmethod(lambda cls, profile=None: engine2))
    args = _bench_args(tmp_path, "--arms", "plain")
    assert args.func(args) == 0
    data = json.loads((tmp_path / "bench.json").read_text())
    assert data["count"] == 0 and data["passed_plain"] == 1 and data["plain_count"] == 2
    assert [r["plain"]["wrote"] for r in data["results"]] == [["double_it.py"], []]
    assert "agent first try" not in data["summary"] and len(engine2.requests) == 2
    assert data["plain_tests_count"] == 0 and data["pct_plain_tests"] is None

    # plain_tests: the same request with the unit tests shown (read-only) after the stub
    engine3 = ScriptedEngine([f"double_it.py\n```python\n{DOUBLE_OK}```\n"] * 2 + ["nothing"] * 2)
    monkeypatch.setattr(runtime.Engine, "load", classmethod(lambda cls, profile=None: engine3))
    args = _bench_args(tmp_path, "--arms", "plain,plain_tests", "--only", "double-it")
    assert args.func(args) == 0
    data = json.loads((tmp_path / "bench.json").read_text())
    assert data["passed_plain"] == 1 and data["passed_plain_tests"] == 1 and len(engine3.requests) == 2
    prompts = [engine3.tokenizer.decode(r.prompt_ids) for r in engine3.requests]
    test_text = (FIXTURES / "double-it" / "double_it_test.py").read_text().strip()
    # exercise 1 runs the arms in order: plain, then plain_tests
    assert test_text not in prompts[0] and test_text in prompts[1]
    assert prompts[1].index("def double(n)") < prompts[1].index("read-only") < prompts[1].index(test_text)
    assert "plain_tests (one greedy whole-file reply, tests shown) 1/1" in data["summary"]
    with pytest.raises(ExerciseError, match="--arms: expected agent, plain and/or plain_tests"):
        args = _bench_args(tmp_path, "--arms", "agent,magic")
        args.func(args)


def test_temperature_sets_the_agent_steps_sampling(tmp_path, monkeypatch):
    from engine import runtime

    engine = ScriptedEngine([format_call("write_file", {"path": "double_it.py", "content": DOUBLE_OK}), "Done."])
    monkeypatch.setattr(runtime.Engine, "load", classmethod(lambda cls, profile=None: engine))
    args = _bench_args(tmp_path, "--only", "double-it", "--repair-rounds", "0", "--temperature", "0.35")
    assert args.func(args) == 0
    data = json.loads((tmp_path / "bench.json").read_text())
    assert data["temperature"] == 0.35 and data["passed_after_repair"] == 1
    assert [r.params.temperature for r in engine.requests] == [0.35, 0.35]  # the scripted profile samples at 0


def _solve_double_it(tmp_path, monkeypatch, *flags) -> tuple[dict, str]:
    """bench agent on the double-it fixture with a scripted correct answer: (the bench's JSON,
    the agent's first prompt as text)."""
    from engine import runtime

    engine = ScriptedEngine([format_call("write_file", {"path": "double_it.py", "content": DOUBLE_OK}), "Done."])
    monkeypatch.setattr(runtime.Engine, "load", classmethod(lambda cls, profile=None, e=engine: e))
    args = _bench_args(tmp_path, "--only", "double-it", "--repair-rounds", "0", *flags)
    assert args.func(args) == 0
    data = json.loads((tmp_path / "bench.json").read_text())
    assert data["passed_after_repair"] == 1
    return data, engine.tokenizer.decode(engine.requests[0].prompt_ids)


def test_show_tests_hands_the_agent_the_test_files(tmp_path, monkeypatch):
    """``--show-tests``: the exercise's tests go with the agent's prompt as read-only files."""
    test_text = (FIXTURES / "double-it" / "double_it_test.py").read_text().strip()
    for flag, shown in ((), False), (("--show-tests",), True):
        data, prompt = _solve_double_it(tmp_path, monkeypatch, *flag)
        assert data["show_tests"] is shown
        assert (test_text in prompt) is shown and ("Read-only files" in prompt) is shown


def test_files_first_puts_the_stub_before_the_instructions(tmp_path, monkeypatch):
    """``--files-first``: the agent's prompt shows the stub, then the instructions (the plain arm's
    order); by default the instructions come first. Both end with how to run the tests."""
    stub = (FIXTURES / "double-it" / "double_it.py").read_text().strip()
    instructions = (FIXTURES / "double-it" / "INSTRUCTIONS.md").read_text().strip().splitlines()[0]
    for flag, first in ((), False), (("--files-first",), True):
        data, prompt = _solve_double_it(tmp_path, monkeypatch, *flag)
        assert data["files_first"] is first
        task = prompt[max(0, prompt.rindex("Write the whole solution") - 4000):]  # the task turn, after the examples
        assert stub in task and instructions in task
        assert (task.rindex(stub) < task.rindex(instructions)) is first
        assert task.rindex("Write the whole solution") > max(task.rindex(stub), task.rindex(instructions))
