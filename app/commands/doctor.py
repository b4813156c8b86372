"""``mlxterm doctor``: what this machine gives mlxterm, in one screen.

The engine's environment settings (engine/settings.py, docs/settings.md), the agent sandbox
(bubblewrap / Seatbelt, or why not), the BLAS the CPU backend uses, the compiled kernels
extension, huge pages for the heap (engine/hugepages.py), espeak-ng (speech tests and voices)
and the microphone (PortAudio and an input device); with ``--profile P`` also the profile's
model server when P is a remote profile (``GET /v1/models`` within a few seconds). Every probe
is guarded: a missing piece is reported, never
raised. ``--json`` prints the same facts as one object. Exit code 0 (facts, not a verdict).
"""

from __future__ import annotations

import importlib
import json
import os
import shutil
from typing import Any


def register(sub) -> None:
    p = sub.add_parser("doctor", help="report the settings, sandbox, BLAS, kernels, huge pages, espeak and microphone status")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--profile", metavar="NAME|PATH", help="also check this profile's remote model server")
    p.set_defaults(func=run)


def run(args) -> int:
    facts = collect()
    if getattr(args, "profile", None):
        facts["remote"] = remote(args.profile)
    if args.json:
        print(json.dumps(facts, indent=2))
        return 0
    width = max(len(k) for k in facts)
    for name, fact in facts.items():
        mark = "ok " if fact["ok"] else "-- "
        print(f"{mark}{name.ljust(width)}  {fact['detail']}")
    return 0


def collect() -> dict[str, dict[str, Any]]:
    return {"settings": settings(), "sandbox": sandbox(), "openblas": openblas(), "kernels": kernels(), "hugepages": hugepages(),
            "espeak": espeak(), "microphone": microphone()}


def settings() -> dict[str, Any]:
    """The engine's ``MLXTERM_*`` settings as parsed (an unreadable value is reported)."""
    from engine import settings as engine_settings

    try:
        values = engine_settings.describe(engine_settings.current())
    except engine_settings.SettingsError as e:
        return {"ok": False, "values": None, "detail": str(e)}
    kernels, blas = values["kernels"], values["blas"]
    parts = [f"home {values['home'] or 'XDG directories'}",
             f"kernels {(kernels['isa'] or 'on') if kernels['enabled'] else 'off'}",
             f"openblas {(blas['path'] or 'on') if blas['enabled'] else 'off'}",
             f"hugepages {'on' if values['hugepages'] else 'off'}",
             f"gguf cache {'on' if values['gguf_cache'] else 'off'}"]
    return {"ok": True, "values": values, "detail": "; ".join(parts)}


def sandbox() -> dict[str, Any]:
    from tools.sandbox import probe
    from tools.settings import SettingsError

    try:
        status = probe()
    except SettingsError as e:  # an unreadable MLXTERM_SANDBOX or MLXTERM_SANDBOX_USER
        return {"ok": False, "workspace_cap": None, "backend": "none", "detail": str(e)}
    detail = status.describe()
    if not status.available:
        detail += ("; bash runs unconfined and every call asks for approval; checks are refused unless "
                   "a person allows it (mlxterm run --allow bash)")
    from tools import space

    try:
        cap = space.default_cap()
        detail += f"; workspace cap {space.human(cap)}"
    except ValueError as e:
        cap = None
        detail += f"; {e}"
    uid = None
    if status.backend == "bwrap":
        uid = status.run_as[0] if status.run_as is not None else os.getuid()
    return {"ok": status.available and cap is not None, "workspace_cap": cap, "backend": status.backend, "process_limit": status.process_limit,
            "cgroup": status.cgroup, "cgroup_note": status.cgroup_note or None, "uid": uid,
            "landlock": status.backend == "bwrap" and status.landlock_off is None,
            "landlock_off": status.landlock_off if status.backend == "bwrap" else None,
            "landlock_helper": _landlock_helper(status), "runs_as": status.identity() if status.available else None, "detail": detail}


def _landlock_helper(status) -> str | None:
    """Which program applies the Landlock rules: the built C helper or the Python fallback."""
    if status.backend != "bwrap" or status.landlock_off is not None:
        return None
    from tools import landlock

    built = landlock.compiled_helper()
    return built if built is not None else "python (no C compiler to build tools/landlock_helper.c)"


