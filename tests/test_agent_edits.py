"""Text file edits (agents/edits.py): parsing, streaming, and the loop applying them for real."""

import random

from engine.sessions import SessionStore

import pytest

from agents.events import AgentDone, Corrective, ToolCallForming, ToolCallParsed, ToolFinished
from agents.parser import ToolCallParser
from agents.protocol import format_call
from agents.scripted import Reply, ScriptedEngine, scripted_profile
from agents.session import AgentOptions, AgentSession
from agents.transcript import Transcript

TOOLS = {"bash": {"type": "object", "properties": {"command": {"type": "string"}}, "required": ["command"]}}


def parse(text, chunks=None):
    """Feed ``text`` in the given chunk sizes (default: all at once); (visible text, calls, malformed)."""
    p = ToolCallParser(TOOLS, text_edits=True)
    i = 0
    for size in chunks or [len(text)]:
        p.feed(text[i:i + size])
        i += size
    if i < len(text):
        p.feed(text[i:])
    p.finish()
    return p.visible_text, [(c.name, c.arguments) for c in p.calls], [(m.name, m.error) for m in p.malformed]


WHOLE = "Here is the solution.\n\nsolver.py\n```python\ndef solve(x):\n    return x * 2\n```\nDone."
SR = ("solver.py\n```python\n<<<<<<< SEARCH\n    return x * 2\n=======\n    return x * 3\n>>>>>>> REPLACE\n"
      "<<<<<<< SEARCH\ndef solve(x):\n=======\ndef solve(x: int):\n>>>>>>> REPLACE\n```\n")


def test_whole_file_block_becomes_write_file():
    text, calls, bad = parse(WHOLE)
    assert calls == [("write_file", {"path": "solver.py", "content": "def solve(x):\n    return x * 2\n"})]
    assert text == "Here is the solution.\n\nDone." and not bad


@pytest.mark.parametrize("line", ["**solver.py**", "`solver.py`", "### solver.py", "File: solver.py",
                                  "solver.py:", "Here is the updated `solver.py`:"])
def test_path_line_variants(line):
    _, calls, _ = parse(f"{line}\n```python\nx = 1\n```\n")
    assert calls == [("write_file", {"path": "solver.py", "content": "x = 1\n"})]


def test_blocks_that_are_not_files_stay_text():
    # a shell block after a sentence naming a file, a block with no path, a path whose
    # extension does not match the fence's language in a sentence
    for reply in ("Run solver_test.py:\n```bash\npython3 -m unittest solver_test\n```\n",
                  "For example:\n```python\nprint(1)\n```\n",
                  "See notes.txt for this:\n```python\nprint(1)\n```\n"):
        text, calls, bad = parse(reply)
        assert calls == [] and bad == [] and text == reply


def test_comment_path_inside_the_fence():
    _, calls, _ = parse("```python\n# solver.py\nx = 1\n```")
    assert calls == [("write_file", {"path": "solver.py", "content": "# solver.py\nx = 1\n"})]


def test_search_replace_blocks_in_a_fence_and_bare():
    _, calls, bad = parse(SR)
    assert not bad and calls == [
        ("edit_file", {"path": "solver.py", "old_text": "    return x * 2\n", "new_text": "    return x * 3\n"}),
        ("edit_file", {"path": "solver.py", "old_text": "def solve(x):\n", "new_text": "def solve(x: int):\n"}),
    ]
    _, calls, _ = parse("solver.py\n<<<<<<< SEARCH\na\n=======\n>>>>>>> REPLACE\n")
    assert calls == [("edit_file", {"path": "solver.py", "old_text": "a\n", "new_text": ""})]


def test_malformed_edits_say_what_is_wrong():
    _, calls, bad = parse("solver.py\n```python\nx = 1\n")
    assert calls == [] and bad[0][0] == "write_file" and "cut off" in bad[0][1]
    _, _, bad = parse("<<<<<<< SEARCH\na\n=======\nb\n>>>>>>> REPLACE\n")
    assert "path on the line before" in bad[0][1]
    _, _, bad = parse("solver.py\n<<<<<<< SEARCH\n=======\nb\n>>>>>>> REPLACE\n")
    assert "SEARCH section for solver.py is empty" in bad[0][1]


