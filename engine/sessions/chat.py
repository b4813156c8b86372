"""Conversations that keep their exact token history: ``ChatService.send`` / ``ChatTurn``.

A session's context is the concatenation of its messages' token ids (see engine.sessions).
A new turn never re-tokenizes history: it appends only the tokens of the text the chat
template adds for the new message -- the template's closing tail after the last generated
token (e.g. ChatML's "\\n" after ``<|im_end|>``), the new message and the generation prompt.
Generated ids stay exactly as generated, so the next turn's prompt always extends the
previous context and its KV checkpoint. Where a template renders history differently from
what was fed (e.g. it strips earlier reasoning), the session keeps the tokens actually fed.
A reply is stored while it streams (``engine.sessions.partial``): a kill mid-reply keeps it,
marked interrupted when the session is next continued.
"""

from __future__ import annotations

import logging
import os
from collections.abc import AsyncIterator, Iterator, Mapping, Sequence
from typing import Any

from engine.errors import MlxtermError
from engine.serving.engine import Engine, GenerationRequest
from engine.serving.events import Done, Event, ReasoningDelta, TextDelta
from engine.sessions import Message, Session, SessionStore, suggest_title
from engine.sessions.partial import PartialReply, recover_interrupted

log = logging.getLogger(__name__)
DEFAULT_TITLE = "New chat"


REMOTE_KEY = "remote"  # session meta: {"base_url", "model"} of the server a remote session ran on


class ChatError(MlxtermError):
    """A chat action that cannot be done in the session's current state."""


def remote_mark(session: Session) -> dict[str, Any] | None:
    """The server a session's turns ran on (``engine.sessions.remote_chat``), else None: such a
    session keeps messages without token ids, so no local model and no KV checkpoint resumes it."""
    mark = session.meta.get(REMOTE_KEY)
    return mark if isinstance(mark, dict) else None


def message_dicts(messages: Sequence[Message]) -> list[dict[str, Any]]:
    """Stored messages as chat-template input."""
    out = []
    for m in messages:
        d: dict[str, Any] = {"role": m.role, "content": m.content}
        if m.tool_calls:
            d["tool_calls"] = m.tool_calls
        if m.tool_call_id:
            d["tool_call_id"] = m.tool_call_id
        if m.name:
            d["name"] = m.name
        out.append(d)
    return out


def junction_tail(rendered_history: str, fed_text: str) -> str:
    """What the template writes after the tokens actually fed so far.

    Normally the fed text is a prefix of the rendered history and the tail is the rest (the
    end-of-turn marker when generation stopped early, the newline after it...). When the
    template rewrote history, match on the longest end of what was fed instead.
    """
    if rendered_history.startswith(fed_text):
        return rendered_history[len(fed_text) :]
    for k in range(min(64, len(fed_text)), 0, -1):
        idx = rendered_history.rfind(fed_text[-k:])
        if idx >= 0:
            return rendered_history[idx + k :]
    return ""


class ChatTurn:
    """One generation in a session; iterate it (sync or async) for engine events.

    When the final ``Done`` arrives, the assistant message (text, reasoning, exact generated
    token ids, usage/timings/cache meta) is stored before ``Done`` is handed on.
    """

    def __init__(self, service: ChatService, session_id: str, handle):
        self.service = service
        self.session_id = session_id
        self.handle = handle
        self.done: Done | None = None
        self.message: Message | None = None
        # The reply is saved as it streams (a kill loses at most ~1 s of it).
        self.partial = PartialReply(service.store, session_id, handle, tokens=service.keeps_tokens)
        self._text: list[str] = []
        self._reasoning: list[str] = []

    def cancel(self) -> None:
        self.handle.cancel()

    def _finish(self, done: Done) -> None:
        if self.done is None:
            self.done = done
            self.message = self.service._record_reply(self.session_id, done, self.partial)

    def _seen(self, ev: Event) -> None:
        if isinstance(ev, Done):
            self._finish(ev)
            return
        if isinstance(ev, TextDelta):
            self._text.append(ev.text)
        elif isinstance(ev, ReasoningDelta):
            self._reasoning.append(ev.text)
        else:
            return
        self.partial.update("".join(self._text), "".join(self._reasoning))

    def __iter__(self) -> Iterator[Event]:
        for ev in self.handle:
            self._seen(ev)
            yield ev

    async def __aiter__(self) -> AsyncIterator[Event]:
        async for ev in self.handle:
            self._seen(ev)
            yield ev

    def result(self) -> Done:
        done = self.handle.result()
        self._finish(done)
        return done


