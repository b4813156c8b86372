"""The bash sandbox: each escape fails inside it while normal work succeeds; the fallback asks.

The escape tests run real commands under bubblewrap. Each one first shows the same command
succeeding without the sandbox (where that is harmless), so a sandbox that silently stopped
confining would fail the test instead of passing by accident.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import threading
import time
from pathlib import Path

import pytest

from agents.checks import agent_sandbox, run_check
from agents.policy import ApprovalPolicy
from agents.taskfile import Check
from tests.ci_strict import sandbox_skip_reason
from tools import cgroups, default_registry
from tools import sandbox as sb
from tools.bash import execute
from tools.sandbox import (
    Limits,
    Sandbox,
    SandboxPolicy,
    SandboxStatus,
    bwrap_args,
    seatbelt_profile,
)

STATUS = sb.probe()
# "namespaces unavailable" is an environment fact (a container without user namespaces) that
# CI strict mode accepts as a skip; a missing bwrap is an install step that must not be skipped.
needs_bwrap = pytest.mark.skipif(
    STATUS.backend != "bwrap",
    reason=sandbox_skip_reason(STATUS),
)
OFF = SandboxStatus("none", "test: no sandbox")
SECRET = "outside secret 42"


@pytest.fixture
def layout(tmp_path):
    ws = tmp_path / "ws"
    outside = tmp_path / "outside"
    ws.mkdir()
    outside.mkdir()
    (outside / "secret.txt").write_text(SECRET)
    return ws, outside


def sandbox(**limits) -> Sandbox:
    return Sandbox(SandboxPolicy(limits=Limits(**limits)), STATUS)


def run(cmd: str, ws: Path, box: Sandbox | None, timeout: float = 60) -> dict:
    return execute(cmd, ws, timeout, None, box)


def _pids_with(marker: str) -> list[int]:
    """Host processes whose command line contains ``marker`` (zombies excluded)."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            cmdline = Path(f"/proc/{entry}/cmdline").read_bytes().replace(b"\0", b" ").decode()
            state = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if marker in cmdline and state not in ("Z", "X"):
            found.append(int(entry))
    return found


# -- escapes ----------------------------------------------------------------------------------

@needs_bwrap
def test_reading_and_writing_beside_the_workspace_fails(layout):
    ws, outside = layout
    read = "cat ../outside/secret.txt"
    write = "echo pwned > ../outside/new.txt"
    assert SECRET in run(read, ws, None)["stdout"]  # the control: unconfined, it works
    confined = run(f"{read}; {write}; echo x > /usr/mlxterm-escape", ws, sandbox())
    assert SECRET not in confined["stdout"]
    assert "No such file or directory" in confined["stderr"]
    assert "Read-only file system" in confined["stderr"]
    assert not (outside / "new.txt").exists() and not os.path.exists("/usr/mlxterm-escape")
    assert confined["sandboxed"] and confined["sandbox"] == "bwrap"


@needs_bwrap
def test_a_symlink_made_inside_the_sandbox_does_not_reach_outside(layout):
    ws, outside = layout
    cmd = f"ln -s {outside} link; cat link/secret.txt; echo pwned > link/new.txt"
    result = run(cmd, ws, sandbox())
    assert SECRET not in result["stdout"] and result["exit_code"] != 0
    assert not (outside / "new.txt").exists()
    assert os.path.islink(ws / "link")  # the link itself was made: the workspace is writable


@needs_bwrap
def test_home_and_mlxterm_home_are_hidden(tmp_path, monkeypatch):
    ws = tmp_path / "ws"
    ws.mkdir()
    # Data dirs inside the workspace's own tree stay visible to a bind mount unless hidden,
    # so this proves the hide rule itself (under /tmp everything is private anyway).
    home = ws / "mlxterm-home"
    (home / "data").mkdir(parents=True)
    (home / "data" / "sessions.sqlite3").write_text("SESSION DATABASE")
    monkeypatch.setenv("MLXTERM_HOME", str(home))
    cmd = f"cat {home}/data/sessions.sqlite3; ls -A {home}; cat ~root/.bashrc /root/.profile 2>&1 | head -c 200"
    assert "SESSION DATABASE" in run(cmd, ws, None)["stdout"]
    result = run(cmd, ws, agent_sandbox(status=STATUS))
    assert "SESSION DATABASE" not in result["stdout"]
    assert result["stdout"].strip() == "" or "No such file" in result["stdout"]


