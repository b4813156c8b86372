"""Red team: escapes that worked through ``agents.checks.agent_sandbox()`` as root, each run as
a real command through the real sandbox and asserted to fail; and the normal work an agent or
a check does, asserted to still succeed.

CI runs this as root, where bubblewrap used to keep nearly every capability inside. The layout
lies outside ``/tmp`` (under ``/var/lib`` for root), so "two levels above the workspace" is a
real host directory and not just the private ``/tmp``. Every escape test first makes sure the
thing it reaches for exists on the host (the control), so a test cannot pass because the
target was missing. Tests that only mean something for root skip elsewhere with a reason that
states that fact (CI strict mode accepts it).
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import stat
import subprocess
import sys
import tempfile
from dataclasses import replace
from pathlib import Path

import pytest

from agents.checks import agent_sandbox, run_check
from agents.taskfile import Check
from tests.ci_strict import sandbox_skip_reason
from tools import cgroups, default_registry, landlock, settings
from tools import sandbox as sb
from tools.bash import execute

STATUS = sb.probe()
ROOT = os.geteuid() == 0
needs_bwrap = pytest.mark.skipif(
    STATUS.backend != "bwrap",
    reason=sandbox_skip_reason(STATUS),
)
needs_root = pytest.mark.skipif(not ROOT, reason="system lacks: root (this escape needs a root mlxterm)")
pytestmark = needs_bwrap

SECRET = "app data secret 7d1c"
COUSIN = "cousin file 4b2e"


@pytest.fixture
def base(tmp_path):
    """A host directory outside /tmp (root: under /var/lib) holding the whole layout."""
    if ROOT:
        path = Path(tempfile.mkdtemp(prefix="mlxterm-redteam-", dir="/var/lib"))
        path.chmod(0o755)  # like most project directories: the cousin is readable on the host
        yield path
        shutil.rmtree(path, ignore_errors=True)
    else:
        yield tmp_path


@pytest.fixture
def ws(base):
    """base/cousin.txt, base/a/ws (the workspace): the cousin is two levels above."""
    (base / "cousin.txt").write_text(COUSIN)
    root = base / "a" / "ws"
    root.mkdir(parents=True)
    return root


@pytest.fixture
def app_data(monkeypatch):
    """mlxterm's data with a secret in it; for root under /root, where it usually lives."""
    from engine import paths

    home = Path(tempfile.mkdtemp(prefix=".mlxterm-redteam-", dir="/root")) if ROOT else None
    if home is not None:
        monkeypatch.setenv("MLXTERM_HOME", str(home))
    data = paths.data_dir()
    data.mkdir(parents=True, exist_ok=True)
    (data / "secret").write_text(SECRET)
    yield data
    if home is not None:
        shutil.rmtree(home, ignore_errors=True)


def bash(command: str, ws: Path, timeout: float = 60, **env: str) -> dict:
    """``command`` as the agent's bash tool and a check run it: through agent_sandbox()."""
    data = execute(command, ws, timeout, None, agent_sandbox(), extra_env=env or None)
    assert data["sandboxed"] and data["sandbox"] == "bwrap"
    return data


# -- escapes ----------------------------------------------------------------------------------

def test_no_capabilities_no_root_and_no_new_privileges_inside(ws):
    out = bash("id -u; id -G; grep -E '^(CapInh|CapPrm|CapEff|CapBnd|CapAmb|NoNewPrivs):' /proc/self/status", ws)
    lines = out["stdout"].split("\n")
    uid, groups, status = lines[0], lines[1], dict(line.split(":\t") for line in lines[2:] if line)
    assert uid != "0" and "0" not in groups.split(), out
    if ROOT:
        assert (int(uid), int(groups)) == STATUS.run_as
    assert {k: int(v, 16) for k, v in status.items() if k.startswith("Cap")} == dict.fromkeys(
        ("CapInh", "CapPrm", "CapEff", "CapBnd", "CapAmb"), 0), status
    assert status["NoNewPrivs"] == "1"


