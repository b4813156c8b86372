"""bash: run a shell command in the workspace with a timeout, capped output and an allowlisted env.

The command runs in its own process group so a timeout or cancellation can stop everything
it started (SIGTERM, then SIGKILL after a grace period). Output is read incrementally into
head+tail buffers, so a command printing gigabytes costs a few tens of KB of memory.
"""

from __future__ import annotations

import os
import selectors
import signal
import subprocess
import threading
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from tools.base import Tool, ToolResult, Workspace
from tools.sandbox import Sandbox, SandboxRefused, SandboxStatus
from tools.space import Watch
from tools.textio import HeadTail, strip_ansi

STREAM_CAP = 16 * 1024  # bytes kept per stream (head + tail)
DEFAULT_TIMEOUT_S = 30
MAX_TIMEOUT_S = 600
TERM_GRACE_S = 1.0  # SIGTERM -> SIGKILL
PIPE_GRACE_S = 0.5  # after the shell exits, how long background children may keep its pipes
_POLL_S = 0.05
SPACE_POLL_S = 0.2  # how often a running command's workspace size is checked (one statvfs)

UNCONFINED = SandboxStatus("none", "no sandbox was asked for")
# The only host variables a command sees (plus LC_*); everything else -- tokens, passwords,
# proxy URLs with credentials, DSNs, agent sockets -- stays out. Callers add what a command
# needs on purpose through ``extra_env`` (a check's MLXTERM_TASK_DIR...).
ENV_ALLOW = ("PATH", "LANG", "TERM", "TZ")
ENV_ALLOW_PREFIXES = ("LC_",)


def scrub_env(env: Mapping[str, str], home: str) -> dict[str, str]:
    """The allowlisted part of ``env`` (``ENV_ALLOW``, ``LC_*``), HOME set to ``home``, and the
    settings for a shell nobody can answer."""
    clean = {name: value for name, value in env.items()
             if name in ENV_ALLOW or name.startswith(ENV_ALLOW_PREFIXES)}
    clean.setdefault("PATH", "/usr/local/bin:/usr/bin:/bin")
    clean["HOME"] = home
    # Nothing can answer a pager or a prompt: stdin is /dev/null and output is captured.
    clean.update(PAGER="cat", GIT_PAGER="cat", GIT_TERMINAL_PROMPT="0", TERM="dumb", NO_COLOR="1")
    # No .pyc files in the workspace: an agent rewrites a module within the same second at the
    # same size (x + 5 -> 2 * x), and Python would trust the old bytecode (mtime + size match).
    clean["PYTHONDONTWRITEBYTECODE"] = "1"
    return clean


def run(ws: Workspace, args: dict[str, Any], cancel: threading.Event | None) -> ToolResult:
    timeout = args["timeout_s"]
    try:
        data = execute(args["command"], ws.root, timeout, cancel, ws.sandbox)
    except SandboxRefused as e:
        return ToolResult.failure(f"bash refused: {e}", sandboxed=False, refused=True)
    content = _render(data, timeout)
    if data["timed_out"] or data["cancelled"] or data["over_cap"]:
        return ToolResult(ok=False, content=content, data=data, error=content.splitlines()[0])
    return ToolResult.success(content, **data)


def execute(command: str, cwd: Path, timeout: float, cancel: threading.Event | None = None,
            sandbox: Sandbox | None = None, extra_env: Mapping[str, str] | None = None) -> dict[str, Any]:
    """Run ``bash -c command`` in ``cwd`` confined by ``sandbox``; the result fields the bash
    tool reports. Task acceptance checks use it too (with ``extra_env`` telling them where the
    task's files and the run's evidence directory are). ``sandbox=None`` runs it unconfined
    (the caller's explicit choice); an inactive sandbox raises ``SandboxRefused`` unless it was
    made with ``unconfined_ok``."""
    started = time.monotonic()
    sandbox = sandbox if sandbox is not None else Sandbox(status=UNCONFINED, unconfined_ok=True)
    env = {**scrub_env(os.environ, str(cwd)), **(extra_env or {})}
    with sandbox.launch(command, cwd, env) as (argv, fds, watch):
        proc = subprocess.Popen(
            argv,
            pass_fds=fds,
            cwd=cwd,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            start_new_session=True,  # own process group: killpg reaches every child
        )
        out, err = HeadTail(STREAM_CAP), HeadTail(STREAM_CAP)
        outcome = _pump(proc, {proc.stdout: out, proc.stderr: err}, started + timeout, cancel, watch)
        if outcome == "done" and watch.check(final=True) is not None:
            outcome = "over_cap"  # it ended on its own, past the cap: said, though nothing was stopped
    duration_ms = round((time.monotonic() - started) * 1000)
    exit_code = proc.returncode
    return {
        "exit_code": exit_code,
        "timed_out": outcome == "timeout",
        "cancelled": outcome == "cancelled",
        "background_killed": outcome == "background",
        "over_cap": watch.over is not None,
        "over_cap_stopped": outcome == "space",
        "space": watch.message() if watch.over is not None else None,
        "duration_ms": duration_ms,
        "stdout": strip_ansi(out.text()),
        "stderr": strip_ansi(err.text()),
        "stdout_bytes": out.total,
        "stderr_bytes": err.total,
        "stdout_truncated": out.truncated,
        "stderr_truncated": err.truncated,
        "sandboxed": sandbox.active,
        "sandbox": sandbox.status.backend,
    }