@needs_bwrap
def test_no_network_to_a_host_loopback_listener_but_the_sandboxes_own_loopback_works(layout):
    ws, _ = layout
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(8)
    port = server.getsockname()[1]
    try:
        probe = (f"python3 -c \"import socket; socket.create_connection(('127.0.0.1', {port}), timeout=5); "
                 "print('CONNECTED')\"")
        assert "CONNECTED" in run(probe, ws, None)["stdout"]
        assert "CONNECTED" not in run(probe, ws, sandbox())["stdout"]
        # the task switch keeps the host network
        assert "CONNECTED" in run(probe, ws, Sandbox(SandboxPolicy(network=True), STATUS))["stdout"]
    finally:
        server.close()
    own = ("python3 -c \"import socket; s = socket.socket(); s.bind(('127.0.0.1', 0)); s.listen(); "
           "c = socket.create_connection(s.getsockname()); print('OWN LOOPBACK OK')\"")
    assert "OWN LOOPBACK OK" in run(own, ws, sandbox())["stdout"]


@needs_bwrap
def test_a_fork_bomb_ends_as_a_tool_error_and_leaves_nothing_behind(layout):
    ws, _ = layout
    bomb = ("python3 -c \"import os, time\nwhile True:\n    try:\n        os.fork()\n"
            "    except OSError as e:\n        print('LIMIT', e, flush=True); time.sleep(600)\" forkbomb-7f3a")
    t0 = time.monotonic()
    result = run(bomb, ws, sandbox(processes=64), timeout=6)
    assert time.monotonic() - t0 < 40
    assert "LIMIT" in result["stdout"] and "Resource temporarily unavailable" in result["stdout"]
    assert result["timed_out"]
    deadline = time.monotonic() + 10
    while _pids_with("forkbomb-7f3a") and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _pids_with("forkbomb-7f3a") == []


@needs_bwrap
def test_a_memory_hog_fails_with_memory_error(layout):
    ws, _ = layout
    hog = "python3 -c \"b = bytearray(1 << 30); print('ALLOCATED', len(b))\""
    result = run(hog, ws, sandbox(data_bytes=256 << 20))
    assert "MemoryError" in result["stderr"] and "ALLOCATED" not in result["stdout"]
    assert result["exit_code"] == 1


@needs_bwrap
def test_runaway_output_is_capped_and_runaway_files_stop_at_the_size_limit(layout):
    ws, _ = layout
    box = sandbox(file_bytes=1 << 20, tmp_bytes=4 << 20)
    result = run("head -c 100M /dev/zero > big; head -c 100M /dev/zero > /tmp/big; yes | head -c 50M", ws, box)
    assert (ws / "big").stat().st_size == 1 << 20
    assert "File size limit exceeded" in result["stderr"]
    assert result["stdout_bytes"] == 50 << 20 and result["stdout_truncated"] and len(result["stdout"]) < 20_000


@needs_bwrap
def test_timeout_and_cancel_end_every_process_in_the_sandbox(layout):
    ws, _ = layout
    t0 = time.monotonic()
    result = run("sleep 301.25 & sleep 301.25 & echo started; sleep 301.25", ws, sandbox(), timeout=1)
    assert result["timed_out"] and "started" in result["stdout"]
    assert time.monotonic() - t0 < 15
    cancel = threading.Event()
    timer = threading.Timer(0.5, cancel.set)
    timer.start()
    try:
        cancelled = execute("setsid sleep 302.25 & echo started; sleep 302.25", ws, 60, cancel, sandbox())
    finally:
        timer.cancel()
    assert cancelled["cancelled"]
    deadline = time.monotonic() + 10
    while (_pids_with("301.25") or _pids_with("302.25")) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _pids_with("301.25") == [] and _pids_with("302.25") == []


# -- normal work ------------------------------------------------------------------------------

@needs_bwrap
def test_normal_work_succeeds_inside(layout):
    ws, _ = layout
    reg = default_registry(ws, sandbox=sandbox())
    result = reg.run("bash", {"command": "mkdir -p src && printf 'print(6*7)\\n' > src/m.py && python3 src/m.py "
                                         "&& echo tmp > /tmp/t && cat /tmp/t && git --version >/dev/null && echo ok"})
    assert result.ok and result.data["exit_code"] == 0, result.content
    assert result.data["stdout"] == "42\ntmp\nok\n" and result.data["sandboxed"]
    assert (ws / "src/m.py").read_text() == "print(6*7)\n"