def test_unmounting_tmp_and_root_does_not_reveal_app_data(ws, app_data):
    assert (app_data / "secret").read_text() == SECRET  # the control: it is there on the host
    out = bash(f"umount -l /tmp; umount -l /root; cat {app_data}/secret; "
               f"unshare -Urm sh -c 'umount -l /tmp; umount -l /root; cat {app_data}/secret'", ws)
    assert SECRET not in out["stdout"], out


def test_remounting_the_root_read_write_does_not_reach_the_host(ws, base):
    target = base / "escaped.txt"
    usr_target = Path("/usr") / f"mlxterm-redteam-{os.getpid()}"
    out = bash(f"umount -l /tmp; mount -o remount,rw,bind /; mount -o remount,rw /usr; "
               f"echo x > {target}; echo x > {usr_target}; echo x > /etc/mlxterm-redteam", ws)
    try:
        assert not target.exists() and not usr_target.exists() and not Path("/etc/mlxterm-redteam").exists(), out
    finally:
        for p in (target, usr_target, Path("/etc/mlxterm-redteam")):
            p.unlink(missing_ok=True)


def test_host_processes_stay_invisible_even_after_unmounting_proc(ws):
    marker = f"redteam-host-proc-{os.getpid()}"
    host = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)", marker])
    try:
        out = bash("umount -l /proc; ps -eo args; ls /proc", ws)
        assert marker not in out["stdout"], out
    finally:
        host.kill()
        host.wait()


def test_the_pids_cgroup_cannot_be_remounted_or_raised(ws):
    out = bash("ls /sys/fs/cgroup && echo SYS_VISIBLE; mount -o remount,rw /sys/fs/cgroup/pids && echo REMOUNTED; "
               "mkdir -p /tmp/cg && mount -t cgroup -o pids none /tmp/cg && echo MOUNTED; "
               "test -e /tmp/cg/cgroup.procs && echo max > /tmp/cg/pids.max && echo RAISED; mount -t cgroup2 none /tmp/cg && echo MOUNTED2", ws)
    for word in ("SYS_VISIBLE", "REMOUNTED", "MOUNTED", "RAISED"):
        assert word not in out["stdout"], out


def test_no_setuid_binary_is_left_in_the_workspace(ws):
    out = bash("cp /bin/true ./rt && chmod 4755 rt && chmod g+s rt && mkdir d && chmod 2777 d "
               "&& ls -ln rt", ws)
    assert out["exit_code"] == 0, out  # it may make the file inside...
    st = os.lstat(ws / "rt")
    assert not st.st_mode & (stat.S_ISUID | stat.S_ISGID), oct(st.st_mode)  # ...but no setuid/gid is left
    assert (st.st_uid, st.st_gid) == (os.geteuid(), os.getegid())  # and it is the host user's again
    assert (os.lstat(ws / "d").st_uid, os.lstat(ws).st_uid) == (os.geteuid(), os.geteuid())


def test_two_levels_above_the_workspace_is_absent(ws, base):
    assert (ws / ".." / ".." / "cousin.txt").read_text() == COUSIN  # the control
    out = bash("cat ../../cousin.txt; cat ../cousin.txt; ls -a .. ../..; "
               f"cat {base}/cousin.txt; find / -name cousin.txt 2>/dev/null", ws)
    assert COUSIN not in out["stdout"] and "cousin.txt" not in out["stdout"], out
    assert "No such file or directory" in out["stderr"]


def test_a_host_unix_socket_outside_run_is_unreachable(ws, base):
    path = str(base / "host.sock")
    abstract = f"\0mlxterm-redteam-{os.getpid()}"
    servers = []
    for address in (path, abstract):
        server = socket.socket(socket.AF_UNIX)
        server.bind(address)
        server.listen(4)
        servers.append(server)
    probe = ("import socket, sys\nfor a in sys.argv[1:]:\n    s = socket.socket(socket.AF_UNIX)\n    try:\n"
             "        s.connect(a.replace('@', chr(0), 1)); print('CONNECTED', repr(a))\n"
             "    except OSError as e:\n        print('refused', e)\n")
    (ws / "probe.py").write_text(probe)
    try:
        control = subprocess.run([sys.executable, str(ws / "probe.py"), path, "@" + abstract[1:]],
                                 capture_output=True, text=True, timeout=30)
        assert control.stdout.count("CONNECTED") == 2, control  # the control: reachable on the host
        out = bash(f"python3 probe.py {path} @{abstract[1:]}; ls -la /run /var/run", ws)
        assert "CONNECTED" not in out["stdout"], out
    finally:
        for server in servers:
            server.close()


