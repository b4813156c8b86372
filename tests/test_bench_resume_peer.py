"""bench resume --long-context's llama.cpp arms (app/benches/llama_peer.py).

Fast tests run the bench on the tiny random-weight model with a stand-in ``xllamacpp`` module:
its server keeps each slot's cached tokens as llama.cpp does and reports timings from the
context length, so the test can check what the arm asks of llama.cpp (the engine arms' prompt,
one slot per context, chunk-sized requests alternating, the q8_0 cache with flash attention)
and the JSON it writes. Without xllamacpp the arms are skipped with a note. The e2e test runs
the real llama.cpp on SmolLM2 at a short context."""

import sys
from argparse import Namespace
from types import ModuleType, SimpleNamespace

from engine import kernels

import pytest

from app.benches import llama_peer, resume
from app.benches.engine import _prompt_ids

N, CHUNK, TURNS = 200, 4, 4


@pytest.fixture(scope="module")
def q8_profile(tmp_path_factory):
    """The tiny llama with head dim 32 and the q8 KV format at group 32: the bench times the
    attention op in q8 rows too, and the tiny models' head dim 16 is below the kernel's groups."""
    from tests.tiny_models import LLAMA_CONFIG, make_model_dir, write_profile

    tmp = tmp_path_factory.mktemp("bench-peer")
    model_dir = make_model_dir(tmp / "model", {**LLAMA_CONFIG, "num_attention_heads": 2, "num_key_value_heads": 1})
    return write_profile(tmp / "tiny-q8.yaml", model_dir, kv_cache={"format": "q8", "group_size": 32})


def _args(profile, arms: str, n: int = N) -> Namespace:
    return Namespace(profile=str(profile), long_context=n, decode_tokens=CHUNK * TURNS, chunk=CHUNK, repeats=1,
                     arms=arms, threads=2)


class _FakeServer:
    """llama.cpp's server as far as the arm sees it: per slot the tokens whose K/V it holds;
    a request evaluates the prompt past the cached prefix (at least its last token) and decodes
    ``n_predict`` - 1 steps at 100 tok/s up to 100 tokens of context, 40 tok/s beyond."""

    def __init__(self, params):
        # What the test reads back, kept apart so the test holds no reference to the server.
        self.record = SimpleNamespace(params=params, requests=[], closed=False)
        self.cached: dict[int, list[int]] = {}
        _FakeServer.made.append(self.record)

    def handle_completions(self, req):
        self.record.requests.append(req)
        slot, prompt = req.get("id_slot", 0), req["prompt"]
        have = self.cached.get(slot, []) if req["cache_prompt"] else []
        common = 0
        while common < min(len(have), len(prompt) - 1) and have[common] == prompt[common]:
            common += 1
        n = req["n_predict"]
        self.cached[slot] = list(prompt) + [0] * (n - 1)  # generated tokens past the prompt
        return {"timings": {"prompt_n": len(prompt) - common, "prompt_ms": 2.0 * (len(prompt) - common),
                            "predicted_n": n, "predicted_ms": 10.0 * (n - 1),
                            "predicted_per_second": 100.0 if len(prompt) <= 100 else 40.0}}

    def __del__(self):
        self.record.closed = True


@pytest.fixture
def fake_xllamacpp(monkeypatch):
    mod = ModuleType("xllamacpp")
    mod.CommonParams = lambda: SimpleNamespace(model=SimpleNamespace(), cpuparams=SimpleNamespace(),
                                               cpuparams_batch=SimpleNamespace())
    mod.ggml_type = SimpleNamespace(GGML_TYPE_Q8_0="q8_0")
    mod.llama_flash_attn_type = SimpleNamespace(LLAMA_FLASH_ATTN_TYPE_ENABLED="fa-on")
    mod.llama_load_mode = SimpleNamespace(LLAMA_LOAD_MODE_NONE="read")
    _FakeServer.made = []
    mod.Server = _FakeServer
    monkeypatch.setitem(sys.modules, "xllamacpp", mod)
    return _FakeServer.made


def test_start_server_without_xllamacpp_says_why(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "xllamacpp", None)  # import raises ImportError
    assert llama_peer.start_server(tmp_path / "m.gguf", 1000, 2) == (None, llama_peer.MISSING)


def test_start_server_params(fake_xllamacpp, tmp_path):
    server, load_s = llama_peer.start_server(tmp_path / "m.gguf", 1000, 2, slots=2, kv_type="q8_0")
    p = server.record.params
    assert load_s >= 0 and p.model.path == str(tmp_path / "m.gguf")
    assert p.n_parallel == 2 and p.n_ctx == 2 * 1024  # per slot, rounded up to llama.cpp's 256
    assert p.kv_unified is False and p.cache_ram_mib == 0  # each slot keeps its own context
    assert p.cache_type_k == p.cache_type_v == "q8_0" and p.flash_attn_type == "fa-on"
    assert p.cpuparams.n_threads == p.cpuparams_batch.n_threads == 2
    one, _ = llama_peer.start_server(tmp_path / "m.gguf", 1000, 2)
    # the default: llama.cpp's own f16 cache and flash-attention setting, one slot, as bench engine runs it
    p = one.record.params
    assert not hasattr(p, "cache_type_k") and not hasattr(p, "flash_attn_type")
    assert not hasattr(p, "kv_unified") and p.n_parallel == 1
    with pytest.raises(ValueError):
        llama_peer.start_server(tmp_path / "m.gguf", 1000, 2, kv_type="q4_0")