@needs_bwrap
def test_a_check_can_serve_on_loopback_and_fetch_inside_its_own_namespace(layout):
    ws, _ = layout
    (ws / "index.html").write_text("<h1>board</h1>")
    script = ("python3 -m http.server 8765 --bind 127.0.0.1 >/dev/null 2>&1 & "
              "for i in $(seq 50); do python3 -c \"import urllib.request as u; "
              "print(u.urlopen('http://127.0.0.1:8765/index.html').read().decode())\" 2>/dev/null && exit 0; "
              "sleep 0.2; done; exit 1")
    record = run_check(Check("serves", script, 60), ws, agent_sandbox(status=STATUS))
    assert record["passed"], record["output"]
    assert "<h1>board</h1>" in record["output"] and record["sandboxed"]


CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")


@needs_bwrap
@pytest.mark.skipif(CHROMIUM is None, reason="chromium not installed (setup.sh --test installs it)")
def test_headless_chromium_runs_inside_the_check_sandbox(layout):
    ws, _ = layout
    (ws / "page.html").write_text("<title>t</title><p id=x>rendered by chromium</p>")
    script = (f"python3 -m http.server 8766 --bind 127.0.0.1 >/dev/null 2>&1 & sleep 1; "
              f"{CHROMIUM} --headless --no-sandbox --disable-gpu --dump-dom http://127.0.0.1:8766/page.html 2>/dev/null")
    record = run_check(Check("browser", script, 120), ws, agent_sandbox(status=STATUS))
    assert record["passed"] and "rendered by chromium" in record["output"], record["output"]


# -- the fallback -----------------------------------------------------------------------------

def test_fallback_runs_unconfined_only_with_consent_and_says_so(layout):
    ws, _ = layout
    result = run("cat ../outside/secret.txt", ws, Sandbox(SandboxPolicy(), OFF, unconfined_ok=True))
    assert SECRET in result["stdout"] and not result["sandboxed"] and result["sandbox"] == "none"
    with pytest.raises(sb.SandboxRefused, match="test: no sandbox"):
        run("cat ../outside/secret.txt", ws, Sandbox(SandboxPolicy(), OFF))


def test_default_registry_sandboxes_bash_and_refuses_without_a_sandbox(layout, monkeypatch):
    ws, _ = layout
    if STATUS.available:
        result = default_registry(ws).run("bash", {"command": "cat ../outside/secret.txt"})
        assert result.data["sandboxed"] and SECRET not in result.content
    monkeypatch.setattr(sb, "_probed", OFF)  # no bubblewrap: the default fails closed
    refused = default_registry(ws).run("bash", {"command": "cat ../outside/secret.txt"})
    assert not refused.ok and "refused" in refused.error and SECRET not in refused.content
    consented = default_registry(ws, unconfined=True).run("bash", {"command": "cat ../outside/secret.txt"})
    assert consented.ok and SECRET in consented.content and not consented.data["sandboxed"]
    with pytest.raises(ValueError):
        default_registry(ws, sandbox=sandbox(), unconfined=True)
    assert default_registry(ws, sandbox=agent_sandbox(status=OFF)).run("bash", {"command": "true"}).ok  # agents ask


def test_run_check_without_a_sandbox_needs_explicit_consent(layout):
    ws, _ = layout
    check = Check("reads", "cat ../outside/secret.txt", 30)
    refused = run_check(check, ws, agent_sandbox(status=OFF))
    assert not refused["passed"] and "check refused" in refused["output"] and SECRET not in refused["output"]
    assert refused["exit_code"] is None and refused["sandboxed"] is False
    consented = run_check(check, ws, agent_sandbox(status=OFF), unconfined_ok=True)
    assert consented["passed"] and SECRET in consented["output"] and consented["sandboxed"] is False


def test_fallback_forces_ask_for_bash_whatever_the_profile_says():
    interactive = ApprovalPolicy({"bash": "allow", "read_file": "allow"}, unsandboxed=["bash"])
    assert interactive.decide("bash") == "ask" and interactive.decide("read_file") == "allow"
    interactive.remember("bash")  # an "always" answer does not stick for an unconfined shell
    assert interactive.decide("bash") == "ask"
    headless = ApprovalPolicy({"bash": "allow"}, interactive=False, unsandboxed=["bash"])
    assert headless.decide("bash") == "deny" and "cannot be sandboxed" in headless.denial_message("bash")
    explicit = ApprovalPolicy({"bash": "ask"}, allow=["bash"], interactive=False, unsandboxed=["bash"])
    assert explicit.decide("bash") == "allow"  # this run's own --allow bash
    denied = ApprovalPolicy({"bash": "deny"}, allow=["bash"], interactive=False, unsandboxed=["bash"])
    assert denied.decide("bash") == "deny"
    sandboxed = ApprovalPolicy({"bash": "allow"})
    assert sandboxed.decide("bash") == "allow"


