"""The profile schema: one frozen dataclass per YAML section, each field carrying its rule.

A rule turns a YAML node into a Python value or records a problem naming what is allowed.
``engine.profiles`` walks a YAML document against these dataclasses.
"""

from __future__ import annotations

import difflib
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

KNOWN_TOOLS = ("read_file", "write_file", "edit_file", "list_dir", "grep", "bash")
APPROVALS = ("allow", "ask", "deny")
DEFAULT_APPROVAL = {
    "read_file": "allow",
    "list_dir": "allow",
    "grep": "allow",
    "write_file": "allow",
    "edit_file": "allow",
    "bash": "ask",
}


class Problems:
    """Collects every problem in one file as ``file:line: key: message`` lines."""

    def __init__(self, file: str) -> None:
        self.file = file
        self._items: list[tuple[int, str]] = []

    def add(self, line: int, key: str, message: str) -> None:
        where = f"{self.file}:{line}"
        self._items.append((line, f"{where}: {key}: {message}" if key else f"{where}: {message}"))

    def lines(self) -> list[str]:
        return [text for _, text in sorted(self._items, key=lambda item: item[0])]

    def __bool__(self) -> bool:
        return bool(self._items)


class Invalid(Exception):
    """A scalar value broke its rule; the message says why (the rule adds what is allowed)."""


BAD = object()  # returned by a rule whose value was invalid (the problem is already recorded)


def line_of(node: yaml.Node) -> int:
    return node.start_mark.line + 1


def plain(node: yaml.Node) -> Any:
    """The Python value of a YAML node (safe types only)."""
    return yaml.constructor.SafeConstructor().construct_object(node, deep=True)


