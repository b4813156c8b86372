"""``ChatController``: the only place the chat front ends talk to the engine and the store.

The TUI and the plain REPL call it for everything: loading a profile (blocking; call it from
a worker thread), listing and editing sessions, and starting chat turns through
``engine.sessions.chat.ChatService`` (which keeps each session's exact tokens so its KV checkpoint
is reused). Nothing here imports Textual.
"""

from __future__ import annotations

import logging
import re
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from engine.errors import MlxtermError

log = logging.getLogger(__name__)

EXPORT_FORMATS = ("md", "json")
AGENT_TITLE = "Agent run"  # AgentSession's default title, renamed after the first task


class ChatError(MlxtermError):
    """A chat action that cannot be done (no model loaded, nothing to retry...)."""


@dataclass(frozen=True)
class ModelInfo:
    """What the status bar shows about the loaded profile."""

    profile: str  # profile name
    spec: str  # what was passed to load (a name or a YAML path)
    model: str
    weight_format: str
    kv_format: str
    max_context: int
    load_ms: float
    remote: str = ""  # a remote profile's server (base_url); "" for a model loaded here


@dataclass(frozen=True)
class ProfileChoice:
    """A profile for the switcher, with the outcome of ``check_profile``."""

    name: str
    spec: str  # name or path to load it with
    description: str
    status: str  # "ok" | "warning" | "invalid"
    note: str  # first problem or warning, one sentence ("" when ok)


