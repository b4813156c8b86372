"""Remote profiles (``model.remote``): chat through an OpenAI-compatible server, here a real
``mlxterm serve`` on loopback with a tiny model."""

from __future__ import annotations

import json
import socket

from engine.errors import MlxtermError
from engine.profiles import ProfileValidationError, load_profile

import openai
import pytest
import yaml

from tests.serve_server import running_server


@pytest.fixture(scope="module")
def server(tmp_path_factory, tiny_llama_dir):
    from tests.tiny_models import write_profile

    prof = write_profile(tmp_path_factory.mktemp("remote") / "tiny.yaml", tiny_llama_dir)
    env = {"REMOTE_TEST_KEY": "k3y"}
    with running_server(prof, tmp_path_factory.mktemp("remote-home"), "--api-key-env", "REMOTE_TEST_KEY",
                        env=env) as s:
        yield s


def _remote_profile(path, base_url: str, **remote) -> str:
    data = {"name": path.stem, "model": {"remote": {"base_url": base_url, "model": "tiny", **remote}},
            "sampling": {"temperature": 0.0, "max_tokens": 16}}
    path.write_text(yaml.safe_dump(data))
    return str(path)


def _generate(capsys, *argv: str) -> tuple[int, dict | None, str]:
    from app.cli import main

    code = main(["generate", *argv, "--json"])
    out, err = capsys.readouterr()
    return code, (json.loads(out) if out.strip() else None), err


def test_generate_on_a_remote_profile(server, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("REMOTE_TEST_KEY", "k3y")
    prof = _remote_profile(tmp_path / "far.yaml", server.base_url, api_key_env="REMOTE_TEST_KEY")
    code, out, _ = _generate(capsys, "--profile", prof, "--prompt", "hello there")
    assert code == 0
    sdk = openai.OpenAI(base_url=server.base_url, api_key="k3y", max_retries=0)
    direct = sdk.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hello there"}],
                                         max_tokens=16, temperature=0)
    assert out["text"] == direct.choices[0].message.content
    assert out["usage"]["completion_tokens"] == direct.usage.completion_tokens
    assert out["timings"]["ttft_ms"] > 0 and out["remote"] == server.base_url
    # the follow-up turn: the server's checkpoint store serves the repeated prefix
    msgs = tmp_path / "msgs.json"
    msgs.write_text(json.dumps([{"role": "user", "content": "hello there"},
                                {"role": "assistant", "content": out["text"]},
                                {"role": "user", "content": "go on"}]))
    code, follow, _ = _generate(capsys, "--profile", prof, "--messages", str(msgs))
    assert code == 0
    assert follow["usage"]["cached_tokens"] >= out["usage"]["prompt_tokens"] - 1


def test_remote_errors_are_one_clear_line(server, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("REMOTE_TEST_KEY", "wrong")
    prof = _remote_profile(tmp_path / "badkey.yaml", server.base_url, api_key_env="REMOTE_TEST_KEY")
    code, out, err = _generate(capsys, "--profile", prof, "--prompt", "hi")
    assert code == 1 and "401" in out["error"] and "API key" in out["error"]
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    prof = _remote_profile(tmp_path / "gone.yaml", f"http://127.0.0.1:{port}/v1")
    code, out, err = _generate(capsys, "--profile", prof, "--prompt", "hi")
    assert code == 1 and "connection refused" in out["error"]
    assert err.count("\n") == 1 and err.startswith("mlxterm: http://127.0.0.1:")


def test_remote_profile_validation(tmp_path):
    from engine.runtime import Engine

    ok = load_profile(_remote_profile(tmp_path / "ok.yaml", "http://127.0.0.1:9/v1"))
    assert ok.model.remote.model == "tiny" and ok.model.remote.timeout_s == 600.0
    with pytest.raises(MlxtermError, match="remote server"):
        Engine.load(ok)
    cases = {
        "both": ({"source": "smollm2-135m", "remote": {"base_url": "http://h/v1", "model": "m"}}, "not both"),
        "nomodel": ({"remote": {"base_url": "http://h/v1"}}, "model.remote.model: missing"),
        "badurl": ({"remote": {"base_url": "ftp://h", "model": "m"}}, "not an http"),
        "typo": ({"remote": {"base_url": "http://h/v1", "model": "m", "api_key": "x"}}, "unknown key"),
        "neither": ({"weights": "fp32"}, "model.source: missing"),
    }
    for name, (model, message) in cases.items():
        path = tmp_path / f"{name}.yaml"
        path.write_text(yaml.safe_dump({"model": model}))
        with pytest.raises(ProfileValidationError) as info:
            load_profile(str(path))
        assert message in "\n".join(info.value.problems), name


def test_doctor_checks_a_remote_profiles_server(server, tmp_path, capsys, monkeypatch, tiny_profile):
    from app.cli import main
    from app.commands import doctor

    monkeypatch.setenv("REMOTE_TEST_KEY", "k3y")
    prof = _remote_profile(tmp_path / "far.yaml", server.base_url, api_key_env="REMOTE_TEST_KEY")
    assert main(["doctor", "--profile", prof, "--json"]) == 0
    fact = json.loads(capsys.readouterr().out)["remote"]
    assert fact["ok"] and fact["models"] == ["tiny"] and fact["model_listed"]
    assert fact["detail"] == f"{server.base_url} answers; serves tiny"
    other = doctor.remote(_remote_profile(tmp_path / "other.yaml", server.base_url, model="big",
                                          api_key_env="REMOTE_TEST_KEY"))
    assert other["ok"] and not other["model_listed"] and "lists tiny, not big" in other["detail"]
    monkeypatch.setenv("REMOTE_TEST_KEY", "wrong")
    refused = doctor.remote(prof)
    assert not refused["ok"] and "401" in refused["detail"]
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    down = doctor.remote(_remote_profile(tmp_path / "down.yaml", f"http://127.0.0.1:{port}/v1"))
    assert not down["ok"] and "connection refused" in down["detail"]
    with socket.create_server(("127.0.0.1", 0)) as silent:  # accepts, never answers
        url = f"http://127.0.0.1:{silent.getsockname()[1]}/v1"
        mute = doctor.remote(_remote_profile(tmp_path / "mute.yaml", url), timeout=0.5)
    assert not mute["ok"] and mute["detail"] == f"{url}: no answer within 0.5 s"
    local = doctor.remote(str(tiny_profile))
    assert local["ok"] and "runs its model here" in local["detail"]
    assert not doctor.remote(str(tmp_path / "missing.yaml"))["ok"]
