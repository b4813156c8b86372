"""ChatService: exact token history across turns, cache reuse, retry and fork."""

from engine.runtime import Engine
from engine.sessions import SessionStore
from engine.sessions.chat import ChatService, junction_tail

import pytest


@pytest.fixture(scope="module")
def engine(tmp_path_factory, tiny_llama_dir):
    from tests.tiny_models import write_profile

    path = write_profile(
        tmp_path_factory.mktemp("p") / "tiny-chat.yaml",
        tiny_llama_dir,
        chat={"system_prompt": "Be brief."},
        sampling={"max_tokens": 10},
    )
    eng = Engine.load(str(path))
    yield eng
    eng.close()


def test_turns_extend_the_exact_context(engine, tmp_path):
    store = SessionStore(tmp_path / "s.sqlite3")
    chat = ChatService(engine, store)
    sid = chat.create().id
    prev_total = 0
    for i, text in enumerate(["hello", "and the other thing?", "thanks"]):
        turn = chat.send(sid, text)
        done = turn.result()
        ctx = store.context_tokens(sid)
        # the prompt was the stored context before the reply; the reply's ids follow it
        assert done.prompt_token_ids == ctx[: len(done.prompt_token_ids)]
        assert ctx[len(done.prompt_token_ids):] == done.completion_token_ids
        if i:
            assert done.cache_source == "ram"
            assert done.usage.cached_tokens >= prev_total - 1
        prev_total = len(ctx)
    msgs = store.messages(sid)
    assert [m.role for m in msgs] == ["system", "user", "assistant"] * 1 + ["user", "assistant"] * 2
    assert store.get(sid).title == "hello"


def test_history_tokens_match_a_fresh_render_when_replies_end_with_eos(engine, tmp_path):
    store = SessionStore(tmp_path / "s.sqlite3")
    chat = ChatService(engine, store)
    sid = chat.create().id
    tok = engine.tokenizer
    eos = tok.token_to_id("<|im_end|>")
    # Store a reply by hand that ended on the model's own end token, as a real one would.
    chat.send(sid, "first").result()
    store.delete_last(sid, 1)
    store.add_message(sid, "assistant", "ok", token_ids=tok.encode("ok") + [eos])
    chat.send(sid, "second").result()
    msgs = store.messages(sid)
    dicts = [{"role": m.role, "content": m.content} for m in msgs[:-1]]
    rendered = engine.render(dicts, add_generation_prompt=True)
    fed = tok.decode(store.context_tokens(sid, upto=len(msgs) - 1))
    assert fed == rendered


def test_reply_cut_by_budget_gets_the_template_closing(engine, tmp_path):
    store = SessionStore(tmp_path / "s.sqlite3")
    chat = ChatService(engine, store)
    sid = chat.create().id
    first = chat.send(sid, "go", max_tokens=3).result()
    assert first.finish_reason == "length"
    chat.send(sid, "next").result()
    user2 = store.messages(sid)[3]
    assert engine.tokenizer.decode(user2.token_ids).startswith("<|im_end|>\n<|im_start|>user\nnext")


def test_retry_replaces_last_reply(engine, tmp_path):
    store = SessionStore(tmp_path / "s.sqlite3")
    chat = ChatService(engine, store)
    sid = chat.create().id
    chat.send(sid, "hello").result()
    n = len(store.messages(sid))
    again = chat.retry(sid, temperature=1.0, seed=3).result()
    msgs = store.messages(sid)
    assert len(msgs) == n and msgs[-1].content == again.text
    assert again.usage.cached_tokens > 0  # the prompt is unchanged: its KV is reused


def test_fork_first_turn_reuses_parent_prefix(engine, tmp_path):
    store = SessionStore(tmp_path / "s.sqlite3")
    chat = ChatService(engine, store)
    sid = chat.create().id
    chat.send(sid, "one").result()
    chat.send(sid, "two").result()
    child = chat.fork(sid, at=3)  # system, user "one", its reply
    done = chat.send(child.id, "three").result()
    assert done.usage.cached_tokens >= len(store.context_tokens(sid, upto=3)) - 1


def test_junction_tail():
    assert junction_tail("A<|im_end|>\n", "A<|im_end|>") == "\n"
    assert junction_tail("A stopped<|im_end|>\n", "A stopped") == "<|im_end|>\n"
    # template stripped reasoning from history: match on the end of what was fed
    assert junction_tail("ans<|im_end|>\n", "<think>x</think>ans<|im_end|>") == "\n"
