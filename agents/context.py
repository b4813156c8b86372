"""The agent session's context: its stored messages and their exact tokens.

Every message an agent run adds goes through ``SessionContext.append`` with the tokens it adds
to the context (``agents.ledger`` renders them the way the chat template would), so each step's
prompt extends the previous one exactly and the engine reuses its KV cache. ``compact`` shortens
old tool output when the context runs short (``agents.compaction`` plans what to cut) and puts
the later messages back with their tokens recomputed; ``close_interrupted_turn`` ends a turn a
stopped run left open. A remote session has no tokens here: its size is estimated from its
characters, at the characters per token the server's own ``usage`` showed for the last reply.
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from typing import Any

from engine.sessions import Message, SessionStore
from engine.sessions.partial import recover_interrupted

from agents import compaction
from agents.events import Compacted
from agents.ledger import TokenLedger, render_dict
from agents.transcript import Transcript

CHARS_PER_TOKEN = 3.5  # a remote session's estimate until a reply's usage gives the server's own
MESSAGE_OVERHEAD = 4  # template tokens around each message (role markers), estimated


class SessionContext:
    """Appends to, closes and compacts one stored agent session's messages (exact tokens)."""

    def __init__(self, store: SessionStore, session_id: str, ledger: TokenLedger, tokenizer,
                 transcript: Transcript):
        self.store, self.session_id, self.ledger = store, session_id, ledger
        self.tokenizer, self.transcript = tokenizer, transcript

    def append(self, messages: list[dict[str, Any]], *, generation_prompt: bool, metas: list[dict[str, Any]],
                step: int = 0, tool_calls: list | None = None) -> list[Message]:
        _, ids = self.tokens_after(messages, generation_prompt)
        stored = []
        for i, (m, tokens, meta) in enumerate(zip(messages, ids, metas, strict=True)):
            calls = tool_calls[i] if tool_calls else None
            msg = self.store.add_message(self.session_id, m["role"], m["content"], tool_calls=calls,
                                         tool_call_id=m.get("tool_call_id"), name=m.get("name"),
                                         token_ids=tokens, meta=meta)
            self.transcript.message(msg, step)
            stored.append(msg)
        return stored

    def tokens_after(self, messages: list[dict[str, Any]], generation_prompt: bool) -> tuple[list[int], list[list[int]]]:
        """(the stored context's tokens, each of ``messages``' tokens appended after it). A run
        that ended at its write (``ends_run``) left no generation prompt after its results."""
        history = self.store.messages(self.session_id)
        fed = [t for m in history for t in m.token_ids]
        prompted = False if history and history[-1].meta.get("ends_run") else None
        return fed, self.ledger.tokens_for([render_dict(m) for m in history], fed, messages, generation_prompt,
                                           prompted)

    def close_interrupted_turn(self) -> None:
        """A run stopped after tool results (or a crash after the user message) leaves the
        context ending in a generation prompt; close that turn with an empty assistant reply
        so the next user message follows a complete turn. A reply left streaming by a killed
        process is marked interrupted and kept (its exact tokens stay in the context)."""
        recover_interrupted(self.store, self.session_id)
        last = self.store.messages(self.session_id, tokens=False)[-1:]
        if last and last[0].role in ("user", "tool") and not last[0].meta.get("ends_run"):
            self.append([{"role": "assistant", "content": ""}], generation_prompt=False,
                         metas=[{"interrupted": True}])

    def used_tokens(self, messages: Sequence[Message] | None = None) -> int:
        """The context's size in tokens: exact with a tokenizer, else estimated (remote)."""
        if messages is None:
            if self.tokenizer is not None:
                return self.store.get(self.session_id).token_count
            messages = self.store.messages(self.session_id, tokens=False)
        if self.tokenizer is not None:
            return sum(m.token_count for m in messages)
        ratio = chars_per_token(messages)
        return sum(math.ceil(len(_renderable(m)) / ratio) + MESSAGE_OVERHEAD for m in messages)

    def compact(self, step: int, tokens_over: int, room: int) -> Compacted | None:
        """Shorten old tool results so the prompt fits ``room`` with some slack."""
        messages = self.store.messages(self.session_id)
        before = self.used_tokens(messages)
        target = int(room * compaction.TARGET_FRACTION)
        need = max(tokens_over, before - target)
        tok = self.tokenizer
        ratio = chars_per_token(messages)
        count = ((lambda text: len(tok.encode(text)) + 8) if tok is not None
                 else (lambda text: math.ceil(len(text) / ratio) + 8))
        plan = compaction.plan(messages, need, count)
        if not plan.indices:
            return None
        first = plan.indices[0]
        self.store.delete_last(self.session_id, len(messages) - first)
        removed = sum(len(_renderable(messages[i])) - len(plan.new_content[i]) for i in plan.indices)
        superseded = [{"index": i, "path": path} for i, path in plan.superseded.items()]
        self.transcript.write("compaction", step, from_index=first, messages=list(plan.indices),
                              tokens_before=before, chars_removed=removed, superseded=superseded)
        roles = [m.role for m in messages]
        for m in messages[first:]:
            following = roles[m.index + 1] if m.index + 1 < len(roles) else None
            self._readd(m, plan.new_content.get(m.index), step, following)
        after = self.used_tokens()
        record = {"step": step, "messages": list(plan.indices), "tokens_before": before,
                  "tokens_after": after, "chars_removed": removed, "superseded": superseded}
        history = self.store.get_meta(self.session_id).get("compactions", [])
        self.store.set_meta(self.session_id, {"compactions": [*history, record]})
        self.transcript.write("compaction_done", step, tokens_after=after)
        return Compacted(step, plan.indices, before, after, removed)

    def _readd(self, m: Message, new_content: str | None, step: int, following: str | None) -> None:
        """Put message ``m`` back after a compaction (assistant turns keep their exact tokens
        unless an older file version in them is replaced: then their raw text is re-rendered)."""
        if m.role == "assistant" and new_content is not None:
            old_raw = m.meta.get("raw_text", m.content)
            meta = {**m.meta, "raw_text": new_content,
                    "compacted": {"original_chars": len(old_raw), "step": step, "superseded": True}}
            content = _replace_block(m.content, old_raw, new_content)
            history = self.store.messages(self.session_id)
            fed = [t for h in history for t in h.token_ids]
            ids = self.ledger.tokens_for([render_dict(h) for h in history], fed,
                                         [{"role": "assistant", "content": new_content}], False)[0]
            msg = self.store.add_message(self.session_id, "assistant", content, reasoning=m.reasoning,
                                         tool_calls=m.tool_calls, token_ids=ids, meta=meta)
            self.transcript.message(msg, step)
            return
        if m.role == "assistant":
            msg = self.store.add_message(self.session_id, "assistant", m.content, reasoning=m.reasoning,
                                         tool_calls=m.tool_calls, token_ids=m.token_ids, meta=m.meta)
            self.transcript.message(msg, step)
            return
        meta = dict(m.meta)
        content = m.content
        if new_content is not None:
            meta["compacted"] = {"original_chars": len(m.content), "step": step}
            content = new_content
        history = self.store.messages(self.session_id)
        gp = m.role in ("user", "tool") and following in (None, "assistant")
        fed = [t for h in history for t in h.token_ids]
        d = {"role": m.role, "content": content}
        if m.tool_call_id:
            d["tool_call_id"] = m.tool_call_id
        if m.name:
            d["name"] = m.name
        ids = self.ledger.tokens_for([render_dict(h) for h in history], fed, [d], gp)[0]
        msg = self.store.add_message(self.session_id, m.role, content, tool_calls=m.tool_calls,
                                     tool_call_id=m.tool_call_id, name=m.name, token_ids=ids, meta=meta)
        self.transcript.message(msg, step)


