"""Cards, attempts and the one table of allowed state changes.

Every state change of a card goes through ``BoardStore.move``, which calls ``check_move``
against ``TRANSITIONS``; nothing else writes a card's state.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from engine.errors import MlxtermError

STATES = ("backlog", "queued", "running", "review", "done", "failed", "blocked", "archived")

# from -> the states a card may move to. "running -> review" is an attempt whose checks passed
# or a card without checks whose agent answered (its attempt is "unchecked": review tells it
# apart); "running -> done" is a passed attempt of an auto_accept card (never an unchecked
# one); "running -> queued" is a retry after failed checks (the attempt's repair rounds are
# spent) or an attempt interrupted by a crash; "review -> queued" is a reject (a follow-up
# attempt in the same agent session); "running -> backlog" is a cancel.
TRANSITIONS: dict[str, frozenset[str]] = {
    "backlog": frozenset({"queued", "archived"}),
    "queued": frozenset({"running", "backlog", "blocked", "archived"}),
    "running": frozenset({"review", "done", "queued", "failed", "backlog"}),
    "review": frozenset({"done", "queued", "backlog", "archived"}),
    "done": frozenset({"archived"}),
    "failed": frozenset({"queued", "backlog", "archived"}),
    "blocked": frozenset({"queued", "backlog", "archived"}),
    "archived": frozenset({"backlog"}),
}
ACTIVE = ("queued", "running")
# passed: at least one check ran and every one passed (after the attempt's repair rounds);
# unchecked: the card has no checks and the agent answered (nothing verified it); failed: a check
# still failed, or the agent stopped without an answer; error / cancelled / interrupted: the run.
ATTEMPT_STATUSES = ("running", "passed", "unchecked", "failed", "error", "cancelled", "interrupted")
WORKSPACE_KINDS = ("empty", "template", "git")


class BoardError(MlxtermError):
    """A board action that cannot be done (unknown card, forbidden move, bad card spec)."""


def check_move(card_id: int, old: str, new: str) -> None:
    """Raise ``BoardError`` unless ``old -> new`` is in ``TRANSITIONS``."""
    if new not in STATES:
        raise BoardError(f"unknown state {new!r} (states: {', '.join(STATES)})")
    if new not in TRANSITIONS[old]:
        allowed = ", ".join(sorted(TRANSITIONS[old])) or "none"
        raise BoardError(f"card {card_id} cannot move from {old} to {new} (from {old}: {allowed})")


@dataclass
class CheckSpec:
    name: str
    run: str
    timeout_s: float = 60.0


@dataclass
class Card:
    """One task. ``workspace`` is ``{"kind": empty|template|git, "source": path|None}``; the
    directory the agent works in (``workspace_dir``) is made on the first attempt and kept for
    the following ones (a retry fixes the work, a reject continues it)."""

    id: int
    title: str
    prompt: str
    state: str = "backlog"
    profile: str | None = None
    workspace: dict[str, Any] = field(default_factory=lambda: {"kind": "empty", "source": None})
    workspace_dir: str | None = None
    base: str | None = None  # git: the commit the card's branch started from
    checks: list[CheckSpec] = field(default_factory=list)
    limits: dict[str, Any] = field(default_factory=dict)  # steps, tokens, wall_s
    sandbox: dict[str, Any] = field(default_factory=dict)  # tools.sandbox.Limits fields (the task YAML's sandbox:)
    sampling: dict[str, Any] = field(default_factory=dict)  # temperature, seed, max_tokens
    allow: list[str] = field(default_factory=list)
    system: str | None = None
    examples: bool = True
    priority: int = 0
    labels: list[str] = field(default_factory=list)
    depends_on: list[int] = field(default_factory=list)
    max_retries: int = 2
    auto_accept: bool = False
    task_file: str | None = None
    task_dir: str | None = None  # the task YAML's folder: checks may read it ($MLXTERM_TASK_DIR)
    test_command: str | None = None  # the prompt tells the agent to run it (task YAML test_command)
    repair_rounds: int | None = None  # check failures sent back per attempt (None: the profile's)
    created_at: float = 0.0
    updated_at: float = 0.0
    reason: str | None = None  # why it is where it is (blocked by..., failed after...)
    review_comment: str | None = None  # the last reject's comment, fed to the follow-up
    next_attempt: dict[str, Any] | None = None  # {"kind": retry|followup|resume, "feedback": text}
    retries_used: int = 0  # automatic retries since the last human action
    cancel_requested: bool = False  # set by `tasks cancel` / x; the running attempt stops

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class Attempt:
    """One run of a card's agent. Unknown numbers are None, never 0."""

    card_id: int
    number: int
    kind: str  # first | retry | followup | resume
    prompt: str
    status: str = "running"
    session_id: str | None = None
    started_at: float | None = None
    finished_at: float | None = None
    wall_s: float | None = None
    tokens: dict[str, int | None] = field(
        default_factory=lambda: {"prompt": None, "cached": None, "completion": None})
    requests: int | None = None
    ttft_s_sum: float | None = None
    tool_errors: int | None = None
    checks: list[dict[str, Any]] = field(default_factory=list)
    workspace: str | None = None
    diff: str | None = None
    steps: list[dict[str, Any]] = field(default_factory=list)
    stop_reason: str | None = None
    error: str | None = None
    final_text: str | None = None
    # repair rounds inside the attempt (agents.repair): the check summary at the agent's first
    # final answer ({status, checks_passed, checks_failed}; None: checks never ran), one record
    # per round that followed, the answers sent back once for not doing the work, and whether
    # any workspace file changed during the attempt (None: not recorded, e.g. an old board)
    first_try: dict[str, Any] | None = None
    repair_rounds: list[dict[str, Any]] = field(default_factory=list)
    corrective_turns: int | None = None
    workspace_changed: bool | None = None
    changed_files: list[str] = field(default_factory=list)
    evidence_dir: str | None = None  # $MLXTERM_RUN_DIR of its checks (quality.json, screenshots)
    pid: int | None = None  # the process running it (crash recovery checks it is gone)

    @property
    def first_step_cached_ratio(self) -> float | None:
        if not self.steps or not self.steps[0].get("prompt_tokens"):
            return None
        return self.steps[0]["cached_tokens"] / self.steps[0]["prompt_tokens"]

    @property
    def cached_ratio(self) -> float | None:
        p, c = self.tokens.get("prompt"), self.tokens.get("cached")
        return None if not p or c is None else c / p

    def notes(self) -> list[str]:
        """Short facts review should see beside the status (CLI, TUI, the dispatcher's reason):
        the first try when repair changed the outcome or rounds ran, corrective turns, and an
        unchanged workspace. Unknown fields (older attempts) add nothing."""
        out = []
        ft = self.first_try
        if ft and self.repair_rounds:
            total = (ft.get("checks_passed") or 0) + (ft.get("checks_failed") or 0)
            n = len(self.repair_rounds)
            out.append(f"first try {ft.get('status')} ({ft.get('checks_passed')}/{total} checks), "
                       f"{n} repair round{'s' if n != 1 else ''}")
        if self.corrective_turns:
            out.append(f"{self.corrective_turns} corrective turn{'s' if self.corrective_turns != 1 else ''}")
        if self.workspace_changed is False:
            out.append("no file in the workspace changed")
        return out

    def as_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["first_step_cached_ratio"] = self.first_step_cached_ratio
        d["cached_ratio"] = self.cached_ratio
        return d
