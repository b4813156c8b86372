"""Exercism-layout exercises as agent tasks (``mlxterm bench agent``).

An exercise is a folder with ``INSTRUCTIONS.md``, ``exercise.json``
(``{"slug", "solution": [...], "test": [...]}``), the stub solution file(s) and unittest
file(s); its tests run as ``python3 -m unittest <module>`` from inside the folder.

``load_exercise(dir)`` reads and validates one (an ``ExerciseError`` names the file and the
problem); ``exercise_task(ex, workspace_root)`` turns it into a ``TaskSpec``: the workspace
template is a writable copy of the stub, the tests and the instructions (not
``exercise.json``), the prompt names the file(s) to edit and the test command, and the one
check first restores the test files from the exercise folder (``$MLXTERM_TASK_DIR``), so an
agent that edits the tests cannot pass by it. ``split_of(slug)`` is the fixed tune/report
split.
"""

from __future__ import annotations

import hashlib
import json
import shlex
import shutil
from dataclasses import dataclass
from pathlib import Path

from engine.errors import MlxtermError

from agents.taskfile import Check, TaskSpec

CHECK_TIMEOUT_S = 60
SPLITS = ("tune", "report")


class ExerciseError(MlxtermError):
    """An exercise folder is missing, incomplete or has a bad exercise.json."""


@dataclass(frozen=True)
class Exercise:
    slug: str
    dir: Path
    instructions: str
    solution: tuple[str, ...]
    test: tuple[str, ...]

    @property
    def test_modules(self) -> tuple[str, ...]:
        """The unittest modules to run: the ``*_test.py`` files (helpers such as
        ``test_utils.py`` are copied but not run on their own), else every test file."""
        tests = [t for t in self.test if t.endswith("_test.py")] or [t for t in self.test if t.endswith(".py")]
        return tuple(t[:-3].replace("/", ".") for t in tests)

    @property
    def test_command(self) -> str:
        return "python3 -m unittest -q " + " ".join(self.test_modules)


def split_of(slug: str) -> str:
    """``tune`` when sha1(slug) % 3 == 0, else ``report``: fixed, independent of the set."""
    return "tune" if int(hashlib.sha1(slug.encode("utf-8")).hexdigest(), 16) % 3 == 0 else "report"