@pytest.mark.parametrize("seed", range(8))
def test_streaming_split_at_any_chunk_boundary_gives_the_same_result(seed):
    rng = random.Random(seed)
    for reply in (WHOLE, SR, "a\n" + format_call("bash", {"command": "ls"}) + "\n" + WHOLE):
        chunks = []
        while sum(chunks) < len(reply):
            chunks.append(rng.randint(1, 7))
        assert parse(reply, chunks) == parse(reply)


def test_json_calls_and_edits_share_reply_order_ids():
    p = ToolCallParser(TOOLS, text_edits=True, id_prefix="call_1")
    p.feed(WHOLE.replace("Done.", format_call("bash", {"command": "python3 solver.py"})))
    p.finish()
    assert [(c.id, c.name) for c in p.calls] == [("call_1_0", "write_file"), ("call_1_1", "bash")]


# -- the loop applies them --------------------------------------------------------------------------
def agent_run(tmp_path, replies, prompt="fix solver.py", edit_format="whole", **opts):
    ws = tmp_path / "ws"
    ws.mkdir(exist_ok=True)
    (ws / "solver.py").write_text("def solve(x):\n    return x\n")
    engine = ScriptedEngine(replies, profile=scripted_profile(edit_format=edit_format))
    opts.setdefault("allow", ("write_file", "edit_file"))
    options = AgentOptions(system_prompt="You are a test agent.", examples=False, interactive=False, **opts)
    agent = AgentSession.create(engine, SessionStore(), ws, options=options, transcript=Transcript(None))
    return ws, agent, list(agent.run(prompt))


def test_loop_writes_whole_files_and_search_replace_edits(tmp_path):
    ws, agent, events = agent_run(tmp_path, [WHOLE, SR, "All done."], edit_format="diff")
    assert (ws / "solver.py").read_text() == "def solve(x: int):\n    return x * 3\n"
    finished = [e for e in events if isinstance(e, ToolFinished)]
    assert [(f.name, f.result.ok) for f in finished] == [("write_file", True), ("edit_file", True), ("edit_file", True)]
    assert finished[0].diff and "+    return x * 2" in finished[0].diff  # the same cards and diffs as JSON calls
    assert any(isinstance(e, ToolCallForming) and e.name == "write_file" for e in events)
    done = events[-1]
    assert isinstance(done, AgentDone) and done.reason == "answered" and done.extra["changed_files"] == [
        "solver.py", "solver.py", "solver.py"]
    assert "write_file" not in [s["function"]["name"] for s in agent.schemas]  # offered as text, not JSON


def test_search_with_no_match_or_ambiguous_match_is_an_error_result(tmp_path):
    (tmp_path / "ws").mkdir()
    (tmp_path / "ws" / "dup.py").write_text("x = 1\nx = 1\n")
    miss = "solver.py\n<<<<<<< SEARCH\n    return y\n=======\n    return 0\n>>>>>>> REPLACE\n"
    twice = "dup.py\n<<<<<<< SEARCH\nx = 1\n=======\nx = 2\n>>>>>>> REPLACE\n"
    ws, _, events = agent_run(tmp_path, [miss, twice, "ok"], edit_format="diff")
    results = [e.result for e in events if isinstance(e, ToolFinished)]
    assert not results[0].ok and "return x" in results[0].content  # quotes the nearest lines
    assert not results[1].ok and "matches 2 times" in results[1].content
    assert (ws / "solver.py").read_text() == "def solve(x):\n    return x\n"


def test_edits_outside_the_workspace_are_refused(tmp_path):
    ws, _, events = agent_run(tmp_path, ["../evil.py\n```python\nx = 1\n```\n", "/tmp/evil2.py\n```python\nx\n```\n",
                                         "stop"])
    results = [e.result for e in events if isinstance(e, ToolFinished)]
    assert len(results) == 2 and not any(r.ok for r in results)
    assert not (tmp_path / "evil.py").exists()


def test_json_format_leaves_fenced_blocks_as_text(tmp_path):
    ws, _, events = agent_run(tmp_path, [WHOLE], edit_format="json", corrective_turns=0)
    assert not [e for e in events if isinstance(e, ToolCallParsed)]
    assert (ws / "solver.py").read_text() == "def solve(x):\n    return x\n"


