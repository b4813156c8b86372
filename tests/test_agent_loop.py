"""The agent loop end to end on a scripted model: transcript, tokens, tools, approvals, limits."""

import asyncio
import json
import threading
import time

from engine.sessions import SessionStore

import pytest

from agents.events import (
    AgentDone,
    ApprovalNeeded,
    Compacted,
    StepDone,
    StepStart,
    ToolCallMalformed,
    ToolCallParsed,
    ToolFinished,
    ToolStarted,
)
from agents.protocol import format_call
from agents.scripted import CHATML_TOOLS, Reply, ScriptedEngine, scripted_profile
from agents.session import AgentError, AgentLimits, AgentOptions, AgentSession
from agents.transcript import Transcript, read_transcript, replay_messages

SHORT = AgentOptions(system_prompt="You are a test agent.", examples=False)


def call(name, **args):
    return format_call(name, args)


def run(engine, workspace, prompt="do it", options=SHORT, limits=None, transcript=None, store=None):
    store = store or SessionStore()
    agent = AgentSession.create(engine, store, workspace, options=options, transcript=transcript or Transcript(None))
    events = list(agent.run(prompt, limits))
    return agent, events, store


def of(events, kind):
    return [e for e in events if isinstance(e, kind)]


def assert_transcript_matches_session(agent, store, records):
    exported = json.loads(store.export(agent.session_id, "json"))["messages"]
    assert replay_messages(records) == exported
    # every call in an assistant message has exactly one tool message answering it
    ids = [c["id"] for m in exported if m["role"] == "assistant" for c in (m["tool_calls"] or [])]
    answered = [m["tool_call_id"] for m in exported if m["role"] == "tool"]
    assert ids == answered


def test_three_steps_transcript_tokens_and_cache(tmp_path):
    ws = tmp_path / "ws"
    ws.mkdir()
    engine = ScriptedEngine([
        "Writing the file.\n" + call("write_file", content="print(2+3)\n", path="calc.py"),
        call("bash", command="python3 calc.py"),
        "It printed: 5",
    ])
    tr = Transcript(tmp_path / "t.jsonl")
    agent, events, store = run(engine, ws, "create calc.py", AgentOptions(examples=True, allow=("bash",)),
                               transcript=tr)
    done = events[-1]
    assert isinstance(done, AgentDone) and done.reason == "answered" and done.final_text == "It printed: 5"
    assert done.step == 3 and (ws / "calc.py").read_text() == "print(2+3)\n"
    assert engine.substitutions == 0  # the grammar accepts exactly what format_call writes

    # event order per step
    kinds = [type(e).__name__ for e in events if not type(e).__name__.startswith(("TextDelta", "ToolCallForming"))]
    assert kinds == ["StepStart", "ToolCallParsed", "StepDone", "ToolStarted", "ToolFinished",
                     "StepStart", "ToolCallParsed", "StepDone", "ToolStarted", "ToolFinished",
                     "StepStart", "StepDone", "AgentDone"]
    write, bash = of(events, ToolFinished)
    assert write.diff and "+print(2+3)" in write.diff and write.exit_code is None
    assert bash.exit_code == 0 and "5" in bash.result.content and bash.duration_ms >= 0

    # each step's prompt extends the previous prompt + generation; the KV prefix is reused
    reqs = engine.requests
    for prev, nxt in zip(reqs, reqs[1:], strict=False):
        assert all(r.session_id == agent.session_id for r in (prev, nxt))
    steps = of(events, StepDone)
    for a, b in zip(steps, steps[1:], strict=False):
        assert b.cached_tokens > a.cached_tokens and b.prompt_tokens > a.prompt_tokens
    context = store.context_tokens(agent.session_id)
    msgs = store.messages(agent.session_id)
    assert context == [t for m in msgs for t in m.token_ids]
    assert reqs[2].prompt_ids == context[: len(reqs[2].prompt_ids)]
    assert sum(1 for m in msgs if m.meta.get("example")) > 0
    assert done.cached_tokens == sum(s.cached_tokens for s in steps)

    # the rendered history still matches what was fed (no re-tokenization drift)
    text = engine.tokenizer.decode(context)
    assert text.endswith("<|im_start|>assistant\nIt printed: 5<|im_end|>")
    assert "<|im_start|>tool\nCreated calc.py" in text

    # transcript on disk == in memory == the session export
    records = read_transcript(tmp_path / "t.jsonl")
    assert [r["type"] for r in records] == [r["type"] for r in tr.records]
    assert_transcript_matches_session(agent, store, records)
    types = [r["type"] for r in records]
    assert types.count("request") == 3 and types.count("response") == 3 and types.count("tool_result") == 2
    assert records[-1]["type"] == "done" and records[-1]["reason"] == "answered"
    response = [r for r in records if r["type"] == "response"][0]
    assert response["constraint"]["tokens"] == response["usage"]["completion_tokens"]
    assert store.get(agent.session_id).meta["last_run"]["steps"] == 3