def test_host_secrets_in_the_environment_do_not_reach_commands(ws, monkeypatch):
    leaks = {"HTTPS_PROXY": "http://user:proxy-pw-1@proxy:3128", "https_proxy": "http://u:proxy-pw-2@p:1",
             "DB_DSN": "postgres://u:dsn-pw-3@db/x", "SENTRY_DSN": "https://sentry-key-4@o.ingest.sentry.io/1",
             "SMTP_PASS": "smtp-pw-5", "MYSQL_PWD": "mysql-pw-6", "CI_JOB_JWT": "jwt-7", "PYTHONPATH": "/pp-8"}
    for name, value in leaks.items():
        monkeypatch.setenv(name, value)
    out = bash("env", ws, MLXTERM_TASK_DIR="/task-dir-ok")
    for value in leaks.values():
        assert value not in out["stdout"], value
    assert "MLXTERM_TASK_DIR=/task-dir-ok" in out["stdout"] and f"HOME={ws}" in out["stdout"]
    record = run_check(Check("env", "env", 30), ws, agent_sandbox(), env={"MLXTERM_RUN_DIR": "/run-dir-ok"})
    assert record["passed"] and "MLXTERM_RUN_DIR=/run-dir-ok" in record["output"]
    assert not any(value in record["output"] for value in leaks.values())


def test_memory_is_capped_per_process_and_in_tmp_and_shm(ws):
    out = bash("ulimit -d unlimited && echo RAISED; "
               "python3 -c 'b = bytearray(5 << 30); print(\"ALLOCATED\")'; "
               "head -c 600M /dev/zero > /dev/shm/fill; head -c 600M /dev/zero > /tmp/fill; "
               "du -m /dev/shm/fill /tmp/fill; echo x > /dev/fill && echo DEV_WRITABLE; echo x > /fill && echo ROOT_WRITABLE",
               ws, timeout=120)
    assert "RAISED" not in out["stdout"] and "ALLOCATED" not in out["stdout"], out
    assert "MemoryError" in out["stderr"]
    assert out["stderr"].count("No space left on device") == 2
    sizes = [int(line.split()[0]) for line in out["stdout"].splitlines() if line.endswith("fill")]
    assert sizes and max(sizes) <= 512
    assert "DEV_WRITABLE" not in out["stdout"] and "ROOT_WRITABLE" not in out["stdout"]


SYSCALL_PROBE = """import ctypes, errno, json, socket, sys
libc = ctypes.CDLL(None, use_errno=True)
nr = json.loads(sys.argv[1])
def call(name, *args):
    ret = libc.syscall(nr[name], *args)
    return "ok" if ret >= 0 else errno.errorcode[ctypes.get_errno()]
def sock(family, kind):
    try:
        socket.socket(family, kind).close()
        return "ok"
    except OSError as e:
        return errno.errorcode[e.errno]
params = ctypes.create_string_buffer(120)
out = {"unshare": call("unshare", 0), "ptrace": call("ptrace", 0, 0, 0, 0),
       "add_key": call("add_key", b"user", b"mlxterm-redteam", b"x", 1, ctypes.c_long(-2)),
       "keyctl": call("keyctl", 0, ctypes.c_long(-2), 0),
       "io_uring_setup": call("io_uring_setup", 1, params), "bpf": call("bpf", 0, 0, 0),
       "perf_event_open": call("perf_event_open", 0, 0, -1, -1, 0),
       "clone_newuser": call("clone", 0x10000000 | 17, 0, 0, 0, 0),
       "netlink": sock(socket.AF_NETLINK, socket.SOCK_DGRAM), "packet": sock(socket.AF_PACKET, socket.SOCK_DGRAM)}
print(json.dumps(out))
"""