def openblas() -> dict[str, Any]:
    import engine  # noqa: F401  (loads OpenBLAS before MLX, like every engine user)
    from engine import blas

    state = blas.status()
    if state["path"]:
        return {"ok": True, "path": state["path"], "detail": f"loaded from {state['path']}"}
    return {"ok": False, "path": None, "detail": f"not loaded: {state['reason']}"}


def kernels() -> dict[str, Any]:
    """The compiled kernels extension (``engine.kernels``), when it is built here."""
    try:
        module = importlib.import_module("engine.kernels")
    except ImportError as e:
        return {"ok": False, "detail": f"not available ({e})"}
    except Exception as e:  # a broken build must show up here, not crash the report
        return {"ok": False, "detail": f"fails to import: {type(e).__name__}: {e}"}
    try:
        state = module.status()  # the runtime's own verdict: built is not the same as used
    except Exception as e:  # noqa: BLE001 (a broken build must show up here, not crash the report)
        return {"ok": False, "detail": f"status failed: {type(e).__name__}: {e}"}
    if not state.get("available"):
        return {"ok": False, "detail": f"not used: {state.get('reason')}"}
    return {"ok": True, "detail": f"used ({state.get('isa')}; {getattr(module, '__file__', None) or 'built in'})"}


def hugepages() -> dict[str, Any]:
    """Whether this process's heap is on transparent huge pages (set up by the mlxterm command)."""
    from engine import hugepages as pages

    state = pages.status()
    return {"ok": bool(state["active"]), "mode": state["mode"], "detail": f"{state['reason']} (system mode {state['mode']})"}


def espeak() -> dict[str, Any]:
    exe = shutil.which("espeak-ng") or shutil.which("espeak")
    if exe is None:
        return {"ok": False, "detail": "espeak-ng not found (apt-get install espeak-ng)"}
    return {"ok": True, "detail": exe}


def microphone() -> dict[str, Any]:
    try:
        from engine.speech.capture import default_input_device
        from engine.speech.errors import AudioInputError

        try:
            name = default_input_device()
        except AudioInputError as e:
            portaudio = "PortAudio missing" if "libportaudio2" in str(e) else "PortAudio present"
            return {"ok": False, "portaudio": portaudio == "PortAudio present", "detail": f"{portaudio}; {e}"}
    except Exception as e:  # never let a sound-stack problem hide the rest of the report
        return {"ok": False, "portaudio": False, "detail": f"cannot probe: {type(e).__name__}: {e}"}
    return {"ok": True, "portaudio": True, "detail": f"input device: {name}"}


REMOTE_PROBE_S = 5.0


def remote(profile_name: str, timeout: float = REMOTE_PROBE_S) -> dict[str, Any]:
    """Whether a remote profile's server answers ``GET /models`` within ``timeout`` seconds and
    lists the profile's model (a one-model server, such as llama.cpp's, may list another name
    and still answer to any)."""
    from engine.errors import MlxtermError
    from engine.profiles import load_profile
    from engine.serving.remote import RemoteChat

    try:
        profile = load_profile(profile_name)
    except MlxtermError as e:
        return {"ok": False, "base_url": None, "detail": str(e)}
    spec = profile.model.remote
    if spec is None:
        return {"ok": True, "base_url": None, "detail": f"profile {profile.name} runs its model here "
                "(no server to check)"}
    try:
        ids = RemoteChat(profile).models(timeout=timeout)
    except MlxtermError as e:
        return {"ok": False, "base_url": spec.base_url, "detail": str(e)}
    except Exception as e:  # a probe never crashes the report
        return {"ok": False, "base_url": spec.base_url, "detail": f"cannot probe: {type(e).__name__}: {e}"}
    served = spec.model in ids
    listed = ", ".join(str(i) for i in ids[:5]) or "none"
    detail = f"{spec.base_url} answers; serves {spec.model}" if served else (
        f"{spec.base_url} answers, but lists {listed}, not {spec.model}")
    return {"ok": True, "base_url": spec.base_url, "models": ids, "model_listed": served, "detail": detail}
