"""The benches' ``run()`` on tiny random models at their smallest sizes (a few seconds each):
the JSON each returns has its arms, and ratios computed from them. Timings are not checked;
the structure and the arithmetic between the fields are. Benches whose arms are child
processes (hugepages, board) get their children's JSON from a stub at that boundary."""

from __future__ import annotations

from argparse import Namespace
from pathlib import Path

import pytest


@pytest.fixture
def profile_path(tmp_path, tiny_llama_dir):
    from tests.tiny_models import write_profile

    def make(name: str = "tiny", **sections) -> str:
        sections.setdefault("cache", {})["ssd_dir"] = str(tmp_path / name / "ckpt")
        return str(write_profile(tmp_path / f"{name}.yaml", tiny_llama_dir, **sections))

    return make


def test_bench_engine_run_reports_each_arm_and_ratios(profile_path):
    from app.benches import engine as bench

    arms = ["engine", "engine_fp32", "stock_same"]
    out = bench.run(Namespace(profile=profile_path(), prompt_tokens=16, max_tokens=4, rounds=1,
                              arms=",".join(arms), threads=1))
    assert out["bench"] == "engine" and out["prompt_tokens"] == 16 and out["max_tokens"] == 4
    assert set(out["arms"]) == set(arms)
    for name, r in out["arms"].items():
        assert r["decode_tps"] > 0 and r["prefill_tps"] > 0 and r["ttft_ms"] > 0, name
    assert out["ratios"], out["ratios"]
    for key, value in out["ratios"].items():
        assert value > 0, key
    assert out["weight_format_engine"] == "fp32" and out["load_ms"]["engine"] >= 0
    assert "| engine |" in out["summary"]


def test_bench_engine_runs_the_standard_set_and_skips_what_is_not_installed(profile_path, monkeypatch, tmp_path):
    from app.benches import engine as bench
    from tests.tiny_models import write_profile

    assert bench.STANDARD_PROFILES == ("smollm2-135m", "qwen2.5-coder-0.5b", "qwen2.5-coder-1.5b")
    parser = __import__("argparse").ArgumentParser()
    bench.add_arguments(parser)
    defaults = parser.parse_args([])
    assert defaults.profile is None and defaults.profiles.split(",") == list(bench.STANDARD_PROFILES)
    assert defaults.arms == "engine,llama_cpp"
    ran = []

    def one(args, name):
        ran.append(name)
        return {"profile": name, "arms": {"engine": {"decode_tps": 30.0}, "llama_cpp": {"decode_tps": 20.0}},
                "ratios": {"decode_vs_llama_cpp": 1.5, "prefill_vs_llama_cpp": 3.0}, "summary": f"table of {name}"}

    monkeypatch.setattr(bench, "_run_profile", one)
    missing = str(write_profile(tmp_path / "nomodel.yaml", tmp_path / "no-such-model"))
    out = bench.run(Namespace(profile=None, profiles=f"{profile_path()},{missing}", threads=2))
    assert ran == [profile_path()] and [r["profile"] for r in out["runs"]] == ran
    assert len(out["notes"]) == 1 and out["notes"][0].startswith(f"{missing} skipped")
    assert f"| {profile_path()} | 30.0 | 20.0 | 1.5 | 3.0 |" in out["table"]
    assert out["cpu"]["kernel_isa"] == __import__("engine.kernels").kernels.status()["isa"]
    assert "table of" in out["summary"] and out["cpu"]["model"] in out["summary"]


