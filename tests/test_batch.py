"""Continuous batching on tiny random models: every row of a mixed batch yields its solo tokens.

Solo references are the same requests served alone by a second engine (its own checkpoint
store, so neither run reuses the other's KV). Concurrency tests compare every request's
tokens and streamed text with its reference, so a lost or duplicated token fails them.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import threading

from engine.runtime import Engine, GenerationRequest, Priority
from engine.serving.events import Done, Queued, TextDelta

import mlx.core as mx
import pytest


def _engine(tmp_path, model_dir, name: str, **sections) -> Engine:
    from tests.tiny_models import write_profile

    d = tmp_path / name
    d.mkdir(exist_ok=True)
    sections.setdefault("cache", {})["ssd_dir"] = str(d / "ckpt")
    return Engine.load(str(write_profile(d / f"{name}.yaml", model_dir, **sections)))


class EveryThird:
    """A constraint: token ids in one residue class mod 3, rotating each token."""

    def __init__(self, vocab: int):
        self.vocab, self.n, self.seen = vocab, 0, []

    def allowed(self):
        return (mx.arange(self.vocab) % 3) == (self.n % 3)

    def advance(self, token: int) -> None:
        self.seen.append(token)
        self.n += 1


class NoEos:
    """A constraint that only rules out end-of-sequence ids (rows run to max_tokens)."""

    def __init__(self, eng):
        eos = mx.array(sorted(eng.tokenizer.eos_ids))
        self.mask = (mx.arange(eng.logits_width)[:, None] != eos[None]).all(axis=1)
        mx.eval(self.mask)  # built here, used on the engine thread

    def allowed(self):
        return self.mask

    def advance(self, token: int) -> None:
        pass


class GateAfter:
    """``inner``'s constraint that holds the engine thread after ``n`` tokens until ``release``
    is set (``reached`` says it got there): the test then acts at a known token boundary."""

    def __init__(self, inner, n: int):
        self.inner, self.n = inner, n
        self.reached, self.release = threading.Event(), threading.Event()

    def allowed(self):
        return self.inner.allowed()

    def advance(self, token: int) -> None:
        self.inner.advance(token)
        self.n -= 1
        if self.n == 0:
            self.reached.set()
            self.release.wait(60)


class OnToken:
    """``inner``'s constraint that calls ``fn`` on the engine thread at its first token: the
    test acts at a known point of the run, not after a race with the engine."""

    def __init__(self, inner, fn):
        self.inner, self.fn = inner, fn

    def allowed(self):
        return self.inner.allowed()

    def advance(self, token: int) -> None:
        self.inner.advance(token)
        if self.fn is not None:
            self.fn, fn = None, self.fn
            fn()


def _prompt(eng, text: str) -> list[int]:
    return eng.chat_prompt([{"role": "user", "content": text}])


def _mixed(eng) -> list[dict]:
    """Requests with different prompt lengths and samplers (one constrained)."""
    s = eng.sampling
    return [
        dict(prompt=_prompt(eng, "hi"), params=s(max_tokens=24)),
        dict(prompt=_prompt(eng, "a much longer prompt " * 12), params=s(max_tokens=20)),
        dict(
            prompt=_prompt(eng, "sampled row"),
            params=s(temperature=0.9, top_k=40, seed=11, max_tokens=22),
        ),
        dict(
            prompt=_prompt(eng, "penalised"),
            params=s(repetition_penalty=1.5, repetition_context=8, max_tokens=18),
        ),
        dict(
            prompt=_prompt(eng, "nucleus"),
            params=s(temperature=0.7, top_p=0.8, seed=3, max_tokens=16, logprobs=2),
        ),
        dict(prompt=_prompt(eng, "constrained"), params=s(max_tokens=16), constrained=True),
    ]


def _request(eng, spec: dict, **kw) -> GenerationRequest:
    constraint = EveryThird(eng.logits_width) if spec.get("constrained") else None
    constraint = NoEos(eng) if spec.get("no_eos") else constraint
    return GenerationRequest(
        list(spec["prompt"]), spec["params"], constraint=constraint, split_reasoning=False, **kw
    )


def _solo(eng, spec: dict) -> Done:
    done = eng.submit(_request(eng, spec)).result(60)
    assert done.lane == "serial" and done.batch_max == 1
    return done


def _streaming(handle, deltas: int = 1):
    """Wait until ``handle`` has streamed ``deltas`` pieces of text; returns its event iterator."""
    it = iter(handle)
    for _ in range(deltas):
        while not isinstance(next(it), TextDelta):
            pass
    return it


def _cancel_after(handle, deltas: int) -> None:
    """Read ``handle``'s events, cancel it after ``deltas`` pieces of text, drain the rest."""
    seen = 0
    for ev in handle:
        if isinstance(ev, TextDelta):
            seen += 1
            if seen == deltas:
                handle.cancel()


