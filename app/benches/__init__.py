"""Benchmark scripts behind ``mlxterm bench NAME``: each writes JSON and compares arms in one run."""

from __future__ import annotations

import contextlib
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any


@contextlib.contextmanager
def scratch_profile(name: str, prefix: str, edit: Any = None) -> Iterator[Path]:
    """A copy of profile ``name`` (``NAME-bench``) in a fresh temporary folder, its SSD
    checkpoints in ``ssd/`` there, so a bench neither reads the user's checkpoints nor leaves
    any: the folder, and every checkpoint the bench wrote, is removed on exit. ``edit(data)``
    may change the profile's dict first. Yields the profile file's path."""
    from engine.profiles import load_profile, profile_to_dict

    import yaml

    base = load_profile(name)
    tmp = Path(tempfile.mkdtemp(prefix=prefix))
    try:
        data = profile_to_dict(base)
        data["cache"]["ssd_dir"] = str(tmp / "ssd")
        data["name"] = base.name + "-bench"
        if edit is not None:
            edit(data)
        path = tmp / "bench.yaml"
        path.write_text(yaml.safe_dump(data))
        yield path
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
