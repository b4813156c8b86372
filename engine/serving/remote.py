"""A remote profile's model: chat over an OpenAI-compatible server's streaming API.

``RemoteChat(profile).stream(messages, params)`` yields the same events a local request does
(``TextDelta``, ``ReasoningDelta``, then one ``Done``), so callers treat both alike. Timings
come from the stream (time to first token, decode rate), cached tokens from ``usage`` when
the server reports ``prompt_tokens_details.cached_tokens``. A server that cannot be reached,
times out or answers with an error ends in ``Done(finish_reason="error")`` with one clear line.
The client is the standard library's http.client: one POST, server-sent events read line by line.
A ``Hangup`` passed to ``stream`` lets another thread cancel the turn at once: it shuts the
socket down, so a read blocked on a slow server returns and the turn ends as "cancelled"
(the server sees the client hang up and stops generating).
"""

from __future__ import annotations

import http.client
import json
import os
import socket
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from typing import Any
from urllib.parse import urlsplit

from engine.errors import MlxtermError
from engine.generation.sampling import SamplingParams
from engine.profiles import Profile
from engine.serving.events import (
    Done,
    Event,
    ReasoningDelta,
    TextDelta,
    Timings,
    ToolCallDelta,
    Usage,
)

SERVER_CACHE = "server"  # Done.cache_source when the server reports cached prompt tokens