def test_the_seccomp_filter_denies_what_no_command_needs(ws):
    """Calls an unprivileged process may make (keyrings, ptrace on itself, unshare(0), netlink
    sockets) succeed with the filter off (the control) and are denied with it on."""
    import pyseccomp

    assert STATUS.seccomp_off is None, STATUS.describe()
    names = ("unshare", "ptrace", "add_key", "keyctl", "io_uring_setup", "bpf", "perf_event_open", "clone")
    numbers = json.dumps({n: pyseccomp.resolve_syscall(pyseccomp.system_arch(), n) for n in names})
    (ws / "probe.py").write_text(SYSCALL_PROBE)
    cmd = f"grep Seccomp: /proc/self/status; python3 probe.py '{numbers}'"
    on = bash(cmd, ws)
    box = agent_sandbox()
    control = execute(cmd, ws, 60, None, sb.Sandbox(box.policy, replace(STATUS, seccomp_off="control")))
    filtered, unfiltered = (json.loads(r["stdout"].splitlines()[-1]) for r in (on, control))
    assert on["stdout"].startswith("Seccomp:\t2") and control["stdout"].startswith("Seccomp:\t0"), (on, control)
    for name in ("unshare", "ptrace", "add_key", "keyctl", "netlink"):
        assert unfiltered[name] == "ok", unfiltered  # the control: allowed without the filter
    assert filtered == {**dict.fromkeys(filtered, "EPERM"), "netlink": "EAFNOSUPPORT", "packet": "EAFNOSUPPORT"}, filtered


@needs_root
def test_a_root_fork_bomb_hits_the_process_limit(ws):
    bomb = ("python3 -c \"import os, time\nwhile True:\n    try:\n        os.fork()\n"
            "    except OSError as e:\n        print('LIMIT', e, flush=True); time.sleep(600)\" redteam-bomb")
    box = agent_sandbox()
    box = sb.Sandbox(replace(box.policy, limits=sb.Limits(processes=48)), box.status)
    out = execute(bomb, ws, 6, None, box)
    assert "LIMIT" in out["stdout"] and out["timed_out"], out


@needs_root
@pytest.mark.skipif(cgroups.own_v1("memory") is None or STATUS.process_limit != "cgroup",
                    reason="system lacks: a cgroup v1 memory hierarchy root may write")
def test_a_root_call_has_a_total_memory_cap(ws):
    box = agent_sandbox()
    box = sb.Sandbox(replace(box.policy, limits=sb.Limits(memory_bytes=300 << 20)), box.status)
    hogs = "for i in 1 2 3; do python3 -c 'b = bytearray(200 << 20); import time; time.sleep(2)' & done; wait"
    out = execute(hogs, ws, 60, None, box)
    assert "Killed" in out["stderr"], out  # 3 x 200 MiB, each under RLIMIT_DATA, over 300 MiB in all


FORGE = """prompt: "x"
checks:
  - name: forge
    run: |
      for f in transcript.jsonl result.json quality.json; do
        echo FORGED > {run}/$f; echo FORGED > "$MLXTERM_RUN_DIR/../$f"; rm -f {run}/$f; done
      ls -la {run} "$MLXTERM_RUN_DIR/.." 2>&1
      mkdir -p "$MLXTERM_RUN_DIR/screenshots" && printf png > "$MLXTERM_RUN_DIR/screenshots/ok.png"
      ln -s {run}/transcript.jsonl "$MLXTERM_RUN_DIR/screenshots/t.png"
      printf '{{"passed": 1, "failed": 0, "blocked": 0, "total": 1, "categories": [
        {{"name": "a", "screenshot": "%s/screenshots/ok.png"}}, {{"name": "b", "screenshot": "%s/screenshots/t.png"}},
        {{"name": "c", "screenshot": "{run}/transcript.jsonl"}}]}}' "$MLXTERM_RUN_DIR" "$MLXTERM_RUN_DIR" > "$MLXTERM_RUN_DIR/quality.json"
"""


