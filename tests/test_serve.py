"""``mlxterm serve`` against the official OpenAI Python SDK, on loopback, with a tiny model."""

from __future__ import annotations

import http.client
import json
import signal
import socket
import time
from concurrent.futures import ThreadPoolExecutor
from urllib.parse import urlparse

import openai  # test extra: installed by ./setup.sh --test
import pytest

from tests.serve_server import running_server

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "the weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
CONTEXT = 8192


@pytest.fixture(scope="module")
def profile(tmp_path_factory, tiny_llama_dir):
    from tests.tiny_models import write_profile

    return write_profile(tmp_path_factory.mktemp("serve") / "tiny.yaml", tiny_llama_dir,
                         context={"max_context": CONTEXT}, batch={"cap": 4})


@pytest.fixture(scope="module")
def server(profile, tmp_path_factory):
    with running_server(profile, tmp_path_factory.mktemp("serve-home")) as s:
        yield s


@pytest.fixture
def client(server):
    return openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0, timeout=120)


def _chat(client, text: str, **kw):
    kw.setdefault("max_tokens", 16)
    kw.setdefault("temperature", 0)
    return client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": text}], **kw)


def test_models_and_health(client, server):
    ids = [m.id for m in client.models.list().data]
    assert ids == ["tiny"]
    h = server.health()
    assert h["status"] == "ok" and h["model"] == "tiny"


def test_plain_chat_is_the_engines_greedy_text(client, profile):
    from engine.runtime import Engine

    r = _chat(client, "hello there")
    choice = r.choices[0]
    assert r.object == "chat.completion" and choice.message.role == "assistant"
    assert choice.finish_reason in ("stop", "length")
    with Engine.load(str(profile)) as engine:
        ids = engine.chat_prompt([{"role": "user", "content": "hello there"}])
        done = engine.generate(ids, max_tokens=16, temperature=0.0)
    assert choice.message.content == done.text
    assert r.usage.prompt_tokens == len(ids)
    assert r.usage.completion_tokens == len(done.completion_token_ids)
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens


