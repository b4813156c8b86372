"""YAML profiles: find, load and validate presets, and check that they can run.

Shipped presets live in the repo's ``profiles/`` directory; a user's
``config_dir()/profiles/NAME.yaml`` overrides a shipped preset of the same name. Validation
walks the YAML node tree (``yaml.compose``) so every problem names ``file:line``, the key
path, the bad value and what is allowed; all problems in a file are reported at once.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import engine
from engine import paths
from engine.errors import CatalogError, MlxtermError, ModelLoadError, ProfileError
from engine.profile_schema import (
    BAD,
    SECTIONS,
    TOP_LEVEL_TEXT,
    AgentConfig,
    CacheConfig,
    ChatConfig,
    ContextConfig,
    KVCacheConfig,
    ModelConfig,
    Problems,
    Profile,
    SamplingConfig,
    SpeculationConfig,
    SpeechConfig,
    Text,
    describe,
    format_size,
    line_of,
    plain,
    suggest,
)

import yaml

__all__ = [
    "DEFAULT_PROFILE", "Profile", "ProfileInfo", "CheckResult", "ProfileValidationError",
    "ModelConfig", "KVCacheConfig", "SpeculationConfig", "SamplingConfig", "ContextConfig",
    "CacheConfig", "ChatConfig", "AgentConfig", "SpeechConfig",
    "shipped_dir", "user_dir", "find_profile", "load_profile", "parse_profile", "list_profiles",
    "check_profile", "profile_to_dict",
]

DEFAULT_PROFILE = "smollm2-135m"
SUFFIXES = (".yaml", ".yml")


class ProfileValidationError(ProfileError):
    """An invalid profile file; ``problems`` holds one ``file:line: key: message`` per problem."""

    def __init__(self, problems: list[str]) -> None:
        super().__init__("\n".join(problems))
        self.problems = problems


@dataclass(frozen=True)
class ProfileInfo:
    name: str
    path: Path
    source: str  # "shipped" or "user"
    description: str
    overrides_shipped: bool = False


@dataclass(frozen=True)
class CheckResult:
    """``valid`` is False when any problem was found; warnings do not make a profile invalid."""

    target: str
    valid: bool
    problems: tuple[str, ...]
    warnings: tuple[str, ...] = ()
    profile: Profile | None = None
    model_path: Path | None = None


def shipped_dir() -> Path:
    return Path(engine.__file__).resolve().parent.parent / "profiles"


def user_dir() -> Path:
    return paths.config_dir() / "profiles"


def _profiles_in(directory: Path) -> dict[str, Path]:
    if not directory.is_dir():
        return {}
    found = {}
    for p in sorted(directory.iterdir()):
        if p.suffix in SUFFIXES and p.is_file() and not p.name.startswith("."):
            found.setdefault(p.stem, p)
    return found


def _looks_like_path(name_or_path: str) -> bool:
    return "/" in name_or_path or "\\" in name_or_path or name_or_path.endswith(SUFFIXES)


def find_profile(name_or_path: str) -> Path:
    """The YAML file for a profile name (user dir first, then shipped) or an explicit path."""
    if _looks_like_path(name_or_path):
        path = Path(name_or_path).expanduser()
        if not path.is_file():
            raise ProfileError(f"profile file not found: {path}")
        return path.resolve()
    user, shipped = _profiles_in(user_dir()), _profiles_in(shipped_dir())
    path = user.get(name_or_path) or shipped.get(name_or_path)
    if path is None:
        names = sorted(set(user) | set(shipped))
        raise ProfileError(f"no profile named {name_or_path!r}{suggest(name_or_path, names)} "
                           f"(available: {', '.join(names) or 'none'})")
    return path


def load_profile(name_or_path: str) -> Profile:
    """Load and validate a profile by name or path; raises ``ProfileError`` naming every problem."""
    path = find_profile(name_or_path)
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise ProfileError(f"cannot read profile {path}: {e}") from e
    return parse_profile(text, path)


def parse_profile(text: str, path: Path) -> Profile:
    """Validate YAML ``text`` read from ``path`` into a Profile (all problems reported together)."""
    problems = Problems(str(path))
    try:
        root = yaml.compose(text, Loader=yaml.SafeLoader)
    except yaml.MarkedYAMLError as e:
        mark = e.problem_mark or e.context_mark
        line, col = (mark.line + 1, mark.column + 1) if mark else (1, 1)
        reason = e.problem or e.context or "invalid YAML"
        raise ProfileValidationError([f"{path}:{line}:{col}: YAML syntax error: {reason}"]) from None
    except yaml.YAMLError as e:
        raise ProfileValidationError([f"{path}:1: YAML error: {e}"]) from None
    if root is None:
        raise ProfileValidationError([f"{path}:1: the profile is empty; it needs at least model.source"])
    if not isinstance(root, yaml.MappingNode):
        raise ProfileValidationError(
            [f"{path}:{line_of(root)}: expected a mapping of sections, got {describe(plain(root))}"])

    lines: dict[str, int] = {}
    top: dict[str, Any] = {}
    sections: dict[str, Any] = {}
    allowed = list(TOP_LEVEL_TEXT) + list(SECTIONS)
    for key_node, value_node in _mapping_items(root, "", problems):
        key = plain(key_node)
        lines[str(key)] = line_of(key_node)
        if key in SECTIONS:
            sections[key] = _section(SECTIONS[key], key, key_node, value_node, problems, lines)
        elif key in TOP_LEVEL_TEXT:
            top[key] = Text().convert(value_node, key, problems)
        else:
            problems.add(line_of(key_node), str(key), _unknown(key, allowed))
    if "model" not in sections:
        problems.add(1, "model.source", "missing; every profile needs model.source "
                     "(a catalogue name, a path, or pkg:PACKAGE/file)")
    model = sections.get("model")
    if isinstance(model, ModelConfig) and bool(model.source) == (model.remote is not None):
        problems.add(lines.get("model", 1), "model.source",
                     "missing; every profile needs model.source (a catalogue name, a path, or "
                     "pkg:PACKAGE/file) or model.remote" if not model.source else
                     "give model.source or model.remote, not both")
    _cross_checks(sections, lines, problems)
    if problems:
        raise ProfileValidationError(problems.lines())
    return Profile(
        name=top.get("name") or path.stem,
        description=top.get("description") or "",
        path=path,
        lines=lines,
        **sections,
    )


def _mapping_items(node: yaml.MappingNode, prefix: str, problems: Problems):
    """Key/value node pairs, reporting duplicate keys (PyYAML would silently keep the last)."""
    seen: dict[Any, int] = {}
    for key_node, value_node in node.value:
        key = plain(key_node)
        if not isinstance(key, str):
            problems.add(line_of(key_node), f"{prefix}{key}", f"keys must be strings, got {describe(key)}")
            continue
        if key in seen:
            problems.add(line_of(key_node), f"{prefix}{key}", f"duplicate key (first set on line {seen[key]})")
            continue
        seen[key] = line_of(key_node)
        yield key_node, value_node


def _unknown(key: Any, allowed: list[str]) -> str:
    return f"unknown key{suggest(key, allowed)} (allowed: {', '.join(allowed)})"


def _section(cls: type, name: str, key_node: yaml.Node, node: yaml.Node, problems: Problems,
             lines: dict[str, int]) -> Any:
    """Validate one section mapping into its dataclass (defaults for keys not given)."""
    fields = {f.name: f for f in dataclasses.fields(cls)}
    if isinstance(node, yaml.ScalarNode) and plain(node) is None:
        node = yaml.MappingNode("tag:yaml.org,2002:map", [], start_mark=node.start_mark)
    if not isinstance(node, yaml.MappingNode):
        problems.add(line_of(node), name, f"expected a mapping, got {describe(plain(node))} "
                     f"(allowed keys: {', '.join(fields)})")
        return BAD
    values: dict[str, Any] = {}
    for k_node, v_node in _mapping_items(node, f"{name}.", problems):
        key = plain(k_node)
        path = f"{name}.{key}"
        lines[path] = line_of(k_node)
        if key not in fields:
            problems.add(line_of(k_node), path, _unknown(key, list(fields)))
            continue
        values[key] = fields[key].metadata["rule"].convert(v_node, path, problems)
    for f in fields.values():
        required = f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
        if required and f.name not in values:
            problems.add(line_of(key_node), f"{name}.{f.name}", "missing; this key is required")
            return BAD
    if any(v is BAD for v in values.values()):
        return BAD
    return cls(**values)


def _cross_checks(sections: dict[str, Any], lines: dict[str, int], problems: Problems) -> None:
    _speculation_checks(sections.get("speculation"), lines, problems)
    sampling, context = sections.get("sampling"), sections.get("context")
    max_context = context.max_context if isinstance(context, ContextConfig) else ContextConfig().max_context
    if isinstance(sampling, SamplingConfig) and sampling.max_tokens >= max_context:
        problems.add(lines.get("sampling.max_tokens", lines.get("sampling", 1)), "sampling.max_tokens",
                     f"{sampling.max_tokens} is out of range (allowed: an integer smaller than "
                     f"context.max_context, {max_context})")


def _speculation_checks(spec: Any, lines: dict[str, int], problems: Problems) -> None:
    if not isinstance(spec, SpeculationConfig):
        return
    at = lines.get("speculation", 1)
    if spec.mode == "draft" and not spec.draft_model:
        problems.add(lines.get("speculation.mode", at), "speculation.draft_model",
                     "missing; mode: draft needs draft_model (a catalogue name, a profile or a path)")
    if spec.min_draft_tokens > spec.num_draft_tokens:
        problems.add(lines.get("speculation.min_draft_tokens", at), "speculation.min_draft_tokens",
                     f"{spec.min_draft_tokens} is out of range (allowed: an integer <= "
                     f"speculation.num_draft_tokens, {spec.num_draft_tokens})")
    if spec.lookup_max_ngram < spec.lookup_ngram:
        problems.add(lines.get("speculation.lookup_max_ngram", at), "speculation.lookup_max_ngram",
                     f"{spec.lookup_max_ngram} is out of range (allowed: an integer >= "
                     f"speculation.lookup_ngram, {spec.lookup_ngram})")


def list_profiles() -> list[ProfileInfo]:
    """Every profile by name: user profiles replace shipped ones with the same name."""
    shipped, user = _profiles_in(shipped_dir()), _profiles_in(user_dir())
    infos = [ProfileInfo(n, p, "shipped", _description(p)) for n, p in shipped.items() if n not in user]
    infos += [ProfileInfo(n, p, "user", _description(p), overrides_shipped=n in shipped)
              for n, p in user.items()]
    return sorted(infos, key=lambda i: i.name)


def _description(path: Path) -> str:
    """The description for listings; a broken file is listed, not fatal (``check`` explains)."""
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, yaml.YAMLError):
        return "(invalid YAML: run `mlxterm profile check`)"
    if isinstance(data, dict) and isinstance(data.get("description"), str):
        return data["description"].strip()
    return ""


def check_profile(name_or_path: str) -> CheckResult:
    """Validate a profile and check that its model (and template, speech models) can be found.

    A catalogue model that is merely not installed yet is a warning (one command fixes it);
    a path that does not exist is a problem ("model not found at <path>").
    """
    from engine.model import catalog

    try:
        profile = load_profile(name_or_path)
    except ProfileValidationError as e:
        return CheckResult(name_or_path, False, tuple(e.problems))
    except ProfileError as e:
        return CheckResult(name_or_path, False, (str(e),))
    problems: list[str] = []
    warnings: list[str] = []
    model_path = None
    source = profile.model.source
    try:
        if profile.model.remote is not None:
            pass  # served elsewhere: `mlxterm doctor` asks the server
        elif source in catalog.CATALOG:
            status = catalog.model_status(source)
            if status.installed:
                model_path = status.path
            else:
                warnings.append(f"{profile.where('model.source')}: model.source: "
                                f"{catalog.not_installed_message(source)}")
        else:
            model_path = catalog.resolve_source(source, profile.base_dir)
    except (CatalogError, ModelLoadError) as e:
        problems.append(f"{profile.where('model.source')}: model.source: {e}")

    draft = profile.speculation.draft_model
    if profile.speculation.mode == "draft" and draft:
        try:
            if draft in catalog.CATALOG:
                if not catalog.model_status(draft).installed:
                    warnings.append(f"{profile.where('speculation.draft_model')}: speculation.draft_model: "
                                    f"{catalog.not_installed_message(draft)}")
            else:
                resolve_draft_source(profile)
        except MlxtermError as e:
            problems.append(f"{profile.where('speculation.draft_model')}: speculation.draft_model: {e}")
    template = profile.chat.template
    if template.endswith(".jinja"):
        template_path = _relative(template, profile.base_dir)
        if not template_path.is_file():
            problems.append(f"{profile.where('chat.template')}: chat.template: "
                            f"template not found at {template_path}")
    for key in ("whisper", "vad"):
        value = getattr(profile.speech, key)
        try:
            if value in catalog.CATALOG:
                if not catalog.model_status(value).installed:
                    raise CatalogError(catalog.not_installed_message(value))
            else:
                catalog.resolve_source(value, profile.base_dir)
        except (CatalogError, ModelLoadError) as e:
            warnings.append(f"{profile.where('speech.' + key)}: speech.{key}: {e} (dictation will not work)")
    return CheckResult(name_or_path, not problems, tuple(problems), tuple(warnings), profile, model_path)


def resolve_draft_source(profile: Profile) -> tuple[Path, str]:
    """The draft model of ``speculation.draft_model`` and its weight format.

    A catalogue name or a model path runs in the target's ``model.weights``; a profile name
    or a ``.yaml`` path lends its own ``model.source`` and ``model.weights``.
    """
    from engine.model import catalog

    name = profile.speculation.draft_model
    if not name:
        raise ProfileError(f"{profile.where('speculation')}: speculation.draft_model: missing for mode: draft")
    if name in catalog.CATALOG:
        return catalog.model_path(name), profile.model.weights
    profile_path = None
    if name.endswith(SUFFIXES):
        profile_path = _relative(name, profile.base_dir)
    elif not _looks_like_path(name):
        profile_path = _profiles_in(user_dir()).get(name) or _profiles_in(shipped_dir()).get(name)
    if profile_path is not None:
        draft = load_profile(str(profile_path))
        return catalog.resolve_source(draft.model.source, draft.base_dir), draft.model.weights
    return catalog.resolve_source(name, profile.base_dir), profile.model.weights


def _relative(value: str, base_dir: Path) -> Path:
    p = Path(value).expanduser()
    return p if p.is_absolute() else base_dir / p


def profile_to_dict(profile: Profile, sizes_as_text: bool = False) -> dict[str, Any]:
    """The profile as plain YAML/JSON-ready data, every default filled in.

    The result loads back as an equivalent profile. ``sizes_as_text`` writes byte counts
    as ``2GiB`` where exact (for people); otherwise they stay integers (for programs).
    """
    out: dict[str, Any] = {"name": profile.name}
    if profile.description:  # an empty one is absent (a present one must not be empty)
        out["description"] = profile.description
    for section in SECTIONS:
        values = {}
        for f in dataclasses.fields(getattr(profile, section)):
            value = getattr(getattr(profile, section), f.name)
            if isinstance(value, tuple):
                value = list(value)
            elif isinstance(value, dict):
                value = dict(value)
            elif sizes_as_text and f.name.endswith("_bytes"):
                value = format_size(value)
            values[f.name] = value
        out[section] = values
    return out