@pytest.mark.skipif(not kernels.available(), reason="CPU kernels not built on this machine")
def test_long_context_skips_llama_arms_without_xllamacpp(monkeypatch, q8_profile):
    monkeypatch.setitem(sys.modules, "xllamacpp", None)
    out = resume.run(_args(q8_profile, "engine,llama_cpp,llama_cpp_q8"))
    assert list(out["arms"]) == ["engine"]
    assert out["notes"] == [f"{arm} arm skipped: {llama_peer.MISSING}" for arm in ("llama_cpp", "llama_cpp_q8")]
    assert out["vs_llama_cpp"] == {}
    assert "llama_cpp arm skipped" in out["summary"]


@pytest.mark.skipif(not kernels.available(), reason="CPU kernels not built on this machine")
def test_long_context_llama_arms_alternate_chunks_on_two_slots(fake_xllamacpp, q8_profile):
    out = resume.run(_args(q8_profile, "engine,llama_cpp_q8,llama_cpp"))
    assert out["notes"] == [] and out["threads"] == 2
    servers = {s.params.cache_type_k if hasattr(s.params, "cache_type_k") else "f16": s for s in fake_xllamacpp}
    assert len(fake_xllamacpp) == 2 and set(servers) == {"f16", "q8_0"}  # one fresh server per run
    assert all(s.closed for s in fake_xllamacpp)  # freed before the next arm
    long_ids = _prompt_ids(_tokenizer(q8_profile), N)
    for server in fake_xllamacpp:
        reqs = server.requests
        # cold prefill of the engine arms' N prompt tokens on slot 0, then the first 100 on slot 1
        assert [(r["id_slot"], r["prompt"], r["n_predict"]) for r in reqs[:2]] == [(0, long_ids, 1),
                                                                                   (1, long_ids[:100], 1)]
        # chunks alternate long/short, short/long, ...; each chunk + 1 tokens on its slot's cached prompt
        assert [r["id_slot"] for r in reqs[2:]] == [0, 1, 1, 0] * (TURNS // 2)
        assert all(r["n_predict"] == CHUNK + 1 for r in reqs[2:]) and all(r["cache_prompt"] for r in reqs)
    for arm, kv in (("llama_cpp", "f16"), ("llama_cpp_q8", "q8_0")):
        r = out["arms"][arm]
        assert r["kv_cache"] == kv
        assert r["cold_prefill_s"] == 2.0 * N / 1000
        assert r["decode_tps_at_context_runs"] == [40.0] * TURNS and r["decode_tps_at_100_runs"] == [100.0] * TURNS
        assert r["decode_ratio_context_vs_100"] == 0.4 and r["runs"] == 1
    eng = out["arms"]["engine"]
    assert out["vs_llama_cpp"]["engine / llama_cpp_q8"] == {
        "decode_at_context": round(eng["decode_tps_at_context"] / 40.0, 2),
        "decode_at_100": round(eng["decode_tps_at_100"] / 100.0, 2),
        "cold_prefill": round(2.0 * N / 1000 / eng["cold_prefill_s"], 2) if eng["cold_prefill_s"] else None,
    }
    assert set(out["vs_llama_cpp"]) == {"engine / llama_cpp", "engine / llama_cpp_q8"}
    assert "engine / llama_cpp_q8: decode at" in out["summary"]


def test_llama_chunk_that_lost_its_slot_context_fails(fake_xllamacpp, monkeypatch, tmp_path):
    """A chunk must decode on its slot's cached context, never time a prefill: a server that
    drops the cache (here: it ignores cache_prompt) is an error, not a number."""
    real = _FakeServer.handle_completions
    monkeypatch.setattr(_FakeServer, "handle_completions", lambda self, req: real(self, {**req, "cache_prompt": False}))
    with pytest.raises(RuntimeError, match="re-evaluated"):
        resume._llama_cpp_long(tmp_path / "m.gguf", list(range(300)), list(range(100)), CHUNK, 2, 2, "f16")
    assert fake_xllamacpp[0].closed


def _tokenizer(profile):
    from engine.model.catalog import resolve_source
    from engine.model.loader import load_bundle
    from engine.profiles import load_profile

    prof = load_profile(str(profile))
    return load_bundle(resolve_source(prof.model.source, prof.base_dir), "quantized").tokenizer


@pytest.mark.e2e
@pytest.mark.skipif(not kernels.available(), reason="CPU kernels not built on this machine")
def test_long_context_real_llama_cpp_smollm2():
    pytest.importorskip("xllamacpp")
    out = resume.run(Namespace(profile="smollm2-135m", long_context=300, decode_tokens=16, chunk=8, repeats=1,
                               arms="engine,llama_cpp_q8", threads=2))
    assert out["notes"] == []
    r = out["arms"]["llama_cpp_q8"]
    assert r["kv_cache"] == "q8_0" and r["cold_prefill_s"] > 0
    assert len(r["decode_tps_at_context_runs"]) == len(r["decode_tps_at_100_runs"]) == 2
    assert min(r["decode_tps_at_context_runs"] + r["decode_tps_at_100_runs"]) > 0
    assert out["vs_llama_cpp"]["engine / llama_cpp_q8"]["decode_at_context"] > 0
