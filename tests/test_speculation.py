"""Speculative decoding on tiny random models: identical tokens, exact caches, every accept path."""

from __future__ import annotations

import engine  # noqa: F401  (loads OpenBLAS before mlx)

# isort: split
import json
import os
import random
import subprocess
import sys
from pathlib import Path

from engine.errors import ProfileError
from engine.generation.generate import generate_step, prefill
from engine.generation.kv_cache import WindowKVCache, make_cache
from engine.generation.speculation.base import DraftPolicy, SpecStats, Speculation
from engine.generation.speculation.lookup import LookupDrafter, NgramIndex
from engine.profiles import ProfileValidationError, load_profile
from engine.runtime import Engine, GenerationRequest
from engine.sampling import SamplingParams

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.utils import load_model

from tests.tiny_models import LLAMA_CONFIG, VOCAB, make_model_dir, write_profile

REPO = Path(__file__).resolve().parent.parent
PROMPT = [5, 40, 77, 101, 200, 13, 64, 90, 91, 92, 150, 151, 152, 153, 20, 21, 22, 23, 24, 25]
K = 6


@pytest.fixture(scope="module")
def models(tiny_llama_dir, tiny_qwen2_dir, tiny_gemma_dir):
    return {name: load_model(d)[0] for name, d in
            (("llama", tiny_llama_dir), ("qwen2", tiny_qwen2_dir), ("gemma3", tiny_gemma_dir))}


class Oracle:
    """Drafts the reference continuation, optionally with the token at draft index ``wrong`` changed."""

    name, needs_hidden = "oracle", False

    def __init__(self, ref: list[int], start: int, wrong: int | None = None):
        self.ref, self.start, self.wrong = ref, start, wrong

    def reset(self, context):
        self.n = len(context)

    def propose(self, pending, k, hidden=None):
        i = self.n - self.start + 1  # index in ref of the token after ``pending``
        draft = list(self.ref[i : i + k])
        if self.wrong is not None and self.wrong < len(draft):
            draft[self.wrong] = (draft[self.wrong] + 2) % 256  # same parity (see Alternating)
        return draft

    def commit(self, tokens):
        self.n += len(tokens)

    def bind(self, stats):
        pass


class RandomDrafter(Oracle):
    def __init__(self, seed: int):
        self.rng = random.Random(seed)

    def propose(self, pending, k, hidden=None):
        return [self.rng.randrange(256) for _ in range(k)]


def _spec(drafter, k=K, adaptive=True) -> Speculation:
    return Speculation(drafter, DraftPolicy(k, 1, adaptive), SpecStats("test"))


def _plain(model, params, prompt=PROMPT):
    return [o.token for o in generate_step(model, prompt, make_cache(model), params)]


def assert_cache_is_fresh_prefill(model, cache, tokens, tol: float = 1e-4):
    """The caches hold exactly ``tokens``: same offset and K/V as prefilling them from scratch."""
    fresh = make_cache(model)
    prefill(model, fresh, tokens)
    for c, f in zip(cache, fresh, strict=True):
        assert c.offset == f.offset == len(tokens)
        if isinstance(c, WindowKVCache):
            got, want = c.state, f.state
        else:
            got = [c.keys[..., : c.offset, :], c.values[..., : c.offset, :]]
            want = [f.keys[..., : f.offset, :], f.values[..., : f.offset, :]]
        for g, w in zip(got, want, strict=True):
            np.testing.assert_allclose(np.array(g), np.array(w), rtol=tol, atol=tol)


@pytest.mark.parametrize("which", ["llama", "qwen2", "gemma3"])
@pytest.mark.parametrize("temperature", [0.0, 0.8])
@pytest.mark.parametrize("wrong", [None, *range(K)])
def test_oracle_drafts_keep_the_output_identical(models, which, temperature, wrong):
    """All drafts right (every round fully accepted), or one wrong token at draft index j
    (every partial-accept length); greedy, and sampled with a seed, with the repetition window."""
    model = models[which]
    params = SamplingParams(temperature=temperature, seed=7, max_tokens=40, repetition_penalty=1.1)
    ref = _plain(model, params)
    spec = _spec(Oracle(ref, len(PROMPT), wrong), adaptive=False)
    got = [o.token for o in generate_step(model, PROMPT, make_cache(model), params, speculation=spec)]
    assert got == ref
    st = spec.stats
    assert st.rounds > 0 and st.disabled is None
    cap = K if which != "gemma3" else min(K, 8 - 1)  # the tiny Gemma's window is 8
    if wrong is None:
        assert st.accepted == st.drafted and st.mean_accepted > cap - 1
    else:
        assert st.accepted < st.drafted
        if wrong < cap:
            assert set(st.accepted_lengths[:-1]) <= {wrong}  # each round stops at the wrong token