def test_fallback_is_announced_once(monkeypatch):
    monkeypatch.setattr(sb, "_warned", False)
    first = sb.warn_once(OFF)
    assert first and "without a sandbox" in first and "test: no sandbox" in first
    assert sb.warn_once(OFF) is None
    assert sb.warn_once(SandboxStatus("bwrap", "x")) is None


def test_mlxterm_sandbox_off_and_missing_bwrap_are_reported(monkeypatch):
    monkeypatch.setenv("MLXTERM_SANDBOX", "off")
    assert sb._probe().reason == "turned off by MLXTERM_SANDBOX=off"
    monkeypatch.delenv("MLXTERM_SANDBOX")
    monkeypatch.setattr(sb.sys, "platform", "linux")
    monkeypatch.setattr(sb.shutil, "which", lambda name: None)
    status = sb._probe()
    assert not status.available and "bubblewrap" in status.reason


# -- generated arguments and profiles --------------------------------------------------------

def test_bwrap_arguments_mount_only_what_a_shell_needs_and_hide_inside_binds(tmp_path, monkeypatch):
    monkeypatch.setattr(sb, "PRIVATE_TMP", "/private-tmp")  # tmp_path lies under the real one
    home = tmp_path / "home"
    ws = home / "proj" / "ws"
    data = ws / ".mlxterm"  # a hidden path inside the workspace is hidden after its bind
    venv = home / "venv"
    for d in (ws, data, venv):
        d.mkdir(parents=True)
    args = bwrap_args(SandboxPolicy(hide=(str(data),), read_only=(str(venv),)), ws, str(home))
    joined = " ".join(args)
    assert "--unshare-all" in args and "--die-with-parent" in args and "--share-net" not in args
    assert "--cap-drop ALL" in joined and "--ro-bind / /" not in joined
    assert "--tmpfs /private-tmp" in joined and "--tmpfs /dev/shm" in joined
    # home, the project dir beside the workspace: never mounted, so never hidden either
    assert f"--tmpfs {home} " not in joined and f" {home / 'proj'} {home / 'proj'} " not in joined
    assert f"--perms 0711 --dir {home / 'proj'}" in joined  # passable, not listable
    order = [args.index(x) for x in (str(venv), str(ws), str(data))]  # shallowest first
    assert order == sorted(order), args
    assert args[args.index("--bind") + 1] == str(ws) and args[args.index("--chdir") + 1] == str(ws)
    assert args[args.index(str(data)) - 1] == "--tmpfs"
    assert args.index("--remount-ro") > args.index(str(data))
    networked = bwrap_args(SandboxPolicy(network=True), ws, str(home))
    resolv = os.path.realpath("/etc/resolv.conf")
    assert "--share-net" in networked
    if os.path.exists(resolv) and not resolv.startswith("/etc/"):  # a link into /run: bound itself
        assert networked[networked.index(resolv) - 1] == "--ro-bind"


def test_bwrap_arguments_for_root_drop_to_an_unprivileged_uid(tmp_path):
    status = SandboxStatus("bwrap", "x", "rlimit", run_as=(65534, 65534))
    args = bwrap_args(SandboxPolicy(), tmp_path, None, status)
    assert "--unshare-user" not in args and "--unshare-all" not in args and "--unshare-net" in args
    assert args[args.index("--cap-drop") + 1] == "ALL"
    assert {args[i + 1] for i, a in enumerate(args) if a == "--cap-add"} == {"CAP_SETUID", "CAP_SETGID", "CAP_SETPCAP"}
    drop = sb._drop_args(status)
    assert drop[1:] == ["--reuid=65534", "--regid=65534", "--clear-groups", "--inh-caps=-all",
                        "--bounding-set=-all", "--"]
    assert sb._drop_args(SandboxStatus("bwrap", "x")) == []


