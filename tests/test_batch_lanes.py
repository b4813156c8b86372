"""Continuous batching, scheduling between the serial and batched lanes on tiny random models: a
lone batched row returning to the serial lane, a chat turn beside background rows, bursts,
``ignore_eos``, and identical prompts prefilled once (twins). Every request's tokens are
compared with its solo run (tests/batch_helpers.py), so a lost or duplicated token fails.
"""

from __future__ import annotations

from engine.runtime import GenerationRequest, Priority

from tests.batch_helpers import (
    GateAfter,
    NoEos,
    OnToken,
    gated_submit,
    make_engine,
    prompt_ids,
    request_of,
    solo_done,
    streaming,
)


def test_lone_batched_row_returns_to_the_serial_lane(tmp_path, tiny_llama_dir, engines):
    """When the others leave, the last batched row continues in the serial lane at a token
    boundary (key schedule, window and tokens unchanged) and speculation runs for its tail."""
    solo, _ = engines
    spec_eng = make_engine(
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
        # own second token (its first comes from its prefill, its second from a batched step
        # of all three), when the tail is batched; then the short row leaves and the tail
        # decodes alone. Every step is a token boundary, none a race with the engine thread.
        blocker = dict(prompt=prompt_ids(spec_eng, "blocker"), params=s(max_tokens=400), no_eos=True)
        short = dict(prompt=prompt_ids(spec_eng, "short one"), params=s(max_tokens=4), no_eos=True)
        tails = [
            dict(
                prompt=prompt_ids(spec_eng, "the tail repeats the tail " * 4), params=s(max_tokens=60)
            ),
            dict(
                prompt=prompt_ids(spec_eng, "sampled tail " * 4),
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
            ref = solo_done(solo, tail)
            gate = GateAfter(NoEos(spec_eng), 1)
            first = spec_eng.submit(
                GenerationRequest(
                    list(blocker["prompt"]), blocker["params"], constraint=gate, split_reasoning=False
                )
            )
            try:
                assert gate.reached.wait(60)
                handles = [
                    spec_eng.submit(request_of(spec_eng, tail)),
                    spec_eng.submit(
                        GenerationRequest(
                            list(short["prompt"]),
                            short["params"],
                            constraint=OnToken(NoEos(spec_eng), first.cancel, at=2),
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
                == solo_done(solo, dict(blocker, params=s(max_tokens=n))).completion_token_ids
            )
            assert (
                handles[1].result(60).completion_token_ids
                == solo_done(solo, short).completion_token_ids
            )
    finally:
        spec_eng.close()


def test_a_chat_turn_joining_background_rows_gets_its_first_token_from_its_own_forward(
    tmp_path, tiny_llama_dir, engines, monkeypatch
):
    """An interactive request joining background rows draws its first token from the logits
    of its own prefill chunk (no separate pass for its last prompt token, no wait for the
    batch's next step); its tokens are still its solo run's."""
    from engine.serving import scheduler

    solo, _ = engines
    chat = dict(prompt=prompt_ids(solo, "quick question"), params=solo.sampling(max_tokens=12))
    ref = solo_done(solo, chat)
    logit_chunks = []  # prefill calls whose logits are read: (first token, last token, length)
    real = scheduler.prefill

    def counting(model, cache, tokens, *a, **kw):
        if kw.get("logits", True):
            logit_chunks.append((tokens[0], tokens[-1], len(tokens)))
        return real(model, cache, tokens, *a, **kw)

    monkeypatch.setattr(scheduler, "prefill", counting)
    with make_engine(tmp_path, tiny_llama_dir, "urgent") as eng:
        s = eng.sampling
        bg = [
            eng.submit(
                GenerationRequest(
                    prompt_ids(eng, f"background {i}"),
                    s(max_tokens=300),
                    constraint=NoEos(eng),
                    priority=Priority.BACKGROUND,
                )
            )
            for i in range(2)
        ]
        for h in bg:
            streaming(h)
        logit_chunks.clear()
        done = eng.submit(request_of(eng, chat, priority=Priority.INTERACTIVE)).result(60)
        for h in bg:
            h.cancel()
        for h in bg:
            h.result(60)
    assert done.lane == "batched" and done.batch_max == 3
    # one chunk with logits, ending the chat prompt (its reused prefix aside)
    (first, last, length), = logit_chunks
    assert last == chat["prompt"][-1] and first == chat["prompt"][-length] and length > 1
    assert done.completion_token_ids == ref.completion_token_ids


def test_a_burst_starts_decoding_together_and_keeps_its_solo_tokens(
    tmp_path, tiny_llama_dir, engines
):
    """Newcomers arriving together are all prefilled before the first batched step (the decode
    step is held, not run on a partial batch), so every step of the burst has every row; the
    tokens are the solo runs' and the step count is exact (no lost or repeated step)."""
    solo, _ = engines
    n, tokens = 5, 9
    with make_engine(tmp_path, tiny_llama_dir, "burst") as eng:
        specs = [
            dict(
                prompt=prompt_ids(eng, f"burst row {i} " + "y" * (5 * i)),
                params=eng.sampling(max_tokens=tokens),
                no_eos=True,
            )
            for i in range(n)
        ]
        specs[2]["params"] = eng.sampling(temperature=0.8, seed=2, max_tokens=tokens)
        refs = [solo_done(solo, spec) for spec in specs]
        before = eng.scheduler_stats()
        dones = [h.result(60) for h in gated_submit(eng, [request_of(eng, s) for s in specs])]
        after = eng.scheduler_stats()
    for done, ref in zip(dones, refs, strict=True):
        assert done.completion_token_ids == ref.completion_token_ids
        assert done.lane == "batched" and done.batch_min == done.batch_max == n
    d = {k: after[k] - before[k] for k in after}
    assert d["held_ticks"] >= 1 and d["serial_steps"] == 0
    # the first token from each row's prefill, one step per later token, then the step that
    # feeds every row's last token
    assert d["batched_steps"] == tokens and d["batched_rows"] == n * tokens
    assert d["prefill_tokens"] == sum(len(s["prompt"]) for s in specs)


def test_a_chat_turn_is_not_held_behind_a_burst_of_background_prefill(
    tmp_path, tiny_llama_dir, engines
):
    """The hold never makes a request wait for lower-priority newcomers' prefill: a chat turn
    arriving with background requests starts decoding before they have all joined."""
    solo, _ = engines
    chat = dict(prompt=prompt_ids(solo, "chat first"), params=solo.sampling(max_tokens=6), no_eos=True)
    bg = [
        dict(
            prompt=prompt_ids(solo, f"background prompt {i} " * 6),
            params=solo.sampling(max_tokens=12),
            no_eos=True,
        )
        for i in range(3)
    ]
    refs = [solo_done(solo, s) for s in [chat, *bg]]
    with make_engine(tmp_path, tiny_llama_dir, "nohold") as eng:
        reqs = [request_of(eng, chat, priority=Priority.INTERACTIVE)]
        reqs += [request_of(eng, s, priority=Priority.BACKGROUND) for s in bg]
        dones = [h.result(60) for h in gated_submit(eng, reqs)]
    for done, ref in zip(dones, refs, strict=True):
        assert done.completion_token_ids == ref.completion_token_ids
    # its first steps ran while background rows were still prefilling (the batch ramped up)
    assert dones[0].lane == "batched" and dones[0].batch_min == 1 and dones[0].batch_max == 4


def test_ignore_eos_runs_replies_to_max_tokens_in_both_lanes(tmp_path, tiny_llama_dir):
    """``SamplingParams.ignore_eos`` (fixed reply lengths for benchmarks): a reply that stops at
    an end-of-sequence token goes on to max_tokens with the tokens it would draw anyway, served
    alone and in a batch; explicit stop_token_ids still end it."""
    solo = make_engine(tmp_path, tiny_llama_dir, "eos-solo")
    eng = make_engine(tmp_path, tiny_llama_dir, "eos-batch")
    try:
        prompts = [prompt_ids(eng, f"fixed length {i} " + "z" * (5 * i)) for i in range(3)]
        free = [
            solo_done(solo, dict(prompt=p, params=solo.sampling(max_tokens=24, ignore_eos=True)))
            for p in prompts
        ]
        for done in free:
            assert done.finish_reason == "length" and len(done.completion_token_ids) == 24
        # Make a token each reply draws early an end-of-sequence id of both engines' tokenizers.
        ends = {done.completion_token_ids[3] for done in free}
        for e in (solo, eng):
            e.tokenizer.eos_ids = set(e.tokenizer.eos_ids) | ends
        stopped = solo_done(solo, dict(prompt=prompts[0], params=solo.sampling(max_tokens=24)))
        assert stopped.finish_reason == "stop" and len(stopped.completion_token_ids) <= 4
        assert (
            stopped.completion_token_ids
            == free[0].completion_token_ids[: len(stopped.completion_token_ids)]
        )
        alone = solo_done(
            solo, dict(prompt=prompts[0], params=solo.sampling(max_tokens=24, ignore_eos=True))
        )
        assert alone.completion_token_ids == free[0].completion_token_ids
        handles = [
            eng.submit(
                request_of(eng, dict(prompt=p, params=eng.sampling(max_tokens=24, ignore_eos=True)))
            )
            for p in prompts
        ]
        for h, ref in zip(handles, free, strict=True):
            done = h.result(60)
            assert done.lane == "batched" and done.finish_reason == "length"
            assert done.completion_token_ids == ref.completion_token_ids
        end = free[1].completion_token_ids[3]
        told = solo_done(
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
    with make_engine(tmp_path, tiny_llama_dir, "twins") as eng:
        prompt = prompt_ids(eng, "one prompt, many drafts " * 6)
        specs = _drafts(eng, prompt)
        refs = [solo_done(solo, s) for s in specs]
        before = eng.scheduler_stats()
        dones = [h.result(60) for h in gated_submit(eng, [request_of(eng, s) for s in specs])]
        after = eng.scheduler_stats()
        assert eng.active_requests == 0
    for i, (done, ref) in enumerate(zip(dones, refs, strict=True)):
        assert done.completion_token_ids == ref.completion_token_ids, i
        assert done.text == ref.text and done.finish_reason == ref.finish_reason, i
        assert done.lane == "batched" and done.batch_max == len(specs), i
    assert [x.token for x in dones[2].logprobs] == [x.token for x in refs[2].logprobs]
    assert len({tuple(d.completion_token_ids) for d in dones[:3]}) == 3  # the seeds differ
    assert after["prefill_tokens"] - before["prefill_tokens"] == len(prompt)  # once
    twins = len(specs) - 1
    assert [d.cache_source for d in dones] == ["none"] + ["twin"] * twins
    assert [d.usage.cached_tokens for d in dones] == [0] + [len(prompt)] * twins


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
    with make_engine(tmp_path, tiny_llama_dir, "twins-cancel") as eng:
        prompt = prompt_ids(eng, "cancel the one that prefills " * 8)
        assert len(prompt) > 4 * chunk
        specs = _drafts(eng, prompt)
        refs = [solo_done(solo, s) for s in specs]
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
        gated_submit(eng, [request_of(eng, s) for s in specs], into=handles)
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
    assert after["prefill_tokens"] - before["prefill_tokens"] == len(prompt)
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

    with make_engine(tmp_path, tiny_llama_dir, "twins-fail") as eng:
        prompt = prompt_ids(eng, "this prefill fails")
        specs = _drafts(eng, prompt)[:3]
        monkeypatch.setattr(scheduler, "prefill", failing)
        dones = [h.result(60) for h in gated_submit(eng, [request_of(eng, s) for s in specs])]
        assert [d.error for d in dones] == ["prefill failed"] * 3
        assert eng.active_requests == 0
        monkeypatch.setattr(scheduler, "prefill", real)
        again = eng.submit(request_of(eng, specs[0])).result(60)
        assert again.error is None and again.finish_reason in ("stop", "length")


def test_a_draft_arriving_after_its_twins_prefill_copies_the_decoding_rows_kv(
    tmp_path, tiny_llama_dir, engines
):
    """A request of a prompt that another request is already decoding (alone in the serial
    lane, or as a batched row) copies that row's prompt KV instead of prefilling it, and
    still yields its solo tokens; so do the rows it joins."""
    solo, _ = engines
    s = solo.sampling
    with make_engine(tmp_path, tiny_llama_dir, "twins-late") as eng:
        prompt = prompt_ids(eng, "a late draft " * 5)
        other = prompt_ids(eng, "another prompt entirely")
        specs = [
            dict(prompt=prompt, params=s(temperature=0.9, seed=5, max_tokens=200), no_eos=True),
            dict(prompt=prompt, params=s(temperature=0.9, seed=6, max_tokens=12), no_eos=True),
            dict(prompt=other, params=s(max_tokens=30), no_eos=True),
            dict(prompt=other, params=s(temperature=0.8, top_p=0.9, seed=7, max_tokens=12)),
        ]
        refs = [solo_done(solo, spec) for spec in specs]
        before = eng.scheduler_stats()["prefill_tokens"]
        reqs = [request_of(eng, spec) for spec in specs]
        gates = [GateAfter(reqs[i].constraint, 3) for i in (0, 2)]
        reqs[0].constraint, reqs[2].constraint = gates
        first = eng.submit(reqs[0])
        gates[0].reached.wait(60)  # the engine thread holds ``first`` decoding alone
        late = eng.submit(reqs[1])
        gates[0].release.set()
        assert late.result(60).cache_source == "twin"
        assert eng.scheduler_stats()["prefill_tokens"] - before == len(prompt)
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
    assert dones[1].usage.cached_tokens == len(prompt) and dones[1].lane == "batched"
    assert dones[3].usage.cached_tokens == len(other) and dones[3].batch_max == 3
    tail = len(other) - dones[2].usage.cached_tokens
    assert after - before == len(prompt) + tail  # each prompt prefilled once
