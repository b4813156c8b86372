"""Parallel candidates: N drafts of the next reply in one batched run; the checks pick one.

Between repair rounds (the checks failed), the repair message's context is sent to the engine N
times at once with different seeds; the batched scheduler decodes the rows together after the
shared prefix is restored from the session's checkpoint. In a run that ends at its write, every
draft starts with the file's forced opening (path line and fence) and stops at the block's
closing fence, as the loop's own step does. Some drafts may be fresh: the task's first step
sampled again, without the failed file in view (the 1.5B otherwise copies its failing file, 4 of
4 drafts token for token even at temperature 1.0). Each draft's file edits are applied to a scratch copy
of the workspace and the task's checks run there. The first draft that passes is adopted: the
repair message and that reply go into the session (exact tokens), its edits run in the real
workspace through the ordinary tools (cards, diffs, approvals). When none passes, the caller may
adopt the best one (most tests passed, ``best``) as the round's reply instead of decoding an
ordinary round after them. Drafts never reach the model before that, so the first-try result
stays what it was.
"""

from __future__ import annotations

import shutil
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from engine.runtime import GenerationRequest, Priority
from engine.serving.events import Done, TextDelta

from agents.events import AgentEvent
from agents.loops import LoopGuard
from agents.parser import ToolCallParser
from agents.session import AgentSession
from agents.test_output import tests_passed
from tools import ToolRegistry, default_registry

WRITES = ("write_file", "edit_file")
CLOSING_FENCE = "\n```\n"  # ends a draft that was opened on its file (stop string)
MIN_FILE_BUDGET = 512  # tokens a draft of a file may always take (a stub grows into a solution)


@dataclass
class Draft:
    index: int
    seed: int
    done: Done
    parser: ToolCallParser
    handle: Any
    opening_ids: list[int] = field(default_factory=list)
    fresh: bool = False  # drafted from the task's own prompt, not from the failed attempt
    edits: int = 0
    edit_errors: int = 0
    changed: bool = False  # an edit changed a file of the workspace
    checks: list[dict[str, Any]] = field(default_factory=list)

    @property
    def passed(self) -> bool:
        return bool(self.checks) and all(c["passed"] for c in self.checks)

    @property
    def tests_passed(self) -> int:
        """Tests passed over the checks (a check whose output has no test summary counts as one
        test, passed or not); -1 when no check ran."""
        return checks_tests_passed(self.checks) if self.checks else -1

    def record(self) -> dict[str, Any]:
        return {"index": self.index, "seed": self.seed, "fresh": self.fresh,
                "completion_tokens": self.done.usage.completion_tokens,
                "finish_reason": self.done.finish_reason, "edits": self.edits, "edit_errors": self.edit_errors,
                "changed": self.changed, "checks_passed": sum(1 for c in self.checks if c["passed"]),
                "tests_passed": self.tests_passed, "passed": self.passed}


@dataclass
class CandidateRound:
    drafts: list[Draft]
    chosen: Draft | None
    wall_s: float
    decode_s: float

    def record(self) -> dict[str, Any]:
        return {"n": len(self.drafts), "chosen": None if self.chosen is None else self.chosen.index,
                "wall_s": round(self.wall_s, 3), "decode_s": round(self.decode_s, 3),
                "completion_tokens": sum(d.done.usage.completion_tokens for d in self.drafts),
                "drafts": [d.record() for d in self.drafts]}


def draft(agent: AgentSession, message: str, n: int, *, temperature: float, seed: int,
          fresh: int = 0, task_from: int | None = None) -> tuple[list[Draft], float]:
    """N replies to ``message`` (not stored) decoded together; (drafts, seconds). Each draft's
    ``done`` holds the forced opening in its text and tokens, like a step of the loop. The last
    ``fresh`` of them (when the run opens a file) answer the task itself instead: the context of
    its first step (the task's user message is the first at or after message ``task_from``),
    without the failed file and its test output (``Draft.fresh``)."""
    engine = agent.engine
    opening = agent.file_opening()
    opening_ids = engine.tokenizer.encode(opening) if opening else []
    prompt_ids = agent.prompt_with(message) + opening_ids
    task_ids = agent.task_prompt_ids(task_from) if opening and fresh and task_from is not None else None
    fresh = min(fresh, n) if task_ids else 0
    budget = agent.step_budget(len(prompt_ids))
    if opening:
        budget = min(budget, file_budget(agent, opening))
    stop = (CLOSING_FENCE,) if opening else ()
    t0 = time.monotonic()
    handles = []
    for i in range(n):
        params = engine.sampling(max_tokens=budget, temperature=temperature, seed=seed + i, stop=stop,
                                 top_p=1.0, min_p=engine.profile.agent.candidate_min_p,
                                 repetition_penalty=engine.profile.agent.repetition_penalty)
        ids = task_ids + opening_ids if i >= n - fresh else prompt_ids
        handles.append(engine.submit(GenerationRequest(list(ids), params, split_reasoning=False,
                                                       priority=Priority.AGENT)))
    # a draft that loops would hold the whole batch to its token budget: watch each stream
    looped = [False] * n
    watchers = [threading.Thread(target=_stop_if_looping, args=(h, looped, i), daemon=True)
                for i, h in enumerate(handles)]
    for w in watchers:
        w.start()
    for w in watchers:
        w.join()
    drafts = []
    for i, h in enumerate(handles):
        done = h.result()
        if done.finish_reason == "cancelled" and looped[i]:
            done = replace(done, finish_reason="looped")
        if opening:
            text = done.text
            if done.finish_reason == "stop" and "\n```" not in text:
                text += CLOSING_FENCE  # the stop string ended it: the block is whole
            done = replace(done, text=opening + text,
                           completion_token_ids=opening_ids + list(done.completion_token_ids))
        parser = ToolCallParser(agent.tool_params, id_prefix="draft", text_edits=agent.edit_format != "json",
                                infer_path=agent.infer_path)
        parser.feed(done.text)
        parser.finish()
        drafts.append(Draft(i, seed + i, done, parser, h, opening_ids, fresh=i >= n - fresh))
    return drafts, time.monotonic() - t0


