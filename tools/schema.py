"""A small JSON-Schema subset for tool arguments, and a validator that explains its errors.

Supported: a top-level ``{"type": "object", "properties": ..., "required": [...],
"additionalProperties": false}`` whose properties have ``type`` string / integer / boolean /
array (with ``items``), plus ``enum``, ``minimum``, ``maximum``, ``default`` and
``description``. Keeping to this subset keeps the schemas readable by small chat templates.

Schemas written elsewhere (the tools a client offers ``mlxterm serve``) go through
``signature`` and ``validate_args`` as well, so those two accept any property: a ``type`` of
number, object or null, a list of types, an array without ``items``, or no ``type`` at all
(any value). They check what such a property states and let the rest through.
"""

from __future__ import annotations

import json
from typing import Any

_TYPES = {"string", "integer", "boolean", "array"}
_PROPERTY_KEYS = {"type", "description", "enum", "minimum", "maximum", "default", "items"}
_OBJECT_KEYS = {"type", "properties", "required", "additionalProperties"}


class ArgumentError(ValueError):
    """Arguments do not match a tool's schema; the message names the problem and the shape."""


def check_schema(name: str, schema: dict[str, Any]) -> None:
    """Raise ValueError when a tool's schema leaves the supported subset (a programming error)."""
    where = f"tool {name!r} schema"
    if schema.get("type") != "object" or set(schema) - _OBJECT_KEYS:
        raise ValueError(f"{where}: top level must be an object using only {sorted(_OBJECT_KEYS)}")
    if schema.get("additionalProperties") is not False:
        raise ValueError(f"{where}: additionalProperties must be false")
    props = schema.get("properties", {})
    for key in schema.get("required", []):
        if key not in props:
            raise ValueError(f"{where}: required {key!r} is not a property")
    for key, prop in props.items():
        extra = set(prop) - _PROPERTY_KEYS
        if extra or prop.get("type") not in _TYPES:
            raise ValueError(f"{where}: property {key!r} uses unsupported {sorted(extra) or prop.get('type')}")
        if prop["type"] == "array" and prop.get("items", {}).get("type") not in _TYPES - {"array"}:
            raise ValueError(f"{where}: array property {key!r} needs items with a scalar type")
        if "description" not in prop:
            raise ValueError(f"{where}: property {key!r} has no description")


def signature(name: str, schema: dict[str, Any]) -> str:
    """A one-line shape such as ``bash(command: string, timeout_s?: integer 1..600 = 30)``."""
    required = set(_required(schema))
    parts = []
    for key, prop in _properties(schema).items():
        kind = _type_name(prop)
        if isinstance(prop.get("enum"), list):
            kind = " | ".join(json.dumps(v) for v in prop["enum"])
        if "minimum" in prop or "maximum" in prop:
            kind += f" {prop.get('minimum', '')}..{prop.get('maximum', '')}"
        if "default" in prop:
            kind += f" = {json.dumps(prop['default'])}"
        parts.append(f"{key}{'' if key in required else '?'}: {kind}")
    return f"{name}({', '.join(parts)})"