def test_a_check_cannot_forge_the_runs_transcript_result_or_quality(ws, base):
    """The run directory is never in the sandbox: a check writes only its evidence folder, and
    the host copies quality.json (and the screenshots inside that folder) out of it."""
    from agents.headless import HeadlessRun
    from agents.taskfile import load_task

    run = base / "run"
    run.mkdir()
    transcript = '{"type": "task", "step": 0}\n'
    (run / "transcript.jsonl").write_text(transcript)  # an earlier run's, which checks_only keeps
    (run / "result.json").write_text("{}")
    (run / "quality.json").write_text("host")
    (base / "t.yaml").write_text(FORGE.format(run=run))
    result = HeadlessRun(load_task(base / "t.yaml"), workspace=ws, run_dir=run).checks_only()
    check = result["checks"][0]
    assert result["status"] == "passed" and check["sandboxed"], check["output"]
    assert (run / "transcript.jsonl").read_text() == transcript and "FORGED" not in check["output"]
    # inside, the run directory is only the empty way down to the evidence folder
    listed = [line.split()[-1] for line in check["output"].splitlines() if line.startswith(("d", "-", "l"))]
    assert set(listed) == {".", "..", "evidence"}, check["output"]
    assert check["output"].count("Permission denied") == 6, check["output"]
    assert json.loads((run / "result.json").read_text()) == result
    quality = json.loads((run / "quality.json").read_text())  # the host's copy of the checks' own file
    assert result["quality"] == {"passed": 1, "failed": 0, "blocked": 0, "total": 1, "path": str(run / "quality.json")}
    assert [c["screenshot"] for c in quality["categories"]] == [str(run / "screenshots" / "ok.png"), None, None]
    assert (run / "screenshots" / "ok.png").read_bytes() == b"png"


def test_a_run_directory_inside_the_workspace_is_refused(ws):
    from engine.errors import MlxtermError

    from agents.headless import HeadlessRun
    from agents.taskfile import TaskSpec

    task = TaskSpec(ws.parent / "t.yaml", "t", "x")
    for run_dir in (ws / "runs" / "x", ws):
        with pytest.raises(MlxtermError, match="must lie outside the workspace"):
            HeadlessRun(task, workspace=ws, run_dir=run_dir)


def test_bash_and_checks_do_not_see_a_hidden_run_dir_inside_the_workspace(ws):
    """Evidence.protect() hides the run directory even where it lies inside a mounted path
    (a board whose cards folder sits in a workspace); the evidence folder inside stays writable."""
    from agents.evidence import Evidence

    run = ws / "cards" / "1"
    evidence = Evidence(run / "evidence", run)
    evidence.prepare()
    (run / "attempt-1.jsonl").write_text("host log")
    box = agent_sandbox(hide=evidence.protect())
    out = execute("cat cards/1/attempt-1.jsonl; echo FORGED > cards/1/attempt-1.jsonl; ls cards/1", ws, 30, None, box)
    assert "host log" not in out["stdout"] and (run / "attempt-1.jsonl").read_text() == "host log", out
    record = run_check(Check("write", 'echo e > "$MLXTERM_RUN_DIR/e" && cat cards/1/attempt-1.jsonl', 30), ws,
                       agent_sandbox(), evidence=evidence)
    assert not record["passed"] and "host log" not in record["output"], record
    assert (evidence.folder / "e").read_text() == "e\n" and (run / "attempt-1.jsonl").read_text() == "host log"


@needs_root
@pytest.mark.skipif(cgroups.own_v1("cpu") is None or STATUS.process_limit != "cgroup",
                    reason="system lacks: a cgroup v1 cpu hierarchy root may write")
def test_a_root_call_gets_only_its_cpu_quota(ws):
    box = agent_sandbox()
    box = sb.Sandbox(replace(box.policy, limits=sb.Limits(cpus=0.2)), box.status)
    spin = ("python3 -c 'import time\nt = time.monotonic()\nwhile time.monotonic() - t < 1.5: pass\n"
            "print(round(time.process_time(), 2))'")
    out = execute(spin, ws, 60, None, box)
    assert out["exit_code"] == 0 and float(out["stdout"]) < 0.5, out  # ~0.3 s of CPU in 1.5 s, not 1.5 s


