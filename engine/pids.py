"""Whether a process id names a live process: used to tell a crashed writer (a checkpoint temp
file, a streaming reply, a board attempt) from one still at work."""

from __future__ import annotations

import os
from typing import Any


def pid_alive(pid: Any) -> bool:
    """True when ``pid`` is a positive int naming a process that exists (ours or another user's)."""
    if not isinstance(pid, int) or isinstance(pid, bool) or pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # exists, owned by someone else
    return True