def file_budget(agent: AgentSession, opening: str) -> int:
    """Tokens a draft of the opened file may take: twice the file as it is now, at least
    ``MIN_FILE_BUDGET``. The batch runs until its longest draft ends, so one draft that rambles
    on to the step's budget (2048 tokens on the 1.5B preset) holds all of them; a repair that
    more than doubles a file is rare, and a cut-off draft is simply not kept."""
    path = opening.split("\n", 1)[0]
    try:
        current = agent.workspace.joinpath(path).read_text(encoding="utf-8", errors="replace")
    except OSError:
        current = ""
    return max(MIN_FILE_BUDGET, 2 * len(agent.engine.tokenizer.encode(current)) + 64)


def _stop_if_looping(handle, looped: list[bool], i: int) -> None:
    """Follow draft ``i``'s stream; cancel it (and mark it in ``looped``) once it repeats itself."""
    guard, text = LoopGuard(), ""
    for ev in handle:
        if isinstance(ev, TextDelta):
            text += ev.text
            if guard.update(text):
                looped[i] = True
                handle.cancel()
                return


def try_drafts(agent: AgentSession, drafts: list[Draft],
               run_checks_in: Callable[[Path], list[dict[str, Any]]]) -> Draft | None:
    """Apply each draft's edits to a scratch copy of the workspace and check it; the first that passes."""
    for d in drafts:
        # the agent's own rules: a write to a protected path (the tests) is not applied
        writes = [c for c in d.parser.calls if c.name in WRITES and not agent.refuses(c)]
        if not writes or d.done.error:
            continue
        scratch = Path(tempfile.mkdtemp(prefix="mlxterm-draft-"))
        try:
            ws = scratch / "ws"
            shutil.copytree(agent.workspace, ws, symlinks=True)
            base = default_registry(ws, sandbox=agent.sandbox)
            registry = ToolRegistry(base.workspace, [base.get(n) for n in WRITES])
            for call in writes:
                result = registry.run(call.name, call.arguments)
                d.edits += result.ok
                d.edit_errors += not result.ok
                data = result.data
                d.changed = d.changed or (result.ok and bool(data.get("diff") or data.get("created")))
            if d.edits:
                d.checks = run_checks_in(ws)
        finally:
            shutil.rmtree(scratch, ignore_errors=True)
        if d.passed:
            return d
    return None


def best(drafts: list[Draft], baseline: int = -1) -> Draft | None:
    """The failing draft to keep when none passed: one that changed the file and passed the most
    tests (the earliest of equals), more than ``baseline`` (the tests the current file passes);
    None when no draft does better than what is there (bob: the best draft passed 17 of 26
    tests where the file it would replace passed 18)."""
    changed = [d for d in drafts if d.changed and d.checks and d.tests_passed > baseline]
    return max(changed, key=lambda d: (d.tests_passed, -d.index)) if changed else None


def checks_tests_passed(checks: list[dict[str, Any]]) -> int:
    """Tests passed over ``checks``, counted as for a draft (``Draft.tests_passed``)."""
    counts = [tests_passed(c.get("output") or "") for c in checks]
    return sum(int(c["passed"]) if n is None else n for c, n in zip(checks, counts, strict=True))


def candidate_round(agent: AgentSession, message: str, n: int, run_checks_in: Callable[[Path], list[dict[str, Any]]],
                    *, temperature: float, seed: int, keep_best: bool = False, baseline: int = -1,
                    fresh: int = 0, task_from: int | None = None) -> Iterator[AgentEvent | CandidateRound]:
    """Draft, check, adopt the first passing draft (its events are yielded), or with ``keep_best``
    the best failing one that passes more than ``baseline`` tests; last the round's record
    (``chosen``: the draft adopted, if any)."""
    t0 = time.monotonic()
    drafts, decode_s = draft(agent, message, n, temperature=temperature, seed=seed, fresh=fresh,
                             task_from=task_from)
    chosen = try_drafts(agent, drafts, run_checks_in)
    if chosen is None and keep_best:
        chosen = best(drafts, baseline)
    if chosen is not None:
        yield from agent.adopt(message, chosen.done, chosen.parser, chosen.handle, chosen.opening_ids,
                               fresh=chosen.fresh)
    yield CandidateRound(drafts, chosen, time.monotonic() - t0, decode_s)