# -- normal work still works ------------------------------------------------------------------

UNITTEST = """import unittest

class T(unittest.TestCase):
    def test_sum(self):
        self.assertEqual(sum([1, 2, 3]), 6)
"""


def test_normal_work_succeeds_and_stays_the_host_users(ws):
    (ws / "test_tiny.py").write_text(UNITTEST)  # a file the host (the agent's write_file) made
    cmd = ("python3 -c 'print(6*7)' && mkdir -p src && printf 'x = 1\\n' > src/m.py && echo tmp > /tmp/t "
           "&& cat /tmp/t && \"$MLXTERM_PYTHON\" -m pip --version && git init -q . && git add -A "
           "&& git -c user.name=t -c user.email=t@t commit -qm init && git log --oneline | wc -l "
           "&& python3 -m unittest -q test_tiny 2>&1 | tail -1 && echo edited >> test_tiny.py && echo DONE")
    out = bash(cmd, ws, timeout=120, MLXTERM_PYTHON=sys.executable)
    assert out["exit_code"] == 0, out
    assert out["stdout"].startswith("42\ntmp\npip ") and "\n1\nOK\nDONE\n" in out["stdout"], out
    # what it made belongs to the host user, and the host's git accepts the repository
    for path in (ws / "src" / "m.py", ws / ".git" / "HEAD", ws / "test_tiny.py"):
        assert os.lstat(path).st_uid == os.geteuid(), path
    host_git = subprocess.run(["git", "-C", str(ws), "status", "--porcelain"], capture_output=True, text=True)
    assert host_git.returncode == 0 and "test_tiny.py" in host_git.stdout, host_git.stderr


def test_a_check_and_the_default_registry_run_normal_work(ws):
    (ws / "test_tiny.py").write_text(UNITTEST)
    record = run_check(Check("unit", "python3 -m unittest -q test_tiny", 60), ws, agent_sandbox())
    assert record["passed"] and record["sandboxed"], record["output"]
    result = default_registry(ws).run("bash", {"command": "echo hi > f && cat f && cat ../../cousin.txt"})
    assert result.data["sandboxed"] and "hi" in result.content and COUSIN not in result.content


def test_a_server_and_a_client_inside_one_call_still_talk(ws):
    out = bash("python3 -m http.server 8791 --bind 127.0.0.1 >/dev/null 2>&1 & "
               "for i in $(seq 50); do python3 -c \"import urllib.request as u; "
               "print(u.urlopen('http://127.0.0.1:8791/').status)\" 2>/dev/null && exit 0; sleep 0.2; done; exit 1", ws)
    assert out["exit_code"] == 0 and "200" in out["stdout"], out


# -- the workspace size cap -------------------------------------------------------------------

CAP = 24 << 20


def capped_sandbox(**limits) -> sb.Sandbox:
    box = agent_sandbox()
    return sb.Sandbox(replace(box.policy, limits=replace(box.policy.limits, workspace_bytes=CAP, **limits)), box.status)


def test_filling_the_disk_past_the_workspace_cap_is_stopped_and_reported(ws, base):
    """Many files each under the per-file limit, written as fast as the disk takes them: the call
    is killed soon after the workspace passes the cap, the agent is told why, nothing beside the
    workspace changed, and a following ``rm`` (which shrinks it) runs normally."""
    before = {p: p.read_bytes() for p in base.rglob("*") if p.is_file()}
    ws_ = default_registry(ws, sandbox=capped_sandbox())
    # bounded (800 MB) so that a broken cap fails this test instead of filling the disk
    result = ws_.run("bash", {"command": "for i in $(seq 200); do head -c 4000000 /dev/zero > f$i || exit 3; done",
                              "timeout_s": 120})
    assert not result.ok, result.content
    assert result.content.startswith("stopped: the workspace grew to"), result.content
    assert "past its size cap of 24.0 MiB" in result.content and "killed" in result.content
    assert result.data["over_cap_stopped"] and result.data["duration_ms"] < 60_000
    # stopped within a few polls of passing the cap: what a fast disk writes in well under a second
    from tools.space import usage
    assert CAP < usage(str(ws)) < CAP + (1 << 30)
    assert {p: p.read_bytes() for p in base.rglob("*") if p.is_file() and not p.is_relative_to(ws)} == before
    ok = ws_.run("bash", {"command": "rm -f f*; echo cleaned"})
    assert ok.ok and "cleaned" in ok.content and not ok.data["over_cap"], ok.content


