"""Continuous batching on real weights (SmolLM2-135M, fp32 on CPU): batched rows = solo runs.

Solo references come from a second engine with its own checkpoint directory, so neither
engine reuses the other's KV.
"""

from __future__ import annotations

import threading
from pathlib import Path

from engine.runtime import Engine, GenerationRequest

import pytest

from tests.batch_helpers import cancel_after, prompt_ids, request_of, streaming

TASKS = Path(__file__).resolve().parent.parent / "assets" / "tasks"


def _smol(tmp_path: Path, name: str) -> Engine:
    from engine.profiles import load_profile, profile_to_dict

    import yaml

    data = profile_to_dict(load_profile("smollm2-135m"))
    data["name"] = name
    # fp32 weights: batched rows equal solo runs bit for bit there; the CPU kernels' int8
    # activations (the CPU default when built) round differently per pass shape
    data["model"]["weights"] = "fp32"
    data["cache"]["ssd_dir"] = str(tmp_path / name / "ckpt")
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(data))
    return Engine.load(str(path))


@pytest.fixture(scope="module")
def smol_pair(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("e2e-batch")
    solo, batch = _smol(tmp, "solo"), _smol(tmp, "batch")
    yield solo, batch
    solo.close()
    batch.close()


@pytest.mark.e2e
def test_smollm2_mixed_batch_matches_solo_runs(smol_pair):
    solo, eng = smol_pair
    s = eng.sampling
    specs = [
        dict(prompt=prompt_ids(eng, "What is the capital of France?"), params=s(temperature=0.0, max_tokens=16)),
        dict(prompt=prompt_ids(eng, "Summarise: " + "the quick brown fox jumps over the lazy dog. " * 25),
             params=s(temperature=0.0, max_tokens=16)),
        dict(prompt=prompt_ids(eng, "Write a haiku about rain."), params=s(temperature=0.8, top_p=0.9, seed=4, max_tokens=16)),
        dict(prompt=prompt_ids(eng, "List three colours."), params=s(temperature=0.0, max_tokens=12), constrained=True),
    ]
    first = eng.submit(GenerationRequest(prompt_ids(eng, "Name a fruit."), s(temperature=0.0, max_tokens=10),
                                         session_id="e2e")).result(600)
    follow = dict(prompt=first.prompt_token_ids + first.completion_token_ids + prompt_ids(eng, "And a vegetable?")[1:],
                  params=s(temperature=0.0, max_tokens=12))
    doomed_spec = dict(prompt=prompt_ids(eng, "Tell me a long story."), params=s(temperature=0.0, max_tokens=40))
    refs = [solo.submit(request_of(solo, spec)).result(600) for spec in [*specs, follow, doomed_spec]]

    handles = [eng.submit(request_of(eng, spec)) for spec in specs]
    doomed = eng.submit(request_of(eng, doomed_spec))
    streaming(handles[0])
    joiner = eng.submit(request_of(eng, follow, session_id="e2e"))
    cancel_after(doomed, 3)
    for h, ref in zip([*handles, joiner], refs, strict=False):
        done = h.result(600)
        assert done.completion_token_ids == ref.completion_token_ids
        assert done.text == ref.text and done.lane == "batched"
    assert joiner.result().cache_source == "ram"
    cut = doomed.result(600)
    n = len(cut.completion_token_ids)
    assert cut.finish_reason == "cancelled" and n < 40
    assert cut.completion_token_ids == refs[-1].completion_token_ids[:n]
    assert all(t % 3 == i % 3 for i, t in enumerate(handles[3].result().completion_token_ids))


@pytest.mark.e2e
def test_two_agent_runs_share_the_batch(smol_pair, tmp_path):
    from agents.headless import HeadlessRun
    from agents.taskfile import load_task
    from agents.transcript import read_transcript

    _, eng = smol_pair
    results = {}

    def run(i: int) -> None:
        results[i] = HeadlessRun(load_task(TASKS / "hello.yaml"), engine=eng, run_dir=tmp_path / f"run{i}").run()

    threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    assert [results[i]["status"] for i in range(2)] == ["passed", "passed"]
    lanes = [
        r["lane"]
        for i in range(2)
        for r in read_transcript(tmp_path / f"run{i}" / "transcript.jsonl")
        if r["type"] == "response"
    ]
    assert "batched" in lanes


@pytest.mark.e2e
def test_smollm2_drafts_of_one_prompt_prefill_once_and_match_solo_runs(smol_pair):
    """Candidate drafts on real weights: one session context plus a new tail, four seeds
    submitted together; the tail is prefilled once and every draft is its seed's solo run."""
    from tests.batch_helpers import gated_submit

    solo, eng = smol_pair
    s = eng.sampling
    base = prompt_ids(eng, "Write a Python function that reverses a string.")
    turn = eng.submit(GenerationRequest(base, s(temperature=0.0, max_tokens=8), session_id="drafts")).result(600)
    prompt = turn.prompt_token_ids + turn.completion_token_ids + prompt_ids(eng, "Now draft it again. " * 8)[1:]
    specs = [dict(prompt=prompt, params=s(temperature=0.8, top_p=1.0, seed=i, max_tokens=16)) for i in range(4)]
    refs = [solo.submit(request_of(solo, spec)).result(600) for spec in specs]
    before = eng.scheduler_stats()["prefill_tokens"]
    reqs = [request_of(eng, spec, session_id="drafts") for spec in specs]
    dones = [h.result(600) for h in gated_submit(eng, reqs)]
    tail = len(prompt) - dones[0].usage.cached_tokens
    assert dones[0].cache_source == "ram" and tail > 0  # the session's context was restored
    assert eng.scheduler_stats()["prefill_tokens"] - before == tail  # the tail, once
    for done, ref in zip(dones, refs, strict=True):
        assert done.completion_token_ids == ref.completion_token_ids
        assert done.lane == "batched" and done.batch_max == 4
    assert [d.cache_source for d in dones[1:]] == ["twin"] * 3
    assert len({tuple(d.completion_token_ids) for d in dones}) > 1
