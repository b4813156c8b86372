"""Task files for headless runs (``mlxterm run TASK.yaml``).

A task names a prompt, optionally a workspace template, profile, system prompt, allowed tools,
limits, sampling, network, sandbox limits, a test command, repair rounds, protected paths,
read-only files shown with the prompt, a plan switch, and the checks (shell commands run in the sandboxed workspace afterwards) that
decide whether the agent succeeded::

    name: hello
    prompt: "create hello.txt containing exactly: hello world"
    checks:
      - name: content
        run: test "$(cat hello.txt)" = "hello world"

Every key with its default: docs/agents.md, "Headless runs". Every problem is reported as
``FILE: KEY: what is wrong`` (a TaskError, one sentence).
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from engine.errors import MlxtermError

import yaml

from tools import TOOL_NAMES
from tools.sandbox import Limits

TOP_KEYS = ("name", "prompt", "workspace_template", "profile", "system", "examples", "allow",
            "limits", "sampling", "checks", "network", "test_command", "repair_rounds", "protected", "read",
            "plan", "sandbox")
LIMIT_KEYS = ("steps", "tokens", "wall_s")
SAMPLING_KEYS = ("temperature", "seed", "max_tokens")
CHECK_KEYS = ("name", "run", "timeout_s")
DEFAULT_CHECK_TIMEOUT_S = 60
READ_FILE_CHARS = 12000  # a ``read:`` file is shown whole up to this (~3k tokens), else its head


class TaskError(MlxtermError):
    """A task file is missing, unreadable or invalid."""


@dataclass(frozen=True)
class Check:
    name: str
    run: str
    timeout_s: float = DEFAULT_CHECK_TIMEOUT_S


@dataclass(frozen=True)
class TaskSpec:
    path: Path
    name: str
    prompt: str
    workspace_template: Path | None = None
    profile: str | None = None
    system: str | None = None
    examples: bool = True
    allow: tuple[str, ...] = ()
    steps: int | None = None
    tokens: int | None = None
    wall_s: float | None = None
    temperature: float | None = None
    seed: int | None = None
    max_tokens: int | None = None
    checks: tuple[Check, ...] = field(default_factory=tuple)
    network: bool = False
    test_command: str | None = None
    repair_rounds: int | None = None  # None: the profile's agent.repair_rounds
    protected: tuple[str, ...] = ()
    read: tuple[str, ...] = ()  # workspace files shown read-only before the prompt (e.g. the tests)
    plan: bool | None = None  # None: plan when the prompt names 2+ files the workspace lacks
    sandbox_limits: Limits | None = None  # the task's ``sandbox:`` limits (None: the defaults)
    sandbox: dict[str, Any] = field(default_factory=dict)  # the same as written (a board card keeps it)

    def full_prompt(self, workspace: Path | None = None) -> str:
        """The prompt the agent gets: the ``read:`` files as they are in ``workspace`` (when
        given), the task's prompt, and how to run its tests when it names them."""
        prompt = self.prompt
        if self.test_command and self.test_command not in prompt:
            prompt = f"{prompt.rstrip()}\n\nRun the tests with: {self.test_command}"
        if self.read and workspace is not None:
            prompt = f"{read_context(Path(workspace), self.read)}\n\n---\n\n{prompt}"
        return prompt


def fenced_file(path: Path, name: str, *, limit: int | None = None) -> str:
    """``name`` on a line of its own, then the file's text in one fenced block (cut to its first
    ``limit`` characters at a line end, with a note saying so)."""
    text = path.read_text(encoding="utf-8", errors="replace").rstrip()
    if limit is not None and len(text) > limit:
        text = text[:text.rfind("\n", 0, limit) + 1].rstrip() + f"\n# ... ({name} continues)"
    lang = "python" if name.endswith(".py") else ""
    return f"{name}\n```{lang}\n{text}\n```"


READ_HEADING = "Read-only files (for reference: do not change them):"