def test_malformed_calls_get_an_error_result_and_the_loop_goes_on(tmp_path):
    engine = ScriptedEngine([
        "<tool_call>{\"name\": \"write_file\", \"arguments\": {\"path\": \"a.txt\"</tool_call>",
        "<tool_call>\n{\"name\": \"nope\", \"arguments\": {}}\n</tool_call>",
        call("write_file", path="a.txt", content="ok"),
        "Done.",
    ])
    options = AgentOptions(system_prompt="t", examples=False, constrained=False)
    agent, events, store = run(engine, tmp_path, options=options)
    assert events[-1].reason == "answered" and (tmp_path / "a.txt").read_text() == "ok"
    bad = of(events, ToolCallMalformed)
    assert [b.call_id for b in bad] == ["call_1_0", "call_2_0"]
    results = of(events, ToolFinished)
    assert [r.approval for r in results] == ["malformed", "malformed", "allow"]
    assert "not valid JSON" in results[0].result.content and "<tool_call>" in results[0].result.content
    assert "unknown tool 'nope'" in results[1].result.content
    msgs = store.messages(agent.session_id)
    first = next(m for m in msgs if m.role == "assistant")
    assert first.tool_calls[0]["error"] and first.tool_calls[0]["function"]["name"] == "write_file"
    assert_transcript_matches_session(agent, store, agent.transcript.records)


def test_constraint_repairs_what_the_model_gets_wrong(tmp_path):
    # Under the grammar the "model" cannot leave the JSON unfinished or use an unknown key.
    engine = ScriptedEngine([
        '<tool_call>{"name": "write_file", "arguments": {"path": "a.txt", "colour": "x"}}</tool_call>',
        "Done.",
    ])
    agent, events, store = run(engine, tmp_path, limits=AgentLimits(steps=2))
    assert engine.substitutions > 0
    assert not of(events, ToolCallMalformed)
    parsed = of(events, ToolCallParsed)
    assert parsed and parsed[0].call.name == "write_file" and set(parsed[0].call.arguments) == {"path", "content"}


def test_failing_tool_result_is_recorded_and_the_agent_continues(tmp_path):
    engine = ScriptedEngine([
        call("edit_file", path="missing.txt", old_text="a", new_text="b"),
        call("bash", command="exit 3"),
        "Both failed.",
    ])
    agent, events, store = run(engine, tmp_path, options=AgentOptions(system_prompt="t", examples=False, allow=("bash",)))
    edit, bash = of(events, ToolFinished)
    assert not edit.result.ok and "does not exist" in edit.result.content
    assert bash.exit_code == 3 and bash.result.ok  # a non-zero exit is a result, not a tool failure
    tool_msgs = [m for m in store.messages(agent.session_id) if m.role == "tool"]
    assert tool_msgs[0].meta["ok"] is False and "does not exist" in tool_msgs[0].meta["error"]
    assert tool_msgs[1].meta["exit_code"] == 3
    assert events[-1].reason == "answered"


