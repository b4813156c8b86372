"""tools/schema.py: signatures and argument checks for the agents' subset and for any schema a
client offers (number, object, null, type lists, arrays without items, no type at all)."""

from __future__ import annotations

import pytest

from tools.schema import ArgumentError, check_schema, signature, validate_args

OURS = {"type": "object", "additionalProperties": False, "required": ["command"], "properties": {
    "command": {"type": "string", "description": "the command"},
    "timeout_s": {"type": "integer", "minimum": 1, "maximum": 600, "default": 30, "description": "limit"},
    "paths": {"type": "array", "items": {"type": "string"}, "description": "files"},
}}
CLIENT = {"type": "object", "required": ["query"], "properties": {
    "query": {"description": "no type: any value"},
    "ratio": {"type": "number", "minimum": 0, "maximum": 1},
    "filters": {"type": "object", "properties": {"lang": {"type": "string"}}},
    "tags": {"type": "array"},
    "matrix": {"type": "array", "items": {"type": "array", "items": {"type": "number"}}},
    "limit": {"type": ["integer", "null"]},
    "mode": {"enum": ["fast", "slow"]},
    "odd": True,
}}


def test_our_subset_is_unchanged():
    check_schema("bash", OURS)
    assert signature("bash", OURS) == "bash(command: string, timeout_s?: integer 1..600 = 30, paths?: array of string)"
    assert validate_args("bash", OURS, {"command": "ls", "timeout_s": 5.0}) == {"command": "ls", "timeout_s": 5}
    with pytest.raises(ArgumentError, match="must be <= 600"):
        validate_args("bash", OURS, {"command": "ls", "timeout_s": 900})
    with pytest.raises(ArgumentError, match="'paths' must be array of string, got array"):
        validate_args("bash", OURS, {"command": "ls", "paths": ["a", 1]})
    with pytest.raises(ArgumentError, match="unknown argument 'x'"):
        validate_args("bash", OURS, {"command": "ls", "x": 1})


def test_client_schemas_get_a_signature():
    assert signature("search", CLIENT) == (
        "search(query: any, ratio?: number 0..1, filters?: object, tags?: array, "
        "matrix?: array of array of number, limit?: integer | null, mode?: \"fast\" | \"slow\", odd?: any)")
    with pytest.raises(ValueError):  # our own tools still keep to the subset
        check_schema("search", {**CLIENT, "additionalProperties": False})


def test_client_schemas_check_what_they_state():
    args = {"query": {"free": "form"}, "ratio": 0.25, "filters": {"lang": "en"}, "tags": [1, "a"],
            "matrix": [[1, 2.5], []], "limit": None, "mode": "fast", "odd": [1]}
    assert validate_args("search", CLIENT, args) == {k: v for k, v in args.items() if v is not None}
    assert validate_args("search", CLIENT, {"query": 3, "ratio": 1, "limit": 7})["ratio"] == 1
    bad = [({"ratio": True}, "'ratio' must be number, got boolean"),
           ({"ratio": 2}, "'ratio' must be <= 1"),
           ({"filters": ["en"]}, "'filters' must be object, got array"),
           ({"tags": "a"}, "'tags' must be array, got string"),
           ({"matrix": [[1, "x"]]}, "'matrix' must be array of array of number"),
           ({"limit": 1.5}, "'limit' must be integer | null, got number"),
           ({"mode": "medium"}, "'mode' must be one of \"fast\", \"slow\"")]
    for extra, message in bad:
        with pytest.raises(ArgumentError, match=message.replace("|", r"\|")):
            validate_args("search", CLIENT, {"query": "q", **extra})
    with pytest.raises(ArgumentError, match="missing required argument 'query'"):
        validate_args("search", CLIENT, {"ratio": 0.5})


def test_malformed_schema_parts_do_not_crash():
    odd = {"type": "object", "properties": {"a": {"type": 7}, "b": {"type": "integer", "minimum": "1"}},
           "required": "a"}
    assert signature("f", odd) == "f(a?: any, b?: integer 1..)"
    assert validate_args("f", odd, {"a": [1], "b": 0}) == {"a": [1], "b": 0}
    assert validate_args("f", {"type": "object", "properties": None}, {}) == {}
