"""YAML profiles: validation messages (file:line, key, value, allowed), lookup, shipped presets, CLI."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

from engine import paths
from engine.errors import ProfileError
from engine.profiles import (
    DEFAULT_PROFILE,
    ProfileValidationError,
    check_profile,
    list_profiles,
    load_profile,
    parse_profile,
    profile_to_dict,
    shipped_dir,
)

import pytest
import yaml

REPO = Path(__file__).resolve().parent.parent
SHIPPED = {"smollm2-135m", "smollm2-135m-kv8", "gemma3-270m", "qwen2.5-coder-0.5b", "mlx-qwen2.5-7b-apple"}


def write(tmp_path: Path, text: str, name: str = "p.yaml") -> Path:
    path = tmp_path / name
    path.write_text(textwrap.dedent(text).lstrip("\n"))
    return path


def problems_of(path: Path) -> list[str]:
    with pytest.raises(ProfileValidationError) as info:
        load_profile(str(path))
    assert str(info.value) == "\n".join(info.value.problems)
    return info.value.problems


def test_minimal_profile_gets_documented_defaults(tmp_path):
    p = load_profile(str(write(tmp_path, "model: {source: smollm2-135m}\n", "mini.yaml")))
    assert p.name == "mini" and p.path == tmp_path / "mini.yaml"
    assert (p.model.source, p.model.weights) == ("smollm2-135m", "auto")
    kv = p.kv_cache
    assert (kv.format, kv.group_size, kv.quantized_start, kv.sliding_window, kv.checkpoint_format) == (
        "fp16", 64, 0, None, "same")
    assert (p.speculation.mode, p.speculation.num_draft_tokens) == ("none", 3)
    s = p.sampling
    assert (s.temperature, s.top_p, s.top_k, s.min_p, s.seed, s.max_tokens, s.stop) == (
        0.7, 1.0, 0, 0.0, None, 1024, ())
    assert p.context.max_context == 8192
    assert (p.cache.ram_bytes, p.cache.ssd_bytes, p.cache.ssd_dir) == (2 * 1024**3, 8 * 1024**3, None)
    assert (p.chat.template, p.chat.reasoning, p.chat.system_prompt) == ("auto", True, None)
    assert p.agent.approval["bash"] == "ask" and p.agent.approval["read_file"] == "allow"
    assert "bash" in p.agent.tools and p.agent.max_steps == 24
    assert (p.speech.whisper, p.speech.vad, p.speech.vad_threshold) == ("whisper-tiny.en", "silero-vad", 0.5)


def test_sizes_and_partial_approval(tmp_path):
    p = load_profile(str(write(tmp_path, """
        model: {source: x.gguf}
        cache: {ram_bytes: 512MiB, ssd_bytes: 1.5GB}
        agent:
          approval: {bash: deny}
    """)))
    assert p.cache.ram_bytes == 512 * 1024**2 and p.cache.ssd_bytes == 1_500_000_000
    assert p.agent.approval["bash"] == "deny" and p.agent.approval["write_file"] == "allow"


@pytest.mark.parametrize(
    "body, line, key, fragments",
    [
        # unknown key, with the closest valid key suggested
        ("sampling:\n  top_pp: 0.5\n", 3, "sampling.top_pp", ["unknown key", "did you mean 'top_p'"]),
        ("sampling2: {}\n", 2, "sampling2", ["unknown key", "did you mean 'sampling'"]),
        # wrong type
        ("sampling:\n  temperature: hot\n", 3, "sampling.temperature",
         ["expected a number", "'hot'", "a number >= 0"]),
        ("chat:\n  reasoning: maybe\n", 3, "chat.reasoning", ["expected a boolean", "true or false"]),
        ("sampling:\n  stop: done\n", 3, "sampling.stop", ["expected a list"]),
        # out of range
        ("sampling:\n  top_p: 1.5\n", 3, "sampling.top_p", ["1.5 is out of range", "(0, 1]"]),
        ("context:\n  max_context: 100\n", 3, "context.max_context", ["100 is out of range", ">= 256"]),
        ("speculation:\n  num_draft_tokens: 17\n", 3, "speculation.num_draft_tokens", ["[1, 16]"]),
        # bad enum
        ("kv_cache:\n  format: q3\n", 3, "kv_cache.format",
         ["'q3' is not a valid choice", "fp16, bf16, fp32, q8, q4"]),
        ("kv_cache:\n  group_size: 48\n", 3, "kv_cache.group_size", ["48", "32, 64, 128"]),
        ("agent:\n  approval: {bash: maybe}\n", 3, "agent.approval.bash", ["'maybe'", "allow, ask, deny"]),
        ("agent:\n  tools: [read_file, bsh]\n", 3, "agent.tools[1]", ["'bsh'", "did you mean 'bash'"]),
        ("chat:\n  template: llama3\n", 3, "chat.template", ["'llama3'", ".jinja"]),
        ("cache:\n  ram_bytes: 2 parsecs\n", 3, "cache.ram_bytes", ["'2 parsecs' is not a size", "2GiB"]),
    ],
)
def test_each_error_names_file_line_key_value_and_allowed(tmp_path, body, line, key, fragments):
    path = write(tmp_path, "model: {source: x.gguf}\n" + body)
    problems = problems_of(path)
    assert len(problems) == 1, problems
    assert problems[0].startswith(f"{path}:{line}: {key}: "), problems[0]
    for fragment in fragments:
        assert fragment in problems[0]


def test_all_problems_in_a_file_are_reported_at_once(tmp_path):
    path = write(tmp_path, """
        model:
          source: smollm2-135m
          wieghts: fp16
        sampling:
          top_p: 0
          seed: abc
        kv_cache: {format: q2}
    """)
    problems = problems_of(path)
    assert [p.split(": ")[0:2] for p in problems] == [
        [f"{path}:3", "model.wieghts"],
        [f"{path}:5", "sampling.top_p"],
        [f"{path}:6", "sampling.seed"],
        [f"{path}:7", "kv_cache.format"],
    ]
    assert "did you mean 'weights'" in problems[0]


def test_yaml_syntax_error_gives_line_and_column(tmp_path):
    path = write(tmp_path, "model:\n  source: x.gguf\nsampling:\n  stop: [a, b\n")
    (problem,) = problems_of(path)
    assert problem.startswith(f"{path}:5:1: YAML syntax error")
    path = write(tmp_path, "model:\n  source: x\n   bad indent: 1\n", "indent.yaml")
    (problem,) = problems_of(path)
    assert problem.startswith(f"{path}:3:") and "YAML syntax error" in problem


def test_missing_source_duplicates_and_cross_checks(tmp_path):
    (problem,) = problems_of(write(tmp_path, "model:\n  weights: auto\n", "a.yaml"))
    assert problem.startswith(f"{tmp_path / 'a.yaml'}:1: model.source: missing")
    (problem,) = problems_of(write(tmp_path, "sampling: {}\n", "b.yaml"))
    assert "model.source: missing" in problem
    problems = problems_of(write(tmp_path, """
        model: {source: x.gguf}
        sampling:
          top_p: 0.5
          top_p: 0.9
          max_tokens: 9000
    """, "c.yaml"))
    assert problems[0].endswith("sampling.top_p: duplicate key (first set on line 3)")
    assert "c.yaml:5: sampling.max_tokens: 9000 is out of range" in problems[1]
    assert "context.max_context" in problems[1]
    (problem,) = problems_of(write(tmp_path, "", "empty.yaml"))
    assert "empty" in problem
    (problem,) = problems_of(write(tmp_path, "- model\n", "list.yaml"))
    assert "expected a mapping" in problem


def test_profile_to_dict_round_trips(tmp_path):
    original = load_profile(DEFAULT_PROFILE)
    for sizes_as_text in (False, True):
        text = yaml.safe_dump(profile_to_dict(original, sizes_as_text=sizes_as_text), sort_keys=False)
        again = parse_profile(text, tmp_path / "again.yaml")
        assert profile_to_dict(again) == profile_to_dict(original)
    assert profile_to_dict(original, sizes_as_text=True)["cache"]["ram_bytes"] == "2GiB"
    assert json.loads(json.dumps(profile_to_dict(original)))["cache"]["ram_bytes"] == 2 * 1024**3


def test_profile_without_description_round_trips(tmp_path):
    bare = load_profile(str(write(tmp_path, "model: {source: smollm2-135m}\n")))
    assert bare.description == ""
    again = parse_profile(yaml.safe_dump(profile_to_dict(bare)), tmp_path / "again.yaml")
    assert profile_to_dict(again) == profile_to_dict(bare)


def test_user_profile_overrides_shipped_by_name():
    user = paths.config_dir() / "profiles"
    user.mkdir(parents=True)
    (user / f"{DEFAULT_PROFILE}.yaml").write_text(
        "description: my own\nmodel: {source: smollm2-135m}\nsampling: {temperature: 0.0}\n")
    (user / "mine.yaml").write_text("model: {source: smollm2-135m}\n")
    p = load_profile(DEFAULT_PROFILE)
    assert p.path == user / f"{DEFAULT_PROFILE}.yaml" and p.sampling.temperature == 0.0
    infos = {i.name: i for i in list_profiles()}
    assert [i.name for i in list_profiles()].count(DEFAULT_PROFILE) == 1
    assert infos[DEFAULT_PROFILE].source == "user" and infos[DEFAULT_PROFILE].overrides_shipped
    assert infos[DEFAULT_PROFILE].description == "my own"
    assert infos["mine"].source == "user" and not infos["mine"].overrides_shipped
    assert infos["gemma3-270m"].source == "shipped"


def test_unknown_profile_name_suggests():
    with pytest.raises(ProfileError, match="no profile named 'smollm2-13m'; did you mean 'smollm2-135m'"):
        load_profile("smollm2-13m")
    with pytest.raises(ProfileError, match="profile file not found"):
        load_profile("/nonexistent/x.yaml")


def test_shipped_profiles_load_and_check():
    shipped = {i.name: i for i in list_profiles() if i.source == "shipped"}
    assert SHIPPED <= set(shipped) and DEFAULT_PROFILE in shipped
    assert all(i.path.parent == shipped_dir() for i in shipped.values())
    for name in shipped:
        profile = load_profile(name)
        assert profile.name == name and profile.description
        result = check_profile(name)
        if name == "mlx-qwen2.5-7b-apple":
            assert not result.valid
            (problem,) = result.problems
            assert "model.source: model not found at " in problem
            assert str(Path("~/models/Qwen2.5-7B-Instruct-4bit").expanduser()) in problem
        else:
            assert result.valid, (name, result.problems)
    kv8 = load_profile("smollm2-135m-kv8")
    assert (kv8.kv_cache.format, kv8.kv_cache.checkpoint_format) == ("q8", "q8")
    assert load_profile("gemma3-270m").chat.template == "none"
    assert check_profile(DEFAULT_PROFILE).model_path.name == "SmolLM2-135M-Instruct.Q4_1.gguf"


def test_check_relative_model_template_and_speculation(tmp_path):
    (tmp_path / "m.gguf").write_bytes(b"GGUF")
    ok = check_profile(str(write(tmp_path, "model: {source: m.gguf}\n")))
    assert ok.valid and ok.model_path == tmp_path / "m.gguf"
    bad = check_profile(str(write(tmp_path, """
        model: {source: missing.gguf}
        speculation: {mode: draft, draft_model: missing-draft.gguf}
        chat: {template: tpl/chat.jinja}
    """, "bad.yaml")))
    assert not bad.valid and len(bad.problems) == 3
    assert f"bad.yaml:1: model.source: model not found at {tmp_path / 'missing.gguf'}" in bad.problems[0]
    assert (f"bad.yaml:2: speculation.draft_model: model not found at {tmp_path / 'missing-draft.gguf'}"
            in bad.problems[1])
    assert f"template not found at {tmp_path / 'tpl/chat.jinja'}" in bad.problems[2]
    invalid = check_profile(str(write(tmp_path, "model: {source: 3}\n", "typed.yaml")))
    assert not invalid.valid and "model.source: expected a non-empty string" in invalid.problems[0]


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "app", *args], cwd=REPO, capture_output=True,
                          text=True, timeout=60)


def test_cli_check_show_list(tmp_path):
    bad = write(tmp_path, "model: {source: x.gguf}\nsampling: {top_p: 2, top_k: -1}\n")
    r = run_cli("profile", "check", str(bad), "--json")
    assert r.returncode == 1, r.stderr
    out = json.loads(r.stdout)
    assert out["valid"] is False and len(out["problems"]) == 2
    assert out["problems"][0].startswith(f"{bad}:2: sampling.top_p: 2 is out of range")

    r = run_cli("profile", "check", DEFAULT_PROFILE, "--json")
    assert r.returncode == 0, r.stdout + r.stderr
    assert json.loads(r.stdout)["model_path"].endswith("SmolLM2-135M-Instruct.Q4_1.gguf")

    r = run_cli("profile", "check", "mlx-qwen2.5-7b-apple")
    assert r.returncode == 1 and "model not found at" in r.stderr

    r = run_cli("profile", "show", "smollm2-135m-kv8", "--json")
    assert r.returncode == 0
    shown = json.loads(r.stdout)
    assert shown["kv_cache"]["format"] == "q8" and shown["speech"]["vad"] == "silero-vad"

    r = run_cli("profile", "show", "gemma3-270m")
    assert r.returncode == 0 and yaml.safe_load(r.stdout)["chat"]["template"] == "none"

    r = run_cli("profile", "show", str(bad))
    assert r.returncode == 2 and r.stderr.startswith("mlxterm: ") and "sampling.top_k" in r.stderr

    r = run_cli("profile", "list", "--json")
    listed = {i["name"]: i for i in json.loads(r.stdout)}
    assert SHIPPED <= set(listed) and listed[DEFAULT_PROFILE]["default"] is True