@pytest.mark.parametrize("flags,family", [
    ("fpu avx2 fma f16c", "avx2"),
    ("avx2 fma avx512f avx512bw avx512vl avx512_vnni", "avx512-vnni"),
    ("avx2 avx512f avx512_vnni amx_tile amx_int8 amx_bf16", "amx"),
    ("avx2 avx_vnni", "avx-vnni"),
    ("sse2", "other"),
])
def test_bench_engine_records_the_cpu_model_and_isa_family(flags, family):
    from app.benches import engine as bench

    text = f"processor\t: 0\nmodel name\t: Some CPU 9000\nflags\t\t: {flags}\n\nprocessor\t: 1\nmodel name\t: other\n"
    cpu = bench.cpu_info(text)
    assert cpu["model"] == "Some CPU 9000" and cpu["family"] == family
    assert cpu["flags"] == [f for f in bench.ISA_FLAGS if f in flags.split()]
    assert "kernel_isa" in cpu and cpu["cores"] >= 1


def test_bench_batch_run_compares_serial_and_batched(profile_path, monkeypatch, tmp_path):
    import tempfile

    from app.benches import batch as bench

    scratch = tmp_path / "scratch"
    scratch.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(scratch))
    out = bench.run(Namespace(profiles=profile_path(), sessions="2", max_tokens=4, rounds=1, seed=3,
                              ignore_eos=True))
    (model,) = out["models"]
    (row,) = model["rows"]
    assert row["sessions"] == 2 and row["replies_match"] is True
    for arm in ("serial", "batched"):
        assert row[arm]["tokens"] == 2 * 4, arm  # ignore_eos: every reply runs to max_tokens
        assert row[arm]["tok_s"] > 0 and row[arm]["decode_tok_s"] > 0, arm
    assert row["batched"]["batch_max"] == 2 and row["serial"]["batch_max"] == 1
    assert row["speedup"] == round(row["batched"]["tok_s"] / row["serial"]["tok_s"], 2)
    assert row["decode_speedup"] == round(
        row["batched"]["decode_tok_s"] / row["serial"]["decode_tok_s"], 2
    )
    assert set(model["interactive"]) and out["targets"]["speedup_at_4"] > 0
    assert list(scratch.iterdir()) == []  # its profile copy and the checkpoints it wrote are gone


def test_scratch_profile_points_checkpoints_inside_and_removes_them(profile_path, monkeypatch, tmp_path):
    import tempfile

    from engine.profiles import load_profile

    from app.benches import scratch_profile

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    source = profile_path()

    def edit(data: dict) -> None:
        data["cache"]["ram_bytes"] = 12345

    with pytest.raises(RuntimeError):
        with scratch_profile(source, "mlxterm-bench-x-", edit) as path:
            prof = load_profile(str(path))
            assert prof.name == load_profile(source).name + "-bench" and prof.cache.ram_bytes == 12345
            assert Path(prof.cache.ssd_dir) == path.parent / "ssd"
            (path.parent / "ssd" / "fp").mkdir(parents=True)
            (path.parent / "ssd" / "fp" / "a.safetensors").write_bytes(b"x" * 10)
            raise RuntimeError("the bench failed")
    assert not path.parent.exists()  # removed on the way out of a failure too


def test_bench_spec_run_reports_scenarios_and_the_verify_curve(profile_path):
    from app.benches import spec as bench

    # The scenarios' prompts (a 300-line file) need more than the tiny profile's 512 tokens.
    prof = profile_path(
        "lookup",
        speculation={"mode": "lookup", "lookup_ngram": 1, "num_draft_tokens": 4},
        context={"max_context": 1 << 15},
    )
    out = bench.run(Namespace(profile=prof, pair_profile="", edit_profile="", max_tokens=4,
                              pair_max_tokens=4, rounds=1, curve_rows="1,2"))
    assert out["bench"] == "spec" and set(out["curves"]) == {prof}
    assert set(out["curves"][prof]["rows"]) == {"1", "2"}
    assert set(out["scenarios"]) >= {"copy_rewrite_300_lines", "free_form_story"}
    for name, r in out["scenarios"].items():
        assert r["identical"] is True, name  # speculation never changes the tokens
        assert r["tokens"] > 0 and r["plain_tps"] > 0 and r["spec_tps"] > 0, name
        assert r["speedup"] == pytest.approx(r["spec_tps"] / r["plain_tps"], rel=0.02, abs=0.01)