def test_cancelling_a_running_bash_stops_it_and_keeps_the_session_valid(tmp_path):
    engine = ScriptedEngine([call("bash", command="sleep 30; echo never"), "unused"])
    store = SessionStore()
    options = AgentOptions(system_prompt="t", examples=False, allow=("bash",))
    agent = AgentSession.create(engine, store, tmp_path, options=options)
    events, t_cancel = [], None
    for ev in agent.run("sleep"):
        events.append(ev)
        if isinstance(ev, ToolStarted):
            threading.Timer(0.3, agent.cancel).start()
            t_cancel = time.monotonic()
    elapsed = time.monotonic() - t_cancel
    assert elapsed < 5, "bash was not stopped promptly"
    finished = of(events, ToolFinished)[0]
    assert finished.result.data["cancelled"] and not finished.result.ok
    assert events[-1].reason == "cancelled" and events[-1].step == 1
    assert_transcript_matches_session(agent, store, agent.transcript.records)
    assert store.messages(agent.session_id)[-1].role == "tool"

    # the session continues: a new prompt extends the exact same context
    before = store.context_tokens(agent.session_id)
    engine.replies = ["All right."]
    again = AgentSession.open(engine, store, agent.session_id, options=options)
    events = list(again.run("never mind"))
    assert events[-1].reason == "answered"
    assert store.context_tokens(agent.session_id)[: len(before)] == before
    assert engine.requests[-1].prompt_ids[: len(before)] == before


def test_cancel_during_generation_stores_the_partial_reply(tmp_path):
    engine = ScriptedEngine([Reply("a very long answer " * 20, delay_s=0.01)])
    store = SessionStore()
    agent = AgentSession.create(engine, store, tmp_path, options=SHORT)
    events = []
    for ev in agent.run("talk"):
        events.append(ev)
        if isinstance(ev, StepStart):
            threading.Timer(0.1, agent.cancel).start()
    assert events[-1].reason == "cancelled"
    reply = store.messages(agent.session_id)[-1]
    assert reply.role == "assistant" and reply.meta["finish_reason"] == "cancelled"
    assert 0 < len(reply.token_ids) < len("a very long answer " * 20)


def test_approval_answers(tmp_path):
    engine = ScriptedEngine([call("bash", command="echo one"), call("bash", command="echo two"),
                             call("bash", command="echo three"), "done"])
    store = SessionStore()
    agent = AgentSession.create(engine, store, tmp_path, options=SHORT)  # profile: bash = ask
    asked, results = [], []
    answers = iter(["deny", "always"])
    for ev in agent.run("echo"):
        if isinstance(ev, ApprovalNeeded):
            asked.append(ev.call.arguments["command"])
            answer = next(answers)
            ev.deny("not now") if answer == "deny" else ev.approve_always()
        if isinstance(ev, ToolFinished):
            results.append((ev.approval, ev.result.content))
    assert asked == ["echo one", "echo two"]  # "always" covers the third call
    assert results[0][0] == "deny" and "did not allow" in results[0][1] and "not now" in results[0][1]
    assert results[1][0] == "always" and "two" in results[1][1]
    assert results[2][0] == "allow" and "three" in results[2][1]
    approvals = agent.transcript.of_type("approval")
    assert [a["decision"] for a in approvals] == ["deny", "always"]


def test_headless_policy_denies_ask_unless_allowed(tmp_path):
    profile = scripted_profile(approval={"bash": "ask", "write_file": "deny"})
    engine = ScriptedEngine([call("bash", command="echo hi"), call("write_file", path="a", content="b"), "ok"],
                            profile=profile)
    options = AgentOptions(system_prompt="t", examples=False, interactive=False, allow=("write_file",))
    agent, events, _ = run(engine, tmp_path, options=options)
    assert not of(events, ApprovalNeeded)
    bash, write = of(events, ToolFinished)
    assert bash.approval == "deny" and "--allow bash" in bash.result.content
    assert write.approval == "deny" and "disabled by the profile" in write.result.content
    assert agent.policy.ignored_allows() == ["write_file"]
    assert not (tmp_path / "a").exists()

    engine = ScriptedEngine([call("bash", command="echo hi"), "ok"], profile=profile)
    options = AgentOptions(system_prompt="t", examples=False, interactive=False, allow=("bash",))
    _, events, _ = run(engine, tmp_path, options=options)
    assert of(events, ToolFinished)[0].approval == "allow"