class ChatService:
    """Runs chat turns of stored sessions on an ``Engine``."""

    keeps_tokens = True  # messages carry their exact token ids (RemoteChatService: False)

    def __init__(self, engine: Engine, store: SessionStore):
        self.engine = engine
        self.store = store

    def create(self, title: str | None = None, kind: str = "chat", **kw) -> Session:
        return self.store.create(title=title, profile=self.engine.profile.name, kind=kind, **kw)

    def send(self, session_id: str, text: str, *, role: str = "user", tools=None, **overrides) -> ChatTurn:
        """Append ``text`` as a ``role`` message and start generating the reply."""
        recover_interrupted(self.store, session_id)
        session = self.store.get(session_id)
        self._add(session, {"role": role, "content": text}, tools)
        if session.title == DEFAULT_TITLE and role == "user":
            self.store.rename(session.id, suggest_title(text))
        return self._generate(session.id, **overrides)

    def set_system(self, session_id: str, text: str) -> Message:
        """Give an empty session its system message (with the exact tokens it renders to)."""
        session = self.store.get(session_id)
        if session.message_count:
            raise ChatError("the system prompt can only be set before the first message; "
                            "start a new chat first.")
        if self.engine.completion_mode:
            raise ChatError(f"profile {self.engine.profile.name} has no chat template, so it has "
                            "no system prompt.")
        self._add(session, {"role": "system", "content": text})
        return self.store.messages(session_id)[-1]

    def retry(self, session_id: str, **overrides) -> ChatTurn:
        """Drop the last assistant reply and generate it again from the same context."""
        recover_interrupted(self.store, session_id)
        self._check_session(self.store.get(session_id))  # before the reply is dropped
        msgs = self.store.messages(session_id, tokens=False)
        if msgs and msgs[-1].role == "assistant":
            self.store.delete_last(session_id, 1)
        return self._generate(session_id, **overrides)

    def fork(self, session_id: str, at: int, title: str | None = None) -> Session:
        """A new session with the first ``at`` messages; its first turn reuses the parent's KV."""
        return self.store.fork(session_id, at, title=title)

    # -- internals ---------------------------------------------------------------------------
    def _generate(self, session_id: str, **overrides) -> ChatTurn:
        self._check_session(self.store.get(session_id))
        prompt = self.store.context_tokens(session_id)
        params = self.engine.sampling(**overrides)
        request = GenerationRequest(
            prompt,
            params,
            session_id=session_id,
            split_reasoning=self.engine.profile.chat.reasoning,
        )
        return ChatTurn(self, session_id, self.engine.submit(request))

    def _add(self, session: Session, message: Mapping[str, Any], tools=None) -> None:
        """Store ``message`` with exactly the tokens it adds to the context."""
        eng = self.engine
        history = self.store.messages(session.id)
        if history and session.profile and session.profile != eng.profile.name:
            # Its token ids belong to another model's tokenizer: never feed them to this one.
            raise ChatError(f"session {session.id} was made with profile {session.profile}; "
                            f"load that profile to continue it (this is {eng.profile.name}).")
        if history:
            self._check_session(session)
        fed = [t for m in history for t in m.token_ids]
        if eng.completion_mode:
            ids = eng.raw_prompt(message["content"]) if not fed else eng.tokenizer.encode(message["content"])
            self.store.add_message(session.id, message["role"], message["content"], token_ids=ids)
            return
        dicts = message_dicts(history)
        sys_prompt = eng.profile.chat.system_prompt
        add_generation_prompt = message["role"] != "system"
        if not history and sys_prompt and message["role"] != "system":
            text = eng.render([{"role": "system", "content": sys_prompt}], tools, add_generation_prompt=False)
            sys_ids = eng.tokenizer.encode(text)
            self.store.add_message(session.id, "system", sys_prompt, token_ids=sys_ids)
            dicts = [{"role": "system", "content": sys_prompt}]
            fed = sys_ids
        before = eng.render(dicts, tools, add_generation_prompt=False) if dicts else ""
        after = eng.render([*dicts, dict(message)], tools, add_generation_prompt=add_generation_prompt)
        tail = junction_tail(before, eng.tokenizer.decode(fed)) if fed else ""
        if not after.startswith(before):
            log.warning("chat template renders history differently once a message is added")
            before = os.path.commonprefix([before, after])
        ids = eng.tokenizer.encode(tail + after[len(before) :])
        self.store.add_message(session.id, message["role"], message["content"], token_ids=ids)

    def _check_session(self, session: Session) -> None:
        """Refuse a session this service cannot continue (here: one that ran remotely)."""
        mark = remote_mark(session)
        if mark is not None:
            raise ChatError(f"session {session.id} ran on a remote server ({mark.get('base_url')}): it "
                            "keeps messages, not token ids, so a local model cannot continue it; load "
                            f"profile {session.profile or 'the remote profile'} to continue it.")

    def _record_reply(self, session_id: str, done: Done, partial: PartialReply | None = None) -> Message:
        meta = {
            "finish_reason": done.finish_reason,
            "usage": {
                "prompt_tokens": done.usage.prompt_tokens,
                "cached_tokens": done.usage.cached_tokens,
                "completion_tokens": done.usage.completion_tokens,
            },
            "timings": vars(done.timings),
            "cache": {"source": done.cache_source, "restore_ms": done.timings.restore_ms},
            # which lane decoded it and how many rows shared the engine's steps meanwhile
            "batch": {"lane": done.lane, "min": done.batch_min, "mean": done.batch_mean, "max": done.batch_max},
        }
        if done.error:
            meta["error"] = done.error
        if partial is None:
            return self.store.add_message(session_id, "assistant", done.text, reasoning=done.reasoning or None,
                                          token_ids=done.completion_token_ids, meta=meta)
        return partial.finish(done.text, reasoning=done.reasoning or None, token_ids=done.completion_token_ids,
                              meta=meta)

