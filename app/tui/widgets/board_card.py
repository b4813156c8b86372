"""``BoardCard``: one card on the board (title, labels, attempt, live status or checks)."""

from __future__ import annotations

from textual.widgets import Static

from app.tui.format import clean


def card_status(card, attempt, run) -> str:
    """The status line: live while running (repair round, step, tool or "checks", tokens,
    tok/s, elapsed, approval), else the last attempt's status (passed / unchecked / failed...),
    checks (✓/✗), repair rounds, "no changes" when no workspace file changed, and why the card
    is where it is."""
    if run is not None:
        att = run.attempt
        if run.pending_approval is not None:
            return f"attempt {att.number} · waiting for approval: {run.pending_approval.call.name}"
        done = att.tokens.get("completion") or 0
        tps = att.steps[-1].get("decode_tps") if att.steps else None
        parts = [f"attempt {att.number}"]
        if getattr(run, "round", 0):
            parts.append(f"repair round {run.round}")
        parts.append(f"step {run.step or 1}")
        if run.tool:
            parts.append(run.tool)
        parts.append(f"{done + run.step_tokens} tok")
        if tps:
            parts.append(f"{tps:.1f} tok/s")
        parts.append(f"{run.elapsed_s:.0f} s")
        return " · ".join(parts)
    if attempt is None:
        return card.reason or ""
    checks = attempt.checks
    passed = sum(1 for c in checks if c["passed"])
    mark = (" " + "".join("✓" if c["passed"] else "✗" for c in checks)) if checks else ""
    score = f"{mark} {passed}/{len(checks)}" if checks else ""
    if card.state in ("failed", "blocked") and card.reason:
        return f"{score.strip()} · {card.reason}" if score else card.reason
    flag = " · no changes" if getattr(attempt, "workspace_changed", None) is False else ""
    if getattr(attempt, "repair_rounds", None):
        flag = f" · {len(attempt.repair_rounds)} repair round{'s' if len(attempt.repair_rounds) != 1 else ''}" + flag
    return f"attempt {attempt.number} {attempt.status}{score}{flag}"


class BoardCard(Static, can_focus=False):
    """Selected with the board's cursor (class ``-selected``), not with focus."""

    def __init__(self, card_id: int) -> None:
        super().__init__("", markup=False, classes="board-card")
        self.card_id = card_id

    def show(self, card, attempt, run) -> None:
        head = f"#{card.id} {card.title}"
        lines = [clean(head)]
        if card.labels:
            lines.append("[" + ", ".join(card.labels) + "]")
        status = card_status(card, attempt, run)
        if status:
            lines.append(clean(status))
        self.set_class(run is not None and run.pending_approval is not None, "-approval")
        self.set_class(card.state == "failed", "-failed")
        # nothing verified it (no checks), or it changed nothing: review should look twice
        self.set_class(run is None and attempt is not None and card.state == "review"
                       and (attempt.status == "unchecked" or getattr(attempt, "workspace_changed", None) is False),
                       "-unchecked")
        self.update("\n".join(lines))