# -- the corrective turn ----------------------------------------------------------------------------
def test_code_shown_but_not_written_is_sent_back_once(tmp_path):
    shown = "The solution:\n```python\ndef solve(x):\n    return 2 * x\n```"
    ws, agent, events = agent_run(tmp_path, [shown, WHOLE, "Done."], prompt="fix the solver")  # names no file
    corrective = [e for e in events if isinstance(e, Corrective)]
    assert len(corrective) == 1 and "Nothing was written" in corrective[0].message
    assert (ws / "solver.py").read_text().endswith("return x * 2\n")
    msgs = agent.store.messages(agent.session_id, tokens=False)
    assert [m for m in msgs if m.meta.get("corrective")][0].role == "user"
    assert events[-1].reason == "answered" and events[-1].extra["corrective_turns"] == 1


def test_only_one_corrective_turn_per_run_and_none_after_real_work(tmp_path):
    _, _, events = agent_run(tmp_path, ["I fixed it.", "I really fixed it."])
    assert len([e for e in events if isinstance(e, Corrective)]) == 1
    assert events[-1].reason == "answered" and events[-1].final_text == "I really fixed it."
    _, _, events = agent_run(tmp_path, [WHOLE, "Fixed."])  # something changed: the answer stands
    assert not [e for e in events if isinstance(e, Corrective)]
    _, _, events = agent_run(tmp_path, ["It returns x."], prompt="what does solve return?")  # a question
    assert not [e for e in events if isinstance(e, Corrective)]


def test_protected_paths_cannot_be_written(tmp_path):
    (tmp_path / "ws").mkdir()
    (tmp_path / "ws" / "solver_test.py").write_text("original\n")
    ws, _, events = agent_run(tmp_path, ["solver_test.py\n```python\nrigged\n```\n", WHOLE, "ok"],
                              protected=("*_test.py",))
    results = [e.result for e in events if isinstance(e, ToolFinished)]
    assert not results[0].ok and "protected by the task" in results[0].content and results[1].ok
    assert (ws / "solver_test.py").read_text() == "original\n"


def test_a_loop_of_identical_calls_is_refused_then_stopped(tmp_path):
    # the 1.5B's failure mode: the same whole file again and again after "Updated ..."
    ws, _, events = agent_run(tmp_path, [WHOLE] * 5 + ["unreached"])
    results = [e.result for e in events if isinstance(e, ToolFinished)]
    assert results[0].ok and [r.data.get("repeated") for r in results[1:]] == [True]
    assert "same as in step 1" in results[1].content  # every call still gets its result
    assert events[-1].reason == "repeated" and events[-1].step == 2


def test_the_same_test_run_after_a_change_is_not_a_repeat(tmp_path):
    test = format_call("bash", {"command": "true"})
    edit2 = WHOLE.replace("x * 2", "x * 3")
    _, _, events = agent_run(tmp_path, [test, WHOLE, test, edit2, test, "done"], allow=("write_file", "bash"))
    assert not [e for e in events if isinstance(e, ToolFinished) and e.result.data.get("repeated")]
    assert events[-1].reason == "answered"


def test_a_block_for_a_protected_file_stops_the_step_at_once(tmp_path):
    (tmp_path / "ws").mkdir()
    (tmp_path / "ws" / "solver_test.py").write_text("original\n")
    rewrite = Reply("solver_test.py\n```python\n" + "".join(f"assert solve({i}) == {i}\n" for i in range(300)) + "```",
                    delay_s=0.001)
    ws, agent, events = agent_run(tmp_path, [rewrite, WHOLE, "ok"], protected=("*_test.py",))
    first = [e.result for e in events if isinstance(e, ToolFinished)][0]
    assert not first.ok and "solver_test.py is protected" in first.content
    reply = [m for m in agent.store.messages(agent.session_id, tokens=False) if m.role == "assistant"][0]
    assert reply.meta["finish_reason"] == "protected" and reply.meta["usage"]["completion_tokens"] < 300
    assert (ws / "solver_test.py").read_text() == "original\n" and (ws / "solver.py").read_text().endswith("x * 2\n")


def test_starting_the_same_protected_file_again_is_a_repeat(tmp_path):
    (tmp_path / "ws").mkdir()
    (tmp_path / "ws" / "solver_test.py").write_text("original\n")
    start = "solver_test.py\n```python\nimport unittest\n"  # stopped at its first lines, every time
    ws, _, events = agent_run(tmp_path, [start, start, start, "unreached"], protected=("*_test.py",))
    assert events[-1].reason == "repeated" and events[-1].step == 2
