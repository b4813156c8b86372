"""A reply cancelled mid-stream is checkpointed: the next turn, which extends prompt + partial
reply, restores it instead of prefilling the reply again (an agent's loop-stopped step)."""

import threading

from engine.runtime import Engine, GenerationRequest
from engine.serving.events import Done, TextDelta

import pytest


@pytest.fixture(scope="module")
def engine(tmp_path_factory, tiny_qwen2_dir):
    from tests.tiny_models import write_profile

    profile = write_profile(tmp_path_factory.mktemp("p") / "tiny.yaml", tiny_qwen2_dir)
    eng = Engine.load(str(profile))
    yield eng
    eng.close()


@pytest.mark.parametrize("seed", range(8))
def test_a_cancelled_reply_is_reused_by_the_next_turn(engine, seed):
    ids = engine.chat_prompt([{"role": "user", "content": f"write a long file {seed}"}])
    params = engine.sampling(max_tokens=3000, temperature=1.0, seed=seed, ignore_eos=True)  # ends by the cancel only
    handle = engine.submit(GenerationRequest(ids, params, split_reasoning=False, session_id=f"s{seed}"))
    seen = 0
    for ev in handle:
        if isinstance(ev, TextDelta):
            seen += 1
            if seen == 20:
                threading.Thread(target=handle.cancel).start()
        if isinstance(ev, Done):
            done = ev
    assert done.finish_reason == "cancelled"
    reply = list(done.completion_token_ids)
    follow = ids + reply + engine.tokenizer.encode("<|im_end|>\n<|im_start|>user\nagain<|im_end|>\n<|im_start|>assistant\n")
    nxt = engine.submit(GenerationRequest(follow, engine.sampling(max_tokens=2), session_id=f"s{seed}")).result()
    assert nxt.usage.cached_tokens >= len(ids) + len(reply) - 1, (nxt.usage.cached_tokens, len(ids), len(reply))
