"""One module per CLI subcommand; each exposes ``register(subparsers)``.

Modules import the engine lazily inside their handlers so ``mlxterm --help`` stays instant.
"""

import importlib

# Order is the order shown in ``mlxterm --help``.
COMMANDS = ("chat", "generate", "sessions", "models", "profile", "cache", "transcribe", "run", "board", "bench",
            "report", "doctor", "serve")


def register_all(subparsers) -> None:
    for name in COMMANDS:
        try:
            module = importlib.import_module(f"app.commands.{name}")
        except ModuleNotFoundError as e:
            if e.name == f"app.commands.{name}":
                continue  # command not built yet
            raise
        module.register(subparsers)