@pytest.mark.parametrize("which", ["llama", "gemma3"])
@pytest.mark.parametrize("wrong", [None, 0, 2])
def test_cache_equals_fresh_prefill_after_every_token(models, which, wrong):
    """Also past the Gemma window (8): the ring is rolled back exactly, slot by slot."""
    model = models[which]
    params = SamplingParams(temperature=0.0, max_tokens=30)
    ref = _plain(model, params)
    cache = make_cache(model)
    spec = _spec(Oracle(ref, len(PROMPT), wrong))
    out = []
    for o in generate_step(model, PROMPT, cache, params, speculation=spec):
        out.append(o.token)
        assert_cache_is_fresh_prefill(model, cache, PROMPT + out)
    assert out == ref and len(PROMPT) + len(out) > 8


def test_random_drafts_are_all_rejected_and_change_nothing(models):
    model = models["llama"]
    params = SamplingParams(temperature=0.0, max_tokens=40)
    ref = _plain(model, params)
    spec = _spec(RandomDrafter(1))
    got = [o.token for o in generate_step(model, PROMPT, make_cache(model), params, speculation=spec)]
    assert got == ref
    assert spec.stats.drafted >= 40 and spec.stats.accepted <= 2


@pytest.mark.parametrize("max_tokens", [1, 2, 5, 13])
def test_max_tokens_inside_an_accepted_run(models, max_tokens):
    model = models["llama"]
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    ref = _plain(model, SamplingParams(temperature=0.0, max_tokens=40))
    cache = make_cache(model)
    spec = _spec(Oracle(ref, len(PROMPT)), k=8, adaptive=False)
    got = [o.token for o in generate_step(model, PROMPT, cache, params, speculation=spec)]
    assert got == ref[:max_tokens]
    assert_cache_is_fresh_prefill(model, cache, PROMPT + got)


@pytest.mark.parametrize("which", ["llama", "gemma3"])
@pytest.mark.parametrize("stop_after", [1, 3, 4, 9])
def test_consumer_stopping_mid_round_leaves_exactly_the_yielded_tokens(models, which, stop_after):
    """What an EOS or a stop string does: the caller breaks inside an accepted run and closes."""
    model = models[which]
    params = SamplingParams(temperature=0.0, max_tokens=40)
    ref = _plain(model, params)
    cache = make_cache(model)
    spec = _spec(Oracle(ref, len(PROMPT)), k=6, adaptive=False)
    steps = generate_step(model, PROMPT, cache, params, speculation=spec)
    got = []
    for o in steps:
        got.append(o.token)
        if len(got) == stop_after:
            break
    steps.close()
    assert got == ref[:stop_after]
    assert_cache_is_fresh_prefill(model, cache, PROMPT + got)


def test_ngram_index_finds_the_latest_longest_earlier_match():
    idx = NgramIndex(2, 4)
    idx.extend([5, 1, 2, 3, 9, 6, 1, 2, 3, 8, 6, 1, 2])
    assert idx.continuation([4], 3) == []  # no n-gram ends in "2 4": a miss drafts nothing
    # tail "6 1 2 3": its latest earlier occurrence was followed by 8 (the first one by 9)
    assert idx.continuation([3], 3) == [8, 6, 1]
    short = NgramIndex(2, 3)
    short.extend([5, 1, 2, 3, 9, 6, 1, 2, 3, 8, 6, 1, 2])
    assert short.continuation([3], 2) == [8, 6]
    # the current suffix never matches itself; a match running into the end continues
    # into the pending token
    loop = NgramIndex(1, 2)
    loop.extend([4, 4])
    assert loop.continuation([4], 3) == [4]


