"""CI strict mode, run for real: a pytest subprocess on a small test file with and without CI=true."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

CASES = '''
import pytest

from tests.ci_strict import sandbox_skip_reason
from tools.sandbox import SandboxStatus

OFF = SandboxStatus("none", "turned off by MLXTERM_SANDBOX=off")  # what sandbox._probe says
NO_NAMESPACES = SandboxStatus("none", "bwrap cannot create namespaces here: No permissions to create new namespace")

@pytest.mark.skipif(True, reason="sox is not installed")
def test_missing_tool():
    pass

def test_runtime_skip():
    pytest.skip("espeak-ng and sox synthesize the clip")

@pytest.mark.optin
def test_optin():
    pytest.skip("opt-in (set MLXTERM_OPTIN=1)")

@pytest.mark.skipif(True, reason="namespaces unavailable: bwrap: No permissions to create new namespace")
def test_environment_fact():
    pass

@pytest.mark.skipif(True, reason="CPU feature missing: no AMX-INT8 here")
def test_cpu_fact():
    pass

@pytest.mark.skipif(True, reason="system lacks: transparent huge pages")
def test_system_fact():
    pass

@pytest.mark.skipif(True, reason=sandbox_skip_reason(OFF))
def test_sandbox_turned_off():
    pass

@pytest.mark.skipif(True, reason=sandbox_skip_reason(NO_NAMESPACES))
def test_sandbox_fact():
    pass

@pytest.mark.xfail(reason="known")
def test_xfail():
    assert False

def test_passes():
    pass
'''


def _pytest(tmp_path: Path, ci: str | None) -> dict[str, str]:
    (tmp_path / "test_cases.py").write_text(CASES)
    env = {k: v for k, v in os.environ.items() if k != "CI"}
    if ci is not None:
        env["CI"] = ci
    env["PYTHONPATH"] = str(REPO)
    proc = subprocess.run([sys.executable, "-m", "pytest", "-p", "tests.ci_strict", "-v", "-p", "no:cacheprovider",
                           "--rootdir", str(tmp_path), str(tmp_path / "test_cases.py")],
                          cwd=tmp_path, capture_output=True, text=True, timeout=120, env=env)
    outcomes = {}
    for line in proc.stdout.splitlines():  # "test_cases.py::test_optin SKIPPED (reason)  [ 50%]"
        if line.startswith("test_cases.py::test_"):
            name, word = line.split("::test_", 1)[1].split()[:2]
            outcomes[name] = word
    return outcomes


def test_strict_mode_fails_conditional_skips_only_under_ci(tmp_path):
    relaxed = _pytest(tmp_path, None)
    assert relaxed == {"missing_tool": "SKIPPED", "runtime_skip": "SKIPPED", "optin": "SKIPPED",
                       "environment_fact": "SKIPPED", "cpu_fact": "SKIPPED", "system_fact": "SKIPPED", "xfail": "XFAIL",
                       "sandbox_turned_off": "SKIPPED", "sandbox_fact": "SKIPPED", "passes": "PASSED"}
    strict = _pytest(tmp_path, "true")
    # a skipif fires during setup, so pytest reports the failure there as ERROR
    assert strict == {"missing_tool": "ERROR", "runtime_skip": "FAILED", "optin": "SKIPPED",
                      "environment_fact": "SKIPPED", "cpu_fact": "SKIPPED", "system_fact": "SKIPPED", "xfail": "XFAIL",
                      "sandbox_turned_off": "ERROR", "sandbox_fact": "SKIPPED", "passes": "PASSED"}