def test_bench_hugepages_run_takes_medians_and_on_off_ratios(monkeypatch):
    from app.benches import hugepages as bench

    calls = []

    def child(argv, on):  # a child process's JSON: decode 20 tok/s with huge pages, 10 without
        calls.append((argv[0], on))
        if argv[0] == "resume":
            return {"arms": {"engine": {"decode_tps_at_context": 8.0 if on else 4.0}},
                    "hugepages": {"anon_huge_mib": 12 if on else 0}}
        return {"arms": {"engine": {"prefill_tps": 100.0, "decode_tps": 20.0 if on else 10.0}},
                "hugepages": {"anon_huge_mib": 30 if on else 0}}

    monkeypatch.setattr(bench, "_child", child)
    out = bench.run(Namespace(profile="p", rounds=1, prompt_tokens=8, max_tokens=4, arms="engine",
                              long_context=64))
    # on, off, off, on; each with the long-context child after the engine one
    assert [on for name, on in calls if name == "engine"] == [True, False, False, True]
    assert len(calls) == 8 and out["long_context_argv"][:2] == ["resume", "--profile"]
    assert out["medians"]["on"]["engine.decode_tps"] == 20.0
    assert out["medians"]["off"]["engine.decode_tps"] == 10.0
    assert out["ratios"] == {
        "engine.prefill_tps": 1.0,
        "engine.decode_tps": 2.0,
        "engine.decode_tps_at_context": 2.0,
    }
    assert "[30, 12, 30, 12] / [0, 0, 0, 0]" in out["summary"]


def test_bench_board_run_compares_serial_and_concurrent_arms(monkeypatch, tmp_path):
    from app.benches import board as bench

    for name in ("a", "b"):
        (tmp_path / f"{name}.yaml").write_text("title: x\n")
    order = []

    def arm(profile, tasks, n):  # a child's JSON: the concurrent arm takes half the time
        order.append(n)
        card = {"state": "review", "checks_passed": n == 1 or len(order) < 3}
        return {"concurrency": n, "wall_s": 10.0 if n == 1 else 5.0, "cards": [card]}

    monkeypatch.setattr(bench, "_arm_in_subprocess", arm)
    out = bench.run(Namespace(profile="p", tasks=str(tmp_path), concurrency=3, rounds=1, arm=None))
    assert order == out["order"] == [1, 3, 3, 1]
    assert out["tasks"] == ["a.yaml", "b.yaml"] and len(out["arms"]) == 4
    assert out["speedup"] == 2.0 and out["serial_wall_s_median"] == 10.0
    assert out["all_cards_passed"] is False  # one concurrent arm's card failed its checks


def test_bench_qmm_run_reports_each_arm_against_float():
    from engine import kernels

    from app.benches import qmm as bench

    if not kernels.available():
        pytest.skip(f"CPU kernels not built: {kernels.status()['reason']}")  # fails CI strict
    threads = kernels.status()["threads"]
    rows = kernels.set_amx_min_rows(16)
    try:
        out = bench.run(Namespace(rows="2,16", models="smollm2-135m", bits=4, reps=1, threads=1, group_size=32,
                                  scales="float32"))
        # The 1.5B's scale forms (K-quant records, float16 symmetric 8-bit) and times over one row.
        gguf = [bench.run(Namespace(rows="1,3", models="smollm2-135m", bits=bits, reps=1, threads=1, group_size=32,
                                    scales="gguf")) for bits in (4, 8)]
    finally:  # the bench leaves its settings behind (it runs in its own process)
        kernels.set_amx_min_rows(rows)
        kernels.set_threads(threads)
    assert kernels._load().small_rows()  # restored
    assert out["arms"][-1] == "float"
    assert ("few" in out["arms"]) == (kernels.status()["isa"] == "avx2")
    assert len(out["results"]) == len(bench.SHAPES["smollm2-135m"]) * 2
    for r in out["results"]:
        for arm in out["arms"]:
            assert r[f"{arm}_ms"] > 0 and r[f"{arm}_gops"] > 0
        for arm in out["arms"][:-1]:
            assert r[f"{arm}_speedup"] == pytest.approx(r["float_ms"] / r[f"{arm}_ms"], rel=0.05)
    for g in gguf:
        assert g["scales"] == "gguf" and len(g["results"]) == len(bench.SHAPES["smollm2-135m"]) * 2
        by = {(r["N"], r["K"], r["M"]): r for r in g["results"]}
        for (n, k, _), r in by.items():
            for arm in g["arms"]:
                assert r[f"{arm}_x1"] == pytest.approx(r[f"{arm}_ms"] / by[(n, k, 1)][f"{arm}_ms"], rel=0.05)


