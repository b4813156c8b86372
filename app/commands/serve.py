"""``mlxterm serve``: the engine behind an OpenAI-compatible HTTP API (see app/serve, docs/serving.md)."""

from __future__ import annotations


def register(sub) -> None:
    p = sub.add_parser("serve", help="serve a profile's model over an OpenAI-compatible HTTP API",
                       description="Serve /v1/chat/completions, /v1/completions, /v1/models and "
                       "/health. Loopback by default; any other address needs --api-key-env.")
    p.add_argument("--profile", metavar="NAME|PATH", help="profile name or YAML path (default: smollm2-135m)")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default: 127.0.0.1)")
    p.add_argument("--port", type=int, default=8080, help="port (default: 8080; 0 picks a free one)")
    p.add_argument("--api-key-env", metavar="VAR",
                   help="require 'Authorization: Bearer <key>' with the key read from $VAR")
    p.add_argument("--max-queue", type=int, default=64, metavar="N",
                   help="requests that may wait beyond the batch before new ones get 503 (default: 64)")
    p.add_argument("--grace", type=float, default=10.0, metavar="S",
                   help="seconds replies in flight may finish after SIGINT/SIGTERM (default: 10)")
    p.set_defaults(func=run)


def run(args) -> int:
    import os
    import sys

    from engine.errors import MlxtermError

    from app.serve.server import check_bind

    api_key = None
    if args.api_key_env:
        api_key = os.environ.get(args.api_key_env, "").strip()
        if not api_key:
            raise MlxtermError(f"--api-key-env {args.api_key_env}: ${args.api_key_env} is not set or empty")
    check_bind(args.host, api_key)  # before loading the model
    if not 0 <= args.port <= 65535:
        raise MlxtermError(f"--port {args.port}: expected 0-65535")
    if args.max_queue < 0:
        raise MlxtermError("--max-queue must be >= 0")

    from engine.runtime import Engine

    from app.serve.app import ServerState
    from app.serve.server import serve

    engine = Engine.load(args.profile)
    try:
        state = ServerState(engine, api_key=api_key, max_queue=args.max_queue)
        serve(state, args.host, args.port, grace_s=args.grace,
              log_level="info" if getattr(args, "verbose", False) else "warning")
        report = engine.flush_checkpoints(timeout=60)
        if not report.durable:
            print(f"mlxterm serve: checkpoints not all written: {report}", file=sys.stderr)
    finally:
        engine.close()
    return 0