def test_tools_left_out_of_the_profile_are_not_offered(tmp_path):
    profile = scripted_profile(tools=("read_file", "list_dir"))
    engine = ScriptedEngine([call("bash", command="ls"), "ok"], profile=profile)
    options = AgentOptions(system_prompt="t", examples=False, constrained=False)
    agent, events, store = run(engine, tmp_path, options=options)
    assert agent.registry.names() == ["read_file", "list_dir"]
    assert "unknown tool 'bash'" in of(events, ToolFinished)[0].result.content
    system = store.messages(agent.session_id)[0].content
    assert "list_dir(" in system and "bash(" not in system


@pytest.mark.parametrize("limits, replies, reason", [
    # distinct calls: the same call twice with nothing changed would stop the run as "repeated"
    (AgentLimits(steps=2), [call("read_file", path=f"f{i}") for i in range(5)], "max_steps"),
    (AgentLimits(tokens=100), [call("list_dir"), call("list_dir", path="."), call("list_dir")], "max_tokens"),
    (AgentLimits(wall_s=0.3), [Reply(call("read_file", path=f"f{i}"), delay_s=0.02) for i in range(50)], "wall_time"),
])
def test_limits(tmp_path, limits, replies, reason):
    engine = ScriptedEngine(replies)
    agent, events, store = run(engine, tmp_path, limits=limits)
    done = events[-1]
    assert done.reason == reason
    if reason == "max_steps":
        assert done.step == 2
    if reason == "max_tokens":
        assert done.completion_tokens == 100
        first = of(events, StepDone)[0].completion_tokens
        assert [r.params.max_tokens for r in engine.requests] == [100, 100 - first]
        assert not of(events, ToolCallMalformed)  # too little budget: the call was not opened
        assert len(of(events, ToolCallParsed)) == 1
    # a limit never leaves a call without its result
    assert_transcript_matches_session(agent, store, agent.transcript.records)


def test_profile_max_steps_is_the_default_limit(tmp_path):
    # distinct calls: identical ones in a row would stop the run as "repeated" first
    engine = ScriptedEngine([call("read_file", path=f"f{i}.txt") for i in range(10)], profile=scripted_profile(max_steps=3))
    _, events, _ = run(engine, tmp_path)
    assert events[-1].reason == "max_steps" and events[-1].step == 3


def test_compaction_shortens_old_tool_output_and_keeps_the_prefix(tmp_path):
    big = "python3 -c \"print('{}' * 3000)\""
    engine = ScriptedEngine([call("bash", command=big.format(c)) for c in "xyz"] + ["done"],
                            profile=scripted_profile(max_context=9000, max_tokens=300))
    options = AgentOptions(system_prompt="t", examples=False, allow=("bash",))
    store = SessionStore()
    agent = AgentSession.create(engine, store, tmp_path, options=options)
    snapshots = []
    events = []
    for ev in agent.run("print a lot"):
        events.append(ev)
        if isinstance(ev, StepStart):
            snapshots.append(store.messages(agent.session_id))
    done = events[-1]
    assert done.reason == "answered"
    compactions = of(events, Compacted)
    assert compactions, "the context never got compacted"
    first = compactions[0]
    assert first.tokens_after < first.tokens_before and first.chars_removed > 2000
    msgs = store.messages(agent.session_id)
    shortened = [m for m in msgs if m.meta.get("compacted")]
    assert [m.index for m in shortened] == list(first.messages)
    assert "characters of tool output removed" in shortened[0].content
    assert shortened[0].meta["compacted"]["original_chars"] > 3000
    # everything before the first shortened message kept its exact tokens (KV prefix stable)
    before = next(s for s in snapshots if len(s) > first.messages[0])
    for old, new in zip(before[: first.messages[0]], msgs[: first.messages[0]], strict=True):
        assert old.token_ids == new.token_ids
    # assistant turns keep their generated tokens through the rebuild
    old_assistant = [m.token_ids for m in before if m.role == "assistant"]
    assert [m.token_ids for m in msgs if m.role == "assistant"][: len(old_assistant)] == old_assistant
    assert all(len(r.prompt_ids) < 9000 for r in engine.requests)
    assert store.get(agent.session_id).meta["compactions"][0]["messages"] == list(first.messages)
    assert_transcript_matches_session(agent, store, agent.transcript.records)
    assert store.context_tokens(agent.session_id) == [t for m in msgs for t in m.token_ids]