def _pump(proc: subprocess.Popen, sinks: dict, deadline: float, cancel: threading.Event | None,
          watch: Watch | None = None) -> str:
    """Read both pipes until they close; enforce the deadline, cancellation and the workspace
    size cap (``watch``, checked every ``SPACE_POLL_S``).

    Returns "done", "timeout", "cancelled", "space" (the workspace grew past its cap and the
    command was killed) or "background" (the shell exited but children it left running still
    held the pipes and were killed).
    """
    sel = selectors.DefaultSelector()
    for stream in sinks:
        sel.register(stream, selectors.EVENT_READ)
    outcome = "done"
    exited_at = term_at = kill_at = None
    space_at = time.monotonic()
    try:
        while sel.get_map() or proc.poll() is None:  # output may close before the shell ends
            now = time.monotonic()
            if term_at is None and kill_at is None:
                if cancel is not None and cancel.is_set():
                    outcome, term_at = "cancelled", _signal_group(proc, signal.SIGTERM)
                elif now >= deadline:
                    outcome, term_at = "timeout", _signal_group(proc, signal.SIGTERM)
                elif watch is not None and now - space_at >= SPACE_POLL_S and proc.poll() is None:
                    space_at = now
                    if watch.check() is not None:  # no grace: every second it keeps writing
                        outcome = "space"
                        term_at = kill_at = _signal_group(proc, signal.SIGKILL)
                elif proc.poll() is not None:
                    exited_at = exited_at or now
                    if now - exited_at >= PIPE_GRACE_S:
                        outcome, kill_at = "background", _signal_group(proc, signal.SIGKILL)
            elif kill_at is None and now - term_at >= TERM_GRACE_S:
                kill_at = _signal_group(proc, signal.SIGKILL)
            elif kill_at is not None and now - kill_at >= TERM_GRACE_S:
                break  # a process outside the group (setsid) holds the pipes: stop waiting
            if not sel.get_map():
                try:
                    proc.wait(timeout=_POLL_S)
                except subprocess.TimeoutExpired:
                    pass
                continue
            for key, _ in sel.select(timeout=_POLL_S):
                chunk = os.read(key.fd, 65536)
                if chunk:
                    sinks[key.fileobj].write(chunk)
                else:
                    sel.unregister(key.fileobj)
    finally:
        sel.close()
        for stream in sinks:
            stream.close()
    if outcome != "done":
        # Members that ignored SIGTERM but already closed their pipes are still in the group.
        _signal_group(proc, signal.SIGKILL)
    _reap(proc)
    return outcome


def _signal_group(proc: subprocess.Popen, sig: int) -> float:
    try:
        os.killpg(proc.pid, sig)
    except (ProcessLookupError, PermissionError):
        pass  # the group is already gone
    return time.monotonic()


def _reap(proc: subprocess.Popen) -> None:
    try:
        proc.wait(timeout=TERM_GRACE_S)
    except subprocess.TimeoutExpired:  # closed its pipes but is still running
        _signal_group(proc, signal.SIGKILL)
        proc.wait()


def _render(data: dict[str, Any], timeout: int) -> str:
    seconds = data["duration_ms"] / 1000
    code = data["exit_code"]
    if data["timed_out"]:
        status = f"timed out after {timeout} s; the command and its child processes were killed"
    elif data["cancelled"]:
        status = f"cancelled after {seconds:.1f} s; the command and its child processes were killed"
    elif data["over_cap_stopped"]:
        status = f"stopped: {data['space']}; the command and its child processes were killed"
    elif code is not None and code < 0:
        status = f"killed by signal {-code} ({seconds:.1f} s)"
    else:
        status = f"exit code {code} ({seconds:.1f} s)"
    if data["over_cap"] and not data["over_cap_stopped"]:
        status += f"; {data['space']}"
    if data["background_killed"]:
        status += "; background processes still holding its output were killed (redirect their output to a file to keep them running)"
    parts = [status]
    for stream in ("stdout", "stderr"):
        if data[stream]:
            parts.append(f"{stream}:\n{data[stream].rstrip(chr(10))}")
    if not data["stdout"] and not data["stderr"]:
        parts.append("(no output)")
    return "\n".join(parts)


TOOL = Tool(
    name="bash",
    description=(
        "Run a bash command in the workspace root (non-interactive, no stdin). Returns the exit "
        f"code and stdout/stderr, each capped to ~{STREAM_CAP // 1024} KB (start and end kept). "
        "The command and its children are killed when timeout_s runs out."
    ),
    parameters={
        "type": "object",
        "properties": {
            "command": {"type": "string", "description": "The shell command line to run."},
            "timeout_s": {
                "type": "integer", "minimum": 1, "maximum": MAX_TIMEOUT_S, "default": DEFAULT_TIMEOUT_S,
                "description": "Seconds before the command is killed.",
            },
        },
        "required": ["command"],
        "additionalProperties": False,
    },
    fn=run,
)