def test_a_check_filling_its_evidence_folder_counts_against_the_cap(ws, base):
    evidence = base / "run" / "evidence"
    evidence.mkdir(parents=True)
    box = capped_sandbox()
    box = sb.Sandbox(replace(box.policy, writable=(str(evidence),)), box.status)
    data = execute(f"for i in $(seq 200); do head -c 4000000 /dev/zero > {evidence}/f$i || exit 3; done",
                   ws, 120, None, box)
    assert data["over_cap_stopped"] and "the folders this call may write grew to" in data["space"], data
    assert sum(p.stat().st_size for p in evidence.iterdir()) < 200 * 4_000_000


def test_a_check_that_ends_past_the_cap_does_not_pass(ws):
    """A check that leaves the workspace over the cap and exits 0 is recorded as failed: the
    host trusts check records, and a run that filled the disk did not do its job."""
    script = "head -c 15000000 /dev/zero > a; head -c 15000000 /dev/zero > b; exit 0"
    record = run_check(Check("fill", script, 60), ws, capped_sandbox())
    assert record["exit_code"] == 0 and not record["passed"], record
    assert "grew past its size cap" in record["output"], record["output"]


def test_a_tasks_own_sandbox_limits_cap_its_checks(ws, base):
    """``sandbox: {workspace_bytes: ...}`` in a task file reaches the sandbox its checks run in."""
    from agents.headless import HeadlessRun
    from agents.taskfile import load_task

    (base / "t.yaml").write_text(f"prompt: fill\nsandbox: {{workspace_bytes: {CAP}}}\nchecks:\n"
                                 "  - name: fill\n    run: head -c 30000000 /dev/zero > big; exit 0\n")
    result = HeadlessRun(load_task(base / "t.yaml"), workspace=ws, run_dir=base / "run").checks_only()
    check = result["checks"][0]
    assert check["sandboxed"] and not check["passed"], check
    assert (ws / "big").stat().st_size <= CAP


def test_one_file_past_the_workspace_cap_stops_in_the_kernel(ws):
    """RLIMIT_FSIZE is never above the cap: one big file stops at it, and the call says the
    workspace went over."""
    data = execute("head -c 60000000 /dev/zero > big; echo wrote $?", ws, 60, None, capped_sandbox())
    assert (ws / "big").stat().st_size <= CAP
    assert "File size limit exceeded" in data["stderr"]