def test_context_too_small_stops_with_context(tmp_path):
    engine = ScriptedEngine(["never"], profile=scripted_profile(max_context=300, max_tokens=200))
    _, events, _ = run(engine, tmp_path, options=AgentOptions(system_prompt="x" * 200, examples=False))
    assert events[-1].reason == "context"


def test_engine_error_ends_the_run(tmp_path):
    engine = ScriptedEngine([Reply("", error="out of memory")])
    _, events, _ = run(engine, tmp_path)
    assert events[-1].reason == "error" and events[-1].error == "out of memory"


def test_native_tool_template(tmp_path):
    engine = ScriptedEngine([call("write_file", path="n.txt", content="native"), "ok"], template=CHATML_TOOLS)
    agent, events, store = run(engine, tmp_path, options=AgentOptions(system_prompt="Be brief.", examples=False))
    assert agent.native_tools and agent.describe()["protocol"] == "native"
    text = engine.tokenizer.decode(store.context_tokens(agent.session_id))
    assert "<tools>{\"type\": \"function\", \"function\": {\"name\": \"read_file\"" in text
    assert "# Tools" not in text  # the template lists tools; no text block in the system prompt
    assert "<|im_start|>user\n<tool_response>\nCreated n.txt" in text
    assert (tmp_path / "n.txt").read_text() == "native" and events[-1].reason == "answered"


async def test_async_run_with_approval_from_the_event_loop(tmp_path):
    engine = ScriptedEngine([call("bash", command="echo async"), "fine"])
    agent = AgentSession.create(engine, SessionStore(), tmp_path, options=SHORT)
    seen = []
    async for ev in agent.run_async("go"):
        seen.append(type(ev).__name__)
        if isinstance(ev, ApprovalNeeded):
            await asyncio.sleep(0.05)  # the agent thread waits for the answer
            ev.approve()
        if isinstance(ev, ToolFinished):
            assert "async" in ev.result.content
    assert seen[-1] == "AgentDone" and "ApprovalNeeded" in seen


def test_completion_mode_engines_are_refused(tmp_path):
    class Raw(ScriptedEngine):
        completion_mode = True

    with pytest.raises(AgentError, match="no chat template"):
        AgentSession.create(Raw([]), SessionStore(), tmp_path)


def test_open_rejects_chat_sessions(tmp_path):
    store = SessionStore()
    chat = store.create(title="chat", kind="chat")
    with pytest.raises(AgentError, match="not an agent session"):
        AgentSession.open(ScriptedEngine([]), store, chat.id)


def test_cancel_before_run_stops_at_once_and_next_run_is_fresh(tmp_path):
    engine = ScriptedEngine(["never", "fresh answer"])
    agent = AgentSession.create(engine, SessionStore(), tmp_path, options=SHORT)
    agent.cancel()
    events = list(agent.run("first"))
    assert events[-1].reason == "cancelled" and events[-1].step == 0 and not engine.requests
    events = list(agent.run("second"))
    assert events[-1].reason == "answered" and events[-1].final_text == "never"


@pytest.mark.parametrize("forced", [False, True])
def test_first_step_tool_call_commits_step_one_of_each_task_to_a_call(tmp_path, forced):
    # A model that claims the work instead of doing it: under first_step_tool_call the grammar
    # makes step 1 of every task a call; later steps may still answer in text.
    claim, answer = "The file a.txt now contains: hi", "Done."
    engine = ScriptedEngine([claim, answer, claim, answer] if forced else [claim, claim],
                            profile=scripted_profile(first_step_tool_call=forced))
    options = AgentOptions(system_prompt="You are a test agent.", examples=False, tools=("write_file",),
                           corrective_turns=0)  # the grammar alone, not the corrective turn
    agent, first, store = run(engine, tmp_path, "create a.txt containing exactly: hi", options)
    second = list(agent.run("create b.txt containing exactly: hi"))
    for events in (first, second):
        done = events[-1]
        assert isinstance(done, AgentDone) and done.reason == "answered"
        if forced:
            assert [p.step for p in of(events, ToolCallParsed)] == [1]
            assert done.step == 2 and done.final_text == answer
        else:
            assert not of(events, ToolCallParsed) and done.step == 1 and done.final_text == claim
    assert (engine.substitutions > 0) == forced
    assert_transcript_matches_session(agent, store, agent.transcript.records)
