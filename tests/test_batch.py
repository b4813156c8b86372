"""Continuous batching on tiny random models: every row of a mixed batch yields its solo tokens.

Solo references are the same requests served alone by a second engine (its own checkpoint
store, so neither run reuses the other's KV). Concurrency tests compare every request's
tokens and streamed text with its reference, so a lost or duplicated token fails them.
Scheduling between the lanes (bursts, chat turns beside background rows, twins) is in
tests/test_batch_lanes.py.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import threading

from engine.runtime import GenerationRequest, Priority
from engine.serving.events import Done, Queued, TextDelta

import pytest

from tests.batch_helpers import (
    GateAfter,
    NoEos,
    cancel_after,
    collect_stream,
    make_engine,
    mixed_specs,
    prompt_ids,
    request_of,
    solo_done,
    streaming,
)


def test_mixed_batch_rows_match_their_solo_runs(engines):
    solo, eng = engines
    specs = mixed_specs(eng)
    refs = [solo_done(solo, spec) for spec in specs]
    # A follow-up turn that restores its session checkpoint and joins mid-stream.
    first = eng.submit(
        GenerationRequest(prompt_ids(eng, "first turn"), eng.sampling(max_tokens=12), session_id="s1")
    ).result(60)
    follow = dict(
        prompt=first.prompt_token_ids + first.completion_token_ids + prompt_ids(eng, "and again")[1:],
        params=eng.sampling(max_tokens=20),
    )
    follow_ref = solo_done(solo, follow)
    long_spec = dict(
        prompt=prompt_ids(eng, "cancel me"),
        params=eng.sampling(max_tokens=400, temperature=1.0, seed=9),
    )
    long_ref = solo_done(solo, long_spec)

    handles = [eng.submit(request_of(eng, spec)) for spec in specs]
    doomed = eng.submit(request_of(eng, long_spec))
    # Wait until the batch streams, then a restored row joins and a row is cancelled.
    streaming(handles[0])
    joiner = eng.submit(request_of(eng, follow, session_id="s1"))
    cancel_after(doomed, 4)
    cancelled = doomed.result(60)
    for h, ref in zip(handles, refs, strict=True):
        done = h.result(60)
        assert done.completion_token_ids == ref.completion_token_ids
        assert done.text == ref.text and done.finish_reason == ref.finish_reason
        assert done.lane == "batched" and done.batch_max >= 2
    lp = handles[4].result().logprobs
    assert [x.token for x in lp] == [x.token for x in refs[4].logprobs]
    assert [x.logprob for x in lp] == pytest.approx([x.logprob for x in refs[4].logprobs], abs=1e-4)
    assert all(t % 3 == i % 3 for i, t in enumerate(handles[5].result().completion_token_ids))
    joined = joiner.result(60)
    assert joined.cache_source == "ram" and joined.usage.cached_tokens > 0
    assert joined.completion_token_ids == follow_ref.completion_token_ids
    assert cancelled.finish_reason == "cancelled"
    n = len(cancelled.completion_token_ids)
    assert 4 <= n < 400 and cancelled.completion_token_ids == long_ref.completion_token_ids[:n]


def test_solo_request_migrates_into_the_batch_and_keeps_its_tokens(engines):
    solo, eng = engines
    # long enough that it is still decoding when a loaded machine gets round to submitting b
    a = dict(
        prompt=prompt_ids(eng, "migrating sampled"),
        params=eng.sampling(temperature=1.0, seed=5, max_tokens=300),
        no_eos=True,
    )
    b = dict(prompt=prompt_ids(eng, "late"), params=eng.sampling(max_tokens=10))
    ref_a, ref_b = solo_done(solo, a), solo_done(solo, b)
    ha = eng.submit(request_of(eng, a))
    seen = 0
    for ev in ha:
        if isinstance(ev, TextDelta):
            seen += 1
            if seen == 5:
                hb = eng.submit(request_of(eng, b))
                break
    da, db = ha.result(60), hb.result(60)
    assert da.completion_token_ids == ref_a.completion_token_ids
    assert db.completion_token_ids == ref_b.completion_token_ids
    assert da.lane == "batched" and da.batch_min == 1 and da.batch_max == 2


def test_pipelined_steps_keep_solo_tokens_and_checkpoints(engines):
    """Without constrained rows the batched lane builds step n+1 before it streams step n's
    tokens. Rows that end at different steps (their draw in the step already built is
    dropped), a row cancelled mid-stream and a restored row joining mid-stream still yield
    exactly their solo tokens, and every row's checkpoint holds exactly its prompt and reply:
    its next turn restores all of it and decodes its solo tokens."""
    solo, eng = engines
    s = eng.sampling
    specs = [
        dict(prompt=prompt_ids(eng, f"pipelined {i} " + "y" * (5 * i)), params=s(max_tokens=5 + 4 * i))
        for i in range(4)
    ] + [
        dict(
            prompt=prompt_ids(eng, "pipelined sampled"),
            params=s(temperature=0.8, seed=4, max_tokens=17, logprobs=2),
        )
    ]
    refs = [solo_done(solo, spec) for spec in specs]
    first = eng.submit(
        GenerationRequest(prompt_ids(eng, "pipelined first"), s(max_tokens=10), session_id="pf")
    ).result(60)
    follow = dict(
        prompt=first.prompt_token_ids + first.completion_token_ids + prompt_ids(eng, "more")[1:],
        params=s(max_tokens=15),
    )
    follow_ref = solo_done(solo, follow)
    long_spec = dict(
        prompt=prompt_ids(eng, "pipelined cancel"), params=s(max_tokens=400, temperature=1.0, seed=2)
    )
    long_ref = solo_done(solo, long_spec)
    before = eng.scheduler_stats()["batched_overlapped"]

    # Calls on the engine thread settle the batch first (answered rows are checkpointed, the
    # step in flight is streamed): poll one all along, so some land mid-pipeline.
    polling = threading.Event()

    def poll():
        while not polling.is_set():
            eng.scheduler_stats()

    poller = threading.Thread(target=poll)
    poller.start()
    handles = [eng.submit(request_of(eng, spec, session_id=f"pp{i}")) for i, spec in enumerate(specs)]
    doomed = eng.submit(request_of(eng, long_spec))
    streaming(handles[0])
    joiner = eng.submit(request_of(eng, follow, session_id="pf"))
    cancel_after(doomed, 6)
    dones = [h.result(60) for h in handles]
    joined = joiner.result(60)
    polling.set()
    poller.join(60)
    for done, ref in zip(dones, refs, strict=True):
        assert done.completion_token_ids == ref.completion_token_ids
        assert done.text == ref.text and done.finish_reason == ref.finish_reason
        assert done.lane == "batched" and done.batch_max >= 2
    assert [x.token for x in dones[4].logprobs] == [x.token for x in refs[4].logprobs]
    assert joined.completion_token_ids == follow_ref.completion_token_ids
    cancelled = doomed.result(60)
    n = len(cancelled.completion_token_ids)
    assert cancelled.finish_reason == "cancelled"
    assert 6 <= n < 400 and cancelled.completion_token_ids == long_ref.completion_token_ids[:n]
    assert eng.scheduler_stats()["batched_overlapped"] - before >= 8  # the pipeline ran

    for i, done in enumerate(dones):
        context = done.prompt_token_ids + done.completion_token_ids
        nxt = dict(prompt=context + prompt_ids(eng, "next")[1:], params=s(max_tokens=8))
        got = eng.submit(request_of(eng, nxt, session_id=f"pp{i}")).result(60)
        assert got.cache_source == "ram" and got.usage.cached_tokens == len(context), i
        assert got.completion_token_ids == solo_done(solo, nxt).completion_token_ids, i


def test_burst_of_twenty_from_threads_and_asyncio_loses_nothing(engines):
    solo, eng = engines
    specs = [
        dict(
            prompt=prompt_ids(eng, f"burst {i} " + "x" * (i * 7)),
            params=eng.sampling(max_tokens=24 + i % 5),
            no_eos=True,
        )
        for i in range(20)
    ]
    refs = [solo_done(solo, spec) for spec in specs]
    results: dict[int, tuple] = {}
    # The burst arrives while 8 rows fill the batch, so every request of it must wait (and say
    # so) and then go through the cap: not left to how fast the steps run.
    blocker_params = eng.sampling(max_tokens=4000)
    blockers = [
        eng.submit(
            request_of(
                eng, dict(prompt=prompt_ids(eng, f"blocker {i}"), params=blocker_params, no_eos=True)
            )
        )
        for i in range(8)
    ]
    for b in blockers:
        streaming(b)
    submitted = threading.Semaphore(0)

    def release_blockers():
        for _ in range(20):
            assert submitted.acquire(timeout=60)
        for b in blockers:
            b.cancel()

    def worker(i):
        handle = eng.submit(request_of(eng, specs[i]))
        submitted.release()
        results[i] = collect_stream(handle)

    async def one(i):
        text, events = [], []
        handle = eng.submit(request_of(eng, specs[i]))
        submitted.release()
        async for ev in handle:
            events.append(ev)
            if isinstance(ev, TextDelta):
                text.append(ev.text)
        results[i] = ("".join(text), events[-1], events)

    async def many():
        await asyncio.gather(*(one(i) for i in range(10, 20)))

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(10)]
    threads.append(threading.Thread(target=release_blockers))
    for t in threads:
        t.start()
    asyncio.run(many())
    for t in threads:
        t.join(60)
    assert sorted(results) == list(range(20))
    for i, ref in enumerate(refs):
        text, done, events = results[i]
        assert done.completion_token_ids == ref.completion_token_ids, i
        assert text == done.text == ref.text, i
        assert sum(isinstance(e, Done) for e in events) == 1
        assert isinstance(events[0], Queued), i  # the batch was full when it arrived
    assert all(b.result(60).finish_reason == "cancelled" for b in blockers)
    dones = [results[i][1] for i in range(20)]
    assert max(d.batch_max for d in dones) == 8  # the cap, reached and never passed


def test_priorities_order_admission(tmp_path, tiny_llama_dir):
    with make_engine(tmp_path, tiny_llama_dir, "cap1", batch={"cap": 1}) as eng:
        s = eng.sampling
        blocker = eng.submit(
            GenerationRequest(prompt_ids(eng, "block"), s(max_tokens=400), constraint=NoEos(eng))
        )
        streaming(blocker)
        order = []
        handles = {}
        for name, prio in (
            ("bg", Priority.BACKGROUND),
            ("agent", Priority.AGENT),
            ("chat", Priority.INTERACTIVE),
        ):
            handles[name] = eng.submit(
                GenerationRequest(prompt_ids(eng, name), s(max_tokens=4), priority=prio)
            )
        for h in handles.values():  # all three wait (cap 1) and say so
            assert isinstance(next(iter(h)), Queued)

        # The order the engine thread answers them in, recorded as it emits each Done (a
        # waiting thread per handle would record the order those threads happen to wake in).
        for name, h in handles.items():

            def emit(event, name=name, emit=h.emit):
                if isinstance(event, Done):
                    order.append(name)
                emit(event)

            h.emit = emit
        blocker.cancel()
        for h in handles.values():
            h.result(60)
        assert order == ["chat", "agent", "bg"]


def test_kv_budget_makes_a_request_wait_not_fail(tmp_path, tiny_llama_dir):
    # One tiny-llama token is 2 layers * 2 (K,V) * 2 heads * 16 dims * 4 bytes = 512 bytes:
    # the long row reserves ~210 KB, the short one ~46 KB; together they exceed 240 KB.
    with make_engine(tmp_path, tiny_llama_dir, "budget", batch={"kv_budget": 240 * 1024}) as eng:
        p = prompt_ids(eng, "budget")
        a = eng.submit(GenerationRequest(p, eng.sampling(max_tokens=400), constraint=NoEos(eng)))
        streaming(a)
        b = eng.submit(GenerationRequest(p, eng.sampling(max_tokens=80)))
        first = next(iter(b))
        assert isinstance(first, Queued) and "memory" in first.reason
        a.cancel()
        _, done_b, _ = collect_stream(b)
        assert done_b.finish_reason in ("stop", "length") and done_b.completion_token_ids
        assert done_b.lane == "serial" and a.result(60).finish_reason == "cancelled"


def test_batched_checkpoints_resume_identically_in_a_fresh_process(
    tmp_path, tiny_llama_dir, engines
):
    solo, _ = engines
    eng = make_engine(tmp_path, tiny_llama_dir, "ckpt")
    turns = [prompt_ids(eng, "checkpoint one"), prompt_ids(eng, "checkpoint two is longer " * 3)]
    handles = [
        eng.submit(GenerationRequest(p, eng.sampling(max_tokens=14), session_id=f"c{i}"))
        for i, p in enumerate(turns)
    ]
    dones = [h.result(60) for h in handles]
    assert all(d.lane == "batched" for d in dones)
    eng.close()
    follow = [
        d.prompt_token_ids + d.completion_token_ids + prompt_ids(solo, "next")[1:] for d in dones
    ]
    refs = [solo_done(solo, dict(prompt=f, params=solo.sampling(max_tokens=12))) for f in follow]
    script = (
        "import json,sys\n"
        "from engine.runtime import Engine, GenerationRequest\n"
        "eng = Engine.load(sys.argv[1])\n"
        "out = []\n"
        "for i, f in enumerate(json.loads(sys.argv[2])):\n"
        "    d = eng.submit(GenerationRequest(f, eng.sampling(max_tokens=12), session_id=f'c{i}')).result(60)\n"
        "    out.append([d.cache_source, d.usage.cached_tokens, d.completion_token_ids])\n"
        "eng.close()\n"
        "print(json.dumps(out))\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", script, str(tmp_path / "ckpt" / "ckpt.yaml"), json.dumps(follow)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    for (source, cached, ids), d, ref in zip(got, dones, refs, strict=True):
        assert source == "ssd" and cached >= len(d.prompt_token_ids)
        assert ids == ref.completion_token_ids


def test_sliding_window_rows_batch_and_match_solo_runs(tmp_path, tiny_gemma_dir):
    # Prompts and replies run past the tiny Gemma's 8-token window, so rings wrap before
    # the rows join (and one migrates from the serial lane mid-reply).
    solo = make_engine(tmp_path, tiny_gemma_dir, "gemma-solo")
    eng = make_engine(tmp_path, tiny_gemma_dir, "gemma-batch")
    try:
        specs = [
            dict(
                prompt=prompt_ids(eng, f"gemma {i} " * (3 * i + 1)),
                params=eng.sampling(max_tokens=60 - 10 * i),
                no_eos=True,
            )
            for i in range(3)
        ]
        specs[1]["params"] = eng.sampling(temperature=0.9, seed=8, max_tokens=34)
        refs = [solo_done(solo, s) for s in specs]
        assert len(refs[0].completion_token_ids) == 60
        # The first row streams in the serial lane and waits after its third token until the
        # others are submitted, so it migrates into the batch mid-reply however slowly this
        # thread runs (it used to read 3 deltas while the engine raced on).
        gate = GateAfter(NoEos(eng), 3)
        first = eng.submit(
            GenerationRequest(
                list(specs[0]["prompt"]), specs[0]["params"], constraint=gate, split_reasoning=False
            )
        )
        assert gate.reached.wait(60)
        handles = [first] + [eng.submit(request_of(eng, s)) for s in specs[1:]]
        gate.release.set()
        for h, ref in zip(handles, refs, strict=True):
            done = h.result(60)
            assert done.completion_token_ids == ref.completion_token_ids and done.lane == "batched"
        assert first.result().batch_min == 1  # it migrated from the serial lane
        follow = [
            d.prompt_token_ids + d.completion_token_ids for d in (h.result() for h in handles)
        ]
        again = [
            eng.submit(
                request_of(
                    eng,
                    dict(prompt=f + prompt_ids(eng, "more")[1:], params=eng.sampling(max_tokens=8)),
                )
            )
            for f in follow
        ]
        ref_again = [
            solo_done(
                solo, dict(prompt=f + prompt_ids(eng, "more")[1:], params=eng.sampling(max_tokens=8))
            )
            for f in follow
        ]
        for h, ref in zip(again, ref_again, strict=True):  # rings checkpointed by the batch resume
            done = h.result(60)
            assert (
                done.cache_source == "ram" and done.completion_token_ids == ref.completion_token_ids
            )
    finally:
        solo.close()
        eng.close()


def test_generate_json_reports_lane_and_batch_size(tmp_path, tiny_llama_dir):
    from tests.tiny_models import write_profile

    profile = write_profile(tmp_path / "gen.yaml", tiny_llama_dir)
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "app",
            "generate",
            "--profile",
            str(profile),
            "--prompt",
            "hi",
            "--json",
            "--max-tokens",
            "12",
            "--ignore-eos",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert out["batch"] == {"lane": "serial", "size_min": 1, "size_mean": 1.0, "size_max": 1}
    # --ignore-eos reaches the request: a fixed-length reply
    assert out["finish_reason"] == "length" and out["usage"]["completion_tokens"] == 12


async def test_status_bar_counts_requests_sharing_the_engine(tiny_profile):
    from app.tui.widgets.status import StatusBar
    from tests.test_tui_app import SIZE, loaded, main_screen, make_app

    app = make_app(tiny_profile)
    async with app.run_test(size=SIZE) as pilot:
        await loaded(pilot)
        eng = app.controller.engine
        bar = main_screen(app).query_one(StatusBar)
        label = bar.query_one("#status-shared")
        bar.refresh_shared()
        assert str(label.render()) == ""
        params = eng.sampling(max_tokens=400, temperature=1.0, seed=2)
        handles = [eng.submit(GenerationRequest(prompt_ids(eng, f"bg {i}"), params)) for i in range(3)]
        for h in handles:  # all three are decoding
            streaming(h)
        bar.refresh_shared()
        assert str(label.render()).strip() == "3 requests share the engine"
        for h in handles:
            h.cancel()
        for h in handles:
            assert h.result(60).lane == "batched"
        bar.refresh_shared()
        assert str(label.render()) == ""


def test_newcomers_prefill_together_and_match_their_solo_runs(
    tmp_path, tiny_llama_dir, engines, monkeypatch
):
    """Requests arriving together with as much prompt left at one position prefill in one
    forward (rows of another length, or a restored row further along, prefill on their own);
    every row still yields its solo tokens."""
    import engine.serving.scheduler as scheduler

    solo, _ = engines
    # its own checkpoint store: rows restore exactly the template prefix, nothing more
    eng = make_engine(tmp_path, tiny_llama_dir, "joint")
    calls = []
    real = scheduler.prefill_together

    def spy(model, caches, chunks, logits=False):
        calls.append([len(c) for c in chunks])
        return real(model, caches, chunks, logits)

    monkeypatch.setattr(scheduler, "prefill_together", spy)
    first = eng.submit(
        GenerationRequest(
            prompt_ids(eng, "restored prefix"), eng.sampling(max_tokens=6), session_id="joint"
        )
    ).result(60)
    s = eng.sampling

    def sized(
        text: str, n: int
    ) -> list[int]:  # distinct prompts of one length (template tail kept)
        ids = prompt_ids(eng, text * 20)
        return ids[: n - 8] + ids[-8:]

    # distinct first words, so no row shares more of a stored checkpoint than the template
    specs = [
        dict(prompt=sized("alpha ", 60), params=s(max_tokens=12)),
        dict(prompt=sized("bravo is longer ", 90), params=s(max_tokens=14)),  # its own length
        dict(
            prompt=sized("charlie samples ", 60),
            params=s(temperature=0.8, top_p=0.9, seed=4, max_tokens=12),
        ),
        dict(
            prompt=first.prompt_token_ids + first.completion_token_ids + prompt_ids(eng, "more")[1:],
            params=s(max_tokens=10),
        ),
        dict(prompt=sized("delta is constrained ", 60), params=s(max_tokens=10), constrained=True),
        dict(prompt=sized("echo ", 60), params=s(max_tokens=10)),
    ]
    refs = [solo_done(solo, spec) for spec in specs]
    handles = [
        eng.submit(request_of(eng, spec, session_id="joint" if i == 3 else None))
        for i, spec in enumerate(specs)
    ]
    dones = [h.result(60) for h in handles]
    eng.close()
    for i, (done, ref) in enumerate(zip(dones, refs, strict=True)):
        assert done.completion_token_ids == ref.completion_token_ids, i
        assert done.text == ref.text, i
    assert dones[3].usage.cached_tokens > 0  # the restored row prefilled only its new tail
    # alpha, charlie, delta and echo (alpha alone first if the engine woke between submits)
    assert calls and max(len(c) for c in calls) >= 3 and all(len(set(c)) == 1 for c in calls), calls
