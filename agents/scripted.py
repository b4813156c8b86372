"""``ScriptedEngine``: a stand-in for ``engine.runtime.Engine`` that replays fixed replies.

Same surface as the real engine where agents touch it (``profile``, ``tokenizer``,
``render``, ``chat_prompt``, ``completion_mode``, ``sampling``, ``submit`` -> a handle with
sync/async event iteration, ``cancel`` and ``result``), so agent loops can be tested end to end,
deterministically and in milliseconds. The tokenizer is byte-level (one token per byte plus
ChatML specials), so exact-token bookkeeping is checked for real.

Constraints are honoured like a model would be under them: each scripted token must be allowed
by the request's constraint; when it is not, the engine emits the allowed token that covers the
most of the remaining script (else the lowest allowed id) — a model "wanting" the script but
kept inside the grammar. Prompt reuse per session is reported like the real KV cache
(``cached_tokens`` = common prefix with that session's previous prompt + generation).
"""

from __future__ import annotations

import codecs
import re
import threading
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from engine.model.chat_template import ChatTemplate
from engine.profile_schema import (
    AgentConfig,
    ChatConfig,
    ContextConfig,
    ModelConfig,
    Profile,
    SamplingConfig,
)
from engine.runtime import RequestHandle
from engine.sampling import SamplingParams
from engine.serving.events import Done, TextDelta, Timings, Usage

import numpy as np

SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
_SPECIAL_RE = re.compile("(" + "|".join(re.escape(s) for s in SPECIALS) + ")")

