"""Session-affine KV checkpoints: RAM and SSD tiers keyed by exact token prefixes.

See docs/checkpoints.md. ``open_store(profile, new_cache)`` builds the store a profile asks
for; ``CheckpointStore.acquire`` / ``release`` slot into the engine's prompt cache.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from engine import paths
from engine.checkpoints.fingerprint import Fingerprint, fingerprint_for_profile, make_fingerprint
from engine.checkpoints.format import CorruptCheckpoint
from engine.checkpoints.store import CheckpointStore, DurabilityReport, Restored

__all__ = [
    "CheckpointStore", "CorruptCheckpoint", "DurabilityReport", "Fingerprint", "Restored",
    "fingerprint_for_profile", "make_fingerprint", "open_store", "ssd_root",
]


def ssd_root(profile) -> Path:
    """The profile's ``cache.ssd_dir`` (relative to the profile file) or data_dir()/checkpoints."""
    value = profile.cache.ssd_dir
    if not value:
        return paths.data_dir() / "checkpoints"
    p = Path(value).expanduser()
    return p if p.is_absolute() else profile.base_dir / p


def open_store(profile, new_cache: Callable[[], list] | None,
               fingerprint: Fingerprint | None = None) -> CheckpointStore:
    """The checkpoint store ``profile`` configures (``new_cache`` None: SSD admin only)."""
    return CheckpointStore(
        fingerprint or fingerprint_for_profile(profile),
        new_cache,
        ram_bytes=profile.cache.ram_bytes,
        ssd_dir=ssd_root(profile),
        ssd_bytes=profile.cache.ssd_bytes,
        checkpoint_format=profile.kv_cache.checkpoint_format,
        group_size=profile.kv_cache.group_size,
    )