def test_seatbelt_profile_text():
    policy = SandboxPolicy(hide=("/Users/me/.mlxterm",), read_only=("/opt/venv",))
    text = seatbelt_profile(policy, Path("/Users/me/proj"), "/Users/me", "/private/tmp/x")
    lines = text.splitlines()
    assert lines[0] == "(version 1)" and lines[1] == "(deny default)"
    deny = next(line for line in lines if line.startswith("(deny file-read*"))
    assert '(subpath "/Users/me")' in deny and '(subpath "/Users/me/.mlxterm")' in deny
    allow_read = lines.index(next(line for line in lines if line.startswith("(allow file-read* (subpath")))
    assert allow_read > lines.index(deny)  # later rules win: the workspace is readable again
    write = next(line for line in lines if line.startswith("(allow file-write*"))
    assert write.startswith('(allow file-write* (subpath "/Users/me/proj") (subpath "/private/tmp/x") ')
    assert write.count("/Users") == 1
    assert '(literal "/Users/me")' in text  # the way down to the workspace: metadata only
    assert "(allow network*)" not in text and '(remote ip "localhost:*")' in text
    assert "(allow network*)" in seatbelt_profile(SandboxPolicy(network=True), Path("/tmp"), None, "/t")
    quoted = seatbelt_profile(SandboxPolicy(), Path("/tmp"), '/Users/a"b\\c', "/t")
    assert '(subpath "/Users/a\\"b\\\\c")' in quoted


SELENIUM_CHECK = """
import http.server, threading, sys
from functools import partial
from selenium import webdriver
from selenium.webdriver.chrome.service import Service
from selenium.webdriver.common.by import By

handler = partial(http.server.SimpleHTTPRequestHandler, directory=".")
server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
threading.Thread(target=server.serve_forever, daemon=True).start()
options = webdriver.ChromeOptions()
for arg in ("--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage"):
    options.add_argument(arg)
driver = webdriver.Chrome(options=options, service=Service(sys.argv[1]))
try:
    driver.get(f"http://127.0.0.1:{server.server_port}/board.html")
    driver.find_element(By.ID, "add").click()
    print("CARDS", len(driver.find_elements(By.CLASS_NAME, "card")))
finally:
    driver.quit()
"""


@needs_bwrap
@pytest.mark.skipif(CHROMIUM is None or shutil.which("chromedriver") is None,
                    reason="chromium/chromium-driver not installed (setup.sh --test installs them)")
def test_a_selenium_check_drives_chromium_inside_the_sandbox(layout):
    pytest.importorskip("selenium", reason="selenium is a test extra (setup.sh --test installs it)")
    import sys

    ws, _ = layout
    (ws / "board.html").write_text(
        "<div id=cards></div><button id=add onclick=\"let d=document.createElement('div');"
        "d.className='card';document.getElementById('cards').appendChild(d)\">add</button>")
    (ws / "check_board.py").write_text(SELENIUM_CHECK)
    run_line = f"{sys.executable} check_board.py {shutil.which('chromedriver')}"
    record = run_check(Check("board", run_line, 120), ws, agent_sandbox(status=STATUS))
    assert record["passed"] and "CARDS 1" in record["output"], record["output"]


# -- the agent loop ---------------------------------------------------------------------------

def _agent_run(tmp_path, profile_bash: str, command: str):
    from engine.sessions import SessionStore

    from agents.events import ApprovalNeeded, ToolFinished
    from agents.protocol import format_call
    from agents.scripted import ScriptedEngine, scripted_profile
    from agents.session import AgentOptions, AgentSession

    ws = tmp_path / "agent-ws"
    ws.mkdir()
    engine = ScriptedEngine([format_call("bash", {"command": command}), "done"],
                            profile=scripted_profile(approval={"bash": profile_bash}))
    store = SessionStore()
    agent = AgentSession.create(engine, store, ws, options=AgentOptions(system_prompt="t", examples=False))
    asked, finished = [], []
    for ev in agent.run("go"):
        if isinstance(ev, ApprovalNeeded):
            asked.append(ev)
            ev.approve()
        elif isinstance(ev, ToolFinished):
            finished.append(ev)
    tool_msg = [m for m in store.messages(agent.session_id) if m.role == "tool"][0]
    return agent, asked, finished[0], tool_msg


@needs_bwrap
def test_agent_bash_runs_sandboxed_and_says_so(tmp_path):
    from engine import paths

    (paths.data_dir() / "marker.txt").write_text("PRIVATE DATA")
    agent, asked, done, msg = _agent_run(tmp_path, "allow", f"cat {paths.data_dir()}/marker.txt; echo ran")
    assert not asked and done.result.data["sandboxed"] and msg.meta["sandboxed"] is True
    assert "ran" in done.result.content and "PRIVATE DATA" not in done.result.content
    assert agent.describe()["sandbox"]["active"] and agent.describe()["approval"]["bash"] == "allow"