def test_ngram_index_is_incremental():
    rng = random.Random(0)
    toks = [rng.randrange(6) for _ in range(300)]
    inc = NgramIndex(2, 4)
    for i in range(0, 300, 7):
        inc.extend(toks[i : i + 7])
    whole = NgramIndex(2, 4)
    whole.extend(toks)
    assert inc._last == whole._last
    for k in range(1, 6):
        assert inc.continuation([3], k) == whole.continuation([3], k)


def test_lookup_keeps_copying_the_block_it_matched():
    """Two near-identical blocks: once the reply copies the first, drafts follow the first (the
    latest occurrence of a short n-gram is the second); after the reply parts from it, n-grams again."""
    context = [10, 1, 2, 3, 4, 5, 6, 7, 8, 20, 1, 2, 3, 4, 5, 6, 9, 8, 30]
    d = LookupDrafter(1, 4)
    d.reset(context)
    assert d.propose(10, 3) == [1, 2, 3]
    d.commit([10, 1, 2, 3])  # all accepted; the target's next token is 4
    assert d.propose(4, 3) == [5, 6, 7]  # the copied block, not the latest "1 2 3 4" (-> 5 6 9)
    d.commit([4, 5])  # 5 accepted, 6 rejected: the target wrote 9
    assert d.propose(9, 2) == [8, 30]  # parted from the block: n-gram lookup again ("9" -> 8 30)
    d.commit([9])
    plain = LookupDrafter(1, 4)
    plain.reset(context + [10, 1, 2, 3])
    assert plain.propose(4, 3) == [5, 6, 9]  # the control: n-grams alone take the latest block


def test_prompt_lookup_on_a_repeating_model(models):
    """Real lookup drafts: the tiny models settle into loops, which lookup then copies."""
    model = models["llama"]
    params = SamplingParams(temperature=0.0, max_tokens=80)
    ref = _plain(model, params)
    spec = _spec(LookupDrafter(1, 4), k=8)
    got = [o.token for o in generate_step(model, PROMPT, make_cache(model), params, speculation=spec)]
    assert got == ref
    assert spec.stats.drafted > 0 and spec.stats.plain_steps + spec.stats.rounds < 80


# -- through the engine: profiles, draft models, stops, checkpoints ----------------------------

def _engine(tmp_path, model_dir, name, **speculation):
    sections = {"speculation": speculation} if speculation else {}
    return Engine.load(str(write_profile(tmp_path / f"{name}.yaml", model_dir, **sections)))


@pytest.fixture(scope="module")
def llama_pair(tmp_path_factory, tiny_llama_dir):
    d = tmp_path_factory.mktemp("engines")
    other = make_model_dir(d / "draft-llama", LLAMA_CONFIG, seed=5)
    plain = _engine(d, tiny_llama_dir, "plain")
    selfdraft = _engine(d, tiny_llama_dir, "self", mode="draft", draft_model=str(tiny_llama_dir),
                        num_draft_tokens=5)
    otherdraft = _engine(d, tiny_llama_dir, "other", mode="draft", draft_model=str(other),
                         num_draft_tokens=4, draft_min_prob=0.05)
    lookup = _engine(d, tiny_llama_dir, "lookup", mode="lookup", lookup_ngram=1, num_draft_tokens=8)
    yield plain, {"self": selfdraft, "other": otherdraft, "lookup": lookup}
    for e in (plain, selfdraft, otherdraft, lookup):
        e.close()


def _run(eng, ids, **kw):
    return eng.generate(ids, **kw)