def test_stream_matches_plain_and_ends_with_done(client, server):
    plain = _chat(client, "stream me", max_tokens=20).choices[0].message.content
    chunks = list(_chat(client, "stream me", max_tokens=20, stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == plain
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] in ("stop", "length")
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens > 0
    # the raw wire format: server-sent events ending in data: [DONE]
    events = _raw_sse(server, {"model": "tiny", "stream": True, "max_tokens": 5,
                               "messages": [{"role": "user", "content": "raw"}]})
    assert events[-1] == "[DONE]"
    assert all(json.loads(e)["object"] == "chat.completion.chunk" for e in events[:-1])


def test_completions_plain_stream_and_logprobs(client):
    r = client.completions.create(model="tiny", prompt="the cat sat", max_tokens=8, temperature=0, logprobs=2)
    c = r.choices[0]
    assert r.object == "text_completion" and r.usage.completion_tokens == len(c.logprobs.tokens)
    assert all(lp <= 0 for lp in c.logprobs.token_logprobs)
    assert all(len(top) <= 2 for top in c.logprobs.top_logprobs)
    assert "".join(c.logprobs.tokens).replace("\ufffd", "") == c.text.replace("\ufffd", "")
    streamed = client.completions.create(model="tiny", prompt="the cat sat", max_tokens=8, temperature=0, stream=True)
    assert "".join(ch.choices[0].text for ch in streamed if ch.choices) == c.text


def test_chat_logprobs(client):
    r = _chat(client, "numbers", max_tokens=6, logprobs=True, top_logprobs=3)
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens
    for tok in content:
        assert len(tok.top_logprobs) == 3
        assert tok.top_logprobs[0].logprob >= tok.logprob - 1e-5  # greedy: the top choice was taken
        assert bytes(tok.bytes).decode("utf-8", "replace") == tok.token


def test_follow_up_turn_reuses_cached_prefix(client):
    first = _chat(client, "tell me about caching in one line", max_tokens=12)
    assert first.usage.prompt_tokens_details.cached_tokens < first.usage.prompt_tokens
    history = [{"role": "user", "content": "tell me about caching in one line"},
               {"role": "assistant", "content": first.choices[0].message.content},
               {"role": "user", "content": "and again"}]
    second = client.chat.completions.create(model="tiny", messages=history, max_tokens=8, temperature=0)
    assert second.usage.prompt_tokens_details.cached_tokens >= first.usage.prompt_tokens - 1
    # pinned to a checkpoint session with X-Session-Id: the same reuse, the same text
    third = client.chat.completions.create(model="tiny", messages=history, max_tokens=8, temperature=0,
                                           extra_headers={"X-Session-Id": "conv-1"})
    assert third.choices[0].message.content == second.choices[0].message.content
    assert third.usage.prompt_tokens_details.cached_tokens >= first.usage.prompt_tokens - 1


def test_seed_reproducible(client):
    def sample(seed):
        return _chat(client, "a random story", max_tokens=24, temperature=1.0, seed=seed).choices[0].message.content

    a = sample(7)
    assert sample(7) == a
    assert any(sample(s) != a for s in (8, 9, 10))


def _error(call):
    with pytest.raises(openai.APIStatusError) as info:
        call()
    body = info.value.response.json()
    assert set(body["error"]) == {"message", "type", "param", "code"}
    return info.value.status_code, body["error"]


def test_errors_are_openai_shaped(client, server):
    status, err = _error(lambda: client.chat.completions.create(model="tiny", messages=[]))
    assert status == 400 and err["param"] == "messages" and err["type"] == "invalid_request_error"
    status, err = _error(lambda: _chat(client, "x", temperature=5))
    assert status == 400 and err["param"] == "temperature"
    status, err = _error(lambda: _chat(client, "x", n=2))
    assert status == 400 and err["param"] == "n"
    status, err = _error(lambda: client.chat.completions.create(
        model="tiny", messages=[{"role": "wizard", "content": "x"}]))
    assert status == 400 and "role" in err["message"]
    status, err = _error(lambda: client.chat.completions.create(
        model="gpt-4o", messages=[{"role": "user", "content": "x"}]))
    assert status == 404 and err["code"] == "model_not_found" and "tiny" in err["message"]
    status, err = _error(lambda: _chat(client, "word " * CONTEXT))
    assert status == 400 and err["code"] == "context_length_exceeded" and str(CONTEXT) in err["message"]
    status, err = _error(lambda: _chat(client, "x", tools=[WEATHER],
                                       tool_choice={"type": "function", "function": {"name": "nope"}}))
    assert status == 400 and err["param"] == "tool_choice"
    # a body that is not JSON
    conn = _conn(server)
    conn.request("POST", "/v1/chat/completions", body=b"{not json", headers={"Content-Type": "application/json"})
    resp = conn.getresponse()
    assert resp.status == 400 and "not valid JSON" in json.loads(resp.read())["error"]["message"]


def test_concurrent_requests_return_their_solo_greedy_text(client, server):
    prompts = [f"request number {i} says {'hi ' * i}" for i in range(6)]
    solo = [_chat(client, p, max_tokens=24).choices[0].message.content for p in prompts]
    with ThreadPoolExecutor(len(prompts)) as pool:
        together = list(pool.map(lambda p: _chat(client, p, max_tokens=24).choices[0].message.content, prompts))
    assert together == solo
    assert server.wait_idle()["active"] == 0


def test_tool_call_in_openai_shape(client):
    r = _chat(client, "what is the weather in Paris?", tools=[WEATHER], tool_choice="required", max_tokens=200)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls"
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.function.name == "get_weather" and call.id
    assert isinstance(json.loads(call.function.arguments)["city"], str)
    # streamed: the same call arrives as a tool_calls delta
    chunks = list(_chat(client, "what is the weather in Paris?", tools=[WEATHER], tool_choice="required",
                        max_tokens=200, stream=True))
    deltas = [tc for c in chunks if c.choices for tc in (c.choices[0].delta.tool_calls or [])]
    assert [(d.function.name, d.function.arguments) for d in deltas] == [("get_weather", call.function.arguments)]
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    # the follow-up turn with the call and its result renders and answers
    follow = client.chat.completions.create(model="tiny", max_tokens=8, temperature=0, tools=[WEATHER], messages=[
        {"role": "user", "content": "what is the weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": "sunny, 21 C"}])
    assert follow.usage.prompt_tokens > r.usage.prompt_tokens


def test_tools_with_any_parameter_types(client):
    """Number, object, untyped and type-list properties: offered in the prompt and answered
    (decoded unconstrained, arguments taken as the model writes them), never a 500."""
    search = {"type": "function", "function": {"name": "search", "description": "search the web", "parameters": {
        "type": "object", "required": ["query"], "properties": {
            "query": {"description": "anything"}, "ratio": {"type": "number"},
            "filters": {"type": "object"}, "limit": {"type": ["integer", "null"]}}}}}
    r = _chat(client, "find cats", tools=[search, WEATHER], max_tokens=12)
    assert r.choices[0].finish_reason in ("stop", "length", "tool_calls")
    assert r.usage.prompt_tokens > _chat(client, "find cats", max_tokens=1).usage.prompt_tokens  # tools offered


def test_disconnect_cancels_the_request(server):
    before = server.wait_idle()
    body = {"model": "tiny", "stream": True, "max_tokens": CONTEXT, "ignore_eos": True,
            "messages": [{"role": "user", "content": "go on forever"}]}
    conn = _conn(server)
    conn.request("POST", "/v1/chat/completions", body=json.dumps(body), headers={"Content-Type": "application/json"})
    resp = conn.getresponse()
    assert resp.status == 200
    for _ in range(5):
        assert resp.fp.readline()
    assert server.health()["active"] == 1
    conn.sock.shutdown(socket.SHUT_RDWR)
    conn.close()
    t = time.monotonic()
    after = server.wait_for(lambda h: h["active"] == 0 and h["disconnected"] > before["disconnected"]
                            and h["finished"].get("cancelled", 0) > before["finished"].get("cancelled", 0), 10)
    assert time.monotonic() - t < 5  # the engine gave the row up at once, not at its max_tokens
    assert after["active"] == 0
    assert after["disconnected"] == before["disconnected"] + 1
    assert after["finished"].get("cancelled", 0) == before["finished"].get("cancelled", 0) + 1
    # a non-streaming client that gives up is cancelled too
    conn = _conn(server, timeout=0.5)
    conn.request("POST", "/v1/chat/completions", body=json.dumps({**body, "stream": False}),
                 headers={"Content-Type": "application/json"})
    with pytest.raises(TimeoutError):
        conn.getresponse()
    conn.close()
    again = server.wait_for(lambda h: h["active"] == 0 and h["finished"].get("cancelled", 0)
                            > after["finished"].get("cancelled", 0), 10)
    assert again["active"] == 0
    assert again["finished"].get("cancelled", 0) == after["finished"].get("cancelled", 0) + 1


def test_queue_full_gets_503_with_retry_after(tiny_llama_dir, tmp_path):
    from tests.tiny_models import write_profile

    prof = write_profile(tmp_path / "one.yaml", tiny_llama_dir, context={"max_context": CONTEXT}, batch={"cap": 1})
    with running_server(prof, tmp_path / "home", "--max-queue", "0") as s:
        conn = _conn(s)
        conn.request("POST", "/v1/chat/completions", headers={"Content-Type": "application/json"}, body=json.dumps(
            {"model": "one", "stream": True, "max_tokens": CONTEXT, "ignore_eos": True,
             "messages": [{"role": "user", "content": "busy"}]}))
        resp = conn.getresponse()
        assert resp.fp.readline()
        c = openai.OpenAI(base_url=s.base_url, api_key="x", max_retries=0)
        with pytest.raises(openai.APIStatusError) as info:
            c.chat.completions.create(model="one", messages=[{"role": "user", "content": "me too"}])
        assert info.value.status_code == 503
        assert info.value.response.headers["retry-after"] == "1"
        assert info.value.response.json()["error"]["code"] == "server_busy"
        conn.close()
        assert s.wait_idle(10)["active"] == 0


def test_api_key_and_graceful_shutdown_flushes_checkpoints(profile, tmp_path):
    env = {"SERVE_TEST_KEY": "s3cret"}
    home = tmp_path / "home"
    with running_server(profile, home, "--api-key-env", "SERVE_TEST_KEY", env=env) as s:
        bad = openai.OpenAI(base_url=s.base_url, api_key="wrong", max_retries=0)
        with pytest.raises(openai.AuthenticationError):
            bad.models.list()
        good = openai.OpenAI(base_url=s.base_url, api_key="s3cret", max_retries=0)
        r = _chat(good, "remember this", max_tokens=8)
        assert r.usage.completion_tokens > 0
        assert s.stop(sig=signal.SIGTERM) == 0
        assert "stopped" in "".join(s.lines)
    files = list((home / "data" / "checkpoints").rglob("*.safetensors"))
    assert files, "no checkpoint on disk after shutdown"


def test_non_loopback_needs_a_key(profile, monkeypatch):
    from app.cli import main

    monkeypatch.delenv("NO_SUCH_KEY_VAR", raising=False)
    assert main(["serve", "--profile", str(profile), "--host", "0.0.0.0"]) == 2
    assert main(["serve", "--profile", str(profile), "--host", "0.0.0.0", "--api-key-env", "NO_SUCH_KEY_VAR"]) == 2


@pytest.mark.e2e
def test_default_model_e2e(tmp_path):
    """The default profile (SmolLM2-135M weights): plain, streamed, and the follow-up's cache."""
    with running_server("smollm2-135m", tmp_path / "home") as s:
        c = openai.OpenAI(base_url=s.base_url, api_key="x", max_retries=0, timeout=300)
        msgs = [{"role": "user", "content": "What is the capital of France?"}]
        r = c.chat.completions.create(model="smollm2-135m", messages=msgs, max_tokens=24, temperature=0)
        text = r.choices[0].message.content
        assert "Paris" in text
        chunks = c.chat.completions.create(model="smollm2-135m", messages=msgs, max_tokens=24, temperature=0,
                                           stream=True)
        assert "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices) == text
        follow = c.chat.completions.create(model="smollm2-135m", max_tokens=8, temperature=0, messages=[
            *msgs, {"role": "assistant", "content": text}, {"role": "user", "content": "And of Italy?"}])
        assert follow.usage.prompt_tokens_details.cached_tokens >= r.usage.prompt_tokens - 1


# -- helpers ------------------------------------------------------------------------------------
def _conn(server, timeout: float = 60) -> http.client.HTTPConnection:
    u = urlparse(server.url)
    return http.client.HTTPConnection(u.hostname, u.port, timeout=timeout)


def _raw_sse(server, body: dict) -> list[str]:
    conn = _conn(server)
    conn.request("POST", "/v1/chat/completions", body=json.dumps(body), headers={"Content-Type": "application/json"})
    resp = conn.getresponse()
    assert resp.status == 200 and resp.getheader("content-type").startswith("text/event-stream")
    events = [line[len("data: "):] for line in resp.read().decode().splitlines() if line.startswith("data: ")]
    conn.close()
    return events