def test_agent_without_a_sandbox_asks_for_every_bash_call(tmp_path, monkeypatch):
    monkeypatch.setattr(sb, "_probed", OFF)
    monkeypatch.setattr(sb, "_warned", False)
    agent, asked, done, msg = _agent_run(tmp_path, "allow", "echo ran")
    assert len(asked) == 1 and done.approval == "once"  # the profile said allow; it asked anyway
    assert done.result.data["sandboxed"] is False and msg.meta["sandboxed"] is False
    assert agent.sandbox_notice and "without a sandbox" in agent.sandbox_notice
    assert agent.describe()["sandbox"] == {"backend": "none", "active": False, "network": False,
                                           "detail": "unavailable: test: no sandbox"}
    (tmp_path / "b").mkdir()
    again, asked2, _, _ = _agent_run(tmp_path / "b", "allow", "echo")
    assert again.sandbox_notice is None and len(asked2) == 1  # said once; still asks


def test_doctor_says_which_uid_the_sandbox_uses():
    from app.commands import doctor

    fact = doctor.sandbox()
    if STATUS.backend == "bwrap":
        expected = STATUS.run_as[0] if os.geteuid() == 0 else os.getuid()
        assert fact["uid"] == expected and f"uid {expected}" in fact["detail"] and fact["uid"] != 0
    else:
        assert fact["uid"] is None


@needs_bwrap
def test_doctor_says_whether_landlock_and_which_cgroups_apply_and_why_not(monkeypatch):
    from app.commands import doctor
    from tools import landlock

    fact = doctor.sandbox()
    assert fact["landlock"] == (landlock.unavailable_reason() is None)
    assert ("Landlock write rules: on" in fact["detail"]) == fact["landlock"]
    assert (fact["landlock_helper"] is not None) == fact["landlock"]
    if os.geteuid() == 0:
        assert fact["cgroup"] in ("v1", "v2", None) and fact["cgroup_note"]
        assert fact["cgroup_note"] in fact["detail"]
    assert fact["workspace_cap"] == sb.Limits().workspace_bytes and "workspace cap" in fact["detail"]
    monkeypatch.setenv("MLXTERM_WORKSPACE_CAP", "-3")
    bad = doctor.sandbox()
    assert not bad["ok"] and "MLXTERM_WORKSPACE_CAP must be a positive size" in bad["detail"]
    monkeypatch.delenv("MLXTERM_WORKSPACE_CAP")
    monkeypatch.setenv("MLXTERM_SANDBOX", "no-landlock")
    monkeypatch.setattr(sb, "_probed", None)
    off = doctor.sandbox()
    monkeypatch.setattr(sb, "_probed", None)
    assert not off["landlock"] and off["landlock_off"] == "turned off by MLXTERM_SANDBOX=no-landlock"
    assert "Landlock write rules: OFF (turned off by MLXTERM_SANDBOX=no-landlock)" in off["detail"]


@needs_bwrap
def test_without_libseccomp_the_sandbox_runs_and_says_the_filter_is_off(layout, monkeypatch):
    from tools import seccomp

    def missing():
        raise seccomp.SeccompUnavailable("libseccomp's Python bindings are not usable (test)")

    monkeypatch.setattr(seccomp, "program", missing)
    status = sb._probe()
    assert status.available and status.seccomp_off and "seccomp filter: OFF (libseccomp" in status.describe()
    out = run("grep Seccomp: /proc/self/status; echo ran", layout[0], Sandbox(SandboxPolicy(), status))
    assert out["exit_code"] == 0 and out["stdout"] == "Seccomp:\t0\nran\n", out
    assert "seccomp filter: on" in STATUS.describe()  # here the library is there: the filter is on


def test_the_seccomp_program_is_handed_to_bwrap_whole_on_a_fresh_descriptor():
    from tools import seccomp

    assert seccomp.unavailable_reason() is None  # setup.sh installs libseccomp2 and pyseccomp
    program = seccomp.program()
    assert program and len(program) % 8 == 0  # whole BPF instructions
    fds = [seccomp.program_fd() for _ in range(2)]
    try:
        assert fds[0] != fds[1] and [os.read(fd, 1 << 16) for fd in fds] == [program, program]
    finally:
        for fd in fds:
            os.close(fd)