def test_bench_qmm_gguf_scales_take_the_engines_compact_forms():
    import mlx.core as mx
    import numpy as np

    from app.benches import qmm as bench

    rng = np.random.default_rng(0)
    _, s, b, sym = bench._weights(8, 512, 4, 32, "gguf", rng)  # whole super-blocks: K-quant records
    assert s.dtype == b.dtype == mx.uint8 and s.shape == (8, 2 * 20) and not sym
    _, s, b, sym = bench._weights(8, 576, 4, 32, "gguf", rng)  # no K-quant form: float16
    assert s.dtype == b.dtype == mx.float16 and s.shape == (8, 18) and not sym
    _, s, b, sym = bench._weights(8, 576, 8, 32, "gguf", rng)  # re-quantized Q6_K: symmetric float16
    assert s.dtype == mx.float16 and sym and mx.array_equal(b, s * -128).item()


def test_bench_sandbox_run_times_both_arms():
    from app.benches import sandbox as bench
    from tests.ci_strict import sandbox_skip_reason
    from tools import sandbox as sb

    status = sb.probe()
    if not status.available:
        pytest.skip(sandbox_skip_reason(status))
    out = bench.run(Namespace(rounds=1))
    assert out["available"] is True and set(out["commands"]) == set(bench.COMMANDS)
    for name, r in out["commands"].items():
        assert r["n"] == 2 and r["plain_ms"] > 0 and r["sandboxed_ms"] > 0, name
        assert r["overhead_ms"] == pytest.approx(r["sandboxed_ms"] - r["plain_ms"], abs=0.11)


def test_bench_sampling_run_times_each_filter_and_decodes_both_arms(profile_path):
    from engine import kernels

    from app.benches import sampling as bench

    path = profile_path(sampling={"temperature": 0.7, "top_p": 0.9})
    out = bench.run(Namespace(vocabs="1000,3000", rows="1,2", reps=1, rounds=1, profiles=path, max_tokens=4))
    want = ["sort", "mlx"] + (["kernel"] if kernels.available() else [])
    assert out["bench"] == "sampling" and out["arms"] == want
    assert [(r["vocab"], r["rows"]) for r in out["sampler"]] == [(1000, 1), (1000, 2), (3000, 1), (3000, 2)]
    for r in out["sampler"]:
        for arm in want:
            assert r[f"{arm}_ms"] > 0
        for arm in want[1:]:
            assert r[f"{arm}_speedup"] == pytest.approx(r["sort_ms"] / r[f"{arm}_ms"], rel=0.1)
    (d,) = out["decode"]
    assert d["top_p"] == 0.9 and d["tokens"] == 4
    for arm in ("sort", "kernel") if kernels.available() else ("sort",):
        assert len(d["runs"][arm]) == 2 and d[f"{arm}_tok_s"] > 0 and d[f"{arm}_cpu_ms_per_token"] > 0
    assert "| 3000 | 2 |" in out["summary"]
    assert out["summary"].splitlines()[-1].count("|") == 2 + 3 * len(d["runs"])  # a cell per column
