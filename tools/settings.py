"""The agent tools' environment settings: the sandbox and the workspace cap, parsed here.

tools/ imports nothing from the engine, so these three names are not in engine/settings.py;
they follow its one on/off rule (``switch`` below is the same rule; tests/test_settings.py
checks that both agree) and stop with one line naming the variable for a value they cannot
read. docs/settings.md lists every ``MLXTERM_*`` name.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

ON = ("1", "on", "true", "yes")
OFF = ("0", "off", "false", "no")
NO_LANDLOCK = "no-landlock"
NOBODY = 65534  # nobody/nogroup: what a root mlxterm's sandboxed commands run as by default
DEFAULT_CAP = 8 << 30  # bytes a workspace may occupy on disk (Limits.workspace_bytes)
NAMES = ("MLXTERM_SANDBOX", "MLXTERM_SANDBOX_USER", "MLXTERM_WORKSPACE_CAP")


class SettingsError(ValueError):
    """An ``MLXTERM_*`` variable of the tools holds a value they cannot read."""


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
class Sandbox:
    """``MLXTERM_SANDBOX``: on (default), off, or ``no-landlock``."""

    enabled: bool = True
    """False (``off``): no sandbox for the agent's shell (every call then asks for approval)."""
    landlock: bool = True
    """False (``no-landlock``): no Landlock write rules; the mounts and seccomp still apply."""


def sandbox(env: Mapping[str, str] = os.environ) -> Sandbox:
    """The sandbox switch; a value other than the on/off words and ``no-landlock`` is an error."""
    value = env.get("MLXTERM_SANDBOX", "").strip().lower()
    if value == NO_LANDLOCK:
        return Sandbox(enabled=True, landlock=False)
    if value and value not in ON + OFF:
        raise SettingsError(f"MLXTERM_SANDBOX={env['MLXTERM_SANDBOX']!r}: use on, off or {NO_LANDLOCK}")
    return Sandbox(enabled=switch(env, "MLXTERM_SANDBOX"))


def sandbox_user(env: Mapping[str, str] = os.environ) -> tuple[int, int]:
    """``MLXTERM_SANDBOX_USER=uid[:gid]``: the uid/gid a root mlxterm runs sandboxed commands as
    (default nobody/nogroup, 65534; the gid defaults to the uid). Never 0."""
    raw = env.get("MLXTERM_SANDBOX_USER", "").strip()
    if not raw:
        return NOBODY, NOBODY
    uid_s, colon, gid_s = raw.partition(":")
    try:
        uid = int(uid_s)
        gid = int(gid_s) if colon else uid
    except ValueError:
        uid = gid = -1
    if uid <= 0 or gid <= 0:
        raise SettingsError(f"MLXTERM_SANDBOX_USER={raw!r}: use uid or uid:gid, positive numbers (never 0, root)")
    return uid, gid


def workspace_cap(env: Mapping[str, str] = os.environ) -> int:
    """``MLXTERM_WORKSPACE_CAP`` (bytes, or with a K/M/G/T suffix: ``20G``), else ``DEFAULT_CAP``."""
    raw = env.get("MLXTERM_WORKSPACE_CAP", "").strip()
    if not raw:
        return DEFAULT_CAP
    shift = {"K": 10, "M": 20, "G": 30, "T": 40}.get(raw[-1].upper(), 0)
    digits = raw[:-1] if shift else raw
    try:
        value = int(float(digits) * (1 << shift))
    except ValueError:
        value = 0
    if value <= 0:
        raise SettingsError(f"MLXTERM_WORKSPACE_CAP must be a positive size such as 20G or 500M, got {raw!r}")
    return value
