"""``mlxterm doctor``: the environment facts, from a real subprocess and from its probes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import types
from pathlib import Path

from app.commands import doctor
from tools.sandbox import probe

REPO = Path(__file__).resolve().parents[1]


def _doctor(**env: str) -> dict:
    proc = subprocess.run([sys.executable, "-m", "app", "doctor", "--json"], cwd=REPO, capture_output=True,
                          text=True, timeout=120, env={**os.environ, "PYTHONPATH": str(REPO), **env})
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


def test_doctor_reports_every_fact_and_follows_the_environment():
    facts = _doctor()
    assert list(facts) == ["settings", "sandbox", "openblas", "kernels", "hugepages", "espeak", "microphone"]
    assert facts["sandbox"]["backend"] == probe().backend
    # `python -m app` is the mlxterm command: it re-executes itself onto huge pages where it can
    assert facts["hugepages"]["ok"] is (facts["hugepages"]["mode"] in ("madvise", "always"))
    assert facts["settings"]["values"]["home"] == os.environ["MLXTERM_HOME"]
    off = _doctor(MLXTERM_SANDBOX="off", MLXTERM_OPENBLAS="off", MLXTERM_HUGEPAGES="0", MLXTERM_KERNELS="avx2")
    assert not off["hugepages"]["ok"] or off["hugepages"]["mode"] == "always"
    assert not off["sandbox"]["ok"] and "MLXTERM_SANDBOX=off" in off["sandbox"]["detail"]
    assert "asks for approval" in off["sandbox"]["detail"]
    assert not off["openblas"]["ok"] and "MLXTERM_OPENBLAS=off" in off["openblas"]["detail"]
    assert off["settings"]["values"]["kernels"] == {"enabled": True, "isa": "avx2"}
    assert "kernels avx2" in off["settings"]["detail"] and "openblas off" in off["settings"]["detail"]
    bad = _doctor(MLXTERM_GGUF_CACHE="maybe")
    assert not bad["settings"]["ok"] and "MLXTERM_GGUF_CACHE='maybe'" in bad["settings"]["detail"]


def test_doctor_text_output_marks_each_line():
    proc = subprocess.run([sys.executable, "-m", "app", "doctor"], cwd=REPO, capture_output=True, text=True,
                          timeout=120, env={**os.environ, "PYTHONPATH": str(REPO), "MLXTERM_SANDBOX": "off"})
    lines = proc.stdout.splitlines()
    assert proc.returncode == 0 and len(lines) == 7
    assert lines[0].startswith("ok settings") and lines[1].startswith("-- sandbox") and all(ln[:3] in ("ok ", "-- ") for ln in lines)


def test_kernels_probe_is_guarded(monkeypatch):
    monkeypatch.setitem(sys.modules, "engine.kernels", None)  # import fails like a missing build
    assert not doctor.kernels()["ok"]
    fake = types.ModuleType("engine.kernels")
    fake.status = lambda: {"available": True, "reason": None, "isa": "avx2"}
    monkeypatch.setitem(sys.modules, "engine.kernels", fake)
    assert doctor.kernels() == {"ok": True, "detail": "used (avx2; built in)"}
    fake.status = lambda: {"available": False, "reason": "this CPU lacks AVX2/FMA"}
    assert doctor.kernels() == {"ok": False, "detail": "not used: this CPU lacks AVX2/FMA"}
    fake.status = lambda: 1 / 0
    assert not doctor.kernels()["ok"]


def test_doctor_says_kernels_are_off_when_mlxterm_kernels_is_off():
    """A module that imports is not a kernel that runs: with MLXTERM_KERNELS=off the engine
    uses MLX's own ops, and doctor says so."""
    off = _doctor(MLXTERM_KERNELS="off")["kernels"]
    assert off == {"ok": False, "detail": "not used: turned off by MLXTERM_KERNELS=off"}


def test_espeak_and_microphone_probes(monkeypatch):
    monkeypatch.setattr(doctor.shutil, "which", lambda name: None)
    assert doctor.espeak() == {"ok": False, "detail": "espeak-ng not found (apt-get install espeak-ng)"}
    from engine.speech import capture
    from engine.speech.errors import NoAudioInputDevice

    def missing():
        raise NoAudioInputDevice("no audio input: libportaudio.so: cannot open (install libportaudio2)")

    monkeypatch.setattr(capture, "default_input_device", missing)
    mic = doctor.microphone()
    assert not mic["ok"] and not mic["portaudio"] and "PortAudio missing" in mic["detail"]
    monkeypatch.setattr(capture, "default_input_device", lambda: "USB mic")
    assert doctor.microphone() == {"ok": True, "portaudio": True, "detail": "input device: USB mic"}
