"""CI strict mode (a pytest plugin, loaded by tests/conftest.py).

Under ``CI=true`` a skipped test fails instead, so a missing install step (espeak-ng, sox,
tmux, OpenBLAS, bubblewrap, chromium...) cannot turn the run green. Two kinds of skip stay
skips: ``@pytest.mark.optin`` tests (optional big downloads) and reasons that state a fact
about the machine rather than a missing package, which start with one of ``ENVIRONMENT_FACTS``
(a container that cannot create user namespaces for the sandbox; a CPU without AMX, whose
kernel tests then have nothing to run; a system without transparent huge pages or glibc).
"""

from __future__ import annotations

import os

import pytest

ENVIRONMENT_FACTS = ("namespaces unavailable:", "CPU feature missing:", "system lacks:")
NAMESPACE_FAILURE = "bwrap cannot create namespaces here"  # tools.sandbox's reason for that fact


def sandbox_skip_reason(status) -> str:
    """The skip reason for a sandbox test where ``status`` (``tools.sandbox.probe()``) has no
    bubblewrap sandbox: only a machine that cannot create namespaces is an environment fact; a
    missing bwrap, ``MLXTERM_SANDBOX=off`` or a broken setup fails under CI strict mode."""
    if status.reason.startswith(NAMESPACE_FAILURE):
        return "namespaces unavailable: " + status.reason
    if "not installed" in status.reason:
        return "bubblewrap missing: " + status.reason
    return "sandbox unavailable: " + status.reason


def strict() -> bool:
    return os.environ.get("CI", "").strip().lower() == "true"


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if not (strict() and report.skipped) or hasattr(report, "wasxfail") or "optin" in item.keywords:
        return
    reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
    reason = reason.removeprefix("Skipped: ")
    if reason.startswith(ENVIRONMENT_FACTS):
        return
    report.outcome = "failed"
    report.longrepr = (f"CI strict mode (CI=true): this test was skipped ({reason}); install what it needs "
                       "in setup.sh --test, or mark it optin")
