"""A card's workspace: made on its first attempt, kept for the following ones, diffed for review.

Kinds: ``empty`` (a new directory), ``template`` (a copy of a directory; the pristine copy is
kept beside it as the diff base) and ``git`` (a worktree of a repository on a new branch
``board/card-<id>``; the diff is against the commit it started from, untracked files included).
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


def prepare(board, card: Card) -> tuple[str, str | None]:
    """Make the card's workspace if it has none yet; returns ``(workspace_dir, base)``."""
    if card.workspace_dir and Path(card.workspace_dir).is_dir():
        return card.workspace_dir, card.base
    kind, source = card.workspace.get("kind", "empty"), card.workspace.get("source")
    ws = board_dir(board) / "workspaces" / str(card.id)
    base: str | None = None
    if kind == "git":
        repo = Path(source or "").expanduser()
        head = _git(repo, "rev-parse", "HEAD").strip()
        if ws.exists():
            shutil.rmtree(ws)
        ws.parent.mkdir(parents=True, exist_ok=True)
        _git(repo, "worktree", "add", "-q", "-B", f"board/card-{card.id}", str(ws), head)
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


def _git(repo: Path, *args: str) -> str:
    try:
        proc = subprocess.run(["git", "-C", str(repo), *args], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise BoardError(f"git {' '.join(args)} in {repo} failed: {e}") from None
    if proc.returncode != 0:
        raise BoardError(f"git {' '.join(args)} in {repo} failed: {proc.stderr.strip() or proc.returncode}")
    return proc.stdout