def test_workspace_usage_counts_blocks_once_per_inode_and_bounds_without_a_walk(tmp_path):
    from tools import space

    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "a").write_bytes(b"x" * 100_000)
    os.link(tmp_path / "d" / "a", tmp_path / "b")  # a hard link: counted once
    (tmp_path / "l").symlink_to("/usr")  # a symlink: not followed
    one = os.stat(tmp_path / "d" / "a").st_blocks * 512
    size = space.measure(str(tmp_path))
    assert one <= size < one + 64 * 1024
    assert space.bound(str(tmp_path)) >= size  # from the filesystem counter, never below the walk
    (tmp_path / "c").write_bytes(b"y" * 200_000)
    assert space.bound(str(tmp_path)) >= space.usage(str(tmp_path))


def test_limits_from_a_task_mapping_and_bad_values(monkeypatch):
    lim = sb.Limits.from_mapping({"workspace_bytes": 1 << 30, "cpus": 2, "processes": 64})
    assert (lim.workspace_bytes, lim.cpus, lim.processes) == (1 << 30, 2.0, 64)
    with pytest.raises(ValueError, match="unknown sandbox limit 'disk'"):
        sb.Limits.from_mapping({"disk": 1})
    with pytest.raises(ValueError, match="must be a positive number"):
        sb.Limits.from_mapping({"workspace_bytes": -1})
    monkeypatch.setenv("MLXTERM_WORKSPACE_CAP", "1.5G")
    assert sb.Limits().workspace_bytes == 3 << 29
    monkeypatch.setenv("MLXTERM_WORKSPACE_CAP", "lots")
    with pytest.raises(ValueError, match="MLXTERM_WORKSPACE_CAP must be a positive size"):
        sb.Limits()
    monkeypatch.delenv("MLXTERM_WORKSPACE_CAP")
    assert sb.Limits().workspace_bytes == 8 << 30
    # the per-file limit is never above the workspace cap
    assert "ulimit -f 1024 " in sb.limits_wrapper(sb.Limits(workspace_bytes=1 << 20))


# -- cgroup v2 (file writes against a fake tree; the mechanics for real where a v2 mount is writable)

HYBRID = """25 30 0:23 / /sys/fs/cgroup ro,nosuid - tmpfs tmpfs ro,mode=755
41 31 0:38 / /sys/fs/cgroup/unified rw,relatime - cgroup2 cgroup2 rw
42 25 0:39 / /sys/fs/cgroup/pids rw,relatime - cgroup cgroup rw,pids
"""
PURE_V2 = "35 24 0:30 / /sys/fs/cgroup rw,nosuid,nodev,noexec,relatime shared:9 - cgroup2 cgroup2 rw,nsdelegate\n"


def _fake_group(path: Path, controllers: str, enabled: str, procs: str) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    (path / "cgroup.controllers").write_text(controllers + "\n")
    (path / "cgroup.subtree_control").write_text(enabled + "\n")
    (path / "cgroup.procs").write_text(procs)
    return path


def test_v2_mount_and_own_group_are_read_from_proc():
    assert cgroups.v2_mount(HYBRID) == "/sys/fs/cgroup/unified"
    assert cgroups.v2_mount(PURE_V2) == "/sys/fs/cgroup"
    assert cgroups.v2_mount(HYBRID.splitlines()[0]) is None
    assert cgroups.v2_own("/sys/fs/cgroup", "12:pids:/x\n0::/system.slice/a.service\n") == "/sys/fs/cgroup/system.slice/a.service"
    assert cgroups.v2_own("/sys/fs/cgroup/unified", "0::/\n") == "/sys/fs/cgroup/unified"
    assert cgroups.v2_own("/sys/fs/cgroup", "4:memory:/x\n") is None


