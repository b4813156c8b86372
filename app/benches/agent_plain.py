"""The one-shot arm of ``mlxterm bench agent``: the model alone, no agent.

The exercise's instructions and stub file go to the model in one chat turn that asks for the
whole file in one fenced block (the setup of aider's whole-file benchmark, in our own words),
sampled greedily; the block is written over the stub in a fresh workspace and the exercise's
own tests run on it in the agent sandbox. Run beside the agent on the same exercises, engine
and weights, it separates what the model can do from what the agent harness loses or adds.
The ``plain_tests`` arm is the same request with the exercise's unit tests shown beside the stub
(read-only context, as a user hands an agent the files it must satisfy). On a remote profile the
request goes to its server (llama.cpp on the same GGUF: the model's rate without our kernels).
"""

from __future__ import annotations

import shutil
import time
from pathlib import Path
from typing import Any

SYSTEM = ("You are an expert software developer. Change the code the user supplies as they ask. "
          "Reply with the complete new version of the file: its file name on a line of its own, then "
          "the whole file in one fenced code block, every line of it.")
MAX_TOKENS = 2048
ARMS = ("plain", "plain_tests")


def plain_messages(ex, *, show_tests: bool = False) -> list[dict[str, str]]:
    """The stub file(s) in one turn, then the instructions and the request (as aider orders
    them: with the instructions first, the greedy 1.5B opened a fence and copied them into it).
    ``show_tests``: the unit tests follow the stub in the first turn, marked read-only."""
    from agents.taskfile import fenced_file, read_context

    stubs = [fenced_file(ex.dir / name, name) for name in ex.solution]
    first = "Here are the files:\n\n" + "\n\n".join(stubs)
    if show_tests:
        first += "\n\n" + read_context(ex.dir, ex.test, "The unit tests (read-only: do not change them):")
    files = ", ".join(ex.solution)
    request = (f"{ex.instructions.rstrip()}\n\n"
               f"Use the instructions above to change {files}. Keep the names of the existing functions "
               "and classes: unit tests call them. Use only Python's standard library.")
    return [{"role": "system", "content": SYSTEM},
            {"role": "user", "content": first},
            {"role": "assistant", "content": "Ok."},
            {"role": "user", "content": request}]


def written_files(ex, text: str) -> dict[str, str]:
    """The whole files the reply writes, by path (only the exercise's solution files count; a
    fence without a path line writes the one solution file, as the agent would infer it)."""
    from agents.edits import TextEditParser
    from agents.parse_events import Parsed

    ids = iter(range(1, 1000))
    solo = ex.solution[0] if len(ex.solution) == 1 else None
    parser = TextEditParser(lambda: (n := next(ids), f"plain-{n}"),
                            infer_path=lambda lang: solo if lang in ("python", "py", "") else None)
    events = parser.feed(text) + parser.finish()
    out: dict[str, str] = {}
    for ev in events:
        if isinstance(ev, Parsed) and ev.call.name == "write_file":
            path = str(ev.call.arguments.get("path", "")).removeprefix("./")
            if path in ex.solution:
                out[path] = str(ev.call.arguments.get("content", ""))
    return out


def run_plain(ex, engine, workspace: Path, score, *, show_tests: bool = False) -> dict[str, Any]:
    """Ask once, write the reply's block over the stub, score it with ``score(ex, workspace)``."""
    from engine.runtime import GenerationRequest

    from agents.exercises import copy_writable

    t0 = time.monotonic()
    if workspace.exists():
        shutil.rmtree(workspace)
    workspace.mkdir(parents=True)
    for name in ex.solution + ex.test:
        copy_writable(ex.dir / name, workspace / name)
    error = None
    text, usage = "", None
    try:
        params = engine.sampling(max_tokens=MAX_TOKENS, temperature=0.0, repetition_penalty=1.0, seed=0)
        messages = plain_messages(ex, show_tests=show_tests)
        if hasattr(engine, "chat_prompt"):
            handle = engine.submit(GenerationRequest(engine.chat_prompt(messages), params))
        else:  # a remote profile's server (e.g. llama.cpp on the same GGUF): its own chat template
            handle = engine.submit_messages(messages, params)
        try:
            done = handle.result()
        except KeyboardInterrupt:  # Ctrl-C: stop decoding now, the bench reports what finished
            handle.cancel()
            raise
        text, usage = done.text, done.usage
        error = done.error
    except Exception as e:  # one broken exercise must not end the bench
        error = f"{type(e).__name__}: {e}"
    files = written_files(ex, text)
    for name, content in files.items():
        (workspace / name).write_text(content, encoding="utf-8")
    verdict = score(ex, workspace)
    (workspace / "reply.md").write_text(text, encoding="utf-8")
    return {
        "passed": bool(verdict["passed"]),
        "wrote": sorted(files),
        "completion_tokens": getattr(usage, "completion_tokens", None),
        "prompt_tokens": getattr(usage, "prompt_tokens", None),
        "wall_s": round(time.monotonic() - t0, 3),
        "error": error,
        "workspace": str(workspace),
        "score_output": (verdict.get("output") or "")[-800:],
    }
