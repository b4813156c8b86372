"""Session resume on the real SmolLM2 model: checkpoints across turns and processes."""

import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytestmark = pytest.mark.e2e

QUESTIONS = [
    "Hi! My name is Ana and I live in Lisbon.",
    "What is the capital of Portugal?",
    "Name a famous river there.",
    "What did I say my name was?",
]


def _turn(home: Path, session: str, prompt: str, *extra: str) -> tuple[dict, str]:
    env = {**os.environ, "MLXTERM_HOME": str(home)}
    proc = subprocess.run(
        [sys.executable, "-m", "app", "generate", "--session", session, "--prompt", prompt,
         "--temperature", "0", "--max-tokens", "32", "--json", *extra],
        capture_output=True, text=True, timeout=600, env=env,
    )
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout), proc.stderr


def test_every_follow_up_reuses_the_previous_turn(tmp_path):
    home = tmp_path / "home"
    prev_total = 0
    for i in range(10):
        out, _ = _turn(home, "ten", QUESTIONS[i % len(QUESTIONS)])
        if i:
            assert out["cache"]["source"] == "ssd"  # each turn is a new process
            assert out["usage"]["cached_tokens"] >= prev_total
        prev_total = out["usage"]["prompt_tokens"] + out["usage"]["completion_tokens"]


WARM_SCRIPT = textwrap.dedent(
    """
    import json, sys
    from engine.sessions.chat import ChatService
    from engine.runtime import Engine
    from engine.sessions import SessionStore

    questions = json.loads(sys.argv[1])
    eng = Engine.load(None)
    store = SessionStore()
    chat = ChatService(eng, store)
    sid = store.create(profile=eng.profile.name, session_id="resume").id
    for q in questions[:3]:
        chat.send(sid, q, temperature=0.0, max_tokens=32).result()
    eng.flush_checkpoints()
    # Continue warm in a fork (same exact history; its first turn reuses this process's KV).
    child = chat.fork(sid, at=len(store.messages(sid)))
    done = chat.send(child.id, questions[3], temperature=0.0, max_tokens=32).result()
    print(json.dumps({"text": done.text, "source": done.cache_source}))
    eng.close()
    """
)


def test_fresh_process_resume_matches_warm_continuation(tmp_path):
    home = tmp_path / "home"
    env = {**os.environ, "MLXTERM_HOME": str(home)}
    proc = subprocess.run([sys.executable, "-c", WARM_SCRIPT, json.dumps(QUESTIONS)],
                          capture_output=True, text=True, timeout=900, env=env)
    assert proc.returncode == 0, proc.stderr
    warm = json.loads(proc.stdout.strip().splitlines()[-1])
    assert warm["source"] == "ram"
    cold, _ = _turn(home, "resume", QUESTIONS[3])  # process B: only the SSD tier to go on
    assert cold["cache"]["source"] == "ssd"
    assert cold["text"] == warm["text"]


def _checkpoint_files(home: Path) -> list[Path]:
    return sorted((home / "data" / "checkpoints").rglob("*.safetensors"))


@pytest.mark.parametrize("damage", ["truncate", "flip"])
def test_corrupt_checkpoint_is_discarded_and_answer_is_unchanged(tmp_path, damage):
    # fp32 weights: a cold re-prefill then computes the same KV as the warm turns did (the CPU
    # kernels' decode path quantizes activations to int8, their prefill path does not)
    profile = tmp_path / "fp32.yaml"
    profile.write_text("model:\n  source: smollm2-135m\n  weights: fp32\n")
    good, bad = tmp_path / "good", tmp_path / "bad"
    for q in QUESTIONS[:2]:
        _turn(good, "s", q, "--profile", str(profile))
    shutil.copytree(good, bad)
    files = _checkpoint_files(bad)
    assert files
    for f in files:
        data = bytearray(f.read_bytes())
        if damage == "truncate":
            data = data[: len(data) // 2]
        else:
            data[-100] ^= 0xFF  # inside the KV payload
        f.write_bytes(bytes(data))
    expected, _ = _turn(good, "s", QUESTIONS[2], "--profile", str(profile))
    got, stderr = _turn(bad, "s", QUESTIONS[2], "--profile", str(profile))
    assert expected["cache"]["source"] == "ssd"
    assert got["cache"]["source"] == "none"
    assert got["text"] == expected["text"]
    warnings = [ln for ln in stderr.splitlines() if "checkpoint" in ln.lower()]
    assert len(warnings) == 1, stderr


def test_unwritable_ssd_dir_continues_ram_only(tmp_path):
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("a file where the checkpoint directory should be")
    profile = tmp_path / "p.yaml"
    profile.write_text(f"model:\n  source: smollm2-135m\ncache:\n  ssd_dir: {blocker}/ckpt\n")
    out, stderr = _turn(tmp_path / "home", "s", QUESTIONS[0], "--profile", str(profile))
    assert out["text"]
    notes = [ln for ln in stderr.splitlines() if "RAM" in ln or "ram-only" in ln.lower()]
    assert len(notes) == 1, stderr


def test_long_context_bench_pairs_the_two_decodes(tmp_path):
    # bench resume --long-context on the real model: a cold prefill, then decode at the long
    # context and at ~100 tokens in alternating chunks; the ratio is the median of adjacent
    # chunks' ratios, every chunk reported.
    env = {**os.environ, "MLXTERM_HOME": str(tmp_path / "home")}
    proc = subprocess.run(
        [sys.executable, "-m", "app", "bench", "resume", "--long-context", "300", "--decode-tokens", "8",
         "--chunk", "2", "--repeats", "1", "--arms", "engine", "--json"],
        capture_output=True, text=True, timeout=600, env=env,
    )
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    if "skipped" in out:
        pytest.skip(out["skipped"])
    arm = out["arms"]["engine"]
    assert out["context_tokens"] == 300 and arm["chunk_tokens"] == 2 and arm["cold_prefill_s"] > 0
    long, short, ratios = arm["decode_tps_at_context_runs"], arm["decode_tps_at_100_runs"], arm["decode_ratio_runs"]
    assert len(long) == len(short) == len(ratios) == 4 and min(long + short) > 0
    for a, b, r in zip(long, short, ratios, strict=True):
        assert abs(a / b - r) < 0.02 * r  # each ratio pairs the adjacent chunks
    ordered = sorted(ratios)
    assert abs(arm["decode_ratio_context_vs_100"] - (ordered[1] + ordered[2]) / 2) <= 0.006  # rounded
