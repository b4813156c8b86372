"""Nothing the user saw is lost: a streaming reply is in the store as it grows.

The kill -9 test runs ``mlxterm generate --session`` as a real subprocess on a tiny model,
kills it mid-reply (gated on what the store holds, not on a sleep), and checks that the
partial reply and its exact token ids survived, that it is marked interrupted when the
session is continued, and that the next turn is a valid conversation reusing the KV
checkpoint of the turn before.
"""

from __future__ import annotations

import json
import os
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

from engine.sessions import SessionStore
from engine.sessions import partial as partial_mod
from engine.sessions.partial import SAVE_EVERY_TOKENS, PartialReply, recover_interrupted

import pytest

REPO = Path(__file__).resolve().parents[1]


class FakeHandle:
    def __init__(self):
        self.token_ids: list[int] = []


class Clock:
    def __init__(self):
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


# -- PartialReply -----------------------------------------------------------------------------

def test_saves_every_few_dozen_tokens_or_every_second_with_exact_ids():
    store = SessionStore()
    sid = store.create(profile="p").id
    store.add_message(sid, "user", "hi", token_ids=[1, 2])
    handle, clock = FakeHandle(), Clock()
    reply = PartialReply(store, sid, handle, clock=clock)
    handle.token_ids.extend(range(100, 100 + SAVE_EVERY_TOKENS - 1))
    reply.update("a" * 10)
    assert store.get(sid).message_count == 1  # not yet: under the token and time thresholds
    handle.token_ids.append(7)
    reply.update("a" * 11)
    msgs = store.messages(sid)
    assert len(msgs) == 2 and list(msgs[1].token_ids) == handle.token_ids and msgs[1].content == "a" * 11
    assert msgs[1].meta["streaming"]["pid"] == os.getpid()
    handle.token_ids.extend([8, 9])
    reply.update("a" * 12)
    assert store.messages(sid)[1].token_ids[-1] == 7  # two tokens, no time passed: not saved
    clock.t = 1.0
    reply.update("a" * 12)
    assert list(store.messages(sid)[1].token_ids[-2:]) == [8, 9]  # a second later: saved
    assert store.get(sid).token_count == 2 + len(handle.token_ids)
    final = reply.finish("the end", token_ids=[*handle.token_ids, 2], meta={"finish_reason": "stop"})
    msgs = store.messages(sid)
    assert len(msgs) == 2 and msgs[1].id == final.id and msgs[1].content == "the end"
    assert "streaming" not in msgs[1].meta and msgs[1].token_ids[-1] == 2
    assert recover_interrupted(store, sid) is None  # a finished reply is left alone


def test_recover_marks_a_dead_writers_reply_and_leaves_live_ones(monkeypatch):
    store = SessionStore()
    sid = store.create(profile="p").id
    store.add_message(sid, "user", "hi", token_ids=[1])
    handle = FakeHandle()
    handle.token_ids.extend([5, 6, 7])
    reply = PartialReply(store, sid, handle)
    reply.save("partial")
    assert recover_interrupted(store, sid) is None  # still streaming in this process
    reply.close()  # this process stopped streaming without finishing (as after a crash)
    # a writer that is another live process is left alone
    store.update_message(sid, meta={"streaming": {"pid": os.getppid(), "started": 0}})
    assert recover_interrupted(store, sid) is None
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    store.update_message(sid, meta={"streaming": {"pid": dead.pid, "started": 0}})
    msg = recover_interrupted(store, sid)
    assert msg is not None and msg.meta == {"interrupted": True, "finish_reason": "interrupted"}
    assert msg.content == "partial" and list(store.messages(sid)[-1].token_ids) == [5, 6, 7]


def test_an_agent_step_interrupted_mid_reply_is_kept_and_the_next_run_follows_it(tmp_path):
    from agents.events import AgentDone
    from agents.scripted import ScriptedEngine
    from agents.session import AgentOptions, AgentSession

    engine = ScriptedEngine(["the answer"])
    store = SessionStore()
    options = AgentOptions(system_prompt="t", examples=False)
    agent = AgentSession.create(engine, store, tmp_path, options=options)
    sid = agent.session_id
    # A step's reply as a killed process leaves it: user message, then a partial reply.
    agent.context.append([{"role": "user", "content": "first task"}], generation_prompt=True, metas=[{}])
    handle = FakeHandle()
    handle.token_ids.extend(engine.tokenizer.encode("I will st"))
    step = PartialReply(store, sid, handle, meta={"step": 1})
    step.save("I will st")
    step.close()
    store.update_message(sid, meta={"step": 1, "streaming": {"pid": 2**22 + 1, "started": 0}})  # no such pid

    again = AgentSession.open(engine, store, sid, options=options)
    events = list(again.run("second task"))
    assert isinstance(events[-1], AgentDone) and events[-1].final_text == "the answer"
    msgs = store.messages(sid)
    roles = [m.role for m in msgs]
    assert roles[-4:] == ["user", "assistant", "user", "assistant"]
    kept = msgs[-3]
    assert kept.content == "I will st" and kept.meta["interrupted"] and kept.meta["step"] == 1
    assert list(kept.token_ids) == engine.tokenizer.encode("I will st")
    # the next prompt extends the kept tokens and closes the interrupted turn first
    prompt = engine.requests[-1].prompt_ids
    assert list(prompt[: sum(m.token_count for m in msgs[:-2])]) == [t for m in msgs[:-2] for t in m.token_ids]
    assert engine.tokenizer.decode(msgs[-2].token_ids).startswith("<|im_end|>")


