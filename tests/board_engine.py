"""A scripted engine for board tests: replies routed per card, shared-prefix KV reuse.

Each card's prompt carries a key (``[card-a]``); requests are answered from that key's script,
so concurrent cards get their own replies whatever order their requests arrive in. Prompt
reuse is reported like the real checkpoint store, which serves the longest stored prefix of
any session (and of the prefix warm-up request, which has none).
"""

from __future__ import annotations

import re

from agents.protocol import format_call
from agents.scripted import Reply, ScriptedEngine

KEY = re.compile(r"\[card-([a-z0-9]+)\]")


class RoutedEngine(ScriptedEngine):
    def __init__(self, scripts: dict[str, list], **kw):
        super().__init__([], **kw)
        self.scripts = {k: list(v) for k, v in scripts.items()}
        self.warmups = 0
        self.log: list[tuple[str, str]] = []  # (key, event) in engine order

    def submit(self, request):
        text = self.tokenizer.decode(request.prompt_ids)
        if request.session_id is None and not KEY.search(text):  # the prefix warm-up (drafts carry a key)
            self.warmups += 1
            self.replies = [Reply("ok")]
        else:
            keys = KEY.findall(text)
            key = keys[-1] if keys else "?"
            script = self.scripts.get(key) or [Reply(f"(no script for {key})")]
            self.replies = [script.pop(0) if script else Reply("done")]
            self.log.append((key, "submit"))
        return super().submit(request)

    def _serve(self, req, handle, reply):
        super()._serve(req, handle, reply)
        if req.session_id is None:
            with self._lock:
                self._kv[f"warm-{len(self._kv)}"] = list(req.prompt_ids)

    def _cached(self, session_id, prompt):
        best = 0
        for old in self._kv.values():
            n = 0
            for a, b in zip(old, prompt, strict=False):
                if a != b:
                    break
                n += 1
            best = max(best, n)
        return min(best, len(prompt) - 1)


def write(path: str, content: str, delay_s: float = 0.0) -> Reply:
    return Reply(format_call("write_file", {"content": content, "path": path}), delay_s=delay_s)


def answer(text: str = "Done.", delay_s: float = 0.0) -> Reply:
    return Reply(text, delay_s=delay_s)
