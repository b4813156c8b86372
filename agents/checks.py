"""The sandbox agents work in, and task acceptance checks run inside it.

``agent_sandbox`` builds the ``tools.sandbox.Sandbox`` for an agent's ``bash`` calls and a
task's checks: only the system directories, the Python running mlxterm (and where its import
finders put mlxterm's packages, so a check can run ``python -m pytest`` or Selenium from the
same environment) and the workspace are mounted; mlxterm's own data, config and cache
directories and ``$MLXTERM_HOME`` are hidden where they would lie inside one of those. Checks
run model-written code, so they get the same confinement as ``bash``: the workspace writable,
a private ``/tmp`` and ``/dev/shm``, ``/dev`` and ``/proc`` of their own, no capabilities and
(as root) an unprivileged uid, and loopback inside their own network namespace (a check may
start a server and point a headless browser at it). Without a sandbox, ``run_check`` refuses a
check unless its caller passes ``unconfined_ok=True``. What a check leaves for the host goes
into its own evidence folder (``agents.evidence``), never into the run directory the host
trusts: that is hidden from the agent's shell and the checks alike.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from engine import paths

from agents.evidence import Evidence
from agents.taskfile import Check
from agents.transcript import Transcript
from tools.bash import execute
from tools.sandbox import Limits, Sandbox, SandboxPolicy, SandboxRefused, SandboxStatus

CHECK_OUTPUT_CHARS = 4000


def agent_sandbox(network: bool = False, status: SandboxStatus | None = None, *,
                  unconfined_ok: bool = True, hide: Sequence[str] = (), limits: Limits | None = None) -> Sandbox:
    """The sandbox for agent shells and checks (``network``: keep the host network; ``hide``:
    more paths to keep out, e.g. a run directory inside the workspace; ``limits``: a task's
    resource limits, else the defaults).

    ``unconfined_ok`` (default True): where no sandbox works, the agent's ``bash`` still runs,
    unconfined -- ``agents.policy`` then forces every call to be approved by a person (or the
    run's own ``--allow bash``). Checks do not inherit this: ``run_check`` asks for its own
    consent."""
    hide = [str(paths.data_dir()), str(paths.config_dir()), str(paths.cache_dir()), *hide]
    if os.environ.get("MLXTERM_HOME"):
        hide.append(os.environ["MLXTERM_HOME"])
    # mlxterm's own packages too (a check may import them), wherever the checkout lies (even
    # under /tmp, which the sandbox replaces); the packages only, not what sits beside them
    root = Path(__file__).resolve().parent.parent
    packages = [str(root / name) for name in ("agents", "app", "engine", "tools")]
    packages += _installed_package_dirs(("agents", "app", "engine", "tools"))
    read_only = sorted({sys.prefix, sys.base_prefix, os.path.dirname(os.path.realpath(sys.executable)), *packages})
    policy = SandboxPolicy(network=network, hide=tuple(hide), read_only=tuple(read_only))
    if limits is not None:
        policy = replace(policy, limits=limits)
    return Sandbox(policy, status, unconfined_ok=unconfined_ok)


def _installed_package_dirs(names: tuple[str, ...]) -> list[str]:
    """Where this interpreter's import finders (an editable install's finder among them) place
    ``names`` -- a sandboxed ``python -c "import agents"`` goes there, not to this checkout."""
    found = []
    for finder in sys.meta_path:
        find_spec = getattr(finder, "find_spec", None)
        if find_spec is None:
            continue
        for name in names:
            try:
                spec = find_spec(name, None)
            except Exception:  # noqa: BLE001 (a third-party finder must not break the sandbox)
                continue
            if spec is not None and spec.submodule_search_locations:
                found += [str(Path(p).resolve()) for p in spec.submodule_search_locations if os.path.isdir(p)]
    return found


def run_check(check: Check, workspace: Path, sandbox: Sandbox, env: Mapping[str, str] | None = None,
              evidence: Evidence | None = None, readable: tuple[str, ...] = (),
              transcript: Transcript | None = None, *, unconfined_ok: bool = False) -> dict[str, Any]:
    """Run one acceptance check in ``workspace``; its record, also written to ``transcript``.

    ``evidence``: the one folder besides the workspace it may write (``$MLXTERM_RUN_DIR``;
    the run directory it belongs to is hidden, see ``agents.evidence``); ``readable``: more it
    may read (the task's own directory with its check scripts, which may lie beside the
    workspace). A check runs model-written code: where ``sandbox`` is not
    active it is refused (a failed record saying why) unless the caller passes
    ``unconfined_ok=True`` because a person consented (``mlxterm run --allow bash``). ``env``
    is the only thing a check gets from the caller's environment besides PATH, LANG, LC_*, TZ.
    Every check runner (``mlxterm run``, the task board) goes through here."""
    t0 = time.monotonic()
    writable, hide = ((str(evidence.folder),), evidence.protect()) if evidence is not None else ((), ())
    if evidence is not None:
        env = {**(env or {}), **evidence.env()}
    policy = replace(sandbox.policy, writable=(*sandbox.policy.writable, *writable),
                     read_only=(*sandbox.policy.read_only, *readable), hide=(*sandbox.policy.hide, *hide))
    sandbox = Sandbox(policy, sandbox.status, unconfined_ok=unconfined_ok)
    try:
        data = execute(check.run, workspace, check.timeout_s, None, sandbox, extra_env=env)
    except SandboxRefused as e:
        data = {"stdout": "", "stderr": f"check refused: {e}", "timed_out": False, "exit_code": None,
                "sandboxed": False}
    output = data["stdout"] + data["stderr"]
    if data["timed_out"]:
        output += f"\n[check timed out after {check.timeout_s:g} s]"
    over_cap = bool(data.get("over_cap"))
    if over_cap:  # bash's own note says how far past the cap; a check that got there did not pass
        output += "\n[check failed: the workspace grew past its size cap]"
    code = None if data["timed_out"] else data["exit_code"]
    record = {"name": check.name, "run": check.run, "passed": code == 0 and not over_cap, "exit_code": code,
              "output": output[-CHECK_OUTPUT_CHARS:], "duration_ms": round((time.monotonic() - t0) * 1000),
              "sandboxed": data["sandboxed"]}
    if transcript is not None:
        transcript.write("check", 0, **record)
    return record