def load_exercise(path: str | Path) -> Exercise:
    folder = Path(path)
    meta = folder / "exercise.json"
    if not folder.is_dir():
        raise ExerciseError(f"{folder}: exercise folder not found")
    try:
        data = json.loads(meta.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ExerciseError(f"{meta}: exercise.json not found") from None
    except (OSError, UnicodeDecodeError) as e:
        raise ExerciseError(f"{meta}: cannot read ({getattr(e, 'strerror', None) or e})") from None
    except json.JSONDecodeError as e:
        raise ExerciseError(f"{meta}:{e.lineno}: not valid JSON ({e.msg})") from None
    if not isinstance(data, dict):
        raise ExerciseError(f"{meta}: expected a JSON object with slug, solution and test")
    slug = data.get("slug")
    if not isinstance(slug, str) or not slug.strip():
        raise ExerciseError(f"{meta}: slug: required, a non-empty string")
    files = {}
    for key in ("solution", "test"):
        value = data.get(key)
        if not isinstance(value, list) or not value or not all(isinstance(v, str) and v.strip() for v in value):
            raise ExerciseError(f"{meta}: {key}: required, a non-empty list of file names")
        for name in value:
            rel = Path(name)
            if rel.is_absolute() or ".." in rel.parts:
                raise ExerciseError(f"{meta}: {key}: {name!r} must be a path inside the exercise folder")
            if not (folder / rel).is_file():
                raise ExerciseError(f"{meta}: {key}: {name} is missing from {folder}")
        files[key] = tuple(value)
    instructions_path = folder / "INSTRUCTIONS.md"
    try:
        instructions = instructions_path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ExerciseError(f"{instructions_path}: INSTRUCTIONS.md not found") from None
    except (OSError, UnicodeDecodeError) as e:
        raise ExerciseError(f"{instructions_path}: cannot read ({getattr(e, 'strerror', None) or e})") from None
    return Exercise(slug=slug, dir=folder.resolve(), instructions=instructions,
                    solution=files["solution"], test=files["test"])


def find_exercises(root: str | Path) -> list[Exercise]:
    """Every exercise folder under ``root`` (hidden and ``_`` folders skipped), by slug."""
    root = Path(root)
    if not root.is_dir():
        raise ExerciseError(f"{root}: exercises directory not found")
    out = [load_exercise(d) for d in sorted(root.iterdir())
           if d.is_dir() and not d.name.startswith((".", "_"))]
    if not out:
        raise ExerciseError(f"{root}: no exercise folders (each with an exercise.json) found")
    return sorted(out, key=lambda e: e.slug)


def copy_writable(src: Path, dst: Path) -> None:
    """Copy one file's bytes (not its mode: the originals may be read-only) as a 0644 file."""
    dst.parent.mkdir(parents=True, exist_ok=True)
    if dst.exists() or dst.is_symlink():
        if dst.is_dir() and not dst.is_symlink():
            shutil.rmtree(dst)
        else:
            dst.unlink()
    shutil.copyfile(src, dst)
    dst.chmod(0o644)


def restore_tests(ex: Exercise, workspace: Path) -> None:
    """Put the exercise's original test files back into ``workspace``."""
    for name in ex.test:
        copy_writable(ex.dir / name, workspace / name)


def prepare_template(ex: Exercise, workspace_root: str | Path) -> Path:
    """A writable copy of the stub(s), tests and instructions under ``workspace_root/slug``."""
    template = Path(workspace_root) / ex.slug
    if template.exists():
        shutil.rmtree(template)
    template.mkdir(parents=True)
    for name in ("INSTRUCTIONS.md", *ex.solution, *ex.test):
        copy_writable(ex.dir / name, template / name)
    return template


def exercise_prompt(ex: Exercise, files_first: bool = False) -> str:
    """The instructions, the stub file(s) as they are now (what a user hands an agent, and what
    aider's benchmark shows the model), and how to test. ``files_first``: the stubs before the
    instructions (the order of the one-shot arm's prompt, agent_plain.py)."""
    stubs = []
    for name in ex.solution:
        text = (ex.dir / name).read_text(encoding="utf-8", errors="replace")
        lang = "python" if name.endswith(".py") else ""
        stubs.append(f"{name} now contains:\n```{lang}\n{text.rstrip()}\n```")
    files = ", ".join(ex.solution)
    tests = ", ".join(ex.test)
    request = (f"Write the whole solution to {files}, keeping its names and signatures. "
               f"The tests are in {tests}: do not change them. "
               f"Run the tests from the workspace with: {ex.test_command}\n"
               f"When they pass, reply with a short final answer.")
    if files_first:
        return "\n\n".join(stubs) + f"\n\n---\n{ex.instructions.rstrip()}\n\n---\n" + request
    return f"{ex.instructions.rstrip()}\n\n---\n" + "\n\n".join(stubs) + "\n\n" + request


def restore_and_test_command(ex: Exercise) -> str:
    """Restore the original tests from ``$MLXTERM_TASK_DIR`` (writable copies), then run them."""
    lines = []
    for name in ex.test:
        q = shlex.quote(name)
        lines.append(f'rm -rf -- {q} && cp -f -- "$MLXTERM_TASK_DIR"/{q} {q} && chmod u+rw,go+r -- {q}')
    return " && ".join(lines) + " && " + ex.test_command


def exercise_task(ex: Exercise, workspace_root: str | Path, *, repair_rounds: int | None = None,
                  profile: str | None = None, steps: int | None = None, tokens: int | None = None,
                  wall_s: float | None = None, seed: int | None = None,
                  temperature: float | None = None, show_tests: bool = False,
                  files_first: bool = False) -> TaskSpec:
    """The agent task for one exercise (``repair_rounds`` None: the profile's; ``seed``: step n
    samples with seed + n, so a run repeats token for token; ``show_tests``: the test files go
    with the prompt as read-only files; ``files_first``: see ``exercise_prompt``)."""
    return TaskSpec(
        path=ex.dir / "exercise.json",
        name=ex.slug,
        prompt=exercise_prompt(ex, files_first),
        workspace_template=prepare_template(ex, workspace_root),
        profile=profile,
        allow=("bash",),
        steps=steps, tokens=tokens, wall_s=wall_s,
        checks=(Check("tests", restore_and_test_command(ex), CHECK_TIMEOUT_S),),
        test_command=ex.test_command,
        repair_rounds=repair_rounds,
        protected=tuple(ex.test),
        read=tuple(ex.test) if show_tests else (),
        plan=False,  # one solution file to fix: no plan (instructions may name other files)
        seed=seed,
        temperature=temperature,
    )
