"""The Engine facade on a tiny random model: events, cancellation, stops, reuse, async."""

import time

from engine.runtime import Engine, GenerationRequest
from engine.serving.events import Done, TextDelta

import pytest


@pytest.fixture(scope="module")
def tiny_engine(tmp_path_factory, tiny_llama_dir):
    from tests.tiny_models import write_profile

    profile = write_profile(tmp_path_factory.mktemp("p") / "tiny.yaml", tiny_llama_dir)
    eng = Engine.load(str(profile))
    yield eng
    eng.close()


@pytest.fixture(scope="module")
def long_engine(tmp_path_factory, tiny_llama_dir):
    """The tiny model with a context no test reply reaches (a budget is cut to the context)."""
    from tests.tiny_models import write_profile

    path = tmp_path_factory.mktemp("p") / "long.yaml"
    eng = Engine.load(str(write_profile(path, tiny_llama_dir, context={"max_context": 1 << 20})))
    yield eng
    eng.close()


def _chat(eng, text, **kw):
    return eng.chat_prompt([{"role": "user", "content": text}])


def test_chat_prompt_uses_template_and_single_special_ids(tiny_engine):
    ids = _chat(tiny_engine, "hi")
    tok = tiny_engine.tokenizer
    assert ids[0] == tok.token_to_id("<|im_start|>")
    assert tok.decode(ids).endswith("<|im_start|>assistant\n")


def test_events_stream_and_done(tiny_engine):
    ids = _chat(tiny_engine, "hello there")
    handle = tiny_engine.submit(GenerationRequest(ids, tiny_engine.sampling(max_tokens=12)))
    events = list(handle)
    done = events[-1]
    assert isinstance(done, Done)
    assert "".join(e.text for e in events if isinstance(e, TextDelta)) == done.text
    assert done.usage.prompt_tokens == len(ids)
    assert done.usage.completion_tokens == len(done.completion_token_ids) <= 12
    assert done.finish_reason in ("stop", "length")
    assert done.timings.ttft_ms > 0 and done.timings.total_ms >= done.timings.ttft_ms


def test_same_seed_same_text(tiny_engine):
    ids = _chat(tiny_engine, "seeded")
    a = tiny_engine.generate(ids, temperature=1.0, seed=5, max_tokens=20)
    b = tiny_engine.generate(ids, temperature=1.0, seed=5, max_tokens=20)
    assert a.completion_token_ids == b.completion_token_ids


def _until(cond, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.001)


@pytest.mark.parametrize("lane", ["serial", "batched"])
def test_cancel_stops_within_a_token(long_engine, lane):
    """A reply that cannot end by itself (EOS ignored, a budget it never reaches) ends by the
    cancel, with at most one token after ``cancel()`` returns (two in the batched lane, whose
    next step is already launched while one streams)."""
    eng = long_engine
    params = eng.sampling(max_tokens=1_000_000, temperature=1.0, seed=1, ignore_eos=True)
    running = []
    try:
        if lane == "batched":  # a running row: the reply joins it in the batch
            running.append(eng.submit(GenerationRequest(_chat(eng, "beside"), params)))
            _until(lambda: running[0].token_ids)
        handle = eng.submit(GenerationRequest(_chat(eng, "long one"), params, split_reasoning=False))
        running.append(handle)
        _until(lambda: len(handle.token_ids) >= 3)
        handle.cancel()
        at_cancel = len(handle.token_ids)
        done = handle.result(10)
    finally:  # nothing left decoding in the shared engine, whatever failed
        for h in running:
            h.cancel()
            assert h.result(10).finish_reason == "cancelled"
    assert done.finish_reason == "cancelled" and done.lane == lane
    # Serial: the cancel is read before each token is accepted, so at most the one being
    # accepted follows it. Batched: the step being streamed and the one launched after it.
    after = done.usage.completion_tokens - at_cancel
    assert after <= {"serial": 1, "batched": 2}[lane], (at_cancel, done.usage.completion_tokens)
    assert done.text  # the partial reply is kept
    assert done.text == "".join(e.text for e in handle if isinstance(e, TextDelta))


def test_stop_string_ends_generation(tiny_engine):
    ids = _chat(tiny_engine, "stop test")
    free = tiny_engine.generate(ids, max_tokens=30)
    assert len(free.text) > 4
    stop = free.text[2:4]
    cut = tiny_engine.generate(ids, max_tokens=30, stop=(stop,))
    assert cut.finish_reason == "stop"
    assert cut.text == free.text[: free.text.index(stop)]


def test_follow_up_reuses_cached_prefix(tiny_engine):
    msgs = [{"role": "user", "content": "first question"}]
    first = tiny_engine.submit(
        GenerationRequest(tiny_engine.chat_prompt(msgs), tiny_engine.sampling(max_tokens=8), session_id="s1")
    ).result()
    msgs += [{"role": "assistant", "content": first.text}, {"role": "user", "content": "and then?"}]
    # Continue from the exact tokens of turn one (not a re-render) so the prefix must match.
    follow = first.prompt_token_ids + first.completion_token_ids + tiny_engine.tokenizer.encode(
        "\n<|im_start|>user\nand then?<|im_end|>\n<|im_start|>assistant\n"
    )
    second = tiny_engine.submit(
        GenerationRequest(follow, tiny_engine.sampling(max_tokens=8), session_id="s1")
    ).result()
    assert second.cache_source == "ram"
    assert second.usage.cached_tokens >= len(first.prompt_token_ids) + len(first.completion_token_ids) - 1


def test_prompt_over_context_limit_is_an_error(tiny_engine):
    ids = [10] * 600  # the tiny profile allows 512
    done = tiny_engine.generate(ids)
    assert done.finish_reason == "context"
    assert "context limit is 512" in done.error


async def test_async_iteration(tiny_engine):
    ids = _chat(tiny_engine, "async")
    handle = tiny_engine.submit(GenerationRequest(ids, tiny_engine.sampling(max_tokens=6)))
    events = [ev async for ev in handle]
    assert isinstance(events[-1], Done)
    assert handle.result().text == events[-1].text


def test_missing_model_is_one_clear_error(tmp_path):
    from engine.errors import MlxtermError

    from tests.tiny_models import write_profile

    profile = write_profile(tmp_path / "gone.yaml", tmp_path / "no-such-model")
    with pytest.raises(MlxtermError, match="model not found at"):
        Engine.load(str(profile))
