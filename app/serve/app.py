"""The Starlette application: routes, API key, admission and cancel-on-disconnect.

Every completion request is one engine request on the shared batched scheduler. A request is
admitted while fewer than ``batch.cap + max_queue`` are in the engine, else 503 with
``Retry-After``. A watcher per request reads the connection: when the client hangs up before
its reply is complete, the engine request is cancelled at once (its row is freed within one
token). ``X-Session-Id`` pins a conversation to a checkpoint session; without it a follow-up
turn still reuses the longest cached prefix (the checkpoint store matches any prefix).
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import time
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from engine.runtime import GenerationRequest, Priority
from engine.serving.events import Done, ReasoningDelta, TextDelta

from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from app.serve import shapes
from app.serve.errors import APIError, bad_request
from app.serve.requests import Job, attach_constraint, chat_job, completion_job
from app.serve.toolcalls import ReplyReader

log = logging.getLogger(__name__)
RETRY_AFTER_S = 1
SESSION_HEADER = "x-session-id"


class ServerState:
    """What the routes share: the engine, the key, admission limits and counters."""

    def __init__(self, engine, api_key: str | None = None, max_queue: int = 64):
        self.engine = engine
        self.api_key = api_key
        self.limit = engine.profile.batch.cap + max_queue
        self.finished: Counter[str] = Counter()
        self.disconnected = 0
        self.started = time.time()
        self._watchers: set[asyncio.Task] = set()

    @property
    def model_ids(self) -> tuple[str, ...]:
        return (self.engine.profile.name, self.engine.model_name)


class Flight:
    """One admitted request: its handle, and whether its ``Done`` was counted."""

    def __init__(self, state: ServerState, handle):
        self.state = state
        self.handle = handle
        self.done: Done | None = None

    def finish(self, done: Done) -> None:
        if self.done is None:
            self.done = done
            self.state.finished[done.finish_reason] += 1

    async def watch(self, receive) -> None:
        """Cancel the request when its client hangs up before the reply is complete."""
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                break
        if self.done is None:
            self.handle.cancel()
            self.state.disconnected += 1
            log.info("client hung up: request cancelled")
        done = await asyncio.to_thread(self.handle.result, 120)
        self.finish(done)


def build_app(state: ServerState) -> Starlette:
    def route(path: str, fn: Callable[[Request, ServerState], Awaitable[Response]], methods: list[str],
              auth: bool = True) -> Route:
        async def endpoint(request: Request) -> Response:
            try:
                if auth:
                    _check_key(request, state)
                return await fn(request, state)
            except APIError as e:
                return e.response()

        return Route(path, endpoint, methods=methods)

    routes = [
        route("/health", health, ["GET"], auth=False),
        route("/v1/models", models, ["GET"]),
        route("/v1/chat/completions", chat_completions, ["POST"]),
        route("/v1/completions", completions, ["POST"]),
    ]
    app = Starlette(routes=routes)
    app.state.serve = state
    return app


def _check_key(request: Request, state: ServerState) -> None:
    if state.api_key is None:
        return
    header = request.headers.get("authorization", "")
    scheme, _, token = header.partition(" ")
    if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), state.api_key.encode()):
        raise APIError(401, "missing or wrong API key (send Authorization: Bearer <key>)",
                       code="invalid_api_key")


# -- routes -------------------------------------------------------------------------------------
async def health(request: Request, state: ServerState) -> Response:
    return JSONResponse({
        "status": "ok",
        "model": state.engine.profile.name,
        "active": state.engine.active_requests,
        "limit": state.limit,
        "finished": dict(state.finished),
        "disconnected": state.disconnected,
        "uptime_s": round(time.time() - state.started, 1),
    })


async def models(request: Request, state: ServerState) -> Response:
    engine = state.engine
    card = {"id": engine.profile.name, "object": "model", "created": int(state.started),
            "owned_by": "mlxterm", "root": engine.model_name,
            "max_context": engine.profile.context.max_context}
    return JSONResponse({"object": "list", "data": [card]})


async def chat_completions(request: Request, state: ServerState) -> Response:
    body = await _body(request)
    job = await run_in_threadpool(chat_job, body, state.engine)
    return await _run(request, state, job)


async def completions(request: Request, state: ServerState) -> Response:
    body = await _body(request)
    job = await run_in_threadpool(completion_job, body, state.engine)
    return await _run(request, state, job)


async def _body(request: Request) -> dict[str, Any]:
    raw = await request.body()
    try:
        body = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise bad_request(f"the request body is not valid JSON ({e})") from None
    if not isinstance(body, dict):
        raise bad_request("the request body must be a JSON object")
    return body


# -- running a job ------------------------------------------------------------------------------
async def _run(request: Request, state: ServerState, job: Job) -> Response:
    engine = state.engine
    if job.model not in state.model_ids:
        raise APIError(404, f"the model {job.model!r} does not exist; this server serves "
                       f"{engine.profile.name!r}", param="model", code="model_not_found")
    limit = engine.profile.context.max_context
    if len(job.prompt_ids) >= limit:
        raise bad_request(f"this model's maximum context length is {limit} tokens, but the prompt "
                          f"is {len(job.prompt_ids)} tokens", "messages" if job.kind == "chat" else "prompt",
                          code="context_length_exceeded")
    top = max(job.logprobs, 1) if job.logprobs is not None else None  # the engine returns top-N
    params = engine.sampling(**job.overrides, logprobs=top)
    params = params.with_overrides(max_tokens=min(params.max_tokens, limit - len(job.prompt_ids)))
    if job.tools is not None:
        await run_in_threadpool(attach_constraint, job, engine, params.max_tokens)
    if engine.active_requests >= state.limit:
        raise APIError(503, f"the server is busy ({state.limit} requests in the engine); retry shortly",
                       code="server_busy", headers={"Retry-After": str(RETRY_AFTER_S)})
    handle = engine.submit(GenerationRequest(
        job.prompt_ids,
        params,
        session_id=request.headers.get(SESSION_HEADER) or None,
        split_reasoning=engine.profile.chat.reasoning if job.kind == "chat" else False,
        constraint=job.constraint,
        priority=Priority.INTERACTIVE,
    ))
    flight = Flight(state, handle)
    watcher = asyncio.create_task(flight.watch(request.receive))
    state._watchers.add(watcher)
    watcher.add_done_callback(state._watchers.discard)
    cid = shapes.new_id(job.kind)
    if job.stream:
        return StreamingResponse(_sse(flight, job, cid, engine), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
    return await _whole(flight, job, cid, engine)


async def _whole(flight: Flight, job: Job, cid: str, engine) -> Response:
    reader = ReplyReader(job.tools, id_prefix=f"call_{cid[-8:]}")
    content: list[str] = []
    done: Done | None = None
    try:
        async for ev in flight.handle:
            if isinstance(ev, TextDelta):
                content += [x for kind, x in reader.feed(ev.text) if kind == "content"]
            elif isinstance(ev, Done):
                done = ev
    finally:
        if done is None:
            flight.handle.cancel()
    flight.finish(done)
    content += [x for kind, x in reader.finish() if kind == "content"]
    _raise_for(done)
    lp = _logprobs(job, engine, done)
    if job.kind == "chat":
        return JSONResponse(shapes.chat_completion(cid, job.model, done, "".join(content), reader.calls,
                                                   done.reasoning, lp))
    text = (job.echo_prompt or "") + "".join(content)
    return JSONResponse(shapes.text_completion(cid, job.model, done, text, lp))


def _raise_for(done: Done) -> None:
    if done.finish_reason == "context":
        raise bad_request(done.error or "the prompt does not fit the context", code="context_length_exceeded")
    if done.finish_reason == "error":
        raise APIError(500, f"generation failed: {done.error}", code="engine_error")


def _logprobs(job: Job, engine, done: Done) -> dict | None:
    if job.logprobs is None:
        return None
    if job.kind == "chat":
        return shapes.chat_logprobs(engine.tokenizer, done.logprobs, job.logprobs)
    return shapes.text_logprobs(engine.tokenizer, done.logprobs, job.logprobs,
                                len(job.echo_prompt or ""))


async def _sse(flight: Flight, job: Job, cid: str, engine) -> AsyncIterator[str]:
    """The request's events as server-sent events, ending with ``data: [DONE]``. Logprobs,
    when asked for, come with the final chunk."""
    created = int(time.time())
    model = job.model
    reader = ReplyReader(job.tools, id_prefix=f"call_{cid[-8:]}")
    chat = job.kind == "chat"

    def items(pairs) -> list[str]:
        out = []
        for kind, x in pairs:
            if kind == "content":
                chunk = (shapes.chat_chunk(cid, model, created, {"content": x}) if chat
                         else shapes.text_chunk(cid, model, created, x))
            else:
                chunk = shapes.chat_chunk(cid, model, created, {"tool_calls": [x]})
            out.append(_event(chunk))
        return out

    try:
        if chat:
            yield _event(shapes.chat_chunk(cid, model, created, {"role": "assistant", "content": ""}))
        elif job.echo_prompt:
            yield _event(shapes.text_chunk(cid, model, created, job.echo_prompt))
        async for ev in flight.handle:
            if isinstance(ev, TextDelta):
                for line in items(reader.feed(ev.text)):
                    yield line
            elif isinstance(ev, ReasoningDelta) and chat:
                yield _event(shapes.chat_chunk(cid, model, created, {"reasoning_content": ev.text}))
            elif isinstance(ev, Done):
                flight.finish(ev)
                for line in items(reader.finish()):
                    yield line
                try:
                    _raise_for(ev)
                except APIError as e:
                    yield _event(e.body())
                    yield "data: [DONE]\n\n"
                    return
                finish = shapes.finish_reason(ev, bool(reader.calls))
                lp = _logprobs(job, engine, ev)
                last = (shapes.chat_chunk(cid, model, created, {}, finish, lp) if chat
                        else shapes.text_chunk(cid, model, created, "", finish, lp))
                yield _event(last)
                if job.include_usage:
                    yield _event(shapes.usage_chunk(cid, job.kind, model, created, ev))
                yield "data: [DONE]\n\n"
    finally:
        if flight.done is None:
            flight.handle.cancel()  # the client went away mid-stream


def _event(obj: dict[str, Any]) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"
