"""A card's workspace: made on its first attempt, kept for the following ones, diffed for review.

Kinds: ``empty`` (a new directory), ``template`` (a copy of a directory; the pristine copy is
kept beside it as the diff base) and ``git`` (a worktree of a repository on a new branch
``board/card-<id>``; the diff is against the commit it started from, untracked files included).

A git card's work ends up as commits on its branch: approving commits the workspace
(``commit``), archiving commits whatever is left and removes the worktree (``release``), so
nothing is lost and the repository's worktree list stays clean; queueing the card again checks
its branch out anew.
"""

from __future__ import annotations

import difflib
import shutil
import subprocess
from pathlib import Path

from agents.board.model import BoardError, Card

MAX_DIFF_CHARS = 200_000
_SKIP_DIRS = {".git", "__pycache__", ".pytest_cache"}


def board_dir(board) -> Path:
    return board.path.parent / "board"


def evidence_dir(board, card_id: int) -> Path:
    """Where a card's checks may write evidence (quality.json, screenshots): ``$MLXTERM_RUN_DIR``."""
    return (board_dir(board) / "cards" / str(int(card_id)) / "evidence").resolve()


def task_dir(card: Card) -> str | None:
    """The folder of the task YAML the card came from (its checks may read it), or None. Cards
    stored before ``task_dir`` existed fall back to their ``task_file``'s folder."""
    if card.task_dir:
        return card.task_dir
    if card.task_file:
        return str(Path(card.task_file).expanduser().resolve().parent)
    return None


def prepare(board, card: Card) -> tuple[str, str | None]:
    """Make the card's workspace if it has none yet; returns ``(workspace_dir, base)``."""
    if card.workspace_dir and Path(card.workspace_dir).is_dir():
        return card.workspace_dir, card.base
    kind, source = card.workspace.get("kind", "empty"), card.workspace.get("source")
    ws = board_dir(board) / "workspaces" / str(card.id)
    base: str | None = None
    if kind == "git":
        repo = Path(source or "").expanduser()
        branch = f"board/card-{card.id}"
        if ws.exists():
            shutil.rmtree(ws)
        _git(repo, "worktree", "prune")  # forget a worktree whose directory is gone
        ws.parent.mkdir(parents=True, exist_ok=True)
        if card.base and _has_branch(repo, branch):  # archived and queued again: keep its commits
            _git(repo, "worktree", "add", "-q", str(ws), branch)
            base = card.base
        else:
            head = _git(repo, "rev-parse", "HEAD").strip()
            _git(repo, "worktree", "add", "-q", "-B", branch, str(ws), head)
            base = head
    else:
        pristine = board_dir(board) / "base" / str(card.id)
        for d in (ws, pristine):
            if d.exists():
                shutil.rmtree(d)
        if kind == "template":
            src = Path(source or "").expanduser()
            if not src.is_dir():
                raise BoardError(f"card {card.id}: workspace template {src} is not a directory")
            shutil.copytree(src, ws, symlinks=True)
            shutil.copytree(src, pristine, symlinks=True)
        else:
            ws.mkdir(parents=True)
            pristine.mkdir(parents=True)
        base = str(pristine)
    return str(ws), base


def commit(card: Card, message: str) -> str | None:
    """Commit everything in a git card's workspace on its branch; the new commit's id, or None
    (not a git card, no workspace, or nothing to commit)."""
    ws = Path(card.workspace_dir) if card.workspace_dir else None
    if card.workspace.get("kind") != "git" or ws is None or not ws.is_dir():
        return None
    _git(ws, "add", "-A")
    if not _git(ws, "status", "--porcelain").strip():
        return None
    _git(ws, "-c", "user.name=mlxterm board", "-c", "user.email=board@mlxterm.invalid",
         "commit", "-q", "--no-verify", "-m", message)
    return _git(ws, "rev-parse", "HEAD").strip()


def release(card: Card) -> str | None:
    """Archive a git card's workspace: commit what is left on its branch, remove the worktree
    (the branch stays). Returns the commit made, if any. Other kinds keep their directory."""
    ws = Path(card.workspace_dir) if card.workspace_dir else None
    if card.workspace.get("kind") != "git" or ws is None or not ws.is_dir():
        return None
    sha = commit(card, f"card {card.id}: {card.title} (uncommitted work, saved when archived)")
    _git(Path(card.workspace["source"]).expanduser(), "worktree", "remove", "--force", str(ws))
    return sha


def diff(card: Card) -> str | None:
    """The whole change the card's attempts made to its workspace (unified diff), or None when
    the workspace does not exist."""
    if not card.workspace_dir or not Path(card.workspace_dir).is_dir():
        return None
    ws = Path(card.workspace_dir)
    if card.workspace.get("kind") == "git":
        _git(ws, "add", "-A", "-N")  # intent-to-add: new files show up in the diff
        text = _git(ws, "diff", "--no-color", card.base or "HEAD")
    else:
        text = tree_diff(Path(card.base) if card.base else None, ws)
    return text if len(text) <= MAX_DIFF_CHARS else text[:MAX_DIFF_CHARS] + "\n[... diff truncated ...]\n"


def tree_diff(old: Path | None, new: Path) -> str:
    """Unified diff of two directory trees (binary files reported in one line)."""
    files = set(_files(new)) | (set(_files(old)) if old is not None and old.is_dir() else set())
    out: list[str] = []
    for rel in sorted(files):
        a = old / rel if old is not None else None
        b = new / rel
        a_data = a.read_bytes() if a is not None and a.is_file() else None
        b_data = b.read_bytes() if b.is_file() else None
        if a_data == b_data:
            continue
        try:
            a_lines = a_data.decode("utf-8").splitlines(keepends=True) if a_data is not None else []
            b_lines = b_data.decode("utf-8").splitlines(keepends=True) if b_data is not None else []
        except UnicodeDecodeError:
            out.append(f"Binary files a/{rel} and b/{rel} differ\n")
            continue
        lines = difflib.unified_diff(a_lines, b_lines, "/dev/null" if a_data is None else f"a/{rel}",
                                     "/dev/null" if b_data is None else f"b/{rel}")
        out.extend(line if line.endswith("\n") else line + "\n\\ No newline at end of file\n" for line in lines)
    return "".join(out)


def _files(root: Path):
    for p in sorted(root.rglob("*")):
        rel = p.relative_to(root)
        if p.is_file() and not (set(rel.parts) & _SKIP_DIRS):
            yield rel.as_posix()


def _has_branch(repo: Path, branch: str) -> bool:
    try:
        _git(repo, "rev-parse", "--verify", "-q", f"refs/heads/{branch}")
    except BoardError:
        return False
    return True


def _git(repo: Path, *args: str) -> str:
    try:
        proc = subprocess.run(["git", "-C", str(repo), *args], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise BoardError(f"git {' '.join(args)} in {repo} failed: {e}") from None
    if proc.returncode != 0:
        raise BoardError(f"git {' '.join(args)} in {repo} failed: {proc.stderr.strip() or proc.returncode}")
    return proc.stdout
