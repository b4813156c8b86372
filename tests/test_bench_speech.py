"""`bench speech`: the kernels A/B aggregates alternated child runs into medians and ratios,
and the JSON carries the "bench" key the other benches have."""

import argparse

import pytest


def _args(**kw):
    from app.benches import speech

    p = argparse.ArgumentParser()
    speech.add_arguments(p)
    return p.parse_args([f"--{k.replace('_', '-')}={v}" for k, v in kw.items()])


def test_kernels_ab_medians_ratio_and_order(monkeypatch):
    from app.benches import speech

    calls = []
    times = {"kernels": iter([100.0, 120.0]), "no_kernels": iter([300.0, 200.0])}

    def fake(args, arm):
        calls.append((arm, args.clips))
        t = next(times[arm])
        return {"bench": "speech", "arm": arm, "kernels": arm == "kernels",
                "clips": [{"clip": "short", "total_ms": t, "encode_ms": t / 2, "decode_ms": t / 2,
                           "text": "hello"}]}

    monkeypatch.setattr(speech, "_arm_in_subprocess", fake)
    ab = speech.kernels_ab(_args(clips="short", kernels_ab=1))
    assert [a for a, _ in calls] == ["kernels", "no_kernels", "no_kernels", "kernels"]
    row = ab["clips"][0]
    assert row["kernels_total_ms"] == 110.0 and row["no_kernels_total_ms"] == 250.0
    assert row["speedup"] == pytest.approx(250 / 110, abs=1e-3) and row["same_text"]
    table = speech._table({"model": "m", "beam_size": None, "machine": "x", "load_s": 1, "load_avg_1m": 1,
                           "clips": [], "kernels_ab": ab})
    assert "| short | 110.0 | 250.0 | 2.273x |" in table


def test_kernels_ab_skips_without_kernels(monkeypatch):
    from app.benches import speech

    monkeypatch.setattr(speech, "_arm_in_subprocess", lambda args, arm: {
        "bench": "speech", "arm": arm, "kernels": False,
        "clips": [{"clip": "short", "total_ms": 1.0, "encode_ms": 1.0, "decode_ms": 1.0, "text": ""}]})
    assert "skipped" in speech.kernels_ab(_args(clips="short"))


def test_child_env_turns_the_kernels_off(monkeypatch):
    """The off arm's child really runs with MLXTERM_KERNELS=off (and the on arm without it)."""
    import subprocess

    from app.benches import speech

    seen = {}

    def fake_run(cmd, capture_output, text, env):
        seen[cmd[cmd.index("--arm") + 1]] = env.get("MLXTERM_KERNELS")
        return subprocess.CompletedProcess(cmd, 0, '{"arm": "x"}', "")

    monkeypatch.setenv("MLXTERM_KERNELS", "off")  # the parent's own setting must not leak
    monkeypatch.setattr(speech.subprocess, "run", fake_run)
    for arm in speech.ARMS:
        speech._arm_in_subprocess(_args(clips="short"), arm)
    assert seen == {"kernels": None, "no_kernels": "off"}


@pytest.mark.e2e
def test_reference_ab_runs_ctranslate2_on_the_same_model_and_clip():
    """The CTranslate2 arm (faster-whisper's engine, the test extra) transcribes the same clip
    from the same model.bin as the engine: both find the clip's words, and the table quotes the
    medians and their ratio."""
    pytest.importorskip("ctranslate2", reason="ctranslate2 (test extra) is the reference arm")
    from engine.speech.loader import load_whisper

    from app.benches import speech

    ref = speech.reference_ab(_args(clips="short", reference_ab=1), load_whisper("whisper-tiny.en"))
    row = ref["clips"][0]
    assert ref["runs_per_arm"] == 2 and row["clip"] == "short"
    assert row["ours_wer"] == 0.0 and row["ct2_wer"] == 0.0, row["ct2_text"]
    assert row["ratio"] == pytest.approx(row["ours_ms"] / row["ct2_ms"], abs=2e-3)
    table = speech._table({"model": "m", "beam_size": None, "machine": "x", "load_s": 1, "load_avg_1m": 1,
                           "clips": [], "reference_ab": ref})
    assert f"| short | {row['ours_ms']} | {row['ct2_ms']} | {row['ratio']}x | 0.0 | 0.0 |" in table
