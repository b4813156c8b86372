"""Who may run which tool: the profile's ``agent.approval`` (allow / ask / deny per tool).

Interactive runs turn "ask" into an ``ApprovalNeeded`` event; headless runs have nobody to ask,
so "ask" means deny unless the tool was named with ``--allow`` (or the task's ``allow``).
"always" answers are remembered for the session. A profile's "deny" is never overridden.
Where the sandbox is unavailable, ``bash`` is "ask" whatever the profile says (headless: denied
unless this run allows it explicitly with ``--allow bash``; a task file's ``allow`` is no consent
to run unconfined).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Literal

Verdict = Literal["allow", "ask", "deny"]


class ApprovalPolicy:
    def __init__(self, approvals: Mapping[str, str], *, allow: Iterable[str] = (), interactive: bool = True,
                 unsandboxed: Iterable[str] = (), unconfined_allow: Iterable[str] | None = None):
        """``unconfined_allow``: tools the person running this allowed explicitly (None: ``allow``);
        only these may run unsandboxed without asking."""
        self.approvals = dict(approvals)
        self.allow = set(allow)
        self.unconfined_allow = self.allow if unconfined_allow is None else set(unconfined_allow)
        self.interactive = interactive
        self.unsandboxed = set(unsandboxed)  # tools that would run unconfined (no sandbox here)
        self._always: set[str] = set()

    def decide(self, tool: str) -> Verdict:
        setting = self.approvals.get(tool, "ask")
        if setting == "deny":
            return "deny"
        if tool in self.unsandboxed:
            # Never unconfined by a standing setting: the profile's "allow" and "always"
            # answers become "ask"; only this run's explicit allow (headless --allow) counts.
            if tool in self.unconfined_allow:
                return "allow"
            return "ask" if self.interactive else "deny"
        if setting == "allow" or tool in self.allow or tool in self._always:
            return "allow"
        return "ask" if self.interactive else "deny"

    def remember(self, tool: str) -> None:
        """An "always for this session" answer (not kept for a tool that runs unsandboxed)."""
        if tool not in self.unsandboxed:
            self._always.add(tool)

    def ignored_allows(self) -> list[str]:
        """Tools named in ``allow`` that the profile denies (the allow has no effect)."""
        return sorted(t for t in self.allow if self.approvals.get(t) == "deny")

    def denial_message(self, tool: str) -> str:
        setting = self.approvals.get(tool, "ask")
        if setting == "deny":
            return f"{tool} is disabled by the profile's agent.approval setting; do the task without it"
        if not self.interactive and tool in self.unsandboxed:
            return (f"{tool} cannot be sandboxed here and this is a headless run (allow it with --allow {tool} "
                    "to run it unconfined); do the task without it")
        if not self.interactive:
            return (f"{tool} needs approval and this is a headless run (allow it with --allow {tool}); "
                    "do the task without it")
        return f"the user did not allow this {tool} call"