def test_file_tools_refuse_a_write_past_the_cap_but_may_shrink(ws):
    reg = default_registry(ws, sandbox=capped_sandbox())
    big = "x" * (CAP // 2)
    assert reg.run("write_file", {"path": "a.txt", "content": big}).ok
    refused = reg.run("write_file", {"path": "b.txt", "content": big + "y"})
    assert not refused.ok and "write refused: the workspace would use" in refused.content
    assert "past its size cap of 24.0 MiB" in refused.content and not (ws / "b.txt").exists()
    # an edit that grows past the cap is refused too; one that shrinks a file always works
    (ws / "c.txt").write_text("z" * (7 << 20) + "END")
    grown = reg.run("edit_file", {"path": "c.txt", "old_text": "END", "new_text": "E" * (6 << 20)})
    assert not grown.ok and "write refused" in grown.content and (ws / "c.txt").read_text().endswith("zEND")
    assert reg.run("write_file", {"path": "a.txt", "content": "small"}).ok
    assert reg.run("write_file", {"path": "b.txt", "content": big}).ok


# -- Landlock ---------------------------------------------------------------------------------

needs_landlock = pytest.mark.skipif(
    landlock.abi() < landlock.MIN_ABI,
    reason=f"system lacks: Landlock ABI {landlock.MIN_ABI}+ in this kernel (it reports ABI {landlock.abi()})")


def _with_a_mount_mistake(monkeypatch, host: Path) -> None:
    """A future bug in the mount list: a host directory mounted read-write at /mistake."""
    real = sb.bwrap_args

    def mistaken(*args, **kwargs):
        out = real(*args, **kwargs)
        at = out.index("--remount-ro")
        return [*out[:at], "--bind", str(host), "/mistake", *out[at:]]

    monkeypatch.setattr(sb, "bwrap_args", mistaken)


@pytest.fixture(params=["c", "python"])
def helper(request, monkeypatch):
    """Each Landlock helper in turn: the built C one and the Python fallback."""
    if request.param == "python":
        monkeypatch.setattr(landlock, "_compiled", None)
    elif landlock.compiled_helper() is None:
        pytest.skip("system lacks: a C compiler to build the Landlock helper (the Python one runs instead)")
    return request.param


@needs_landlock
def test_landlock_keeps_a_host_directory_mounted_by_mistake_unwritable(ws, base, monkeypatch, helper):
    """The rules hold whatever is mounted: a world-writable host directory bound read-write by
    mistake is still not writable, while the same mistake without Landlock is (the control)."""
    assert STATUS.landlock_off is None, STATUS.describe()
    assert (len(landlock.helper()) > 1) == (helper == "python")  # the Python one runs with -I -S
    host = base / "host-dir"
    host.mkdir()
    host.chmod(0o777)
    _with_a_mount_mistake(monkeypatch, host)
    box = agent_sandbox()
    out = execute("echo x > /mistake/f; echo rc=$?; mkdir /mistake/d; ln -s /etc /mistake/l; ls -A /mistake", ws, 60, None, box)
    assert "rc=1" in out["stdout"] and "Permission denied" in out["stderr"], out
    assert list(host.iterdir()) == []
    control = sb.Sandbox(box.policy, replace(STATUS, landlock_off="off for the control"))
    out = execute("echo x > /mistake/f; echo rc=$?", ws, 60, None, control)
    assert "rc=0" in out["stdout"] and (host / "f").read_text() == "x\n"


@needs_landlock
def test_landlock_leaves_normal_writes_and_shell_signals_alone(ws, helper):
    """Workspace, /tmp, /dev/shm, moving files between directories (pip does), fifos, sockets,
    > /dev/null; and the helper's Python leaves no signal ignored for the command."""
    out = bash("""set -e; mkdir -p a b; echo 1 > a/x; mv a/x b/x; ln b/x b/h; ln -s b/x s; mkfifo p
        echo 2 > /tmp/t; mv /tmp/t /tmp/u; echo 3 > /dev/shm/v; echo 4 > /dev/null; : > b/x
        python3 -c 'import socket; socket.socket(socket.AF_UNIX).bind("sock")'
        grep SigIgn /proc/self/status; yes | head -c 3 >/dev/null; echo done""", ws)
    assert out["exit_code"] == 0 and "done" in out["stdout"], out
    assert "SigIgn:\t0000000000000000" in out["stdout"] and out["stderr"] == ""


def test_landlock_write_rights_follow_the_kernels_abi(monkeypatch):
    assert landlock.write_rights(2) & landlock.REFER and not landlock.write_rights(2) & landlock.TRUNCATE
    assert landlock.write_rights(5) & landlock.IOCTL_DEV and landlock.write_rights(3) & landlock.TRUNCATE
    monkeypatch.setenv("MLXTERM_SANDBOX", "no-landlock")
    assert sb._landlock_off(settings.sandbox()) == "turned off by MLXTERM_SANDBOX=no-landlock"
    monkeypatch.delenv("MLXTERM_SANDBOX")
    monkeypatch.setattr(landlock, "abi", lambda: 1)
    assert "ABI 1 forbids moving files" in landlock.unavailable_reason()
    monkeypatch.setattr(landlock, "abi", lambda: 0)
    assert "kernel has no Landlock" in landlock.unavailable_reason()
    status = replace(STATUS, landlock_off=landlock.unavailable_reason())
    assert "Landlock write rules: OFF (the kernel has no Landlock" in status.describe()
    assert sb._landlock_args(status, ["/w"]) == []