def _stream(handle) -> tuple[str, Done, list]:
    text, done, events = [], None, []
    for ev in handle:
        events.append(ev)
        if isinstance(ev, TextDelta):
            text.append(ev.text)
        if isinstance(ev, Done):
            done = ev
    return "".join(text), done, events


@pytest.fixture(scope="module")
def engines(tmp_path_factory, tiny_llama_dir):
    tmp = tmp_path_factory.mktemp("batch")
    solo = _engine(tmp, tiny_llama_dir, "solo")
    batch = _engine(tmp, tiny_llama_dir, "batch")
    yield solo, batch
    solo.close()
    batch.close()


def test_mixed_batch_rows_match_their_solo_runs(engines):
    solo, eng = engines
    specs = _mixed(eng)
    refs = [_solo(solo, spec) for spec in specs]
    # A follow-up turn that restores its session checkpoint and joins mid-stream.
    first = eng.submit(
        GenerationRequest(_prompt(eng, "first turn"), eng.sampling(max_tokens=12), session_id="s1")
    ).result(60)
    follow = dict(
        prompt=first.prompt_token_ids + first.completion_token_ids + _prompt(eng, "and again")[1:],
        params=eng.sampling(max_tokens=20),
    )
    follow_ref = _solo(solo, follow)
    long_spec = dict(
        prompt=_prompt(eng, "cancel me"),
        params=eng.sampling(max_tokens=400, temperature=1.0, seed=9),
    )
    long_ref = _solo(solo, long_spec)

    handles = [eng.submit(_request(eng, spec)) for spec in specs]
    doomed = eng.submit(_request(eng, long_spec))
    # Wait until the batch streams, then a restored row joins and a row is cancelled.
    _streaming(handles[0])
    joiner = eng.submit(_request(eng, follow, session_id="s1"))
    _cancel_after(doomed, 4)
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
        prompt=_prompt(eng, "migrating sampled"),
        params=eng.sampling(temperature=1.0, seed=5, max_tokens=300),
        no_eos=True,
    )
    b = dict(prompt=_prompt(eng, "late"), params=eng.sampling(max_tokens=10))
    ref_a, ref_b = _solo(solo, a), _solo(solo, b)
    ha = eng.submit(_request(eng, a))
    seen = 0
    for ev in ha:
        if isinstance(ev, TextDelta):
            seen += 1
            if seen == 5:
                hb = eng.submit(_request(eng, b))
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
        dict(prompt=_prompt(eng, f"pipelined {i} " + "y" * (5 * i)), params=s(max_tokens=5 + 4 * i))
        for i in range(4)
    ] + [
        dict(
            prompt=_prompt(eng, "pipelined sampled"),
            params=s(temperature=0.8, seed=4, max_tokens=17, logprobs=2),
        )
    ]
    refs = [_solo(solo, spec) for spec in specs]
    first = eng.submit(
        GenerationRequest(_prompt(eng, "pipelined first"), s(max_tokens=10), session_id="pf")
    ).result(60)
    follow = dict(
        prompt=first.prompt_token_ids + first.completion_token_ids + _prompt(eng, "more")[1:],
        params=s(max_tokens=15),
    )
    follow_ref = _solo(solo, follow)
    long_spec = dict(
        prompt=_prompt(eng, "pipelined cancel"), params=s(max_tokens=400, temperature=1.0, seed=2)
    )
    long_ref = _solo(solo, long_spec)
    before = eng.scheduler_stats()["batched_overlapped"]

    # Calls on the engine thread settle the batch first (answered rows are checkpointed, the
    # step in flight is streamed): poll one all along, so some land mid-pipeline.
    polling = threading.Event()

    def poll():
        while not polling.is_set():
            eng.scheduler_stats()

    poller = threading.Thread(target=poll)
    poller.start()
    handles = [eng.submit(_request(eng, spec, session_id=f"pp{i}")) for i, spec in enumerate(specs)]
    doomed = eng.submit(_request(eng, long_spec))
    _streaming(handles[0])
    joiner = eng.submit(_request(eng, follow, session_id="pf"))
    _cancel_after(doomed, 6)
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
    assert eng.scheduler_stats()["batched_overlapped"] - before >= 10  # the pipeline ran

    for i, done in enumerate(dones):
        context = done.prompt_token_ids + done.completion_token_ids
        nxt = dict(prompt=context + _prompt(eng, "next")[1:], params=s(max_tokens=8))
        got = eng.submit(_request(eng, nxt, session_id=f"pp{i}")).result(60)
        assert got.cache_source == "ram" and got.usage.cached_tokens == len(context), i
        assert got.completion_token_ids == _solo(solo, nxt).completion_token_ids, i


