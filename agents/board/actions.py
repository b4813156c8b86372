"""Human actions on cards (CLI and TUI share them): add, approve, reject, retry, archive, and
the JSON export other tools read (``export_card``)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from agents.board import workspace
from agents.board.model import BoardError, Card, CheckSpec
from agents.board.runner import check_feedback
from agents.board.store import BoardStore
from agents.taskfile import TaskSpec


def card_from_task(task: TaskSpec, **overrides: Any) -> Card:
    """A card from a task YAML (the same file as ``mlxterm run``). The YAML's folder is kept
    (``task_dir``): the card's checks may read it, as under ``mlxterm run``."""
    limits = {k: v for k, v in (("steps", task.steps), ("tokens", task.tokens), ("wall_s", task.wall_s))
              if v is not None}
    sampling = {k: v for k, v in (("temperature", task.temperature), ("seed", task.seed),
                                  ("max_tokens", task.max_tokens)) if v is not None}
    template = task.workspace_template
    card = Card(id=0, title=task.name, prompt=task.prompt, profile=task.profile,
                workspace={"kind": "template", "source": str(Path(template).resolve())} if template
                else {"kind": "empty", "source": None},
                checks=[CheckSpec(c.name, c.run, c.timeout_s) for c in task.checks], limits=limits,
                sampling=sampling, allow=list(task.allow), system=task.system, examples=task.examples,
                task_file=str(Path(task.path).resolve()), task_dir=str(Path(task.path).resolve().parent),
                test_command=task.test_command, repair_rounds=task.repair_rounds, sandbox=dict(task.sandbox))
    for k, v in overrides.items():
        if v is not None:
            setattr(card, k, v)
    return card


def workspace_spec(path: str | None, git: str | None = None) -> dict[str, Any]:
    """``--workspace DIR`` (a template copied for the card) or ``--git REPO`` (a worktree on a
    new branch); neither: an empty directory."""
    if path and git:
        raise BoardError("give --workspace DIR or --git REPO, not both")
    if git:
        repo = Path(git).expanduser().resolve()
        if not (repo / ".git").exists():
            raise BoardError(f"{repo} is not a git repository")
        return {"kind": "git", "source": str(repo)}
    if path:
        d = Path(path).expanduser().resolve()
        if not d.is_dir():
            raise BoardError(f"workspace {d} is not a directory")
        return {"kind": "template", "source": str(d)}
    return {"kind": "empty", "source": None}


def move_by_hand(board: BoardStore, card_id: int, state: str) -> Card:
    """A move asked for by a person (``tasks move``, Shift+arrows): the transitions table,
    plus: only the dispatcher starts or finishes a running card (cancel it to stop it), and
    review -> done is an approval."""
    card = board.get(card_id)
    if state == "running":
        raise BoardError(f"only the dispatcher starts a card; queue card {card.id} instead")
    if card.state == "running":
        raise BoardError(f"card {card.id} is running; cancel it first")
    if card.state == "review" and state == "done":
        return approve(board, card.id)
    return board.move(card.id, state, reason="moved by hand")


def start(board: BoardStore, card_id: int) -> Card:
    """Queue a card (from the backlog, or again after failed / blocked)."""
    card = board.get(card_id)
    if card.state in ("failed", "blocked"):
        return retry(board, card_id)
    return board.move(card.id, "queued", reason="started")


def approve(board: BoardStore, card_id: int) -> Card:
    card = board.get(card_id)
    if card.state != "review":
        raise BoardError(f"card {card.id} is {card.state}; only cards in review can be approved")
    sha = workspace.commit(card, f"card {card.id}: {card.title}")  # git cards: the work on its branch
    board.log(card.id, "approved", **({"commit": sha} if sha else {}))
    return board.move(card.id, "done", reason="approved")


def reject(board: BoardStore, card_id: int, comment: str) -> Card:
    """Back to queued; the next attempt continues the same agent session with the comment."""
    card = board.get(card_id)
    if card.state != "review":
        raise BoardError(f"card {card.id} is {card.state}; only cards in review can be rejected")
    if not comment.strip():
        raise BoardError("a reject needs a comment saying what to change")
    board.log(card.id, "rejected", comment=comment)
    return board.move(card.id, "queued", reason="rejected: " + comment.strip()[:200], review_comment=comment,
                      next_attempt={"kind": "followup", "feedback": comment}, retries_used=0)


def retry(board: BoardStore, card_id: int) -> Card:
    """Queue a failed / blocked card again (a new attempt with the last failure fed back)."""
    card = board.get(card_id)
    if card.state not in ("failed", "blocked", "review", "backlog"):
        raise BoardError(f"card {card.id} is {card.state}; retry is for failed, blocked or reviewed cards")
    last = board.last_attempt(card.id)
    feedback = check_feedback(last.checks) if last else ""
    if card.state == "review":
        board.move(card.id, "backlog", reason="retry")
    nxt = {"kind": "retry", "feedback": feedback} if feedback else None
    return board.move(card.id, "queued", reason="retry", next_attempt=nxt, retries_used=0)


def archive(board: BoardStore, card_id: int) -> Card:
    card = board.get(card_id)
    if card.state == "running":
        raise BoardError(f"card {card.id} is running; cancel it first")
    sha = workspace.release(card)  # git cards: leftovers committed, worktree removed
    if sha:
        board.log(card.id, "workspace_saved", commit=sha)
    return board.move(card.id, "archived", reason="archived")


def export_card(board: BoardStore, card_id: int) -> dict[str, Any]:
    """The card and its attempts as one JSON-able dict (the report renderer's input):
    ``{"kind": "board_card", "card": {...}, "attempts": [...]}``; unknown numbers are None."""
    card = board.get(card_id)
    return {"kind": "board_card", "card": card.as_dict(),
            "attempts": [a.as_dict() for a in board.attempts(card.id)],
            "events": board.events(card.id)}