def _properties(schema: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """``properties``, each a dict (a property given as ``true`` or junk allows any value)."""
    props = schema.get("properties")
    if not isinstance(props, dict):
        return {}
    return {k: p if isinstance(p, dict) else {} for k, p in props.items()}


def _required(schema: dict[str, Any]) -> list[str]:
    req = schema.get("required")
    return [k for k in req if isinstance(k, str)] if isinstance(req, list) else []


def validate_args(name: str, schema: dict[str, Any], args: Any) -> dict[str, Any]:
    """Return ``args`` checked against ``schema``, with defaults filled in.

    Integral floats (``30.0``) are accepted as integers since JSON does not distinguish them.
    Raises ArgumentError naming the first problem plus the expected call shape.
    """
    shape = signature(name, schema)
    if args is None:
        args = {}
    if not isinstance(args, dict):
        raise ArgumentError(f"{name}: arguments must be a JSON object, got {_json_type(args)}; expected {shape}")
    props = _properties(schema)
    unknown = [k for k in args if k not in props]
    if unknown:
        raise ArgumentError(f"{name}: unknown argument {unknown[0]!r}; expected {shape}")
    for key in _required(schema):
        if key not in args or args[key] is None:
            raise ArgumentError(f"{name}: missing required argument {key!r}; expected {shape}")
    out: dict[str, Any] = {}
    for key, prop in props.items():
        if key not in args or args[key] is None:  # models often send null for "not given"
            if "default" in prop:
                out[key] = prop["default"]
            continue
        out[key] = _check_value(name, key, prop, args[key], shape)
    return out


def _check_value(name: str, key: str, prop: dict[str, Any], value: Any, shape: str) -> Any:
    value = _coerce(prop, value)
    if not _is_type(prop, value):
        raise ArgumentError(
            f"{name}: argument {key!r} must be {_type_name(prop)}, got {_json_type(value)} "
            f"{_preview(value)}; expected {shape}"
        )
    if isinstance(prop.get("enum"), list) and value not in prop["enum"]:
        allowed = ", ".join(json.dumps(v) for v in prop["enum"])
        raise ArgumentError(f"{name}: argument {key!r} must be one of {allowed}, got {_preview(value)}")
    if not (_is_number(value) and all(_is_number(prop.get(k, 0)) for k in ("minimum", "maximum"))):
        return value
    if "minimum" in prop and value < prop["minimum"]:
        raise ArgumentError(f"{name}: argument {key!r} must be >= {prop['minimum']}, got {value}")
    if "maximum" in prop and value > prop["maximum"]:
        raise ArgumentError(f"{name}: argument {key!r} must be <= {prop['maximum']}, got {value}")
    return value


def _kinds(prop: Any) -> list[str] | None:
    """The JSON types a property allows; None when it does not say (any value)."""
    kind = prop.get("type") if isinstance(prop, dict) else None
    if isinstance(kind, str):
        return [kind]
    if isinstance(kind, list) and kind and all(isinstance(k, str) for k in kind):
        return kind
    return None


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _coerce(prop: dict[str, Any], value: Any) -> Any:
    kinds = _kinds(prop) or []
    if "integer" in kinds and "number" not in kinds and isinstance(value, float) and value.is_integer():
        return int(value)
    return value


def _is_type(prop: Any, value: Any) -> bool:
    kinds = _kinds(prop)
    return kinds is None or any(_is_kind(kind, prop, value) for kind in kinds)


def _is_kind(kind: str, prop: dict[str, Any], value: Any) -> bool:
    if kind == "string":
        return isinstance(value, str)
    if kind == "boolean":
        return isinstance(value, bool)
    if kind == "integer":  # bool is an int subclass in Python but not in JSON
        return isinstance(value, int) and not isinstance(value, bool)
    if kind == "number":
        return _is_number(value)
    if kind == "object":
        return isinstance(value, dict)
    if kind == "null":
        return value is None
    if kind == "array":
        items = prop.get("items")
        return isinstance(value, list) and (not isinstance(items, dict) or all(_is_type(items, v) for v in value))
    return True  # a type keyword this subset does not know: not ours to reject


def _type_name(prop: Any) -> str:
    kinds = _kinds(prop)
    if kinds is None:
        return "any"
    names = []
    for kind in kinds:
        items = prop.get("items")
        if kind == "array" and isinstance(items, dict):
            names.append(f"array of {_type_name(items)}")
        else:
            names.append(kind)
    return " | ".join(names)


def _json_type(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int):
        return "integer"
    if isinstance(value, float):
        return "number"
    if isinstance(value, str):
        return "string"
    if isinstance(value, list):
        return "array"
    if isinstance(value, dict):
        return "object"
    return type(value).__name__


def _preview(value: Any) -> str:
    text = json.dumps(value, default=str)
    return f"({text[:60]}…)" if len(text) > 60 else f"({text})"
