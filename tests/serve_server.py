"""A real ``mlxterm serve`` process on loopback for tests: started, announced, stopped."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from contextlib import contextmanager
from pathlib import Path

_ANNOUNCE = re.compile(r"on (http://\S+)/v1")
REPO = Path(__file__).resolve().parents[1]


class Server:
    def __init__(self, proc: subprocess.Popen, url: str, home: Path, lines: list[str]):
        self.proc = proc
        self.url = url  # http://127.0.0.1:PORT
        self.home = home
        self.lines = lines

    @property
    def base_url(self) -> str:
        return f"{self.url}/v1"

    def health(self) -> dict:
        with urllib.request.urlopen(f"{self.url}/health", timeout=10) as r:
            return json.loads(r.read())

    def wait_idle(self, timeout: float = 15.0) -> dict:
        """/health once no request is left in the engine."""
        return self.wait_for(lambda h: h["active"] == 0, timeout)

    def wait_for(self, ready, timeout: float = 15.0) -> dict:
        """/health once ``ready(health)`` holds (or the last reading after ``timeout``)."""
        end = time.monotonic() + timeout
        while True:
            h = self.health()
            if ready(h) or time.monotonic() > end:
                return h
            time.sleep(0.05)

    def stop(self, timeout: float = 60.0, sig: int = signal.SIGINT) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode


@contextmanager
def running_server(profile: Path | str, home: Path, *args: str, env: dict | None = None,
                   startup_s: float = 300.0):
    """``mlxterm serve --profile PROFILE --port 0 ARGS`` with $MLXTERM_HOME=home, yielding a Server."""
    full_env = {**os.environ, "MLXTERM_HOME": str(home), **(env or {})}
    proc = subprocess.Popen(
        [sys.executable, "-m", "app", "serve", "--profile", str(profile), "--port", "0", *args],
        cwd=REPO, env=full_env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )
    lines: list[str] = []
    found = threading.Event()
    url: list[str] = []

    def pump() -> None:
        for line in proc.stdout:
            lines.append(line)
            m = _ANNOUNCE.search(line)
            if m and not found.is_set():
                url.append(m.group(1))
                found.set()
        found.set()

    threading.Thread(target=pump, daemon=True).start()
    found.wait(startup_s)
    if not url:
        proc.kill()
        proc.wait()
        raise RuntimeError("mlxterm serve did not start:\n" + "".join(lines))
    server = Server(proc, url[0], home, lines)
    try:
        yield server
    finally:
        server.stop()


@contextmanager
def tiny_server(tmp_path_factory, tiny_llama_dir, name: str):
    """``mlxterm serve`` on loopback with the tiny random model and room for long replies (the
    remote-profile tests: plain chat, the TUI). Each module gets its own (a cold prefix cache)."""
    from tests.tiny_models import write_profile

    prof = write_profile(tmp_path_factory.mktemp(name) / "tiny.yaml", tiny_llama_dir,
                         context={"max_context": 4096})
    with running_server(prof, tmp_path_factory.mktemp(f"{name}-home")) as s:
        yield s
