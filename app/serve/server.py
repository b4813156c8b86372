"""Binding and running the API under uvicorn, loopback unless an API key guards it.

``check_bind`` refuses a non-loopback address without a key. ``serve`` binds the socket
itself (so ``--port 0`` works and the real port is announced), runs uvicorn until SIGINT or
SIGTERM (in-flight replies get ``grace_s`` to finish, then are cancelled), and leaves closing
the engine, which writes pending checkpoints, to the caller.
"""

from __future__ import annotations

import contextlib
import ipaddress
import signal
import socket
import sys
import threading

from engine.errors import MlxtermError

from app.serve.app import ServerState, build_app

LOOPBACK_NAMES = ("localhost",)


def is_loopback(host: str) -> bool:
    if host in LOOPBACK_NAMES:
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def check_bind(host: str, api_key: str | None) -> None:
    if api_key is None and not is_loopback(host):
        raise MlxtermError(
            f"--host {host} exposes the model beyond this machine: set an API key with "
            "--api-key-env VAR (the key in $VAR), or bind 127.0.0.1"
        )


def bind(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    try:
        sock = socket.create_server((host, port), family=family, reuse_port=False)
    except OSError as e:
        raise MlxtermError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None
    sock.set_inheritable(True)
    return sock


def serve(state: ServerState, host: str, port: int, grace_s: float = 10.0, log_level: str = "warning") -> None:
    """Serve until interrupted (blocking)."""
    import uvicorn

    check_bind(host, state.api_key)
    sock = bind(host, port)
    real_port = sock.getsockname()[1]
    shown = f"[{host}]" if ":" in host else host
    config = uvicorn.Config(build_app(state), log_level=log_level, timeout_graceful_shutdown=grace_s,
                            lifespan="off", access_log=log_level in ("info", "debug"))
    server = _server_class(uvicorn)(config)
    engine = state.engine
    print(f"mlxterm serve: {engine.profile.name} ({engine.model_name}) on http://{shown}:{real_port}/v1"
          f"{' (API key required)' if state.api_key else ''}", flush=True)
    try:
        server.run(sockets=[sock])
    finally:
        sock.close()
    print("mlxterm serve: stopped", file=sys.stderr, flush=True)


def _server_class(uvicorn):
    class Server(uvicorn.Server):
        """uvicorn's server, except that SIGINT/SIGTERM are not raised again after the graceful
        shutdown: the caller still has the engine's checkpoints to write, then exits with 0."""

        @contextlib.contextmanager
        def capture_signals(self):
            if threading.current_thread() is not threading.main_thread():
                yield
                return
            sigs = (signal.SIGINT, signal.SIGTERM)
            originals = {sig: signal.signal(sig, self.handle_exit) for sig in sigs}
            try:
                yield
            finally:
                for sig, handler in originals.items():
                    signal.signal(sig, handler)

    return Server