def test_burst_of_twenty_from_threads_and_asyncio_loses_nothing(engines):
    solo, eng = engines
    specs = [
        dict(
            prompt=_prompt(eng, f"burst {i} " + "x" * (i * 7)),
            params=eng.sampling(max_tokens=24 + i % 5),
            no_eos=True,
        )
        for i in range(20)
    ]
    refs = [_solo(solo, spec) for spec in specs]
    results: dict[int, tuple] = {}
    # The burst arrives while 8 rows fill the batch, so every request of it must wait (and say
    # so) and then go through the cap: not left to how fast the steps run.
    blocker_params = eng.sampling(max_tokens=4000)
    blockers = [
        eng.submit(
            _request(
                eng, dict(prompt=_prompt(eng, f"blocker {i}"), params=blocker_params, no_eos=True)
            )
        )
        for i in range(8)
    ]
    for b in blockers:
        _streaming(b)
    submitted = threading.Semaphore(0)

    def release_blockers():
        for _ in range(20):
            assert submitted.acquire(timeout=60)
        for b in blockers:
            b.cancel()

    def worker(i):
        handle = eng.submit(_request(eng, specs[i]))
        submitted.release()
        results[i] = _stream(handle)

    async def one(i):
        text, events = [], []
        handle = eng.submit(_request(eng, specs[i]))
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
    with _engine(tmp_path, tiny_llama_dir, "cap1", batch={"cap": 1}) as eng:
        s = eng.sampling
        blocker = eng.submit(
            GenerationRequest(_prompt(eng, "block"), s(max_tokens=400), constraint=NoEos(eng))
        )
        _streaming(blocker)
        order = []
        handles = {}
        for name, prio in (
            ("bg", Priority.BACKGROUND),
            ("agent", Priority.AGENT),
            ("chat", Priority.INTERACTIVE),
        ):
            handles[name] = eng.submit(
                GenerationRequest(_prompt(eng, name), s(max_tokens=4), priority=prio)
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
    with _engine(tmp_path, tiny_llama_dir, "budget", batch={"kv_budget": 240 * 1024}) as eng:
        p = _prompt(eng, "budget")
        a = eng.submit(GenerationRequest(p, eng.sampling(max_tokens=400), constraint=NoEos(eng)))
        _streaming(a)
        b = eng.submit(GenerationRequest(p, eng.sampling(max_tokens=80)))
        first = next(iter(b))
        assert isinstance(first, Queued) and "memory" in first.reason
        a.cancel()
        _, done_b, _ = _stream(b)
        assert done_b.finish_reason in ("stop", "length") and done_b.completion_token_ids
        assert done_b.lane == "serial" and a.result(60).finish_reason == "cancelled"


def test_batched_checkpoints_resume_identically_in_a_fresh_process(
    tmp_path, tiny_llama_dir, engines
):
    solo, _ = engines
    eng = _engine(tmp_path, tiny_llama_dir, "ckpt")
    turns = [_prompt(eng, "checkpoint one"), _prompt(eng, "checkpoint two is longer " * 3)]
    handles = [
        eng.submit(GenerationRequest(p, eng.sampling(max_tokens=14), session_id=f"c{i}"))
        for i, p in enumerate(turns)
    ]
    dones = [h.result(60) for h in handles]
    assert all(d.lane == "batched" for d in dones)
    eng.close()
    follow = [
        d.prompt_token_ids + d.completion_token_ids + _prompt(solo, "next")[1:] for d in dones
    ]
    refs = [_solo(solo, dict(prompt=f, params=solo.sampling(max_tokens=12))) for f in follow]
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
    solo = _engine(tmp_path, tiny_gemma_dir, "gemma-solo")
    eng = _engine(tmp_path, tiny_gemma_dir, "gemma-batch")
    try:
        specs = [
            dict(
                prompt=_prompt(eng, f"gemma {i} " * (3 * i + 1)),
                params=eng.sampling(max_tokens=60 - 10 * i),
                no_eos=True,
            )
            for i in range(3)
        ]
        specs[1]["params"] = eng.sampling(temperature=0.9, seed=8, max_tokens=34)
        refs = [_solo(solo, s) for s in specs]
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
        handles = [first] + [eng.submit(_request(eng, s)) for s in specs[1:]]
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
                _request(
                    eng,
                    dict(prompt=f + _prompt(eng, "more")[1:], params=eng.sampling(max_tokens=8)),
                )
            )
            for f in follow
        ]
        ref_again = [
            _solo(
                solo, dict(prompt=f + _prompt(eng, "more")[1:], params=eng.sampling(max_tokens=8))
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
        handles = [eng.submit(GenerationRequest(_prompt(eng, f"bg {i}"), params)) for i in range(3)]
        for h in handles:  # all three are decoding
            _streaming(h)
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
    eng = _engine(tmp_path, tiny_llama_dir, "joint")
    calls = []
    real = scheduler.prefill_together

    def spy(model, caches, chunks):
        calls.append([len(c) for c in chunks])
        return real(model, caches, chunks)

    monkeypatch.setattr(scheduler, "prefill_together", spy)
    first = eng.submit(
        GenerationRequest(
            _prompt(eng, "restored prefix"), eng.sampling(max_tokens=6), session_id="joint"
        )
    ).result(60)
    s = eng.sampling

    def sized(
        text: str, n: int
    ) -> list[int]:  # distinct prompts of one length (template tail kept)
        ids = _prompt(eng, text * 20)
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
            prompt=first.prompt_token_ids + first.completion_token_ids + _prompt(eng, "more")[1:],
            params=s(max_tokens=10),
        ),
        dict(prompt=sized("delta is constrained ", 60), params=s(max_tokens=10), constrained=True),
        dict(prompt=sized("echo ", 60), params=s(max_tokens=10)),
    ]
    refs = [_solo(solo, spec) for spec in specs]
    handles = [
        eng.submit(_request(eng, spec, session_id="joint" if i == 3 else None))
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


def test_lone_batched_row_returns_to_the_serial_lane(tmp_path, tiny_llama_dir, engines):
    """When the others leave, the last batched row continues in the serial lane at a token
    boundary (key schedule, window and tokens unchanged) and speculation runs for its tail."""
    solo, _ = engines
    spec_eng = _engine(
        tmp_path,
        tiny_llama_dir,
        "spec",
        speculation={"mode": "lookup", "lookup_ngram": 1, "num_draft_tokens": 8},
    )
    try:
        s = spec_eng.sampling
        # The blocker holds the engine thread at its first token (serial lane) while the tail
        # and short rows are submitted, so both arrive while it decodes; it cannot end by
        # itself (no EOS, a budget it does not reach first): the short row cancels it at its
        # own first token, when the tail is batched; then the short row leaves and the tail
        # decodes alone. Every step is a token boundary, none a race with the engine thread.
        blocker = dict(prompt=_prompt(spec_eng, "blocker"), params=s(max_tokens=400), no_eos=True)
        short = dict(prompt=_prompt(spec_eng, "short one"), params=s(max_tokens=4), no_eos=True)
        tails = [
            dict(
                prompt=_prompt(spec_eng, "the tail repeats the tail " * 4), params=s(max_tokens=60)
            ),
            dict(
                prompt=_prompt(spec_eng, "sampled tail " * 4),
                params=s(
                    temperature=0.9,
                    seed=8,
                    repetition_penalty=1.3,
                    repetition_context=6,
                    max_tokens=60,
                ),
            ),
        ]  # no constraint: speculation needs one that can fork
        for tail in tails:
            ref = _solo(solo, tail)
            gate = GateAfter(NoEos(spec_eng), 1)
            first = spec_eng.submit(
                GenerationRequest(
                    list(blocker["prompt"]), blocker["params"], constraint=gate, split_reasoning=False
                )
            )
            try:
                assert gate.reached.wait(60)
                handles = [
                    spec_eng.submit(_request(spec_eng, tail)),
                    spec_eng.submit(
                        GenerationRequest(
                            list(short["prompt"]),
                            short["params"],
                            constraint=OnToken(NoEos(spec_eng), first.cancel),
                            split_reasoning=False,
                        )
                    ),
                ]
            finally:
                gate.release.set()
            done = handles[0].result(60)
            assert done.completion_token_ids == ref.completion_token_ids
            assert done.text == ref.text
            assert done.lane == "batched" and done.batch_max == 3  # with the blocker
            # Speculation only exists in the serial lane: rounds mean the row went back there.
            assert done.speculation is not None and done.speculation["rounds"] > 0, done.speculation
            stopped = first.result(60)
            n = len(stopped.completion_token_ids)
            assert stopped.finish_reason == "cancelled" and stopped.batch_max == 3, stopped
            assert (
                stopped.completion_token_ids
                == _solo(solo, dict(blocker, params=s(max_tokens=n))).completion_token_ids
            )
            assert (
                handles[1].result(60).completion_token_ids
                == _solo(solo, short).completion_token_ids
            )
    finally:
        spec_eng.close()


def test_a_chat_turn_joining_background_rows_gets_its_first_token_from_its_own_forward(
    tmp_path, tiny_llama_dir, engines, monkeypatch
):
    """An interactive request outranking every running row feeds its last prompt token alone
    (as the serial lane does) instead of waiting for the batch's next step; its tokens are
    still its solo run's."""
    from engine.serving import scheduler

    solo, _ = engines
    chat = dict(prompt=_prompt(solo, "quick question"), params=solo.sampling(max_tokens=12))
    ref = _solo(solo, chat)
    one_token_feeds = []
    real = scheduler.prefill

    def counting(model, cache, tokens, *a, **kw):
        if len(tokens) == 1 and kw.get("logits", True):
            one_token_feeds.append(tokens[0])
        return real(model, cache, tokens, *a, **kw)

    monkeypatch.setattr(scheduler, "prefill", counting)
    with _engine(tmp_path, tiny_llama_dir, "urgent") as eng:
        s = eng.sampling
        bg = [
            eng.submit(
                GenerationRequest(
                    _prompt(eng, f"background {i}"),
                    s(max_tokens=300),
                    constraint=NoEos(eng),
                    priority=Priority.BACKGROUND,
                )
            )
            for i in range(2)
        ]
        for h in bg:
            _streaming(h)
        one_token_feeds.clear()
        done = eng.submit(_request(eng, chat, priority=Priority.INTERACTIVE)).result(60)
        for h in bg:
            h.cancel()
        for h in bg:
            h.result(60)
    assert done.lane == "batched" and done.batch_max == 3
    assert one_token_feeds == [chat["prompt"][-1]]
    assert done.completion_token_ids == ref.completion_token_ids


def _gated_submit(eng, requests: list[GenerationRequest], into: list | None = None) -> list:
    """Submit ``requests`` while the engine thread is parked in a call, so the scheduler sees
    them as one burst (all waiting at the same tick); ``into`` gets the handles before the
    engine thread runs again."""
    gate, parked = threading.Event(), threading.Event()

    def park(_runner):
        parked.set()
        gate.wait(30)

    fut = eng.call(park)
    parked.wait(30)
    handles = [eng.submit(r) for r in requests]
    if into is not None:
        into.extend(handles)
    gate.set()
    fut.result(30)
    return handles


def test_a_burst_starts_decoding_together_and_keeps_its_solo_tokens(
    tmp_path, tiny_llama_dir, engines
):
    """Newcomers arriving together are all prefilled before the first batched step (the decode
    step is held, not run on a partial batch), so every step of the burst has every row; the
    tokens are the solo runs' and the step count is exact (no lost or repeated step)."""
    solo, _ = engines
    n, tokens = 5, 9
    with _engine(tmp_path, tiny_llama_dir, "burst") as eng:
        specs = [
            dict(
                prompt=_prompt(eng, f"burst row {i} " + "y" * (5 * i)),
                params=eng.sampling(max_tokens=tokens),
                no_eos=True,
            )
            for i in range(n)
        ]
        specs[2]["params"] = eng.sampling(temperature=0.8, seed=2, max_tokens=tokens)
        refs = [_solo(solo, spec) for spec in specs]
        before = eng.scheduler_stats()
        dones = [h.result(60) for h in _gated_submit(eng, [_request(eng, s) for s in specs])]
        after = eng.scheduler_stats()
    for done, ref in zip(dones, refs, strict=True):
        assert done.completion_token_ids == ref.completion_token_ids
        assert done.lane == "batched" and done.batch_min == done.batch_max == n
    d = {k: after[k] - before[k] for k in after}
    assert d["held_ticks"] >= 1 and d["serial_steps"] == 0
    # one step per reply token, then the step that feeds every row's last token
    assert d["batched_steps"] == tokens + 1 and d["batched_rows"] == n * (tokens + 1)
    assert d["prefill_tokens"] == sum(len(s["prompt"]) - 1 for s in specs)


def test_a_chat_turn_is_not_held_behind_a_burst_of_background_prefill(
    tmp_path, tiny_llama_dir, engines
):
    """The hold never makes a request wait for lower-priority newcomers' prefill: a chat turn
    arriving with background requests starts decoding before they have all joined."""
    solo, _ = engines
    chat = dict(prompt=_prompt(solo, "chat first"), params=solo.sampling(max_tokens=6), no_eos=True)
    bg = [
        dict(
            prompt=_prompt(solo, f"background prompt {i} " * 6),
            params=solo.sampling(max_tokens=12),
            no_eos=True,
        )
        for i in range(3)
    ]
    refs = [_solo(solo, s) for s in [chat, *bg]]
    with _engine(tmp_path, tiny_llama_dir, "nohold") as eng:
        reqs = [_request(eng, chat, priority=Priority.INTERACTIVE)]
        reqs += [_request(eng, s, priority=Priority.BACKGROUND) for s in bg]
        dones = [h.result(60) for h in _gated_submit(eng, reqs)]
    for done, ref in zip(dones, refs, strict=True):
        assert done.completion_token_ids == ref.completion_token_ids
    # its first steps ran while background rows were still prefilling (the batch ramped up)
    assert dones[0].lane == "batched" and dones[0].batch_min == 1 and dones[0].batch_max == 4


def test_ignore_eos_runs_replies_to_max_tokens_in_both_lanes(tmp_path, tiny_llama_dir):
    """``SamplingParams.ignore_eos`` (fixed reply lengths for benchmarks): a reply that stops at
    an end-of-sequence token goes on to max_tokens with the tokens it would draw anyway, served
    alone and in a batch; explicit stop_token_ids still end it."""
    solo = _engine(tmp_path, tiny_llama_dir, "eos-solo")
    eng = _engine(tmp_path, tiny_llama_dir, "eos-batch")
    try:
        prompts = [_prompt(eng, f"fixed length {i} " + "z" * (5 * i)) for i in range(3)]
        free = [
            _solo(solo, dict(prompt=p, params=solo.sampling(max_tokens=24, ignore_eos=True)))
            for p in prompts
        ]
        for done in free:
            assert done.finish_reason == "length" and len(done.completion_token_ids) == 24
        # Make a token each reply draws early an end-of-sequence id of both engines' tokenizers.
        ends = {done.completion_token_ids[3] for done in free}
        for e in (solo, eng):
            e.tokenizer.eos_ids = set(e.tokenizer.eos_ids) | ends
        stopped = _solo(solo, dict(prompt=prompts[0], params=solo.sampling(max_tokens=24)))
        assert stopped.finish_reason == "stop" and len(stopped.completion_token_ids) <= 4
        assert (
            stopped.completion_token_ids
            == free[0].completion_token_ids[: len(stopped.completion_token_ids)]
        )
        alone = _solo(
            solo, dict(prompt=prompts[0], params=solo.sampling(max_tokens=24, ignore_eos=True))
        )
        assert alone.completion_token_ids == free[0].completion_token_ids
        handles = [
            eng.submit(
                _request(eng, dict(prompt=p, params=eng.sampling(max_tokens=24, ignore_eos=True)))
            )
            for p in prompts
        ]
        for h, ref in zip(handles, free, strict=True):
            done = h.result(60)
            assert done.lane == "batched" and done.finish_reason == "length"
            assert done.completion_token_ids == ref.completion_token_ids
        end = free[1].completion_token_ids[3]
        told = _solo(
            solo,
            dict(
                prompt=prompts[1],
                params=solo.sampling(max_tokens=24, ignore_eos=True, stop_token_ids=(end,)),
            ),
        )
        assert told.finish_reason == "stop"
        assert (
            told.completion_token_ids
            == free[1].completion_token_ids[: len(told.completion_token_ids)]
        )
    finally:
        solo.close()
        eng.close()


def _drafts(eng, prompt: list[int]) -> list[dict]:
    """Candidate drafts of one prompt: different seeds and samplers, one constrained."""
    s = eng.sampling
    return [
        dict(prompt=prompt, params=s(temperature=0.8, seed=1, max_tokens=14), no_eos=True),
        dict(prompt=prompt, params=s(temperature=0.8, seed=2, max_tokens=10)),
        dict(prompt=prompt, params=s(temperature=0.7, top_p=0.9, seed=3, max_tokens=12, logprobs=2)),
        dict(prompt=prompt, params=s(max_tokens=12)),
        dict(prompt=prompt, params=s(max_tokens=8), constrained=True),
    ]


def test_identical_prompts_prefill_once_and_keep_each_seeds_solo_tokens(
    tmp_path, tiny_llama_dir, engines
):
    """Requests of one prompt arriving together (candidate drafts: several seeds) prefill it
    once; the others ("twins") decode from copies of that cache, each yielding exactly its
    solo tokens, and their Done says where their prompt's KV came from."""
    solo, _ = engines
    with _engine(tmp_path, tiny_llama_dir, "twins") as eng:
        prompt = _prompt(eng, "one prompt, many drafts " * 6)
        specs = _drafts(eng, prompt)
        refs = [_solo(solo, s) for s in specs]
        before = eng.scheduler_stats()
        dones = [h.result(60) for h in _gated_submit(eng, [_request(eng, s) for s in specs])]
        after = eng.scheduler_stats()
        assert eng.active_requests == 0
    for i, (done, ref) in enumerate(zip(dones, refs, strict=True)):
        assert done.completion_token_ids == ref.completion_token_ids, i
        assert done.text == ref.text and done.finish_reason == ref.finish_reason, i
        assert done.lane == "batched" and done.batch_max == len(specs), i
    assert [x.token for x in dones[2].logprobs] == [x.token for x in refs[2].logprobs]
    assert len({tuple(d.completion_token_ids) for d in dones[:3]}) == 3  # the seeds differ
    assert after["prefill_tokens"] - before["prefill_tokens"] == len(prompt) - 1  # once
    twins = len(specs) - 1
    assert [d.cache_source for d in dones] == ["none"] + ["twin"] * twins
    assert [d.usage.cached_tokens for d in dones] == [0] + [len(prompt) - 1] * twins


def test_cancelling_the_prefilling_request_still_answers_its_twins(
    tmp_path, tiny_llama_dir, engines, monkeypatch
):
    """The request prefilling a prompt for its twins is cancelled mid-prefill (and one twin
    with it): its first remaining twin goes on from the chunks already computed, the others
    still get their copies, and every answered twin yields its solo tokens."""
    import engine.serving.scheduler as scheduler

    solo, _ = engines
    chunk = 16
    monkeypatch.setattr(scheduler, "PREFILL_CHUNK", chunk)  # several chunks on the tiny model
    with _engine(tmp_path, tiny_llama_dir, "twins-cancel") as eng:
        prompt = _prompt(eng, "cancel the one that prefills " * 8)
        assert len(prompt) > 4 * chunk
        specs = _drafts(eng, prompt)
        refs = [_solo(solo, s) for s in specs]
        handles: list = []
        chunks, active = [], []
        real = scheduler.prefill

        def spy(model, cache, tokens, **kw):
            if len(tokens) == chunk:
                chunks.append(len(tokens))
                if len(chunks) == 2:
                    active.append(eng.active_requests)
                    handles[0].cancel()  # the row prefilling the prompt
                    handles[2].cancel()  # a twin waiting for it
            return real(model, cache, tokens, **kw)

        monkeypatch.setattr(scheduler, "prefill", spy)
        before = eng.scheduler_stats()
        _gated_submit(eng, [_request(eng, s) for s in specs], into=handles)
        dones = [h.result(60) for h in handles]
        after = eng.scheduler_stats()
        assert eng.active_requests == 0
    assert active == [len(specs)]
    for i in (0, 2):
        assert dones[i].finish_reason == "cancelled" and dones[i].completion_token_ids == [], i
    for i in (1, 3, 4):
        assert dones[i].completion_token_ids == refs[i].completion_token_ids, i
        assert dones[i].text == refs[i].text, i
    # nothing prefilled twice: the heir went on from the cancelled row's chunks
    assert after["prefill_tokens"] - before["prefill_tokens"] == len(prompt) - 1
    assert (dones[1].cache_source, dones[1].usage.cached_tokens) == ("none", 0)
    assert [d.cache_source for d in dones[3:]] == ["twin", "twin"]


def test_a_failed_prefill_answers_its_twins(tmp_path, tiny_llama_dir, monkeypatch):
    """A prefill that fails fails the request and every twin waiting for it (none hangs), and
    the engine serves the next request."""
    import engine.serving.scheduler as scheduler

    real = scheduler.prefill

    def failing(model, cache, tokens, **kw):
        if len(tokens) > 1:
            raise RuntimeError("prefill failed")
        return real(model, cache, tokens, **kw)

    with _engine(tmp_path, tiny_llama_dir, "twins-fail") as eng:
        prompt = _prompt(eng, "this prefill fails")
        specs = _drafts(eng, prompt)[:3]
        monkeypatch.setattr(scheduler, "prefill", failing)
        dones = [h.result(60) for h in _gated_submit(eng, [_request(eng, s) for s in specs])]
        assert [d.error for d in dones] == ["prefill failed"] * 3
        assert eng.active_requests == 0
        monkeypatch.setattr(scheduler, "prefill", real)
        again = eng.submit(_request(eng, specs[0])).result(60)
        assert again.error is None and again.finish_reason in ("stop", "length")


def test_a_draft_arriving_after_its_twins_prefill_copies_the_decoding_rows_kv(
    tmp_path, tiny_llama_dir, engines
):
    """A request of a prompt that another request is already decoding (alone in the serial
    lane, or as a batched row) copies that row's prompt KV instead of prefilling it, and
    still yields its solo tokens; so do the rows it joins."""
    solo, _ = engines
    s = solo.sampling
    with _engine(tmp_path, tiny_llama_dir, "twins-late") as eng:
        prompt = _prompt(eng, "a late draft " * 5)
        other = _prompt(eng, "another prompt entirely")
        specs = [
            dict(prompt=prompt, params=s(temperature=0.9, seed=5, max_tokens=200), no_eos=True),
            dict(prompt=prompt, params=s(temperature=0.9, seed=6, max_tokens=12), no_eos=True),
            dict(prompt=other, params=s(max_tokens=30), no_eos=True),
            dict(prompt=other, params=s(temperature=0.8, top_p=0.9, seed=7, max_tokens=12)),
        ]
        refs = [_solo(solo, spec) for spec in specs]
        before = eng.scheduler_stats()["prefill_tokens"]
        reqs = [_request(eng, spec) for spec in specs]
        gates = [GateAfter(reqs[i].constraint, 3) for i in (0, 2)]
        reqs[0].constraint, reqs[2].constraint = gates
        first = eng.submit(reqs[0])
        gates[0].reached.wait(60)  # the engine thread holds ``first`` decoding alone
        late = eng.submit(reqs[1])
        gates[0].release.set()
        assert late.result(60).cache_source == "twin"
        assert eng.scheduler_stats()["prefill_tokens"] - before == len(prompt) - 1
        third = eng.submit(reqs[2])
        gates[1].reached.wait(60)  # ``third`` decoding with ``first`` (200 tokens) in a batch
        fourth = eng.submit(reqs[3])
        gates[1].release.set()
        dones = [h.result(60) for h in (first, late, third, fourth)]
        after = eng.scheduler_stats()["prefill_tokens"]
    for i, (done, ref) in enumerate(zip(dones, refs, strict=True)):
        assert done.completion_token_ids == ref.completion_token_ids, i
        assert done.text == ref.text, i
    # the third restores the chat template's prefix from an earlier row's checkpoint
    assert [d.cache_source for d in dones] == ["none", "twin", "ram", "twin"]
    assert dones[1].usage.cached_tokens == len(prompt) - 1 and dones[1].lane == "batched"
    assert dones[3].usage.cached_tokens == len(other) - 1 and dones[3].batch_max == 3
    tail = len(other) - 1 - dones[2].usage.cached_tokens
    assert after - before == len(prompt) - 1 + tail  # each prompt prefilled once