def read_context(root: Path, names: tuple[str, ...] | list[str], heading: str = READ_HEADING) -> str:
    """The files ``names`` under ``root`` as read-only context (each cut to READ_FILE_CHARS); a
    file that is missing, unreadable or outside ``root`` is named as such, never read."""
    top = root.resolve()
    parts = []
    for name in names:
        path = (root / name).resolve()
        if not path.is_relative_to(top):
            parts.append(f"{name}: not shown (outside the workspace)")
            continue
        try:
            parts.append(fenced_file(path, name, limit=READ_FILE_CHARS))
        except OSError as e:
            parts.append(f"{name}: not shown ({e.strerror or e})")
    return f"{heading}\n\n" + "\n\n".join(parts)


def load_task(path: str | Path) -> TaskSpec:
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise TaskError(f"{path}: task file not found") from None
    except OSError as e:
        raise TaskError(f"{path}: cannot read the task file ({e.strerror})") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" at line {mark.line + 1}" if mark else ""
        raise TaskError(f"{path}: not valid YAML{where}") from None
    return parse_task(data, path)


def parse_task(data: Any, path: Path) -> TaskSpec:
    """Validate a loaded YAML document; ``path`` names the file in errors and anchors paths."""
    if not isinstance(data, dict):
        raise TaskError(f"{path}: a task file must be a mapping with at least a 'prompt' key")
    _known(path, "", data, TOP_KEYS)

    def fail(key: str, problem: str) -> TaskError:
        return TaskError(f"{path}: {key}: {problem}")

    prompt = data.get("prompt")
    if not isinstance(prompt, str) or not prompt.strip():
        raise fail("prompt", "required, a non-empty string")
    template = None
    if data.get("workspace_template") is not None:
        raw = _text(path, "workspace_template", data["workspace_template"])
        template = (path.parent / raw).resolve()
        if not template.is_dir():
            raise fail("workspace_template", f"{template} is not a directory")
    allow = data.get("allow") or []
    if not isinstance(allow, list) or not all(isinstance(a, str) for a in allow):
        raise fail("allow", "expected a list of tool names")
    for a in allow:
        if a not in TOOL_NAMES:
            raise fail("allow", f"unknown tool {a!r}{_suggest(a, TOOL_NAMES)} (tools: {', '.join(TOOL_NAMES)})")
    examples = data.get("examples", True)
    if not isinstance(examples, bool):
        raise fail("examples", "expected true or false")
    network = data.get("network", False)
    if not isinstance(network, bool):
        raise fail("network", "expected true or false")
    plan = data.get("plan")
    if plan is not None and not isinstance(plan, bool):
        raise fail("plan", "expected true or false")
    sandbox_limits = None
    if data.get("sandbox") is not None:
        if not isinstance(data["sandbox"], dict):
            raise fail("sandbox", "expected a mapping of limits, e.g. {workspace_bytes: 2000000000}")
        try:
            sandbox_limits = Limits.from_mapping(data["sandbox"])
        except ValueError as e:
            raise fail("sandbox", str(e)) from None
    limits = _section(path, "limits", data.get("limits"), LIMIT_KEYS)
    sampling = _section(path, "sampling", data.get("sampling"), SAMPLING_KEYS)
    return TaskSpec(
        path=path.resolve(),
        name=_text(path, "name", data["name"]) if data.get("name") is not None else path.stem,
        prompt=prompt,
        workspace_template=template,
        profile=_text(path, "profile", data["profile"]) if data.get("profile") is not None else None,
        system=_text(path, "system", data["system"]) if data.get("system") is not None else None,
        examples=examples,
        allow=tuple(allow),
        steps=_number(path, "limits.steps", limits.get("steps"), integer=True, minimum=1),
        tokens=_number(path, "limits.tokens", limits.get("tokens"), integer=True, minimum=1),
        wall_s=_number(path, "limits.wall_s", limits.get("wall_s"), minimum=0.001),
        temperature=_number(path, "sampling.temperature", sampling.get("temperature"), minimum=0.0),
        seed=_number(path, "sampling.seed", sampling.get("seed"), integer=True, minimum=0),
        max_tokens=_number(path, "sampling.max_tokens", sampling.get("max_tokens"), integer=True, minimum=1),
        checks=_checks(path, data.get("checks")),
        network=network,
        test_command=_text(path, "test_command", data["test_command"]) if data.get("test_command") is not None else None,
        repair_rounds=_number(path, "repair_rounds", data.get("repair_rounds"), integer=True, minimum=0),
        protected=_strings(path, "protected", data.get("protected")),
        read=_relative(path, "read", _strings(path, "read", data.get("read"))),
        plan=plan,
        sandbox_limits=sandbox_limits,
        sandbox=dict(data.get("sandbox") or {}),
    )


