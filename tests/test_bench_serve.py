"""bench serve: mlxterm serve vs llama.cpp's server on one tiny GGUF, at tiny sizes.

The GGUF (tests/tiny_gguf.py) loads in both; the run exercises both real servers, the
alternated arms, the concurrency and follow-up measurements and the JSON. xllamacpp is
installed by ``setup.sh --test`` on x86_64 (its wheel's only platform): elsewhere the
llama.cpp arm is left out and the note saying so is checked instead.
"""

from __future__ import annotations

import importlib.util
import json
import platform
from argparse import Namespace

import pytest

from app.benches import llama_peer
from app.benches import serve as bench

CONVERSATION = 300
HAVE_LLAMA = platform.machine() == "x86_64" or importlib.util.find_spec("xllamacpp") is not None


@pytest.fixture(scope="module")
def gguf_profile(tmp_path_factory):
    from tests.tiny_gguf import write_tiny_llama_gguf
    from tests.tiny_models import write_profile

    tmp = tmp_path_factory.mktemp("bench-serve")
    gguf = write_tiny_llama_gguf(tmp / "tiny.gguf")
    return write_profile(tmp / "tiny-gguf.yaml", gguf, context={"max_context": 2048}, batch={"cap": 4})


def _args(profile, arms: str = "mlxterm,llama_cpp", **kw) -> Namespace:
    base = dict(profile=str(profile), clients="1,3", requests=2, prompt_tokens=24, max_tokens=6,
                conversation_tokens=CONVERSATION, rounds=1, arms=arms, threads=2, startup_s=120.0)
    return Namespace(**{**base, **kw})


def test_run_both_servers_tiny(gguf_profile):
    arms = "mlxterm,llama_cpp" if HAVE_LLAMA else "mlxterm"
    out = bench.run(_args(gguf_profile, arms))
    json.dumps(out)  # what bench writes
    want = arms.split(",")
    assert out["arms"] == want and out["notes"] == []
    for c in ("1", "3"):
        row = out["concurrency"][c]
        for arm in want:
            r = row[arm]
            assert r["requests_per_run"] == int(c) * 2
            assert len(r["tok_s_runs"]) == len(r["ttft_p95_ms_runs"]) == 2  # A B B A: two runs per arm
            assert r["tok_s"] > 0 and r["ttft_p95_ms"] >= r["ttft_median_ms"] > 0
        if HAVE_LLAMA:
            assert row["ratio"]["tok_s"] == round(row["mlxterm"]["tok_s"] / row["llama_cpp"]["tok_s"], 2)
    fu = out["follow_up"]
    ours = fu["mlxterm"]
    assert ours["prompt_tokens"] > CONVERSATION
    # the conversation's prefix came back from the checkpoint store, after the other client's turn
    assert all(n >= CONVERSATION - 1 for n in ours["reused_tokens"])
    if HAVE_LLAMA:
        assert all(isinstance(n, int) for n in fu["llama_cpp"]["reused_tokens"])
        assert fu["ratio"] == round(ours["ttft_ms"] / fu["llama_cpp"]["ttft_ms"], 3)
        assert "ratio tok/s" in out["summary"]
    assert "follow-up TTFT" in out["summary"]


def test_llama_arm_without_xllamacpp_is_a_note(gguf_profile, monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "xllamacpp" else real(name, *a))
    out = bench.run(_args(gguf_profile, clients="2", requests=1, conversation_tokens=0))
    assert out["arms"] == ["mlxterm"] and "follow_up" not in out
    assert out["notes"] == [f"llama_cpp arm skipped: {llama_peer.MISSING}"]
    assert "ratio" not in out["concurrency"]["2"]


def test_bad_arguments_and_non_gguf_models(tiny_profile, gguf_profile):
    from engine.errors import MlxtermError

    with pytest.raises(MlxtermError, match="--arms"):
        bench.run(_args(gguf_profile, "mlxterm,vllm"))
    with pytest.raises(MlxtermError, match="not a GGUF"):
        bench.run(_args(tiny_profile, "mlxterm"))


def test_percentile_is_nearest_rank():
    xs = [float(x) for x in range(1, 21)]
    assert bench.percentile(xs, 95) == 19.0
    assert bench.percentile(xs, 100) == 20.0
    assert bench.percentile([5.0], 95) == 5.0
    assert bench.percentile([3.0, 1.0, 2.0], 50) == 2.0
