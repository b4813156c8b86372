"""The engine's environment settings: every ``MLXTERM_*`` variable the engine reads, parsed here.

One typed, frozen tree (``Settings``) with one docstring per field, one on/off rule (``switch``)
and a clear error for a value it cannot read. ``current()`` parses ``os.environ`` again only
when an ``MLXTERM_*`` variable changed, so tests that set one see it. The table of every name
(the agent sandbox and check variables included, read in tools/ and agents/) is docs/settings.md.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path

from engine.errors import MlxtermError

PREFIX = "MLXTERM_"
ON = ("1", "on", "true", "yes")
OFF = ("0", "off", "false", "no")
ISAS = ("avx2", "avxvnni", "avx512vnni")


class SettingsError(MlxtermError, ValueError):
    """An ``MLXTERM_*`` variable holds a value the engine cannot read."""


def switch(env: Mapping[str, str], name: str, default: bool = True) -> bool:
    """The one on/off rule: 1/on/true/yes, 0/off/false/no (any case), unset or empty: default."""
    value = env.get(name, "").strip().lower()
    if not value:
        return default
    if value in ON:
        return True
    if value in OFF:
        return False
    raise SettingsError(f"{name}={env[name]!r}: use one of {', '.join(ON + OFF)}")


@dataclass(frozen=True)
class Kernels:
    """The CPU kernel extension (engine/kernels), from ``MLXTERM_KERNELS``."""

    enabled: bool = True
    """False (``off``): MLX's own ops and the fp32 + OpenBLAS path, as on a machine without the build."""
    isa: str = ""
    """Instruction set the kernels may use: "" the best this CPU has; ``avx2``, ``avxvnni`` or
    ``avx512vnni`` narrow it (tests run every path on one CPU). Passed to the extension's
    ``configure()`` before its first kernel call."""


@dataclass(frozen=True)
class Blas:
    """OpenBLAS for MLX's CPU fp32 matmuls (engine/blas.py), from ``MLXTERM_OPENBLAS``."""

    enabled: bool = True
    """False (``off``): MLX's reference BLAS (slow)."""
    path: str | None = None
    """The library to load before any other candidate (a path); None: the system's usual places."""


@dataclass(frozen=True)
class Settings:
    """Every setting the engine reads from the environment."""

    home: Path | None = None
    """``MLXTERM_HOME``: one folder for data, config and cache (``data/``, ``config/``,
    ``cache/``) instead of the XDG directories; tests give each test its own."""
    kernels: Kernels = field(default_factory=Kernels)
    """``MLXTERM_KERNELS``: on (default), off, or an instruction set to narrow the kernels to."""
    blas: Blas = field(default_factory=Blas)
    """``MLXTERM_OPENBLAS``: on (default), off, or the path of the OpenBLAS library to load."""
    hugepages: bool = True
    """``MLXTERM_HUGEPAGES``: the mlxterm command re-executes itself once so glibc puts its heaps
    on transparent huge pages (engine/hugepages.py; decode 1.07-1.24x); off keeps 4 KiB pages."""
    gguf_cache: bool = True
    """``MLXTERM_GGUF_CACHE``: keep converted GGUF weights in the cache folder (one file read
    instead of seconds of conversion per load); off converts every time."""


NAMES = ("MLXTERM_HOME", "MLXTERM_KERNELS", "MLXTERM_OPENBLAS", "MLXTERM_HUGEPAGES", "MLXTERM_GGUF_CACHE")


def parse(env: Mapping[str, str]) -> Settings:
    """The settings an environment gives; raises SettingsError for an unreadable value."""
    home = env.get("MLXTERM_HOME", "").strip()
    return Settings(
        home=Path(home).expanduser() if home else None,
        kernels=_kernels(env),
        blas=_blas(env),
        # "reexec": set by engine.hugepages across its own re-exec (on), until ensure() removes it
        hugepages=env.get("MLXTERM_HUGEPAGES") == "reexec" or switch(env, "MLXTERM_HUGEPAGES"),
        gguf_cache=switch(env, "MLXTERM_GGUF_CACHE"),
    )


def _kernels(env: Mapping[str, str]) -> Kernels:
    value = env.get("MLXTERM_KERNELS", "").strip().lower()
    if value in ISAS:
        return Kernels(enabled=True, isa=value)
    if value and value not in ON + OFF:
        raise SettingsError(f"MLXTERM_KERNELS={env['MLXTERM_KERNELS']!r}: use on, off or one of {', '.join(ISAS)}")
    return Kernels(enabled=switch(env, "MLXTERM_KERNELS"))


def _blas(env: Mapping[str, str]) -> Blas:
    value = env.get("MLXTERM_OPENBLAS", "").strip()
    if value.lower() in ON + OFF + ("",):
        return Blas(enabled=switch(env, "MLXTERM_OPENBLAS"))
    return Blas(enabled=True, path=value)


_cache: dict[str, object] = {"key": None, "settings": None}


def current() -> Settings:
    """The settings of this process's environment, parsed again only when an ``MLXTERM_*``
    variable changed."""
    key = tuple(sorted((k, v) for k, v in os.environ.items() if k.startswith(PREFIX)))
    if _cache["key"] != key or _cache["settings"] is None:
        _cache["settings"] = parse(os.environ)
        _cache["key"] = key
    return _cache["settings"]  # type: ignore[return-value]


def describe(settings: Settings) -> dict[str, object]:
    """The settings as plain values (``mlxterm doctor``)."""
    out = asdict(settings)
    out["home"] = str(settings.home) if settings.home else None
    return out