def chars_per_token(messages: Sequence[Message]) -> float:
    """Characters per token of a remote session: the messages' characters up to the last reply
    whose usage the server reported, over its prompt and completion tokens (template and tools
    included, so the estimate errs large); ``CHARS_PER_TOKEN`` before any."""
    chars, ratio = 0, None
    for m in messages:
        chars += len(_renderable(m))
        usage = m.meta.get("usage") if m.role == "assistant" else None
        if isinstance(usage, dict) and usage.get("prompt_tokens"):
            ratio = chars / (usage["prompt_tokens"] + (usage.get("completion_tokens") or 0))
    return max(ratio or CHARS_PER_TOKEN, 0.5)


def _renderable(m: Message) -> str:
    return m.meta.get("raw_text", m.content) if m.role == "assistant" else m.content


def _replace_block(content: str, old_raw: str, new_raw: str) -> str:
    """The visible text of an assistant turn after its raw text changed from ``old_raw`` to
    ``new_raw``: the same replacement where the changed part appears in it, else as it was."""
    start = len(os.path.commonprefix([old_raw, new_raw]))
    end = len(os.path.commonprefix([old_raw[start:][::-1], new_raw[start:][::-1]]))
    removed, added = old_raw[start:len(old_raw) - end], new_raw[start:len(new_raw) - end]
    return content.replace(removed, added, 1) if removed and removed in content else content