@pytest.mark.parametrize("kind", ["self", "other", "lookup"])
def test_engine_draft_and_lookup_match_plain_with_stops_and_eos(llama_pair, kind):
    plain, spec = llama_pair[0], llama_pair[1][kind]
    ids = plain.chat_prompt([{"role": "user", "content": "tell me a story about a fox"}])
    base = _run(plain, ids, temperature=0.0, max_tokens=48)
    assert base.speculation is None
    done = _run(spec, ids, temperature=0.0, max_tokens=48)
    assert done.completion_token_ids == base.completion_token_ids and done.text == base.text
    s = done.speculation
    assert s["mode"] == ("lookup" if kind == "lookup" else "draft")
    if kind == "self":  # the target drafting for itself: everything is accepted
        assert s["rounds"] > 0 and s["acceptance_rate"] > 0.95 and s["mean_accepted_length"] > 2
    # a stop string and an EOS token falling inside accepted runs
    text = base.text
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    a = _run(plain, ids, temperature=0.0, max_tokens=48, stop=[stop])
    b = _run(spec, ids, temperature=0.0, max_tokens=48, stop=[stop])
    assert (b.text, b.finish_reason, b.completion_token_ids) == (a.text, a.finish_reason, a.completion_token_ids)
    eos = base.completion_token_ids[17]
    a = _run(plain, ids, temperature=0.0, max_tokens=48, stop_token_ids=(eos,))
    b = _run(spec, ids, temperature=0.0, max_tokens=48, stop_token_ids=(eos,))
    assert b.completion_token_ids == a.completion_token_ids and b.finish_reason == a.finish_reason == "stop"
    a = _run(plain, ids, temperature=0.9, seed=3, max_tokens=30)
    b = _run(spec, ids, temperature=0.9, seed=3, max_tokens=30)
    assert b.completion_token_ids == a.completion_token_ids


def test_request_can_opt_out_and_constraints_turn_it_off(llama_pair):
    plain, spec = llama_pair[0], llama_pair[1]["self"]
    ids = plain.chat_prompt([{"role": "user", "content": "hi"}])
    done = spec.submit(GenerationRequest(ids, spec.sampling(temperature=0.0, max_tokens=8),
                                         extra={"speculation": False}))
    assert list(done)[-1].speculation is None

    class NoFork:
        def allowed(self):
            return None

        def advance(self, token):
            pass

    events = list(spec.submit(GenerationRequest(ids, spec.sampling(temperature=0.0, max_tokens=8),
                                                constraint=NoFork())))
    s = events[-1].speculation
    assert "without fork" in s["disabled"] and s["rounds"] == 0
    assert events[-1].completion_token_ids == _run(plain, ids, temperature=0.0, max_tokens=8).completion_token_ids
    done = spec.submit(GenerationRequest(ids, spec.sampling(temperature=0.0, max_tokens=24),
                                         constraint=Alternating())).result()
    ref = plain.submit(GenerationRequest(ids, plain.sampling(temperature=0.0, max_tokens=24),
                                         constraint=Alternating())).result()
    assert done.completion_token_ids == ref.completion_token_ids
    assert done.speculation["disabled"] is None and done.speculation["accepted"] > 0


class Alternating:
    """A constraint whose mask changes every token: even ids, then odd ids, then even ..."""

    def __init__(self):
        self.n = 0

    def fork(self):
        other = Alternating()
        other.n = self.n
        return other

    def allowed(self):
        return (mx.arange(VOCAB) % 2) == (self.n % 2)

    def advance(self, token):
        assert token % 2 == self.n % 2, "a token outside the mask was committed"
        self.n += 1


@pytest.mark.parametrize("wrong", [None, 0, 2])
def test_constrained_positions_are_each_masked(models, wrong):
    model = models["llama"]
    params = SamplingParams(temperature=0.0, max_tokens=30)
    ref = [o.token for o in generate_step(model, PROMPT, make_cache(model), params, constraint=Alternating())]
    assert all(t % 2 == i % 2 for i, t in enumerate(ref))
    spec = _spec(Oracle(ref, len(PROMPT), wrong))
    got = [o.token for o in generate_step(model, PROMPT, make_cache(model), params, constraint=Alternating(),
                                          speculation=spec)]
    assert got == ref and spec.stats.rounds > 0


class ForcedAlternating(Alternating):
    """Alternating, plus ``draft()`` (a grammar's forced tokens): the reference continuation,
    optionally with the token at draft index ``wrong`` changed to another allowed one."""

    def __init__(self, ref=(), wrong=None):
        super().__init__()
        self.ref, self.wrong = list(ref), wrong

    def fork(self):
        other = ForcedAlternating(self.ref, self.wrong)
        other.n = self.n
        return other

    def draft(self, k):
        out = list(self.ref[self.n : self.n + k])
        if self.wrong is not None and self.wrong < len(out):
            out[self.wrong] = (out[self.wrong] + 2) % 256  # same parity: the mask allows it
        return out


class NoDrafts(Oracle):
    def __init__(self):
        pass

    def propose(self, pending, k, hidden=None):
        return []