# -- kill -9 of a real process mid-reply ------------------------------------------------------

def _generate(profile: Path, session: str, prompt: str, max_tokens: int, *extra: str) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.Popen(
        [sys.executable, "-m", "app", "generate", "--profile", str(profile), "--session", session,
         "--prompt", prompt, "--max-tokens", str(max_tokens), *extra],
        cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _streaming_tokens(db: Path, session: str) -> int:
    """Tokens of the session's last message while it is still marked streaming (0 if none)."""
    if not db.exists():
        return 0
    try:
        with sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=5) as conn:
            row = conn.execute("SELECT token_count, meta FROM messages WHERE session_id = ? "
                               "ORDER BY idx DESC LIMIT 1", (session,)).fetchone()
    except sqlite3.OperationalError:
        return 0
    return row[0] if row and "streaming" in json.loads(row[1] or "{}") else 0


def _kill_mid_reply(proc: subprocess.Popen, db: Path, session: str, at_least: int) -> None:
    deadline = time.monotonic() + 180  # generous: a loaded 2-core machine
    while _streaming_tokens(db, session) < at_least:
        assert proc.poll() is None, f"the reply ended before it was killed: {proc.communicate()[1][-500:]}"
        assert time.monotonic() < deadline, "no partial reply appeared in the store"
        time.sleep(0.02)
    proc.send_signal(signal.SIGKILL)
    proc.communicate(timeout=60)
    assert proc.returncode == -signal.SIGKILL


@pytest.fixture
def long_profile(tmp_path, tiny_llama_dir):
    from tests.tiny_models import write_profile

    # Greedy decoding of the random-weight model never emits the end token within 4000 tokens,
    # so the reply is still streaming whenever the test decides to kill it.
    return write_profile(tmp_path / "tiny-long.yaml", tiny_llama_dir, context={"max_context": 4096},
                         sampling={"max_tokens": 4000})


def test_kill_9_mid_reply_keeps_the_partial_reply_and_the_next_turn_reuses_the_checkpoint(
        long_profile, _isolated_home):
    from engine.paths import data_dir
    from engine.runtime import Engine, GenerationRequest

    db = data_dir() / "sessions.sqlite3"
    first = _generate(long_profile, "chat", "hello", 12)
    first.communicate(timeout=300)
    assert first.returncode == 0
    store = SessionStore(db)
    turn1 = store.context_tokens("chat")

    second = _generate(long_profile, "chat", "tell me more", 4000)
    _kill_mid_reply(second, db, "chat", at_least=64)

    msgs = store.messages("chat")
    assert [m.role for m in msgs] == ["user", "assistant", "user", "assistant"]
    partial = msgs[-1]
    assert partial.token_count >= 64 and "streaming" in partial.meta and partial.content

    # Exact ids: a fresh greedy generation from the same prompt starts with the saved ids.
    prompt = [t for m in msgs[:-1] for t in m.token_ids]
    with Engine.load(str(long_profile)) as eng:
        ref = eng.submit(GenerationRequest(prompt, eng.sampling(max_tokens=partial.token_count))).result()
    assert list(partial.token_ids) == ref.completion_token_ids[: partial.token_count]
    assert ref.text.startswith(partial.content)

    third = _generate(long_profile, "chat", "and then?", 8, "--json")
    out, err = third.communicate(timeout=300)
    assert third.returncode == 0, err
    result = json.loads(out)
    assert result["cache"]["source"] == "ssd" and result["usage"]["cached_tokens"] >= len(turn1)

    msgs = store.messages("chat")
    assert [m.role for m in msgs] == ["user", "assistant", "user", "assistant", "user", "assistant"]
    kept = msgs[3]
    assert kept.meta.get("interrupted") is True and kept.meta["finish_reason"] == "interrupted"
    assert kept.token_ids == partial.token_ids and "streaming" not in kept.meta
    # The next user message closes the interrupted turn before its own text.
    assert eng.tokenizer.decode(msgs[4].token_ids).startswith("<|im_end|>\n<|im_start|>user\nand then?")
    assert result["usage"]["prompt_tokens"] == sum(m.token_count for m in msgs[:5])
    assert not any(key[1] == "chat" for key in partial_mod._live)
