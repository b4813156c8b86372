"""The Engine facade on a tiny random model: events, cancellation, stops, reuse, async."""

import threading
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


def test_cancel_stops_within_a_token(tiny_engine):
    ids = _chat(tiny_engine, "long one")
    # A budget far beyond what the tiny model decodes while this thread is starved on a loaded
    # machine, so the run can only end by the cancel (400 ran out once at load 6).
    params = tiny_engine.sampling(max_tokens=3500, temperature=1.0, seed=1)
    handle = tiny_engine.submit(GenerationRequest(ids, params, split_reasoning=False))
    seen = 0
    for ev in handle:
        if isinstance(ev, TextDelta):
            seen += 1
            if seen == 3:
                t_cancel = time.perf_counter()
                threading.Thread(target=handle.cancel).start()
        if isinstance(ev, Done):
            done = ev
    assert done.finish_reason == "cancelled"
    assert 3 <= done.usage.completion_tokens < 3500
    assert done.text  # the partial reply is kept
    assert time.perf_counter() - t_cancel < 5


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
