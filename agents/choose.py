"""Which profile agent work runs on by default: the best installed agent-capable one.

The chat default (SmolLM2-135M) cannot do agent tasks (it invents paths outside the
workspace), so cards, ``/agent`` and ``mlxterm run`` use profiles with ``agent.capable: true``
whose model is installed, the largest model first. When none is installed the error says which
command installs one.
"""

from __future__ import annotations

from engine.errors import ProfileError

SUGGESTED = "qwen2.5-coder-0.5b"


class NoAgentProfile(ProfileError):
    """No agent-capable profile has its model installed."""


def agent_profiles() -> list[tuple[str, int]]:
    """(name, model size in bytes) of every installed agent-capable profile, best first."""
    from engine.model import catalog
    from engine.profiles import check_profile, list_profiles

    out = []
    for info in list_profiles():
        result = check_profile(str(info.path))
        if not result.valid or result.profile is None or not result.profile.agent.capable:
            continue
        if result.model_path is None or any("model.source" in w for w in result.warnings):
            continue  # not installed
        source = result.profile.model.source
        if source in catalog.CATALOG:
            size = catalog.CATALOG[source].size
        else:
            p = result.model_path
            size = sum(f.stat().st_size for f in p.rglob("*") if f.is_file()) if p.is_dir() else p.stat().st_size
        out.append((info.name, int(size or 0)))
    return sorted(out, key=lambda t: (-t[1], t[0]))


def best_agent_profile() -> str:
    """The name of the best installed agent-capable profile; ``NoAgentProfile`` says how to
    install one when there is none."""
    found = agent_profiles()
    if not found:
        raise NoAgentProfile("no agent-capable profile is installed (the chat default cannot do agent tasks); "
                             f"install one with: mlxterm models install {SUGGESTED} (or pass --profile NAME)")
    return found[0][0]
