"""Shared parts of the continuous-batching tests (tests/test_batch.py, tests/test_batch_lanes.py):
engines on a tiny random model, constraint and logits-processor stubs, request builders, and
the solo references every batched row is compared with."""

from __future__ import annotations

import threading

from engine.runtime import Engine, GenerationRequest
from engine.serving.events import Done, TextDelta

import mlx.core as mx


def make_engine(tmp_path, model_dir, name: str, **sections) -> Engine:
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
    """``inner``'s constraint that calls ``fn`` on the engine thread at its ``at``-th token
    (default the first): the test acts at a known point of the run, not after a race with the
    engine."""

    def __init__(self, inner, fn, at: int = 1):
        self.inner, self.fn, self.left = inner, fn, at

    def allowed(self):
        return self.inner.allowed()

    def advance(self, token: int) -> None:
        self.inner.advance(token)
        self.left -= 1
        if self.fn is not None and self.left <= 0:
            self.fn, fn = None, self.fn
            fn()


def prompt_ids(eng, text: str) -> list[int]:
    return eng.chat_prompt([{"role": "user", "content": text}])


def mixed_specs(eng) -> list[dict]:
    """Requests with different prompt lengths and samplers (one constrained)."""
    s = eng.sampling
    return [
        dict(prompt=prompt_ids(eng, "hi"), params=s(max_tokens=24)),
        dict(prompt=prompt_ids(eng, "a much longer prompt " * 12), params=s(max_tokens=20)),
        dict(
            prompt=prompt_ids(eng, "sampled row"),
            params=s(temperature=0.9, top_k=40, seed=11, max_tokens=22),
        ),
        dict(
            prompt=prompt_ids(eng, "penalised"),
            params=s(repetition_penalty=1.5, repetition_context=8, max_tokens=18),
        ),
        dict(
            prompt=prompt_ids(eng, "nucleus"),
            params=s(temperature=0.7, top_p=0.8, seed=3, max_tokens=16, logprobs=2),
        ),
        dict(prompt=prompt_ids(eng, "constrained"), params=s(max_tokens=16), constrained=True),
    ]


def request_of(eng, spec: dict, **kw) -> GenerationRequest:
    constraint = EveryThird(eng.logits_width) if spec.get("constrained") else None
    constraint = NoEos(eng) if spec.get("no_eos") else constraint
    return GenerationRequest(
        list(spec["prompt"]), spec["params"], constraint=constraint, split_reasoning=False, **kw
    )


def solo_done(eng, spec: dict) -> Done:
    done = eng.submit(request_of(eng, spec)).result(60)
    assert done.lane == "serial" and done.batch_max == 1
    return done


def streaming(handle, deltas: int = 1):
    """Wait until ``handle`` has streamed ``deltas`` pieces of text; returns its event iterator."""
    it = iter(handle)
    for _ in range(deltas):
        while not isinstance(next(it), TextDelta):
            pass
    return it


def cancel_after(handle, deltas: int) -> None:
    """Read ``handle``'s events, cancel it after ``deltas`` pieces of text, drain the rest."""
    seen = 0
    for ev in handle:
        if isinstance(ev, TextDelta):
            seen += 1
            if seen == deltas:
                handle.cancel()


def collect_stream(handle) -> tuple[str, Done, list]:
    text, done, events = [], None, []
    for ev in handle:
        events.append(ev)
        if isinstance(ev, TextDelta):
            text.append(ev.text)
        if isinstance(ev, Done):
            done = ev
    return "".join(text), done, events


def gated_submit(eng, requests: list[GenerationRequest], into: list | None = None) -> list:
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