class Hangup:
    """Cancels one streaming request from any thread by shutting its connection down."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._conn: http.client.HTTPConnection | None = None
        self.requested = False

    def attach(self, conn: http.client.HTTPConnection) -> None:
        with self._lock:
            self._conn = conn

    def connected(self) -> None:
        """Called once the request is sent: a hang-up asked for while connecting happens now."""
        with self._lock:
            if self.requested:
                _shutdown(self._conn)

    def __call__(self) -> None:
        with self._lock:
            self.requested = True
            _shutdown(self._conn)


def _shutdown(conn: http.client.HTTPConnection | None) -> None:
    sock = getattr(conn, "sock", None)
    if sock is not None:
        try:
            sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass  # already closed


class RemoteChat:
    """Chat completions against ``profile.model.remote`` (base_url, model, api_key_env)."""

    def __init__(self, profile: Profile):
        remote = profile.model.remote
        if remote is None:
            raise MlxtermError(f"profile {profile.name} has no model.remote")
        self.profile = profile
        self.remote = remote
        parts = urlsplit(remote.base_url.rstrip("/"))
        self._https = parts.scheme == "https"
        self._host = parts.hostname or "localhost"
        self._port = parts.port
        self._path = parts.path
        self.api_key = None
        if remote.api_key_env:
            self.api_key = os.environ.get(remote.api_key_env) or None
            if self.api_key is None:
                raise MlxtermError(f"profile {profile.name}: model.remote.api_key_env names "
                                   f"${remote.api_key_env}, which is not set")

    @property
    def model_name(self) -> str:
        return self.remote.model

    def sampling(self, **overrides) -> SamplingParams:
        s = self.profile.sampling
        base = SamplingParams(temperature=s.temperature, top_p=s.top_p, top_k=s.top_k, min_p=s.min_p,
                              repetition_penalty=s.repetition_penalty, seed=s.seed,
                              max_tokens=s.max_tokens, stop=tuple(s.stop))
        return base.with_overrides(**overrides)

    # -- requests ------------------------------------------------------------------------------
    def models(self, timeout: float | None = None) -> list[str]:
        """The server's model ids (``GET /models``); raises MlxtermError when it cannot answer
        (within ``timeout`` seconds when given, else model.remote.timeout_s)."""
        conn = self._conn(timeout)
        try:
            conn.request("GET", f"{self._path}/models", headers=self._headers())
            resp = conn.getresponse()
            body = resp.read()
            if resp.status != 200:
                raise MlxtermError(f"{self.remote.base_url}: {_error_line(resp.status, body)}")
            return [m.get("id") for m in json.loads(body).get("data", [])]
        except (OSError, http.client.HTTPException, ValueError) as e:
            why = (f"no answer within {timeout:g} s" if timeout is not None
                   and isinstance(e, socket.timeout | TimeoutError) else _reason(e))
            raise MlxtermError(f"{self.remote.base_url}: {why}") from None
        finally:
            conn.close()

    def stream(self, messages: Sequence[Mapping[str, Any]], params: SamplingParams,
               should_stop=None, hangup: Hangup | None = None,
               tools: Sequence[Mapping[str, Any]] | None = None) -> Iterator[Event]:
        """One streamed chat turn; the last event is always a ``Done``. ``hangup()`` (from
        another thread) or ``should_stop()`` (checked per chunk) ends it as "cancelled".
        ``tools`` (OpenAI tool definitions, or bare function schemas) are offered natively; the
        calls the server streams come as ``ToolCallDelta`` events."""

        def stopped() -> bool:
            return (hangup is not None and hangup.requested) or (should_stop is not None and should_stop())

        msgs = list(messages)
        sys_prompt = self.profile.chat.system_prompt
        if sys_prompt and not any(m.get("role") == "system" for m in msgs):
            msgs.insert(0, {"role": "system", "content": sys_prompt})
        body = {"model": self.remote.model, "messages": msgs, "stream": True,
                "stream_options": {"include_usage": True}, **_sampling_fields(params)}
        if tools:
            body["tools"] = [dict(t) if "function" in t else {"type": "function", "function": dict(t)} for t in tools]
            body["tool_choice"] = "auto"
        t0 = time.perf_counter()
        t_first = 0.0
        text: list[str] = []
        reasoning: list[str] = []
        usage = Usage()
        finish = "stop"
        chunks = 0
        conn = self._conn()
        if hangup is not None:
            hangup.attach(conn)
        try:
            conn.request("POST", f"{self._path}/chat/completions", body=json.dumps(body),
                         headers={**self._headers(), "Content-Type": "application/json"})
            if hangup is not None:
                hangup.connected()
            resp = conn.getresponse()
            if stopped():
                finish = "cancelled"
            elif resp.status != 200:
                yield _failed(f"{self.remote.base_url}: {_error_line(resp.status, resp.read())}", t0)
                return
            for data in _sse_data(resp) if finish != "cancelled" else ():
                if data == "[DONE]":
                    break
                obj = json.loads(data)
                if "error" in obj:
                    yield _failed(f"{self.remote.base_url}: {obj['error'].get('message', obj['error'])}", t0)
                    return
                if obj.get("usage"):
                    usage = _usage(obj["usage"])
                for choice in obj.get("choices") or []:
                    delta = choice.get("delta") or {}
                    piece = delta.get("content")
                    thought = delta.get("reasoning_content") or delta.get("reasoning")
                    if (piece or thought) and not t_first:
                        t_first = time.perf_counter()
                    if thought:
                        reasoning.append(thought)
                        yield ReasoningDelta(thought)
                    if piece:
                        chunks += 1
                        text.append(piece)
                        yield TextDelta(piece)
                    for call in delta.get("tool_calls") or []:
                        t_first = t_first or time.perf_counter()
                        chunks += 1
                        yield _call_delta(call)
                    if choice.get("finish_reason"):
                        finish = "length" if choice["finish_reason"] == "length" else "stop"
                if stopped():
                    finish = "cancelled"
                    break
            if stopped():  # a hang-up ends the read early: the stream is cut, not finished
                finish = "cancelled"
        except (OSError, http.client.HTTPException, ValueError) as e:
            if not stopped():
                yield _failed(f"{self.remote.base_url}: {_reason(e)}", t0, "".join(text))
                return
            finish = "cancelled"  # the read failed because we hung up
        finally:
            conn.close()
        t_end = time.perf_counter()
        if not usage.completion_tokens:
            usage.completion_tokens = chunks  # servers without usage: one token per chunk, roughly
        t_first = t_first or t_end
        yield Done(
            text="".join(text),
            reasoning="".join(reasoning),
            finish_reason=finish,
            usage=usage,
            cache_source=SERVER_CACHE if usage.cached_tokens else "none",
            timings=Timings(
                ttft_ms=round((t_first - t0) * 1000, 1),
                decode_tps=round(max(usage.completion_tokens - 1, 0) / max(t_end - t_first, 1e-9), 1),
                total_ms=round((t_end - t0) * 1000, 1),
            ),
        )

    def _conn(self, timeout: float | None = None) -> http.client.HTTPConnection:
        cls = http.client.HTTPSConnection if self._https else http.client.HTTPConnection
        return cls(self._host, self._port, timeout=self.remote.timeout_s if timeout is None else timeout)

    def _headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}


def _sampling_fields(p: SamplingParams) -> dict[str, Any]:
    out: dict[str, Any] = {"temperature": p.temperature, "top_p": p.top_p, "max_tokens": p.max_tokens}
    if p.seed is not None:
        out["seed"] = p.seed
    if p.stop:
        out["stop"] = list(p.stop)
    return out


def _call_delta(call: Mapping[str, Any]) -> ToolCallDelta:
    fn = call.get("function") or {}
    args = fn.get("arguments")
    if args is not None and not isinstance(args, str):  # a server that sends an object, not its JSON
        args = json.dumps(args, ensure_ascii=False)
    return ToolCallDelta(index=int(call.get("index") or 0), arguments=args or "", id=call.get("id"),
                         name=fn.get("name"))


def _sse_data(resp) -> Iterator[str]:
    for raw in resp:
        line = raw.decode("utf-8", "replace").rstrip("\r\n")
        if line.startswith("data:"):
            yield line[5:].strip()


def _usage(u: Mapping[str, Any]) -> Usage:
    details = u.get("prompt_tokens_details") or {}
    return Usage(prompt_tokens=int(u.get("prompt_tokens") or 0),
                 cached_tokens=int(details.get("cached_tokens") or 0),
                 completion_tokens=int(u.get("completion_tokens") or 0))


def _error_line(status: int, body: bytes) -> str:
    try:
        message = json.loads(body)["error"]["message"]
    except (ValueError, KeyError, TypeError):
        message = body.decode("utf-8", "replace").strip()[:200] or "no details"
    return f"the server answered {status}: {message}"


def _reason(e: BaseException) -> str:
    if isinstance(e, socket.timeout | TimeoutError):
        return "no answer in time (model.remote.timeout_s)"
    if isinstance(e, ConnectionRefusedError):
        return "connection refused (is the server running?)"
    if isinstance(e, socket.gaierror):
        return f"unknown host ({e.strerror})"
    return str(e) or type(e).__name__


def _failed(message: str, t0: float, text: str = "") -> Done:
    total = round((time.perf_counter() - t0) * 1000, 1)
    return Done(text, "", "error", Usage(), Timings(total_ms=total), error=message)
