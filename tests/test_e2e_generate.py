"""End to end on the real SmolLM2 GGUF through the ``mlxterm generate`` command."""

import json
import subprocess
import sys

import pytest

pytestmark = pytest.mark.e2e


def _mlxterm(*args, check=True):
    proc = subprocess.run(
        [sys.executable, "-m", "app", *args], capture_output=True, text=True, timeout=600
    )
    if check and proc.returncode != 0:
        raise AssertionError(f"exit {proc.returncode}: {proc.stderr}")
    return proc


def test_capital_of_france_is_deterministic():
    args = ("generate", "--prompt", "What is the capital of France?", "--temperature", "0",
            "--max-tokens", "48", "--json")
    first = json.loads(_mlxterm(*args).stdout)
    second = json.loads(_mlxterm(*args).stdout)
    assert "Paris" in first["text"]
    assert first["finish_reason"] == "stop"  # the model's own end token, not the budget
    assert first["usage"]["completion_tokens"] < 48
    assert first["text"] == second["text"]
    assert first["profile"] == "smollm2-135m"
    for key in ("load_ms", "ttft_ms", "prefill_tps", "decode_tps", "total_ms"):
        assert first["timings"][key] > 0


def test_streamed_text_matches_json_text():
    args = ("generate", "--prompt", "Name three colors.", "--temperature", "0", "--max-tokens", "24")
    streamed = _mlxterm(*args).stdout.rstrip("\n")
    as_json = json.loads(_mlxterm(*args, "--json").stdout)
    assert streamed == as_json["text"]


@pytest.mark.parametrize(
    "content, problem",
    [
        (b"NOPE" + b"\0" * 64, "not a gguf file"),
        (None, "truncated"),
    ],
)
def test_bad_model_file_is_one_clear_line(tmp_path, content, problem):
    from engine.model.catalog import resolve_source

    bad = tmp_path / "broken.gguf"
    if content is None:  # the real file cut in half
        real = resolve_source("smollm2-135m").read_bytes()
        content = real[: len(real) // 2]
    bad.write_bytes(content)
    profile = tmp_path / "bad.yaml"
    profile.write_text(f"model:\n  source: {bad}\n")
    proc = _mlxterm("generate", "--profile", str(profile), "--prompt", "hi", check=False)
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and str(bad) in lines[0], proc.stderr
    assert problem in lines[0].lower(), lines[0]
