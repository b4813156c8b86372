"""Plain text for the UI: status-bar segments, relative times, sizes, safe model output."""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

# Model output is untrusted: C0/C1 control characters (escape sequences, backspaces...)
# would corrupt the terminal. Keep newlines and tabs.
_CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f]")


def clean(text: str) -> str:
    return _CONTROL.sub("", text)


def tokens(n: int) -> str:
    return f"{n:,}"


def size(n_bytes: int) -> str:
    mib = n_bytes / (1 << 20)
    return f"{mib / 1024:.2f} GiB" if mib >= 1024 else f"{mib:.0f} MiB"


def ago(then: float, now: float) -> str:
    """``just now``, ``5m ago``, ``3h ago``, ``2d ago`` (weeks and more as ``12w ago``)."""
    s = max(0.0, now - then)
    if s < 60:
        return "just now"
    for unit, length in (("w", 604800), ("d", 86400), ("h", 3600), ("m", 60)):
        if s >= length:
            return f"{int(s // length)}{unit} ago"
    return "just now"


def turn_summary(meta: Mapping[str, Any]) -> str:
    """One line about a finished turn from its stored meta (usage, timings, cache source).

    e.g. ``restored 8,123 tokens from SSD in 180 ms · TTFT 95 ms · 42.1 tok/s``
    """
    usage = meta.get("usage") or {}
    timings = meta.get("timings") or {}
    cache = meta.get("cache") or {}
    parts = []
    cached = int(usage.get("cached_tokens") or 0)
    source = str(cache.get("source") or "none")
    if cached and source == "server":  # a remote profile's server reused its own prefix cache
        parts.append(f"server reused {tokens(cached)}/{tokens(int(usage.get('prompt_tokens') or 0))} "
                     "prompt tokens")
    elif cached and source != "none":
        restore = float(cache.get("restore_ms") or timings.get("restore_ms") or 0.0)
        parts.append(f"restored {tokens(cached)} tokens from {source.upper()} in {restore:.0f} ms")
    else:
        parts.append(f"prefilled {tokens(int(usage.get('prompt_tokens') or 0))} tokens")
    if timings.get("ttft_ms") is not None:
        parts.append(f"TTFT {float(timings['ttft_ms']):.0f} ms")
    if timings.get("decode_tps") is not None:
        parts.append(f"{float(timings['decode_tps']):.1f} tok/s")
    spec = meta.get("speculation")
    if spec and spec.get("drafted"):
        parts.append(speculation_note(spec["accepted"], spec["drafted"]))
    return " · ".join(parts)


def speculation_note(accepted: int, drafted: int) -> str:
    """Acceptance of speculative drafts for the status bar, e.g. ``drafts 73% accepted``."""
    return f"drafts {accepted / drafted:.0%} accepted" if drafted else "drafting"


def done_meta(done) -> dict[str, Any]:
    """The meta dict ``turn_summary`` reads, from an engine ``Done`` event."""
    return {
        "usage": {"prompt_tokens": done.usage.prompt_tokens,
                  "cached_tokens": done.usage.cached_tokens,
                  "completion_tokens": done.usage.completion_tokens},
        "timings": {"ttft_ms": done.timings.ttft_ms, "decode_tps": done.timings.decode_tps,
                    "restore_ms": done.timings.restore_ms},
        "cache": {"source": done.cache_source, "restore_ms": done.timings.restore_ms},
        "speculation": done.speculation,
    }


def agent_step_summary(ev) -> str:
    """Status line after an agent step (an ``agents.events.StepDone``), e.g.
    ``agent · step 2 · cached 1,150/1,204 tokens (RAM) · TTFT 95 ms · 38.2 tok/s``."""
    parts = [f"agent · step {ev.step}"]
    if ev.cached_tokens and ev.cache_source != "none":
        parts.append(f"cached {tokens(ev.cached_tokens)}/{tokens(ev.prompt_tokens)} tokens "
                     f"({ev.cache_source.upper()})")
    else:
        parts.append(f"prefilled {tokens(ev.prompt_tokens)} tokens")
    if ev.ttft_ms:
        parts.append(f"TTFT {ev.ttft_ms:.0f} ms")
    if ev.decode_tps:
        parts.append(f"{ev.decode_tps:.1f} tok/s")
    return " · ".join(parts)


AGENT_OUTCOMES = {"answered": "answered", "cancelled": "cancelled", "error": "failed",
                  "max_steps": "hit the step limit", "max_tokens": "hit the token budget",
                  "wall_time": "hit the time limit", "context": "ran out of context"}


def agent_done_summary(done) -> str:
    """Status line after an agent run (an ``agents.events.AgentDone``)."""
    steps = f"{done.step} step{'s' if done.step != 1 else ''}"
    parts = [f"agent {AGENT_OUTCOMES.get(done.reason, done.reason)} after {steps}"]
    if done.prompt_tokens:
        parts.append(f"cached {tokens(done.cached_tokens)}/{tokens(done.prompt_tokens)} prompt "
                     f"tokens ({done.cached_ratio:.0%})")
    parts.append(f"{done.wall_s:.1f} s")
    return " · ".join(parts)


def process_rss() -> int:
    """Resident memory of this process in bytes (/proc on Linux, else the peak from resource)."""
    try:
        with open("/proc/self/status", encoding="ascii") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    import resource
    import sys

    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024  # bytes on macOS, KiB on Linux
