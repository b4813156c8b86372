"""OpenAI response objects built from the engine's ``Done`` and stream events.

Chat: ``chat.completion`` and ``chat.completion.chunk``; text: ``text_completion``. ``usage``
carries ``prompt_tokens_details.cached_tokens`` (prompt tokens restored from a KV checkpoint).
"""

from __future__ import annotations

import time
import uuid
from typing import Any

from engine.serving.events import Done, TokenLogprobs


def new_id(kind: str) -> str:
    return f"{'chatcmpl' if kind == 'chat' else 'cmpl'}-{uuid.uuid4().hex[:24]}"


def finish_reason(done: Done, called: bool) -> str:
    if called:
        return "tool_calls"
    return "length" if done.finish_reason == "length" else "stop"


def usage(done: Done) -> dict[str, Any]:
    u = done.usage
    return {
        "prompt_tokens": u.prompt_tokens,
        "completion_tokens": u.completion_tokens,
        "total_tokens": u.prompt_tokens + u.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": u.cached_tokens},
    }


def chat_completion(cid: str, model: str, done: Done, content: str, calls: list[dict], reasoning: str,
                    logprobs: dict | None) -> dict[str, Any]:
    message: dict[str, Any] = {"role": "assistant", "content": content if content or not calls else None}
    if calls:
        message["tool_calls"] = [{k: v for k, v in c.items() if k != "index"} for c in calls]
    if reasoning:
        message["reasoning_content"] = reasoning
    return {
        "id": cid,
        "object": "chat.completion",
        "created": int(time.time()),
        "model": model,
        "choices": [{"index": 0, "message": message, "logprobs": logprobs,
                     "finish_reason": finish_reason(done, bool(calls))}],
        "usage": usage(done),
    }


def _chunk(cid: str, obj: str, model: str, created: int, choice: dict[str, Any]) -> dict[str, Any]:
    """One streamed object: a single choice at index 0."""
    return {"id": cid, "object": obj, "created": created, "model": model, "choices": [{"index": 0, **choice}]}


def chat_chunk(cid: str, model: str, created: int, delta: dict[str, Any], finish: str | None = None,
               logprobs: dict | None = None) -> dict[str, Any]:
    return _chunk(cid, "chat.completion.chunk", model, created,
                  {"delta": delta, "logprobs": logprobs, "finish_reason": finish})


def usage_chunk(cid: str, kind: str, model: str, created: int, done: Done) -> dict[str, Any]:
    obj = "chat.completion.chunk" if kind == "chat" else "text_completion"
    return {"id": cid, "object": obj, "created": created, "model": model, "choices": [],
            "usage": usage(done)}


def text_completion(cid: str, model: str, done: Done, text: str, logprobs: dict | None) -> dict[str, Any]:
    return {
        "id": cid,
        "object": "text_completion",
        "created": int(time.time()),
        "model": model,
        "choices": [{"index": 0, "text": text, "logprobs": logprobs,
                     "finish_reason": finish_reason(done, False)}],
        "usage": usage(done),
    }


def text_chunk(cid: str, model: str, created: int, text: str, finish: str | None = None,
               logprobs: dict | None = None) -> dict[str, Any]:
    return _chunk(cid, "text_completion", model, created, {"text": text, "logprobs": logprobs, "finish_reason": finish})


# -- logprobs ----------------------------------------------------------------------------------
def _token_bytes(tokenizer, token: int) -> bytes:
    """The bytes one token adds to the text (a byte-level token may hold part of a character)."""
    piece = tokenizer.piece(token)
    return piece if isinstance(piece, bytes) else piece.encode()


def _token_text(tokenizer, token: int) -> str:
    return _token_bytes(tokenizer, token).decode("utf-8", "replace")


def chat_logprobs(tokenizer, items: list[TokenLogprobs], top: int) -> dict[str, Any]:
    """``{"content": [...]}`` for chat: each token with its logprob and ``top`` alternatives."""
    def entry(tok: int, lp: float) -> dict[str, Any]:
        raw = _token_bytes(tokenizer, tok)
        return {"token": raw.decode("utf-8", "replace"), "logprob": lp, "bytes": list(raw)}

    content = []
    for it in items:
        e = entry(it.token, it.logprob)
        e["top_logprobs"] = [entry(t, lp) for t, lp in it.top[:top]]
        content.append(e)
    return {"content": content}


def text_logprobs(tokenizer, items: list[TokenLogprobs], top: int, offset: int = 0) -> dict[str, Any]:
    """The legacy completions shape: tokens, token_logprobs, top_logprobs, text_offset."""
    tokens, lps, tops, offsets = [], [], [], []
    pos = offset
    for it in items:
        text = _token_text(tokenizer, it.token)
        tokens.append(text)
        lps.append(it.logprob)
        tops.append({_token_text(tokenizer, t): lp for t, lp in it.top[:top]} if top else None)
        offsets.append(pos)
        pos += len(text)
    return {"tokens": tokens, "token_logprobs": lps, "top_logprobs": tops, "text_offset": offsets}