def _checks(path: Path, raw: Any) -> tuple[Check, ...]:
    if raw is None:
        return ()
    if not isinstance(raw, list):
        raise TaskError(f"{path}: checks: expected a list of {{name, run}} mappings")
    out = []
    for i, item in enumerate(raw):
        key = f"checks[{i}]"
        if not isinstance(item, dict):
            raise TaskError(f"{path}: {key}: expected a mapping with 'name' and 'run'")
        _known(path, key + ".", item, CHECK_KEYS)
        if "run" not in item:
            raise TaskError(f"{path}: {key}.run: required, the shell command to run")
        run = _text(path, f"{key}.run", item["run"])
        name = _text(path, f"{key}.name", item["name"]) if item.get("name") is not None else f"check {i + 1}"
        timeout = _number(path, f"{key}.timeout_s", item.get("timeout_s"), minimum=0.001)
        out.append(Check(name, run, DEFAULT_CHECK_TIMEOUT_S if timeout is None else timeout))
    return tuple(out)


def _strings(path: Path, key: str, raw: Any) -> tuple[str, ...]:
    if raw is None:
        return ()
    if not isinstance(raw, list) or not all(isinstance(x, str) and x.strip() for x in raw):
        raise TaskError(f"{path}: {key}: expected a list of paths")
    return tuple(raw)


def _relative(path: Path, key: str, names: tuple[str, ...]) -> tuple[str, ...]:
    for name in names:
        if Path(name).is_absolute() or ".." in Path(name).parts:
            raise TaskError(f"{path}: {key}: {name!r} must be a path inside the workspace")
    return names


def _section(path: Path, key: str, raw: Any, keys: tuple[str, ...]) -> dict[str, Any]:
    if raw is None:
        return {}
    if not isinstance(raw, dict):
        raise TaskError(f"{path}: {key}: expected a mapping with keys {', '.join(keys)}")
    _known(path, key + ".", raw, keys)
    return raw


def _known(path: Path, prefix: str, data: dict, keys: tuple[str, ...]) -> None:
    for k in data:
        if k not in keys:
            raise TaskError(f"{path}: {prefix}{k}: unknown key{_suggest(str(k), keys)} "
                            f"(allowed: {', '.join(keys)})")


def _text(path: Path, key: str, value: Any) -> str:
    if not isinstance(value, str) or not value.strip():
        raise TaskError(f"{path}: {key}: expected a non-empty string")
    return value


def _number(path: Path, key: str, value: Any, *, integer: bool = False, minimum: float | None = None):
    if value is None:
        return None
    bad_type = isinstance(value, bool) or not isinstance(value, int | float) or (integer and not isinstance(value, int))
    if bad_type:
        raise TaskError(f"{path}: {key}: expected {'an integer' if integer else 'a number'}, got {value!r}")
    if minimum is not None and value < minimum:
        raise TaskError(f"{path}: {key}: must be >= {minimum:g}, got {value!r}")
    return value


def _suggest(word: str, choices) -> str:
    close = difflib.get_close_matches(word, list(choices), n=1, cutoff=0.6)
    return f" (did you mean {close[0]!r}?)" if close else ""