class ChatController:
    """Engine + session store behind one small API. Thread-safe for one UI at a time."""

    def __init__(self, store, profile: str | None = None, *,
                 engine_factory: Callable[[str], object] | None = None) -> None:
        from engine.profiles import DEFAULT_PROFILE

        self.store = store
        self.profile_spec = profile or DEFAULT_PROFILE
        self.engine_factory = engine_factory  # spec -> engine (tests: a ScriptedEngine)
        self.engine = None
        self.service = None
        self._lock = threading.Lock()  # one load at a time

    # -- profiles and the model ----------------------------------------------------------------

    @property
    def loaded(self) -> bool:
        return self.engine is not None

    def info(self) -> ModelInfo | None:
        eng = self.engine
        if eng is None:
            return None
        p = eng.profile
        return ModelInfo(p.name, self.profile_spec, eng.model_name, eng.weight_format,
                         p.kv_cache.format, p.context.max_context, eng.load_ms,
                         remote=eng.base_url if is_remote(eng) else "")

    @property
    def remote(self) -> bool:
        """The loaded profile runs on a remote server (its agents use the text protocol)."""
        return is_remote(self.engine)

    def probe(self) -> str | None:
        """For a remote profile: None when its server answers and lists the model, else one
        line saying which URL and what went wrong (blocking, a few seconds at most)."""
        eng = self.engine
        return eng.probe() if is_remote(eng) else None

    def active_requests(self) -> int:
        """Requests in flight on the engine (chat turns and agent steps share its batch)."""
        return int(getattr(self.engine, "active_requests", 0) or 0) if self.engine is not None else 0

    def check(self, spec: str | None = None) -> None:
        """Raise a one-sentence ``ProfileError`` when ``spec`` cannot be loaded (fast: no weights)."""
        from engine.errors import ProfileError
        from engine.profiles import check_profile

        spec = spec or self.profile_spec
        result = check_profile(spec)
        if not result.valid:
            raise ProfileError(f"profile {_label(spec)} cannot be used: {readable(result.problems[0])}")
        for warning in result.warnings:
            if "model.source" in warning:  # catalogue model not installed: loading would fail
                raise ProfileError(f"profile {_label(spec)} cannot be used: {readable(warning)}")

    def load(self, spec: str | None = None) -> ModelInfo:
        """Load a profile's model on a new engine thread (blocking), then drop the old one."""
        from engine.serving.remote_engine import load_engine
        from engine.sessions.chat import ChatService
        from engine.sessions.remote_chat import RemoteChatService

        spec = spec or self.profile_spec
        with self._lock:
            if self.engine_factory is None:
                self.check(spec)
                new = load_engine(spec)  # a RemoteEngine for a profile with model.remote
            else:
                new = self.engine_factory(spec)
            old, self.engine = self.engine, new
            self.service = (RemoteChatService if is_remote(new) else ChatService)(new, self.store)
            self.profile_spec = spec
        if old is not None:
            old.close()
        info = self.info()
        assert info is not None
        log.info("loaded profile %s (%s, %s) in %.0f ms", info.profile, info.model,
                 info.weight_format, info.load_ms)
        return info

    def list_profiles(self) -> list[ProfileChoice]:
        from engine.profiles import check_profile, list_profiles

        choices = []
        infos = list_profiles()
        specs = [(i.name, i.name, i.description) for i in infos]
        if self.profile_spec not in {i.name for i in infos}:
            specs.insert(0, (Path(self.profile_spec).stem, self.profile_spec, "(loaded from a file)"))
        for name, spec, description in specs:
            result = check_profile(spec)
            if not result.valid:
                status, note = "invalid", readable(result.problems[0])
            elif result.warnings:
                status, note = "warning", readable(result.warnings[0])
            else:
                status, note = "ok", ""
            choices.append(ProfileChoice(name, spec, description, status, note))
        return choices

    def close(self) -> None:
        eng, self.engine, self.service = self.engine, None, None
        if eng is not None:
            eng.close()

    # -- sessions ------------------------------------------------------------------------------

    def sessions(self, query: str | None = None, limit: int = 200):
        """Chats and agent sessions, most recent first."""
        return self.store.list(query=query or None, limit=limit)

    def session(self, session_id: str):
        return self.store.get(session_id)

    def messages(self, session_id: str):
        from engine.sessions.partial import recover_interrupted

        recover_interrupted(self.store, session_id)  # a reply left streaming by a killed run
        return self.store.messages(session_id, tokens=False)

    def new_session(self, title: str | None = None):
        if self.service is not None:
            return self.service.create(title=title)  # a remote one is marked remote
        return self.store.create(title=title, profile="", kind="chat")

    def context_used(self, session_id: str | None) -> int:
        """Tokens in the session's context: its stored token ids, or for a remote session the
        last reply's prompt + completion tokens as the server counted them."""
        if not session_id:
            return 0
        from engine.sessions.chat import remote_mark

        session = self.store.get(session_id)
        if remote_mark(session) is None:
            return session.token_count
        for m in reversed(self.store.messages(session_id, tokens=False)):
            usage = m.meta.get("usage") if m.role == "assistant" else None
            if usage and not m.meta.get("error"):
                return int(usage.get("prompt_tokens") or 0) + int(usage.get("completion_tokens") or 0)
        return 0

    def rename(self, session_id: str, title: str):
        return self.store.rename(session_id, title)

    def delete(self, session_id: str) -> str:
        return self.store.delete(session_id)

    def fork(self, session_id: str, at: int):
        """A new session with the first ``at`` messages (its next turn reuses their KV)."""
        return self.store.fork(session_id, at)

    def clear(self, session_id: str) -> int:
        """Delete the session's messages except a leading system message; returns how many."""
        msgs = self.store.messages(session_id, tokens=False)
        keep = 1 if msgs and msgs[0].role == "system" else 0
        return self.store.delete_last(session_id, len(msgs) - keep)

    def system_prompt(self, session_id: str | None) -> str:
        """The session's system message, else the profile's default system prompt."""
        if session_id:
            msgs = self.store.messages(session_id, tokens=False)
            if msgs and msgs[0].role == "system":
                return msgs[0].content
        eng = self.engine
        return (eng.profile.chat.system_prompt or "") if eng else ""

    def set_system(self, session_id: str, text: str) -> None:
        """Give an empty session its system message, with the exact tokens the template renders."""
        self._engine()
        self.service.set_system(session_id, text)

    def export(self, session_id: str, fmt: str = "md", path: str | Path | None = None) -> Path:
        """Write the transcript to ``path`` (default: ``data_dir()/exports/TITLE-ID.EXT``)."""
        from engine.atomic import atomic_write_text
        from engine.paths import data_dir

        if fmt not in EXPORT_FORMATS:
            raise ChatError(f"unknown export format {fmt!r} (use md or json).")
        text = self.store.export(session_id, fmt)
        if path is None:
            s = self.store.get(session_id)
            path = data_dir() / "exports" / f"{_slug(s.title)}-{s.id}.{fmt}"
        path = Path(path).expanduser()
        if path.is_dir():
            s = self.store.get(session_id)
            path = path / f"{_slug(s.title)}-{s.id}.{fmt}"
        try:
            atomic_write_text(path, text)
        except OSError as e:
            raise ChatError(f"cannot write {path}: {e.strerror or e}.") from None
        return path

    # -- chat turns ----------------------------------------------------------------------------

    def send(self, session_id: str, text: str):
        """Store the user's message and start the reply; returns an async-iterable ChatTurn."""
        self._engine()
        return self.service.send(session_id, text)

    def retry(self, session_id: str):
        """Generate the last reply again (the previous one is dropped)."""
        self._engine()
        msgs = self.store.messages(session_id, tokens=False)
        if not any(m.role == "user" for m in msgs):
            raise ChatError("there is no message to answer again yet.")
        return self.service.retry(session_id)

    # -- agent sessions (the loop runs on its own thread; see app/tui/agent_mode.py) ----------

    def new_agent(self, workspace: str | Path | None = None):
        """A new ``AgentSession`` working in ``workspace`` (default: a fresh directory
        ``data_dir()/workspaces/<session id>``). Blocking (tokenizes the system prompt)."""
        from engine.paths import data_dir
        from engine.sessions.naming import new_id

        from agents.session import AgentSession

        engine = self._engine()  # a remote profile's server runs it in the text protocol
        if workspace is not None:
            return AgentSession.create(engine, self.store, Path(workspace).expanduser(),
                                       title=AGENT_TITLE)
        sid = new_id()
        ws = data_dir() / "workspaces" / sid
        ws.mkdir(parents=True)
        try:
            return AgentSession.create(engine, self.store, ws, title=AGENT_TITLE, session_id=sid)
        except BaseException:
            ws.rmdir()
            raise

    def open_agent(self, session_id: str):
        """Continue a stored agent session with the loaded model (``AgentSession.open``)."""
        from agents.session import AgentSession

        return AgentSession.open(self._engine(), self.store, session_id)

    def name_agent(self, session_id: str, task: str) -> None:
        """Title a new agent session after its first task."""
        from engine.sessions.naming import suggest_title

        if self.store.get(session_id).title == AGENT_TITLE:
            self.store.rename(session_id, suggest_title(task))

    def _engine(self):
        if self.engine is None or self.service is None:
            raise ChatError("no model is loaded yet; wait for it or pick a profile with /profile.")
        return self.engine


def is_remote(engine) -> bool:
    """Whether ``engine`` is a remote profile's server (engine.serving.remote_engine)."""
    return bool(getattr(engine, "remote", False))


def latest_session(store=None) -> str | None:
    """The id of the most recently updated session (chat or agent), or None."""
    if store is None:
        from engine.sessions import SessionStore

        store = SessionStore()
    found = store.list(limit=1)
    return found[0].id if found else None


_WHERE = re.compile(r"^\S+?:\d+(?::\d+)?: (?:[\w.]+: )?")


def readable(problem: str) -> str:
    """A profile problem line without its ``file:line: key:`` prefix (the UI shows the name)."""
    line = problem.strip().splitlines()[0] if problem.strip() else "unknown problem"
    return _WHERE.sub("", line)


def _label(spec: str) -> str:
    return Path(spec).stem if ("/" in spec or spec.endswith((".yaml", ".yml"))) else spec


def _slug(title: str) -> str:
    slug = re.sub(r"[^A-Za-z0-9]+", "-", title).strip("-").lower()
    return slug[:40] or "session"
