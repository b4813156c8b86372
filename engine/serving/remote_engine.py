"""``RemoteEngine``: a remote profile in the place of a loaded ``Engine`` for chat front ends.

A remote profile has no model here, no tokenizer and no KV cache: a turn sends the
conversation's messages to the server (``engine.serving.remote.RemoteChat``). This class gives
chat front ends what they use of an ``Engine`` -- ``profile``, ``model_name``, ``sampling``,
``active_requests``, ``close`` -- and ``submit_messages``, which streams the turn on its own
thread into a ``RequestHandle`` (iterate it sync or async, ``cancel()``, ``result()``), the same
handle a local request gives. ``cancel()`` hangs up the HTTP stream at once, so the server stops
generating too. Sessions use it through ``engine.sessions.remote_chat.RemoteChatService``.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Mapping, Sequence
from typing import Any

from engine.errors import MlxtermError
from engine.generation.sampling import SamplingParams
from engine.profiles import Profile, load_profile
from engine.serving.events import Done, Timings, Usage
from engine.serving.remote import Hangup, RemoteChat
from engine.serving.worker import RequestHandle

log = logging.getLogger(__name__)
CLOSE_WAIT_S = 5.0  # how long close() waits for cancelled turns to hang up


class RemoteHandle(RequestHandle):
    """One remote turn streaming on its own thread; ``token_ids`` stays empty (no tokenizer)."""

    def __init__(self, chat: RemoteChat, messages: Sequence[Mapping[str, Any]], params: SamplingParams,
                 on_end=None, tools: Sequence[Mapping[str, Any]] | None = None):
        super().__init__(None)
        self._hangup = Hangup()
        self._on_end = on_end
        self._tools = list(tools) if tools else None
        self.thread = threading.Thread(target=self._run, args=(chat, list(messages), params),
                                       name="mlxterm-remote", daemon=True)
        self.thread.start()

    def cancel(self) -> None:
        super().cancel()
        self._hangup()

    def _run(self, chat: RemoteChat, messages: list, params: SamplingParams) -> None:
        t0 = time.perf_counter()
        done = False
        try:
            for ev in chat.stream(messages, params, hangup=self._hangup, tools=self._tools):
                done = done or isinstance(ev, Done)
                self.emit(ev)
        except Exception as e:  # noqa: BLE001 (the handle must end with a Done whatever happens)
            log.exception("remote turn failed")
            if not done:
                total = round((time.perf_counter() - t0) * 1000, 1)
                self.emit(Done("", "", "error", Usage(), Timings(total_ms=total),
                               error=f"{chat.remote.base_url}: unexpected error: {e}"))
        finally:
            if self._on_end is not None:
                self._on_end(self)


class RemoteEngine:
    """A remote profile's server, used where chat front ends use an ``Engine``."""

    remote = True
    completion_mode = False  # the server applies its own chat template
    weight_format = "remote"

    def __init__(self, profile: Profile):
        self.profile = profile
        self.chat = RemoteChat(profile)
        self.load_ms = 0.0
        self._lock = threading.Lock()
        self._live: set[RemoteHandle] = set()

    @classmethod
    def load(cls, profile: Profile | str) -> RemoteEngine:
        """The remote profile ``profile`` (a Profile or a name/path). Contacts nothing: a server
        that is down shows up at the first turn (or ``probe``), with its URL."""
        if not isinstance(profile, Profile):
            profile = load_profile(profile)
        if profile.model.remote is None:
            raise MlxtermError(f"profile {profile.name} runs its model here (no model.remote)")
        t0 = time.perf_counter()
        eng = cls(profile)
        eng.load_ms = round((time.perf_counter() - t0) * 1000, 1)
        return eng

    @property
    def base_url(self) -> str:
        return self.chat.remote.base_url

    @property
    def model_name(self) -> str:
        return self.chat.model_name

    def describe(self) -> dict[str, Any]:
        return {"remote": self.base_url, "model": self.model_name}

    def probe(self, timeout: float = 3.0) -> str | None:
        """None when the server answers ``GET /models`` and lists the profile's model, else one line."""
        try:
            models = self.chat.models(timeout)
        except MlxtermError as e:
            return str(e)
        if self.model_name not in models:
            listed = ", ".join(m for m in models if m) or "no models"
            return f"{self.base_url} lists {listed}, not {self.model_name}"
        return None

    def sampling(self, **overrides) -> SamplingParams:
        return self.chat.sampling(**overrides)

    def submit_messages(self, messages: Sequence[Mapping[str, Any]], params: SamplingParams,
                        tools: Sequence[Mapping[str, Any]] | None = None) -> RemoteHandle:
        """Start one streamed turn on the server (``tools``: offered natively); the handle ends
        with one ``Done``."""
        if not messages:
            raise MlxtermError("no messages: nothing to send")
        with self._lock:
            handle = RemoteHandle(self.chat, messages, params, on_end=self._ended, tools=tools)
            self._live.add(handle)
        return handle

    def _ended(self, handle: RemoteHandle) -> None:
        with self._lock:
            self._live.discard(handle)

    @property
    def active_requests(self) -> int:
        with self._lock:
            return len(self._live)

    def close(self) -> None:
        """Hang up the turns still streaming and wait (briefly) for their threads."""
        with self._lock:
            live = list(self._live)
        for h in live:
            h.cancel()
        end = time.monotonic() + CLOSE_WAIT_S
        for h in live:
            h.thread.join(max(0.0, end - time.monotonic()))

    def __enter__(self) -> RemoteEngine:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def load_engine(profile: Profile | str | None):
    """An ``Engine`` for a local profile, a ``RemoteEngine`` for a remote one (None: the default)."""
    from engine.profiles import DEFAULT_PROFILE
    from engine.serving.engine import Engine

    if not isinstance(profile, Profile):
        profile = load_profile(profile or DEFAULT_PROFILE)
    return RemoteEngine.load(profile) if profile.model.remote is not None else Engine.load(profile)