class OffMask(Oracle):
    """The reference continuation with draft index 1 outside its mask (other parity)."""

    def propose(self, pending, k, hidden=None):
        draft = super().propose(pending, k)
        if len(draft) > 1:
            draft[1] = (draft[1] + 1) % 256
        return draft


@pytest.mark.parametrize("temperature", [0.0, 0.8])
@pytest.mark.parametrize("wrong", [None, 0, 2])
@pytest.mark.parametrize("max_tokens", [7, 30])
def test_a_constraints_forced_tokens_are_verified_drafts(models, temperature, wrong, max_tokens):
    """Tokens a constraint dictates (``draft()``) are drafted where the drafter has none or its
    guess leaves the mask, up to the draft ceiling; right or wrong, the output is plain decoding's
    (greedy, and sampled with a seed) and ends at max_tokens inside an accepted run."""
    model = models["llama"]
    params = SamplingParams(temperature=temperature, seed=3, max_tokens=max_tokens)
    ref = [o.token for o in generate_step(model, PROMPT, make_cache(model), params, constraint=Alternating())]
    for drafter in (NoDrafts(), OffMask(ref, len(PROMPT))):
        spec = _spec(drafter)
        got = [o.token for o in generate_step(model, PROMPT, make_cache(model), params,
                                              constraint=ForcedAlternating(ref, wrong), speculation=spec)]
        assert got == ref
        assert spec.stats.forced > 0 and spec.stats.rounds > 0
        assert spec.stats.drafted <= spec.stats.rounds * K  # the ceiling holds forced tokens too
        if wrong is None:
            assert spec.stats.accepted == spec.stats.drafted  # the reference is always accepted
            assert spec.stats.rounds + spec.stats.plain_steps < len(ref) / 2


def test_forced_tokens_leave_the_cache_as_a_fresh_prefill(models):
    model = models["llama"]
    params = SamplingParams(temperature=0.0, max_tokens=20)
    ref = [o.token for o in generate_step(model, PROMPT, make_cache(model), params, constraint=Alternating())]
    cache = make_cache(model)
    spec = _spec(NoDrafts())
    got = [o.token for o in generate_step(model, PROMPT, cache, params, constraint=ForcedAlternating(ref, 1),
                                          speculation=spec)]
    assert got == ref and spec.stats.forced > 0
    assert_cache_is_fresh_prefill(model, cache, PROMPT + ref)


def test_profile_rules_and_mtp_refusal(tmp_path, tiny_llama_dir):
    bad = tmp_path / "bad.yaml"
    bad.write_text("model: {source: x.gguf}\nspeculation:\n  mode: draft\n  num_draft_tokens: 2\n"
                   "  min_draft_tokens: 3\n  lookup_ngram: 3\n  lookup_max_ngram: 2\n  mode2: x\n")
    with pytest.raises(ProfileValidationError) as e:
        load_profile(str(bad))
    text = "\n".join(e.value.problems)
    assert f"{bad}:3: speculation.draft_model: missing; mode: draft needs draft_model" in text
    assert f"{bad}:5: speculation.min_draft_tokens: 3 is out of range" in text
    assert f"{bad}:7: speculation.lookup_max_ngram: 2 is out of range" in text
    assert f"{bad}:8: speculation.mode2: unknown key" in text
    with pytest.raises(ProfileError, match=r"mtp.yaml:\d+: speculation.mode: mtp needs a model with "
                       r"multi-token-prediction layers; .* ships none"):
        _engine(tmp_path, tiny_llama_dir, "mtp", mode="mtp")
    wide = make_model_dir(tmp_path / "wide", {**LLAMA_CONFIG, "vocab_size": LLAMA_CONFIG["vocab_size"] + 64})
    with pytest.raises(ProfileError, match="does not share the target's tokenizer"):
        _engine(tmp_path, tiny_llama_dir, "wide", mode="draft", draft_model=str(wide))


