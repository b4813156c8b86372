"""OpenAI request bodies checked and turned into engine requests.

``chat_job`` and ``completion_job`` take a decoded JSON body and return a ``Job``: the prompt's
token ids, the sampling parameters, the tools setup and what the reply should carry. Anything
the server cannot honour is a 400 naming the field (``APIError``), not a silent default.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from app.serve.errors import bad_request
from app.serve.toolcalls import ToolSetup, constraint_for, parse_tools, prompt_messages

_ROLES = ("system", "developer", "user", "assistant", "tool")
MAX_TOP_LOGPROBS = 20


@dataclass
class Job:
    """One request, ready for the engine."""

    kind: str  # "chat" | "text"
    model: str
    prompt_ids: list[int]
    overrides: dict[str, Any]  # sampling overrides for engine.sampling()
    stream: bool = False
    include_usage: bool = False
    logprobs: int | None = None  # None: not asked; else how many alternatives per token
    tools: ToolSetup | None = None
    constraint: Any = None
    echo_prompt: str | None = None  # completions with echo: the prompt text goes first


def chat_job(body: Mapping[str, Any], engine) -> Job:
    """A ``POST /v1/chat/completions`` body as a Job (tokenizes: run it off the event loop)."""
    if engine.completion_mode:
        raise bad_request(f"profile {engine.profile.name} has no chat template (completion mode); "
                          "use /v1/completions", "messages")
    messages = _messages(body.get("messages"))
    tools = parse_tools(body)
    overrides = _sampling(body, max_tokens_keys=("max_completion_tokens", "max_tokens"))
    logprobs = None
    if _get(body, "logprobs", bool, False):
        logprobs = _get(body, "top_logprobs", int, 0)
        if not 0 <= logprobs <= MAX_TOP_LOGPROBS:
            raise bad_request(f"top_logprobs must be between 0 and {MAX_TOP_LOGPROBS}", "top_logprobs")
    elif body.get("top_logprobs") is not None:
        raise bad_request("top_logprobs needs logprobs: true", "top_logprobs")
    msgs, rendered_tools = prompt_messages(messages, tools, engine)
    try:
        ids = engine.chat_prompt(msgs, rendered_tools)
    except Exception as e:  # a template that refuses the conversation (e.g. roles out of order)
        raise bad_request(f"the chat template cannot render these messages: {e}", "messages") from None
    job = Job("chat", _model(body), ids, overrides, tools=tools, logprobs=logprobs)
    _stream_fields(body, job)
    return job


def completion_job(body: Mapping[str, Any], engine) -> Job:
    """A ``POST /v1/completions`` body as a Job (raw text: no chat template)."""
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, str):
        if not prompt:
            raise bad_request("prompt is empty", "prompt")
        ids = engine.raw_prompt(prompt)
        text = prompt
    elif isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        width = engine.logits_width
        if any(not 0 <= t < width for t in prompt):
            raise bad_request(f"prompt token ids must be in [0, {width})", "prompt")
        ids = list(prompt)
        text = engine.tokenizer.decode(ids)
    else:
        raise bad_request("prompt must be a non-empty string or a list of token ids "
                          "(one prompt per request)", "prompt")
    if body.get("suffix"):
        raise bad_request("suffix is not supported", "suffix")
    if _get(body, "best_of", int, 1) != 1:
        raise bad_request("best_of must be 1", "best_of")
    overrides = _sampling(body, max_tokens_keys=("max_tokens",), default_max=16)
    logprobs = body.get("logprobs")
    if logprobs is not None:
        logprobs = _get(body, "logprobs", int, 0)
        if not 0 <= logprobs <= MAX_TOP_LOGPROBS:
            raise bad_request(f"logprobs must be between 0 and {MAX_TOP_LOGPROBS}", "logprobs")
    echo = text if _get(body, "echo", bool, False) else None
    job = Job("text", _model(body), ids, overrides, logprobs=logprobs, echo_prompt=echo)
    _stream_fields(body, job)
    return job


def attach_constraint(job: Job, engine, max_tokens: int) -> None:
    job.constraint = constraint_for(job.tools, engine, max_tokens)


# -- fields -------------------------------------------------------------------------------------
def _messages(raw: Any) -> list[dict[str, Any]]:
    if not isinstance(raw, list) or not raw:
        raise bad_request("messages must be a non-empty list", "messages")
    out = []
    for i, m in enumerate(raw):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise bad_request(f"{where} must be an object", where)
        role = m.get("role")
        if role not in _ROLES:
            raise bad_request(f"{where}.role must be one of {', '.join(_ROLES)}, got {role!r}", f"{where}.role")
        msg: dict[str, Any] = {"role": "system" if role == "developer" else role,
                               "content": _content(m.get("content"), f"{where}.content", role)}
        if role == "assistant" and m.get("tool_calls"):
            msg["tool_calls"] = _calls(m["tool_calls"], f"{where}.tool_calls")
        if role == "tool":
            if isinstance(m.get("tool_call_id"), str):
                msg["tool_call_id"] = m["tool_call_id"]
            if isinstance(m.get("name"), str):
                msg["name"] = m["name"]
        out.append(msg)
    return out


def _content(content: Any, where: str, role: str) -> str:
    if content is None:
        if role == "assistant":
            return ""
        raise bad_request(f"{where} is required for {role} messages", where)
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for j, part in enumerate(content):
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise bad_request(f"{where}[{j}]: only text parts are supported, got {kind!r}", f"{where}[{j}]")
            parts.append(part["text"])
        return "".join(parts)
    raise bad_request(f"{where} must be a string or a list of text parts", where)


def _calls(raw: Any, where: str) -> list[dict[str, Any]]:
    if not isinstance(raw, list):
        raise bad_request(f"{where} must be a list", where)
    out = []
    for j, c in enumerate(raw):
        fn = c.get("function") if isinstance(c, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise bad_request(f"{where}[{j}] must have function.name", f"{where}[{j}]")
        args = fn.get("arguments", "{}")
        if isinstance(args, str):
            try:
                args = json.loads(args) if args.strip() else {}
            except json.JSONDecodeError:
                raise bad_request(f"{where}[{j}].function.arguments is not valid JSON",
                                  f"{where}[{j}].function.arguments") from None
        if not isinstance(args, dict):
            raise bad_request(f"{where}[{j}].function.arguments must be a JSON object",
                              f"{where}[{j}].function.arguments")
        out.append({"name": fn["name"], "arguments": args})
    return out


def _sampling(body: Mapping[str, Any], max_tokens_keys: tuple[str, ...], default_max: int | None = None) -> dict:
    if _get(body, "n", int, 1) != 1:
        raise bad_request("n must be 1 (one choice per request)", "n")
    for name in ("presence_penalty", "frequency_penalty"):
        if _get(body, name, float, 0.0) != 0.0:
            raise bad_request(f"{name} is not supported (use repetition_penalty)", name)
    fmt = body.get("response_format")
    if fmt is not None and (not isinstance(fmt, dict) or fmt.get("type") != "text"):
        raise bad_request('response_format: only {"type": "text"} is supported', "response_format")
    out: dict[str, Any] = {}
    temp = _get(body, "temperature", float, None)
    if temp is not None and not 0.0 <= temp <= 2.0:
        raise bad_request("temperature must be between 0 and 2", "temperature")
    out["temperature"] = temp
    top_p = _get(body, "top_p", float, None)
    if top_p is not None and not 0.0 < top_p <= 1.0:
        raise bad_request("top_p must be in (0, 1]", "top_p")
    out["top_p"] = top_p
    top_k = _get(body, "top_k", int, None)  # extensions many servers accept
    if top_k is not None and top_k < 0:
        raise bad_request("top_k must be >= 0", "top_k")
    out["top_k"] = top_k
    min_p = _get(body, "min_p", float, None)
    if min_p is not None and not 0.0 <= min_p < 1.0:
        raise bad_request("min_p must be in [0, 1)", "min_p")
    out["min_p"] = min_p
    rep = _get(body, "repetition_penalty", float, None)
    if rep is not None and rep <= 0:
        raise bad_request("repetition_penalty must be > 0", "repetition_penalty")
    out["repetition_penalty"] = rep
    out["seed"] = _get(body, "seed", int, None)
    out["ignore_eos"] = _get(body, "ignore_eos", bool, None)  # as vLLM: fixed lengths for benchmarks
    max_tokens = default_max
    for key in max_tokens_keys:
        value = _get(body, key, int, None)
        if value is not None:
            if value < 1:
                raise bad_request(f"{key} must be >= 1", key)
            max_tokens = value
            break
    out["max_tokens"] = max_tokens
    stop = body.get("stop")
    if isinstance(stop, str):
        stop = [stop]
    if stop is not None:
        if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop):
            raise bad_request("stop must be a string or a list of non-empty strings", "stop")
        out["stop"] = tuple(stop) if stop else None
    return out


def _stream_fields(body: Mapping[str, Any], job: Job) -> None:
    job.stream = _get(body, "stream", bool, False)
    opts = body.get("stream_options")
    if opts is not None:
        if not isinstance(opts, dict):
            raise bad_request("stream_options must be an object", "stream_options")
        if not job.stream:
            raise bad_request("stream_options needs stream: true", "stream_options")
        job.include_usage = bool(opts.get("include_usage", False))


def _model(body: Mapping[str, Any]) -> str:
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise bad_request("model is required (see GET /v1/models)", "model")
    return model


def _get(body: Mapping[str, Any], name: str, kind: type, default: Any) -> Any:
    """``body[name]`` as ``kind`` (null or absent: ``default``); a 400 for another type."""
    value = body.get(name)
    if value is None:
        return default
    if kind is float and isinstance(value, int | float) and not isinstance(value, bool):
        return float(value)
    if kind is int and isinstance(value, int) and not isinstance(value, bool):
        return value
    if kind is bool and isinstance(value, bool):
        return value
    names = {float: "a number", int: "an integer", bool: "a boolean"}
    raise bad_request(f"{name} must be {names[kind]}, got {json.dumps(value)[:40]}", name)