def test_v2_parent_enables_controllers_or_says_why_not(tmp_path, monkeypatch):
    ready = _fake_group(tmp_path / "ready", "cpuset cpu io memory pids", "cpu memory pids", "")
    assert cgroups.v2_parent(str(ready), pid=7) == (str(ready), f"v2 groups under {ready}")
    no_pids = _fake_group(tmp_path / "nopids", "hugetlb", "", "1\n")
    parent, note = cgroups.v2_parent(str(no_pids), pid=1)
    assert parent is None and "pids controller is not in the v2 hierarchy" in note
    # the kernel refuses controllers for a group with processes (EBUSY): alone in it, mlxterm
    # moves into a leaf and tries again; with others beside it, it gives up and says why
    calls = []

    def busy_once(path, controllers):
        calls.append(list(controllers))
        return "Device or resource busy" if len(calls) == 1 else None

    monkeypatch.setattr(cgroups, "enable", busy_once)
    alone = _fake_group(tmp_path / "alone", "cpu memory pids", "", "7\n")
    parent, note = cgroups.v2_parent(str(alone), pid=7)
    assert parent == str(alone) and "moved into mlxterm-host" in note
    assert (alone / "mlxterm-host" / "cgroup.procs").read_text() == "7" and calls[0] == ["pids", "memory", "cpu"]
    calls.clear()
    shared = _fake_group(tmp_path / "shared", "cpu memory pids", "", "7\n8\n")
    parent, note = cgroups.v2_parent(str(shared), pid=7)
    assert parent is None and "other processes share it" in note and not (shared / "mlxterm-host").exists()


def test_v2_group_writes_every_limit_and_joins_before_exec(tmp_path):
    parent = _fake_group(tmp_path / "p", "cpu memory pids", "cpu memory pids", "")
    lim = sb.Limits(processes=77, memory_bytes=3 << 30, cpus=1.5)
    group = cgroups.V2Group.create(lim, str(parent))
    assert group is not None and Path(group.path).parent == parent
    files = {name: (Path(group.path) / name).read_text() for name in ("pids.max", "memory.max", "memory.swap.max", "cpu.max")}
    assert files == {"pids.max": "77", "memory.max": str(3 << 30), "memory.swap.max": "0", "cpu.max": "150000 100000"}
    argv = group.wrap(["bwrap", "x"])
    assert argv[:4] == ["/bin/sh", "-c", 'echo 0 > "$0" && exec "$@"', f"{group.path}/cgroup.procs"] and argv[4:] == ["bwrap", "x"]
    # only pids enabled: no memory or cpu files written; pids missing: no group at all
    only = _fake_group(tmp_path / "only", "pids", "pids", "")
    g2 = cgroups.V2Group.create(lim, str(only))
    assert g2 is not None and sorted(p.name for p in Path(g2.path).iterdir()) == ["pids.max"]
    assert cgroups.V2Group.create(lim, str(_fake_group(tmp_path / "none", "memory", "memory", ""))) is None


def test_root_picks_v2_then_v1_then_rlimits_and_says_which(monkeypatch):
    monkeypatch.setattr(cgroups, "cgroup_v2", lambda: ("/cg", "v2 groups under /cg"))
    assert cgroups.choice()["cgroup"] == "v2"
    monkeypatch.setattr(cgroups, "cgroup_v2", lambda: (None, "the pids controller is not in the v2 hierarchy"))
    monkeypatch.setattr(cgroups, "pids_v1_root", lambda: "/sys/fs/cgroup/pids")
    choice = cgroups.choice()
    assert choice["cgroup"] == "v1" and "not v2: the pids controller" in choice["cgroup_note"]
    monkeypatch.setattr(cgroups, "pids_v1_root", lambda: None)
    choice = cgroups.choice()
    assert choice["process_limit"] == "rlimit" and choice["cgroup_note"].startswith("rlimits only")


def _writable_v2() -> str | None:
    mount = cgroups.v2_mount()
    own = cgroups.v2_own(mount) if mount else None
    return own if own and os.geteuid() == 0 and os.access(own, os.W_OK) else None


@pytest.mark.skipif(_writable_v2() is None, reason="system lacks: a cgroup v2 hierarchy root may write")
def test_a_real_v2_group_is_joined_before_the_command_and_removed_after(tmp_path):
    """On this machine's own v2 hierarchy (whatever controllers it has): the command runs in the
    fresh group, and remove() ends what is left inside (cgroup.kill) and deletes the group."""
    own = _writable_v2()
    group = cgroups.V2Group(os.path.join(own, f"mlxterm-test-{os.getpid()}"))
    os.mkdir(group.path)
    try:
        argv = group.wrap(["/bin/sh", "-c", "cat /proc/self/cgroup; sleep 60 >/dev/null 2>&1 & echo started"])
        out = subprocess.run(argv, capture_output=True, text=True, timeout=20).stdout
        rel = "/" + os.path.relpath(group.path, cgroups.v2_mount())
        assert f"0::{rel}\n" in out and "started" in out
        assert (Path(group.path) / "cgroup.procs").read_text().split()  # the sleep is still in there
    finally:
        group.remove()
    assert not os.path.exists(group.path)
