"""Degenerate repetition: detected at the end of a reply, and a looping step is cut short."""

from engine.sessions import SessionStore

from agents.events import AgentDone, ToolFinished
from agents.loops import LoopGuard, looping
from agents.scripted import Reply, ScriptedEngine, scripted_profile
from agents.session import AgentOptions, AgentSession
from agents.transcript import Transcript

LOOP_LINE = "    words = words.replace('-', ' ')\n"


def test_repeated_blocks_and_pieces_are_loops():
    assert looping("x.py\n```python\ndef f(words):\n" + LOOP_LINE * 4)
    assert looping("def f():\n" + "    total = 1\n    total = compute(total)\n" * 4)  # a two-line block
    assert looping("The answer is " + "very, " * 12)
    # the 1.5B on acronym: 23 different replace() lines, then the same 23 again (seen in a bench run)
    marks = list("-.,!?:;()[]{}|~`^&*+=<>/")
    cycle = "".join(f'    words = words.replace("{c}", "")\n' for c in marks)
    assert not looping("def abbreviate(words):\n" + cycle)
    assert looping("def abbreviate(words):\n" + cycle + cycle[: len(cycle) // 6])
    long_block = "".join(f"    step_{i}(state, {i})\n" for i in range(12))
    assert looping("def f(state):\n" + long_block * 3) and not looping("def f(state):\n" + long_block * 2)


def test_real_code_is_not_a_loop():
    tests = "".join(f"    def test_{i}(self):\n        self.assertEqual(f({i}), {2 * i})\n\n" for i in range(12))
    assert not looping("import unittest\n\nclass T(unittest.TestCase):\n" + tests)
    assert not looping("x = [\n" + "    0,\n" * 20 + "]\n")  # short lines repeat legitimately
    assert not looping("}\n" * 30 + "\n\n\n")
    assert not looping(LOOP_LINE * 3)  # three times is not yet a loop
    table = "".join(f"    '{chr(97 + i)}': '{chr(122 - i)}',\n" for i in range(26))  # one shape, no line recurs
    assert not looping("CIPHER = {\n" + table + "}\n")


def test_guard_checks_at_line_ends():
    guard = LoopGuard()
    tripped_at = [n for n in range(1, 11) if guard.update(LOOP_LINE * n)]
    assert tripped_at[0] == 4


def test_a_looping_step_is_stopped_and_the_run_goes_on(tmp_path):
    (tmp_path / "ws").mkdir()
    looped = "solver.py\n```python\ndef solve(words):\n" + LOOP_LINE * 200
    # paced like a real decode, so the cancel lands while the reply streams
    engine = ScriptedEngine([Reply(looped, delay_s=0.001), "solver.py\n```python\ndef solve(x):\n    return x\n```", "Done."],
                            profile=scripted_profile(edit_format="whole", max_tokens=20000))
    options = AgentOptions(system_prompt="t", examples=False, interactive=False, allow=("write_file",))
    agent = AgentSession.create(engine, SessionStore(), tmp_path / "ws", options=options, transcript=Transcript(None))
    events = list(agent.run("write solver.py"))
    first = [e for e in events if isinstance(e, ToolFinished)][0]
    assert not first.result.ok and "kept repeating" in first.result.content
    msgs = agent.store.messages(agent.session_id, tokens=False)
    looped_reply = [m for m in msgs if m.role == "assistant"][0]
    assert looped_reply.meta["finish_reason"] == "looped"
    assert looped_reply.meta["usage"]["completion_tokens"] < 400  # far short of 200 repeated lines
    assert isinstance(events[-1], AgentDone) and events[-1].reason == "answered"
    assert (tmp_path / "ws" / "solver.py").read_text() == "def solve(x):\n    return x\n"