def _turn(home: Path, profile: Path, session: str, prompt: str) -> dict:
    env = {**os.environ, "PYTHONPATH": str(REPO), "MLXTERM_HOME": str(home)}
    cmd = [sys.executable, "-m", "app", "generate", "--profile", str(profile), "--session", session,
           "--prompt", prompt, "--temperature", "0", "--max-tokens", "24", "--json"]
    done = subprocess.run(cmd, env=env, cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def test_speculative_turn_checkpoint_resumes_in_a_fresh_process(tmp_path, tiny_llama_dir):
    """Turn 1 decodes speculatively and is checkpointed; turn 2, a new process, restores it from
    SSD and continues exactly as a plain run does (the checkpoint held exactly the kept tokens)."""
    spec = write_profile(tmp_path / "spec.yaml", tiny_llama_dir,
                         speculation={"mode": "draft", "draft_model": str(tiny_llama_dir), "num_draft_tokens": 6})
    plain = write_profile(tmp_path / "plain.yaml", tiny_llama_dir)
    runs = {}
    for name, profile in (("spec", spec), ("plain", plain)):
        home = tmp_path / f"home-{name}"
        first = _turn(home, profile, "s1", "the quick brown fox")
        second = _turn(home, profile, "s1", "and then?")
        runs[name] = (first, second)
    (s1, s2), (p1, p2) = runs["spec"], runs["plain"]
    assert s1["speculation"]["accepted"] > 0 and "speculation" not in p1
    assert s2["cache"]["source"] == "ssd" and s2["usage"]["cached_tokens"] > s1["usage"]["prompt_tokens"]
    assert (s1["text"], s2["text"]) == (p1["text"], p2["text"])
    assert s2["usage"] == p2["usage"]


def _draft_dir(home: Path, profile: Path) -> Path:
    from engine.checkpoints import make_fingerprint
    from engine.model.weight_policy import choose_weights

    prof = load_profile(str(profile))
    key = make_fingerprint(Path(prof.speculation.draft_model), choose_weights(prof.model.weights), "draft", "same").key
    found = [d for d in home.rglob(key) if d.is_dir()]
    assert len(found) == 1, found
    return found[0]


def test_draft_model_kv_is_checkpointed_with_the_session(tmp_path, tiny_llama_dir):
    """The draft model's KV is saved with the session's checkpoint (exactly the committed tokens)
    and restored in a fresh process, so the draft model does not re-read the context; a corrupt
    or missing draft checkpoint means one warning and a re-prefill, with the same output."""
    import shutil

    other = make_model_dir(tmp_path / "draft-llama", LLAMA_CONFIG, seed=5)
    profile = write_profile(tmp_path / "spec.yaml", tiny_llama_dir, speculation={
        "mode": "draft", "draft_model": str(other), "num_draft_tokens": 4, "draft_min_prob": 0.05})
    home = tmp_path / "home"
    first = _turn(home, profile, "s1", "the quick brown fox")
    s1 = first["speculation"]
    assert s1["rounds"] > 0 and s1["draft_restored"] == 0 and s1["draft_prefilled"] >= first["usage"]["prompt_tokens"]
    for name in ("corrupt", "missing"):
        shutil.copytree(home, tmp_path / f"home-{name}")
    files = list(_draft_dir(home, profile).glob("*.safetensors"))
    assert len(files) == 1

    def second(h: Path) -> tuple[dict, str]:
        env = {**os.environ, "PYTHONPATH": str(REPO), "MLXTERM_HOME": str(h)}
        cmd = [sys.executable, "-m", "app", "generate", "--profile", str(profile), "--session", "s1",
               "--prompt", "and then?", "--temperature", "0", "--max-tokens", "24", "--json"]
        done = subprocess.run(cmd, env=env, cwd=REPO, capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stderr
        return json.loads(done.stdout), done.stderr

    ok, err = second(home)
    s2 = ok["speculation"]
    assert ok["cache"]["source"] == "ssd" and "warning" not in err.lower()
    # restored: everything of turn 1 the target kept, past turn 1's prompt; only the new turn's
    # tokens (and turn 1's unfed last token or so) go through the draft model
    assert s2["draft_restored"] > first["usage"]["prompt_tokens"]
    new_tokens = ok["usage"]["prompt_tokens"] - s2["draft_restored"]
    assert s2["draft_prefilled"] <= new_tokens + ok["usage"]["completion_tokens"]
    bad = _draft_dir(tmp_path / "home-corrupt", profile)
    for f in bad.glob("*.safetensors"):
        f.write_bytes(f.read_bytes()[:-64] + b"\0" * 64)
    for f in _draft_dir(tmp_path / "home-missing", profile).glob("*.safetensors"):
        f.unlink()
    for name in ("corrupt", "missing"):
        got, err = second(tmp_path / f"home-{name}")
        assert got["text"] == ok["text"] and got["usage"] == ok["usage"], name
        assert got["speculation"]["draft_restored"] == 0, name
        assert got["speculation"]["draft_prefilled"] >= got["usage"]["prompt_tokens"] - 1, name
        warnings = [line for line in err.splitlines() if "checkpoint" in line.lower()]
        assert len(warnings) == 1, (name, err)


@pytest.mark.timeout(300)  # it waits on the app in loops: fail, never hang
async def test_tui_status_bar_shows_acceptance_while_a_speculative_preset_streams(tmp_path, tiny_llama_dir):
    from app.tui.app import MlxtermApp
    from app.tui.widgets.prompt import PromptInput

    profile = write_profile(tmp_path / "tui-spec.yaml", tiny_llama_dir, sampling={"max_tokens": 120},
                            speculation={"mode": "draft", "draft_model": str(tiny_llama_dir)})
    app = MlxtermApp(str(profile), memory_probe=lambda: 300 << 20)
    async with app.run_test(size=(120, 36)) as pilot:
        while not app.controller.loaded:
            await pilot.pause(0.02)
        screen = app.screen_stack[0]
        shown: list[str] = []
        set_turn = screen.status.set_turn
        screen.status.set_turn = lambda text: (shown.append(text), set_turn(text))[1]
        app.query_one(PromptInput).focus()
        await pilot.press(*"hi there", "enter")
        await pilot.pause(0.1)
        while screen.generating:
            await pilot.pause(0.02)
        await pilot.pause()
        streaming = [t for t in shown if t.startswith("generating…")]
        assert any("drafts" in t and "% accepted" in t for t in streaming), shown
        assert "% accepted" in screen.status.query_one("#status-turn").render().plain


def test_a_shared_draft_model_counts_into_the_request_drafting(tmp_path, tiny_llama_dir):
    """The draft model is one drafter shared by the engine's requests: a request admitted while
    another still speculates must not take over the other's counters. Two requests alternate
    token by token; each counts at least what it counts alone, and together exactly what the
    draft model read."""
    from engine.generation.speculation.methods import Speculator
    from engine.model.loader import load_bundle
    from engine.model.weight_policy import choose_weights

    other = make_model_dir(tmp_path / "draft-llama", LLAMA_CONFIG, seed=5)
    prof = load_profile(str(write_profile(tmp_path / "spec.yaml", tiny_llama_dir, speculation={
        "mode": "draft", "draft_model": str(other), "num_draft_tokens": 4, "draft_min_prob": 0.05})))
    bundle = load_bundle(Path(tiny_llama_dir), choose_weights(prof.model.weights))
    speculator = Speculator(prof, bundle)
    model, params = bundle.model, SamplingParams(temperature=0.0, max_tokens=24)
    prompts = (PROMPT, [7, 8, 9, *PROMPT[5:]])

    def run(prompt):
        spec = speculator.new()
        return spec, generate_step(model, prompt, make_cache(model), params, speculation=spec)

    alone = []
    for prompt in prompts:
        spec, gen = run(prompt)
        alone.append((list(gen), spec.stats.draft_prefilled))
    fed = speculator._drafter.fed
    spec_a, gen_a = run(prompts[0])
    got_a = [next(gen_a)]
    spec_b, gen_b = run(prompts[1])  # admitted while the first still drafts
    got_b = []
    for a, b in zip(gen_a, gen_b, strict=False):
        got_a.append(a)
        got_b.append(b)
    got_a += list(gen_a)
    got_b += list(gen_b)
    assert [o.token for o in got_a] == [o.token for o in alone[0][0]]
    assert [o.token for o in got_b] == [o.token for o in alone[1][0]]
    assert spec_a.stats.rounds > 1 and spec_b.stats.rounds > 1
    assert spec_a.stats.draft_prefilled >= alone[0][1] and spec_b.stats.draft_prefilled >= alone[1][1]
    assert spec_a.stats.draft_prefilled + spec_b.stats.draft_prefilled == speculator._drafter.fed - fed