# ChatML that ignores ``tools`` and ``tool_calls`` (like SmolLM2's template): the "text" protocol.
CHATML_NO_TOOLS = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
# ChatML that lists ``tools`` in the system turn and wraps tool results (Qwen-like): "native".
CHATML_TOOLS = (
    "{% for m in messages %}<|im_start|>{{ 'user' if m['role'] == 'tool' else m['role'] }}\n"
    "{% if m['role'] == 'tool' %}<tool_response>\n{{ m['content'] }}\n</tool_response>"
    "{% else %}{{ m['content'] }}{% endif %}"
    "{% if loop.first and tools %}\n<tools>{% for t in tools %}\n{{ t | tojson }}{% endfor %}\n</tools>{% endif %}"
    "<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


class ByteTokenizer:
    """One token per byte (ids 0-255) plus the ChatML specials (256-258)."""

    def __init__(self) -> None:
        self.specials = {s: 256 + i for i, s in enumerate(SPECIALS)}
        self.special_ids = frozenset(self.specials.values())
        self.eos_ids = {self.specials["<|im_end|>"], self.specials["<|endoftext|>"]}
        self.bos_id = None
        self.chat_template = None

    @property
    def vocab_size(self) -> int:
        return 256 + len(SPECIALS)

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        ids: list[int] = []
        for part in _SPECIAL_RE.split(text):
            if part in self.specials:
                ids.append(self.specials[part])
            elif part:
                ids.extend(part.encode("utf-8"))
        return ids

    def decode(self, ids: Iterable[int], skip_special: bool = False) -> str:
        out, buf = [], bytearray()
        for i in ids:
            if i < 256:
                buf.append(i)
                continue
            out.append(buf.decode("utf-8", errors="replace"))
            buf = bytearray()
            if not skip_special:
                out.append(SPECIALS[i - 256])
        out.append(buf.decode("utf-8", errors="replace"))
        return "".join(out)

    def piece(self, token_id: int) -> bytes:
        return bytes((token_id,)) if token_id < 256 else SPECIALS[token_id - 256].encode()

    def token_to_id(self, token: str) -> int | None:
        if token in self.specials:
            return self.specials[token]
        data = token.encode()
        return data[0] if len(data) == 1 else None

    def new_detokenizer(self, skip_special: bool = False):
        return _ByteDetokenizer(self)


class _ByteDetokenizer:
    def __init__(self, tok: ByteTokenizer):
        self.tok = tok
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def add(self, token_id: int) -> str:
        if token_id >= 256:
            return self._utf8.decode(b"", final=True) + SPECIALS[token_id - 256]
        return self._utf8.decode(bytes((token_id,)))

    def flush(self) -> str:
        return self._utf8.decode(b"", final=True)


@dataclass(frozen=True)
class Reply:
    """One scripted generation. ``end``: finish with end-of-turn (else it runs to max_tokens).
    ``delay_s``: pause per token (to test cancellation mid-generation). ``error``: fail."""

    text: str
    end: bool = True
    delay_s: float = 0.0
    error: str | None = None


def scripted_profile(max_context: int = 8192, max_tokens: int = 512, **agent: Any) -> Profile:
    agent.setdefault("capable", True)  # it stands in for a model that can do agent tasks
    return Profile(
        name="scripted",
        model=ModelConfig(source="scripted"),
        context=ContextConfig(max_context=max_context),
        sampling=SamplingConfig(max_tokens=max_tokens, temperature=0.0),
        chat=ChatConfig(reasoning=False),
        agent=AgentConfig(**agent),
    )


class ScriptedEngine:
    def __init__(self, replies: Iterable[str | Reply], *, profile: Profile | None = None,
                 template: str = CHATML_NO_TOOLS):
        self.replies: list[Reply | str] = list(replies)
        self.profile = profile or scripted_profile()
        self.tokenizer = ByteTokenizer()
        self.template = ChatTemplate(template, origin="scripted template")
        self.requests: list[Any] = []
        self.substitutions = 0  # scripted tokens the constraint replaced
        self._kv: dict[str, list[int]] = {}
        self._lock = threading.Lock()

    @property
    def logits_width(self) -> int:
        return self.tokenizer.vocab_size

    @property
    def completion_mode(self) -> bool:
        return False

    @property
    def model_name(self) -> str:
        return "scripted"

    def render(self, messages: Sequence[Mapping[str, Any]], tools=None, add_generation_prompt: bool = True) -> str:
        return self.template.render(list(messages), tools=tools, add_generation_prompt=add_generation_prompt)

    def chat_prompt(self, messages, tools=None, add_generation_prompt: bool = True) -> list[int]:
        return self.tokenizer.encode(self.render(messages, tools, add_generation_prompt))

    def sampling(self, **overrides) -> SamplingParams:
        s = self.profile.sampling
        base = SamplingParams(temperature=s.temperature, top_p=s.top_p, max_tokens=s.max_tokens, seed=s.seed)
        return base.with_overrides(**overrides)

    def submit(self, request) -> RequestHandle:
        handle = RequestHandle(request)
        self.requests.append(request)
        reply = self.replies.pop(0) if self.replies else Reply("(script exhausted)")
        reply = reply if isinstance(reply, Reply) else Reply(reply)
        threading.Thread(target=self._serve_safely, args=(request, handle, reply), daemon=True).start()
        return handle

    def close(self) -> None:
        pass

    # -- the fake decode loop ---------------------------------------------------------------------
    def _serve_safely(self, req, handle: RequestHandle, reply: Reply) -> None:
        try:
            self._serve(req, handle, reply)
        except Exception as e:  # like the engine thread: a failure still ends the stream
            if handle._done is None:
                handle.emit(Done("", "", "error", Usage(), Timings(), error=f"{type(e).__name__}: {e}"))

    def _serve(self, req, handle: RequestHandle, reply: Reply) -> None:
        with self._lock:  # one request at a time, like the engine thread
            t0 = time.perf_counter()
            prompt = list(req.prompt_ids)
            limit = self.profile.context.max_context
            if reply.error or len(prompt) >= limit:
                msg = reply.error or f"prompt is {len(prompt)} tokens; the context limit is {limit}"
                handle.emit(Done("", "", "error", Usage(len(prompt)), Timings(), error=msg))
                return
            cached = self._cached(req.session_id, prompt)
            max_tokens = min(req.params.max_tokens, limit - len(prompt))
            script = self.tokenizer.encode(reply.text) + ([self.tokenizer.specials["<|im_end|>"]] if reply.end else [])
            detok = self.tokenizer.new_detokenizer()
            generated: list[int] = handle.token_ids
            parts: list[str] = []
            finish = "length"
            pos = 0
            while len(generated) < max_tokens:
                if handle.cancelled:
                    finish = "cancelled"
                    break
                if reply.delay_s:
                    time.sleep(reply.delay_s)
                tok, pos = self._next(req.constraint, script, pos)
                if req.constraint is not None:
                    req.constraint.advance(tok)
                generated.append(tok)
                if tok in self.tokenizer.eos_ids:
                    finish = "stop"
                    break
                piece = detok.add(tok)
                if piece:
                    parts.append(piece)
                    handle.emit(TextDelta(piece))
                text = "".join(parts)
                stop = next((s for s in req.params.stop if s and s in text), None)
                if stop is not None:  # like the engine: the reply ends at a stop string, without it
                    parts = [text[: text.index(stop)]]
                    finish = "stop"
                    break
            tail = detok.flush()
            if tail:
                parts.append(tail)
                handle.emit(TextDelta(tail))
            if req.session_id is not None:
                self._kv[req.session_id] = prompt + generated
            total_ms = (time.perf_counter() - t0) * 1000
            handle.emit(Done("".join(parts), "", finish, Usage(len(prompt), cached, len(generated)),
                             Timings(total_ms=round(total_ms, 2)), prompt_token_ids=prompt,
                             completion_token_ids=generated, cache_source="ram" if cached else "none"))

    def _cached(self, session_id: str | None, prompt: list[int]) -> int:
        old = self._kv.get(session_id or "", [])
        n = 0
        for a, b in zip(old, prompt, strict=False):
            if a != b:
                break
            n += 1
        return min(n, len(prompt) - 1)

    def _next(self, constraint, script: list[int], pos: int) -> tuple[int, int]:
        """The scripted token at ``pos``, or the allowed token closest to it."""
        wanted = script[pos] if pos < len(script) else self.tokenizer.specials["<|im_end|>"]
        mask = constraint.allowed() if constraint is not None else None
        if mask is None:
            return wanted, pos + 1
        allowed = np.array(mask)
        if allowed[wanted]:
            return wanted, pos + 1
        self.substitutions += 1
        ids = np.flatnonzero(allowed)
        if len(ids) == 0:
            raise RuntimeError("the constraint allows no token at all")
        # Skip ahead in the script to the next byte the grammar accepts, if any.
        for ahead in range(pos + 1, len(script)):
            if allowed[script[ahead]]:
                return script[ahead], ahead + 1
        return int(ids[0]), pos