def describe(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return f"boolean {str(value).lower()}"
    if isinstance(value, str):
        return f"string {value!r}"
    if isinstance(value, dict):
        return "a mapping"
    if isinstance(value, list):
        return "a list"
    return f"{type(value).__name__} {value!r}"


def suggest(word: str, choices: list[str] | tuple[str, ...]) -> str:
    close = difflib.get_close_matches(str(word), list(choices), n=1, cutoff=0.6)
    return f"; did you mean {close[0]!r}?" if close else ""


class Rule:
    """Base rule: check one scalar node. Subclasses set ``allowed`` and implement ``check``."""

    allowed = "any value"

    def convert(self, node: yaml.Node, key: str, problems: Problems) -> Any:
        value = plain(node)
        try:
            return self.check(value)
        except Invalid as e:
            problems.add(line_of(node), key, f"{e} (allowed: {self.allowed})")
            return BAD

    def check(self, value: Any) -> Any:
        return value


class Number(Rule):
    def __init__(self, *, integer: bool = False, ge=None, gt=None, le=None, lt=None,
                 choices: tuple = (), nullable: bool = False) -> None:
        self.integer, self.nullable, self.choices = integer, nullable, choices
        self.ge, self.gt, self.le, self.lt = ge, gt, le, lt
        self.allowed = self._allowed()

    def _allowed(self) -> str:
        noun = "an integer" if self.integer else "a number"
        if self.choices:
            text = "one of " + ", ".join(str(c) for c in self.choices)
        else:
            low = f"[{self.ge}" if self.ge is not None else (f"({self.gt}" if self.gt is not None else None)
            high = f"{self.le}]" if self.le is not None else (f"{self.lt})" if self.lt is not None else None)
            if low and high:
                text = f"{noun} in {low}, {high}"
            elif low:
                text = f"{noun} {'>=' if self.ge is not None else '>'} {low[1:]}"
            elif high:
                text = f"{noun} {'<=' if self.le is not None else '<'} {high[:-1]}"
            else:
                text = noun
        return text + (" or null" if self.nullable else "")

    def check(self, value: Any) -> Any:
        if value is None and self.nullable:
            return None
        wrong_type = isinstance(value, bool) or not isinstance(value, int | float)
        if wrong_type or (self.integer and not isinstance(value, int)):
            raise Invalid(f"expected {'an integer' if self.integer else 'a number'}, got {describe(value)}")
        if self.choices and value not in self.choices:
            raise Invalid(f"{value} is not a valid choice")
        if ((self.ge is not None and value < self.ge) or (self.gt is not None and value <= self.gt)
                or (self.le is not None and value > self.le) or (self.lt is not None and value >= self.lt)):
            raise Invalid(f"{value} is out of range")
        return value if self.integer else float(value)


class Choice(Rule):
    def __init__(self, *values: str) -> None:
        self.values = values
        self.allowed = "one of " + ", ".join(values)

    def check(self, value: Any) -> Any:
        if not isinstance(value, str):
            raise Invalid(f"expected a string, got {describe(value)}")
        if value not in self.values:
            raise Invalid(f"{value!r} is not a valid choice{suggest(value, self.values)}")
        return value


class Text(Rule):
    def __init__(self, *, nullable: bool = False) -> None:
        self.nullable = nullable
        self.allowed = "a non-empty string" + (" or null" if nullable else "")

    def check(self, value: Any) -> Any:
        if value is None and self.nullable:
            return None
        if not isinstance(value, str) or not value.strip():
            raise Invalid(f"expected a non-empty string, got {describe(value)}")
        return value


class Template(Rule):
    """A chat template name, or a path to a .jinja file (existence is checked by ``check``)."""

    NAMES = ("auto", "chatml", "none")
    allowed = "auto, chatml, none, or a path to a .jinja file"

    def check(self, value: Any) -> Any:
        if not isinstance(value, str):
            raise Invalid(f"expected a string, got {describe(value)}")
        if value not in self.NAMES and not value.endswith(".jinja"):
            raise Invalid(f"{value!r} is not a template name or .jinja path{suggest(value, self.NAMES)}")
        return value


class Boolean(Rule):
    allowed = "true or false"

    def check(self, value: Any) -> Any:
        if not isinstance(value, bool):
            raise Invalid(f"expected a boolean, got {describe(value)}")
        return value


_SIZE_UNITS = {
    "": 1, "b": 1,
    "kb": 1000, "mb": 1000**2, "gb": 1000**3, "tb": 1000**4,
    "kib": 1024, "mib": 1024**2, "gib": 1024**3, "tib": 1024**4,
}
_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*$")


def parse_size(value: Any) -> int:
    """Bytes from an int or a string like ``512MiB``, ``2GiB``, ``1.5GB``; raises Invalid."""
    if isinstance(value, bool):
        raise Invalid(f"expected a size, got {describe(value)}")
    if isinstance(value, int):
        if value < 0:
            raise Invalid(f"{value} is negative")
        return value
    if isinstance(value, str):
        m = _SIZE_RE.match(value)
        if m and m.group(2).lower() in _SIZE_UNITS:
            return int(float(m.group(1)) * _SIZE_UNITS[m.group(2).lower()])
        raise Invalid(f"{value!r} is not a size")
    raise Invalid(f"expected a size, got {describe(value)}")


def format_size(n: int) -> str | int:
    """The shortest exact text for ``n`` bytes (``2GiB``), or ``n`` itself when none is exact."""
    for unit, factor in (("GiB", 1024**3), ("MiB", 1024**2), ("KiB", 1024)):
        if n and n % factor == 0:
            return f"{n // factor}{unit}"
    return n


class Size(Rule):
    allowed = "bytes as an integer >= 0, or a string like 512MiB, 2GiB, 1.5GB"

    def check(self, value: Any) -> Any:
        return parse_size(value)


class TextList(Rule):
    """A YAML list of strings, optionally limited to ``choices``; null means empty."""

    def __init__(self, choices: tuple[str, ...] = ()) -> None:
        self.choices = choices
        self.allowed = "a list of " + (("names from: " + ", ".join(choices)) if choices else "strings")

    def convert(self, node: yaml.Node, key: str, problems: Problems) -> Any:
        if isinstance(node, yaml.ScalarNode) and plain(node) is None:
            return ()
        if not isinstance(node, yaml.SequenceNode):
            problems.add(line_of(node), key, f"expected a list, got {describe(plain(node))} (allowed: {self.allowed})")
            return BAD
        items, ok = [], True
        for i, item in enumerate(node.value):
            value = plain(item)
            if not isinstance(value, str):
                problems.add(line_of(item), f"{key}[{i}]", f"expected a string, got {describe(value)}")
                ok = False
            elif self.choices and value not in self.choices:
                problems.add(line_of(item), f"{key}[{i}]", f"unknown name {value!r}"
                             f"{suggest(value, self.choices)} (allowed: {', '.join(self.choices)})")
                ok = False
            else:
                items.append(value)
        return tuple(items) if ok else BAD


class Approval(Rule):
    """Per-tool approval mapping; listed tools override ``DEFAULT_APPROVAL``."""

    allowed = "a mapping of tool name to allow, ask or deny"

    def convert(self, node: yaml.Node, key: str, problems: Problems) -> Any:
        if isinstance(node, yaml.ScalarNode) and plain(node) is None:
            return dict(DEFAULT_APPROVAL)
        if not isinstance(node, yaml.MappingNode):
            problems.add(line_of(node), key, f"expected a mapping, got {describe(plain(node))} (allowed: {self.allowed})")
            return BAD
        result, ok, choice = dict(DEFAULT_APPROVAL), True, Choice(*APPROVALS)
        for key_node, value_node in node.value:
            tool = plain(key_node)
            if tool not in KNOWN_TOOLS:
                problems.add(line_of(key_node), f"{key}.{tool}", f"unknown tool{suggest(tool, KNOWN_TOOLS)} "
                             f"(allowed: {', '.join(KNOWN_TOOLS)})")
                ok = False
                continue
            value = choice.convert(value_node, f"{key}.{tool}", problems)
            ok = ok and value is not BAD
            result[tool] = value
        return result if ok else BAD


def opt(default: Any, rule: Rule) -> Any:
    """A dataclass field with a default and the rule its YAML value must follow."""
    if isinstance(default, dict | list):
        return field(default_factory=lambda: type(default)(default), metadata={"rule": rule})
    return field(default=default, metadata={"rule": rule})


@dataclass(frozen=True)
class RemoteModel:
    """A model served elsewhere over the OpenAI-compatible API (``mlxterm serve``, llama.cpp,
    vLLM, exo, ``mlx_lm.server``)."""

    base_url: str  # e.g. http://127.0.0.1:8080/v1
    model: str  # the server's model id
    api_key_env: str | None = None  # the environment variable holding the API key
    timeout_s: float = 600.0
    # how agents call tools: "text" (the text protocol inside the reply, any server) or "native"
    # (OpenAI ``tools`` in, ``tool_calls`` out: the server's own tool parsing)
    tool_calls: str = "text"


class Remote(Rule):
    """``model.remote``: a mapping with base_url and model (api_key_env, timeout_s, tool_calls optional)."""

    allowed = "a mapping with base_url (http:// or https://), model, and optional api_key_env, timeout_s, tool_calls"
    _RULES = {"base_url": Text(), "model": Text(), "api_key_env": Text(nullable=True),
              "timeout_s": Number(gt=0), "tool_calls": Choice("text", "native")}

    def convert(self, node: yaml.Node, key: str, problems: Problems) -> Any:
        if isinstance(node, yaml.ScalarNode) and plain(node) is None:
            return None
        if not isinstance(node, yaml.MappingNode):
            problems.add(line_of(node), key, f"expected a mapping, got {describe(plain(node))} (allowed: {self.allowed})")
            return BAD
        values, ok = {}, True
        for key_node, value_node in node.value:
            name = plain(key_node)
            if name not in self._RULES:
                problems.add(line_of(key_node), f"{key}.{name}", f"unknown key{suggest(str(name), list(self._RULES))} "
                             f"(allowed: {', '.join(self._RULES)})")
                ok = False
                continue
            values[name] = self._RULES[name].convert(value_node, f"{key}.{name}", problems)
            ok = ok and values[name] is not BAD
        for name in ("base_url", "model"):
            if ok and not values.get(name):
                problems.add(line_of(node), f"{key}.{name}", "missing; this key is required")
                ok = False
        url = values.get("base_url")
        if ok and not str(url).startswith(("http://", "https://")):
            problems.add(line_of(node), f"{key}.base_url", f"{url!r} is not an http:// or https:// URL")
            ok = False
        return RemoteModel(**values) if ok else BAD


@dataclass(frozen=True)
class ModelConfig:
    # catalogue name, path or pkg:...; required unless ``remote`` is given
    source: str = opt("", Text())
    weights: str = opt("auto", Choice("auto", "quantized", "hybrid", "fp32", "fp16", "bf16"))
    remote: RemoteModel | None = opt(None, Remote())


@dataclass(frozen=True)
class KVCacheConfig:
    format: str = opt("fp16", Choice("fp16", "bf16", "fp32", "q8", "q4"))
    group_size: int = opt(64, Number(integer=True, choices=(32, 64, 128)))
    quantized_start: int = opt(0, Number(integer=True, ge=0))
    sliding_window: int | None = opt(None, Number(integer=True, gt=0, nullable=True))
    checkpoint_format: str = opt("same", Choice("same", "fp16", "q8", "q4"))


@dataclass(frozen=True)
class SpeculationConfig:
    mode: str = opt("none", Choice("none", "draft", "lookup", "mtp"))
    draft_model: str | None = opt(None, Text(nullable=True))  # catalogue name, profile or path
    num_draft_tokens: int = opt(3, Number(integer=True, ge=1, le=16))  # draft-length ceiling
    lookup_ngram: int = opt(3, Number(integer=True, ge=1, le=16))  # shortest n-gram looked up
    min_draft_tokens: int = opt(1, Number(integer=True, ge=1, le=16))  # adaptive floor
    adaptive: bool = opt(True, Boolean())  # grow after full accepts, shrink after rejections
    lookup_max_ngram: int = opt(4, Number(integer=True, ge=1, le=16))  # longest n-gram tried first
    draft_min_prob: float = opt(0.0, Number(ge=0, lt=1))  # draft model stops below this top prob


@dataclass(frozen=True)
class SamplingConfig:
    temperature: float = opt(0.7, Number(ge=0))
    top_p: float = opt(1.0, Number(gt=0, le=1))
    top_k: int = opt(0, Number(integer=True, ge=0))
    min_p: float = opt(0.0, Number(ge=0, lt=1))
    repetition_penalty: float = opt(1.0, Number(gt=0))
    repetition_context: int = opt(64, Number(integer=True, ge=0))
    seed: int | None = opt(None, Number(integer=True, nullable=True))
    max_tokens: int = opt(1024, Number(integer=True, ge=1))
    stop: tuple[str, ...] = opt((), TextList())


@dataclass(frozen=True)
class ContextConfig:
    max_context: int = opt(8192, Number(integer=True, ge=256))


@dataclass(frozen=True)
class BatchConfig:
    """Continuous batching: concurrent requests decode together (engine.serving.scheduler)."""

    cap: int = opt(8, Number(integer=True, ge=1, le=64))  # rows decoding together at most
    kv_budget: int = opt(4 * 1024**3, Size())  # live KV bytes admitted rows may reserve


@dataclass(frozen=True)
class CacheConfig:
    ram_bytes: int = opt(2 * 1024**3, Size())
    ssd_bytes: int = opt(8 * 1024**3, Size())
    ssd_dir: str | None = opt(None, Text(nullable=True))  # None = data_dir()/checkpoints


@dataclass(frozen=True)
class ChatConfig:
    system_prompt: str | None = opt(None, Text(nullable=True))
    template: str = opt("auto", Template())
    reasoning: bool = opt(True, Boolean())


@dataclass(frozen=True)
class AgentConfig:
    tools: tuple[str, ...] = opt(KNOWN_TOOLS, TextList(KNOWN_TOOLS))
    approval: dict[str, str] = opt(DEFAULT_APPROVAL, Approval())
    max_steps: int = opt(24, Number(integer=True, ge=1))
    constrained_tool_calls: bool = opt(True, Boolean())
    # Step 1 of each task must be a tool call (under the grammar): small models otherwise tend to
    # answer "The file now contains ..." without calling write_file. Needs constrained_tool_calls.
    first_step_tool_call: bool = opt(False, Boolean())
    capable: bool = opt(False, Boolean())  # can do agent tasks (cards, /agent, `run` pick these)
    # How the model writes files: "whole" (path line + the whole file in a fenced block), "diff"
    # (search/replace blocks, whole files for new ones) or "json" (write_file/edit_file tool calls).
    # Models write code better in fenced blocks than inside JSON strings (agents/edits.py).
    edit_format: str = opt("json", Choice("whole", "diff", "json"))
    # After the final answer a task's checks run; failing output goes back this many times.
    repair_rounds: int = opt(3, Number(integer=True, ge=0, le=20))
    max_tokens_per_step: int | None = opt(None, Number(integer=True, ge=32, nullable=True))  # None: sampling.max_tokens
    repetition_penalty: float = opt(1.0, Number(gt=0))  # agent steps only: code repeats itself on purpose
    # Repair rounds first draft this many replies at once (batched) and keep one that passes the
    # checks (agents/candidates.py); 1 = off.
    candidates: int = opt(1, Number(integer=True, ge=1, le=16))
    candidate_temperature: float = opt(0.7, Number(ge=0))
    # Drafts sample with min_p (tokens under this fraction of the top token's probability are
    # dropped) instead of the profile's top_p: a hot temperature varies the code where the model
    # hesitates and keeps it where it is sure (at 0.7 with top_p 0.9 the 1.5B's drafts came out
    # identical).
    candidate_min_p: float = opt(0.05, Number(ge=0, lt=1))
    # Of the drafts, this many answer the task's first prompt again (without the failed file in
    # view) instead of the repair message: the 1.5B copies a failing file it can see.
    candidate_fresh: int = opt(0, Number(integer=True, ge=0, le=16))
    # Sampling temperature of ordinary repair rounds (None: the run's): near-greedy decoding tends
    # to write the same failing file again after the test output.
    repair_temperature: float | None = opt(None, Number(ge=0, nullable=True))
    # In a run whose task names a test command, a step that writes files ends the agent's turn
    # and the checks run at once (their failures come back as a repair round): small models
    # otherwise spend a step writing the same file again instead of running the tests.
    test_after_write: bool = opt(False, Boolean())


@dataclass(frozen=True)
class SpeechConfig:
    whisper: str = opt("whisper-tiny.en", Text())
    vad: str = opt("silero-vad", Text())
    language: str = opt("en", Text())
    vad_threshold: float = opt(0.5, Number(gt=0, lt=1))
    min_silence_ms: int = opt(600, Number(integer=True, ge=0))
    auto_stop: bool = opt(True, Boolean())


SECTIONS: dict[str, type] = {
    "model": ModelConfig,
    "kv_cache": KVCacheConfig,
    "speculation": SpeculationConfig,
    "sampling": SamplingConfig,
    "context": ContextConfig,
    "cache": CacheConfig,
    "chat": ChatConfig,
    "agent": AgentConfig,
    "speech": SpeechConfig,
    "batch": BatchConfig,
}
TOP_LEVEL_TEXT = ("name", "description")


@dataclass(frozen=True)
class Profile:
    """A validated profile. ``path`` is the YAML file (None when built in code)."""

    name: str
    model: ModelConfig
    description: str = ""
    path: Path | None = None
    kv_cache: KVCacheConfig = field(default_factory=KVCacheConfig)
    speculation: SpeculationConfig = field(default_factory=SpeculationConfig)
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    context: ContextConfig = field(default_factory=ContextConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    chat: ChatConfig = field(default_factory=ChatConfig)
    agent: AgentConfig = field(default_factory=AgentConfig)
    speech: SpeechConfig = field(default_factory=SpeechConfig)
    batch: BatchConfig = field(default_factory=BatchConfig)
    # YAML line of each key path ("sampling.top_p"), so later checks can point at the file.
    lines: dict[str, int] = field(default_factory=dict, compare=False, repr=False)

    @property
    def base_dir(self) -> Path:
        """Relative paths in the profile (model, template, ssd_dir) are relative to its file."""
        return self.path.parent if self.path else Path.cwd()

    def where(self, key: str) -> str:
        """``file:line`` of ``key`` for messages (just the file when the line is unknown)."""
        if self.path is None:
            return f"profile {self.name}"
        line = self.lines.get(key)
        return f"{self.path}:{line}" if line else str(self.path)
