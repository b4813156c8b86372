"""Speculative decoding: decode tok/s with vs without speculation, same prompts, same tokens.

Why: speculation must pay where text is copied and cost ~nothing where it is not. Per scenario
(copy-heavy and free-form on the lookup profile, code on a draft pair, an agent edit_file step
under the tool-call grammar), arms plain/spec/spec/plain on one loaded engine, greedy so the
tokens must be identical. Also each target's verify-cost curve (one forward over 1..16 new rows)
and the draft length that maximises expected tokens per unit of cost. Weights are whatever the
profiles choose, so the bench reruns as is on faster kernels. Scenarios in detail:
docs/benches.md.
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable

STORY = "Write a short story (about 200 words) about a lighthouse keeper who finds a message in a bottle."
CODE = ("Write a Python function `column_means(path)` that reads a CSV file with a header row and "
        "returns a dict mapping each numeric column name to its mean. Include a docstring.")
PASSAGE = (
    "It was the best of times, it was the worst of times, it was the age of wisdom, it was the "
    "age of foolishness, it was the epoch of belief, it was the epoch of incredulity, it was the "
    "season of Light, it was the season of Darkness, it was the spring of hope, it was the winter "
    "of despair, we had everything before us, we had nothing before us, we were all going direct "
    "to Heaven, we were all going direct the other way."
)


def add_arguments(p) -> None:
    p.add_argument("--profile", default="qwen2.5-coder-0.5b-lookup", help="lookup profile (copy-heavy, free-form; '' to skip)")
    p.add_argument("--pair-profile", default="qwen2.5-coder-1.5b-draft", help="draft-model profile ('' to skip)")
    p.add_argument("--edit-profile", default="",
                   help="also run the agent edit_file step (opened up to old_text) on this lookup profile, "
                        "e.g. qwen2.5-coder-1.5b-lookup: a model that copies the function it edits")
    p.add_argument("--max-tokens", type=int, default=160)
    p.add_argument("--pair-max-tokens", type=int, default=64)
    p.add_argument("--rounds", type=int, default=1, help="each round runs plain, spec, spec, plain")
    p.add_argument("--curve-rows", default="1,2,4,8,12,15,16",
                   help="verify forward sizes to time (15 is the most a verify uses on the kernels)")


def source_file(lines: int = 300) -> str:
    """A deterministic ~300-line Python module (small functions, a class, constants)."""
    out = ['"""Inventory helpers."""', "", "import math", "", "TAX_RATE = 0.2", ""]
    i = 0
    while len(out) < lines - 8:
        out += [
            f"def compute_total_{i}(items, discount={i % 5}):",
            f'    """Total price of items in bucket {i}, after a discount of {i % 5} percent."""',
            "    total = 0.0",
            "    for item in items:",
            f"        total += item.price * item.quantity * {1 + i % 3}",
            "    total *= (100 - discount) / 100",
            "    return round(total * (1 + TAX_RATE), 2)",
            "",
        ]
        i += 1
    out += ["class Shelf:", "    def __init__(self, name):", "        self.name = name",
            "        self.items = []", "", "    def add(self, item):", "        self.items.append(item)", ""]
    return "\n".join(out[:lines]) + "\n"


def edit_step_messages(code: str) -> tuple[list[dict], list[dict]]:
    """An agent's ``edit_file`` step as the agent sends it: the real tool schemas, and the real
    ``read_file`` result of the file's first 60 lines (run in a scratch workspace)."""
    import tempfile

    from tools import default_registry

    small = "\n".join(code.splitlines()[:60]) + "\n"
    with tempfile.TemporaryDirectory() as ws:
        with open(os.path.join(ws, "inventory.py"), "w") as f:
            f.write(small)
        registry = default_registry(ws)
        result = registry.run("read_file", {"path": "inventory.py"})
        schemas = [t for t in registry.schemas() if t["function"]["name"] in ("read_file", "edit_file")]
    call = {"name": "read_file", "arguments": {"path": "inventory.py"}}
    messages = [
        {"role": "user", "content": "In inventory.py, make compute_total_3 apply the discount before the "
                                    "multiplier loop. Use the edit_file tool: old_text must be copied "
                                    "verbatim from the file, new_text is the replacement."},
        {"role": "assistant", "content": f"<tool_call>\n{json.dumps(call)}\n</tool_call>"},
        {"role": "tool", "content": result.content, "name": "read_file"},
    ]
    return messages, schemas


def edit_step_prompt(engine, opened: str = "") -> list[int]:
    """The agent's edit_file step, the reply opened up to ``old_text`` (+ ``opened``): a model
    that edits copies the old function into a JSON string (the lookup's escaped index)."""
    msgs, tools = edit_step_messages(source_file())
    return engine.chat_prompt(msgs, tools=tools) + engine.tokenizer.encode(
        '<tool_call>\n{"name": "edit_file", "arguments": {"path": "inventory.py", "old_text": "' + opened)


def edit_step_constraint(engine, prompt: list[int], max_tokens: int):
    """A factory of the agent's tool-call constraint for ``edit_step_prompt``'s reply: the same
    grammar and masks an agent session uses (``constrained_tool_calls``), advanced over the
    opened part of the call, so it constrains what the model writes after it."""
    from agents.constrained import ToolCallConstraint, shared_masks

    msgs, tools = edit_step_messages(source_file())
    opened = prompt[len(engine.chat_prompt(msgs, tools=tools)):]
    masks = shared_masks(engine, tools)

    def make():
        c = ToolCallConstraint(masks, max_tokens=len(opened) + max_tokens)
        for t in opened:
            c.allowed()
            c.advance(t)
        assert c.phase == "call", "the opened edit_file call left the tool-call grammar"
        return c

    return make


def scenarios(engine, max_tokens: int) -> dict[str, list[int]]:
    code = source_file()
    return {
        "copy_rewrite_300_lines": engine.chat_prompt([{
            "role": "user",
            "content": "Here is inventory.py:\n```python\n" + code + "```\nRename TAX_RATE to VAT_RATE. "
                       "Reply with the complete updated file and nothing else."}]),
        # the reply opens the edit_file call up to old_text (a 0.5B does not choose the tool on
        # its own); what is measured is the copy: old_text and new_text as JSON strings
        # Qwen 0.5B copies one line here (docs/benchmarks.md): not a copy-heavy step for it
        "copy_edit_file_step": edit_step_prompt(engine, "def compute_total_3("),
        # the same step under the tool-call grammar, as an agent generates it (both arms)
        "copy_edit_file_step_constrained": edit_step_prompt(engine, "def compute_total_3("),
        "copy_quote_passage": engine.chat_prompt([{
            "role": "user", "content": f"Repeat this passage word for word:\n\n{PASSAGE}\n\n{PASSAGE}"}]),
        "free_form_story": engine.chat_prompt([{"role": "user", "content": STORY}]),
    }


def verify_curve(engine, rows: list[int], context: int = 256, reps: int = 7) -> dict:
    """Milliseconds of one target forward over ``n`` new rows (fastest of ``reps``), and ratios."""
    from engine.generation.generate import prefill
    from engine.generation.speculation.exact_rows import max_verify_rows, step_shaped

    import mlx.core as mx

    def measure(runner):
        model = runner.model
        cache = runner.cache.new_cache()
        prefill(model, cache, [(17 * i + 11) % 5000 + 100 for i in range(context)])
        out = {}
        for n in rows:
            x = mx.array([[(31 * j + 7) % 5000 + 100 for j in range(n)]])
            times = []
            for _ in range(reps + 1):
                for c in cache:
                    c.reserve(n)
                t = time.perf_counter()
                with step_shaped():  # as speculation runs it: rows attend as the decode step does
                    mx.eval(model(x, cache=cache))
                times.append(time.perf_counter() - t)
                for c in cache:
                    c.offset -= n
            # the fastest repetition: the forward's own cost, least disturbed by other load
            out[n] = min(times[1:]) * 1000
        return out

    ms = engine.call(measure).result()
    one = ms[rows[0]]
    curve = {str(n): {"ms": round(v, 2), "vs_1_row": round(v / one, 2)} for n, v in ms.items()}
    best = {}
    for alpha in (0.5, 0.7, 0.9):  # per-token acceptance probability
        def gain(k, alpha=alpha):
            cost = _interp(ms, k + 1) / one
            return (1 - alpha ** (k + 1)) / (1 - alpha) / cost
        k = max(range(1, min(max(rows), max_verify_rows())), key=gain)
        best[str(alpha)] = {"draft_tokens": k, "expected_speedup": round(gain(k), 2)}
    return {"context_tokens": context, "rows": curve, "best_draft_length_by_acceptance": best}


def _interp(ms: dict[int, float], n: int) -> float:
    keys = sorted(ms)
    if n in ms:
        return ms[n]
    lo = max(k for k in keys if k < n)
    hi = min((k for k in keys if k > n), default=None)
    if hi is None:
        return ms[lo] * n / lo
    return ms[lo] + (ms[hi] - ms[lo]) * (n - lo) / (hi - lo)


def compare(engine, prompt: list[int], max_tokens: int, rounds: int, constraint=None) -> dict:
    """``constraint``: a factory of each request's TokenConstraint (both arms), or None."""
    from engine.runtime import GenerationRequest

    runs: dict[str, list] = {"plain": [], "spec": []}

    def once(speculate: bool):
        params = engine.sampling(temperature=0.0, max_tokens=max_tokens, repetition_penalty=1.0)
        done = engine.submit(GenerationRequest(prompt, params, constraint=constraint() if constraint else None,
                                               extra={"speculation": speculate})).result()
        runs["spec" if speculate else "plain"].append(done)

    once(False)  # warm-up: prefill once (later requests reuse the cached prompt), compile traces
    runs["plain"].clear()
    for _ in range(rounds):
        for speculate in (False, True, True, False):
            once(speculate)
    plain, spec = runs["plain"], runs["spec"]
    identical = all(d.completion_token_ids == plain[0].completion_token_ids for d in plain + spec)
    p_tps = statistics.median(d.timings.decode_tps for d in plain)
    s_tps = statistics.median(d.timings.decode_tps for d in spec)
    st = spec[-1].speculation
    return {
        "prompt_tokens": len(prompt),
        "tokens": len(plain[0].completion_token_ids),
        "identical": identical,
        "plain_tps": round(p_tps, 2),
        "spec_tps": round(s_tps, 2),
        "speedup": round(s_tps / p_tps, 2) if p_tps else None,
        "acceptance_rate": st["acceptance_rate"],
        "forced_drafted": st.get("forced_drafted", 0),
        "mean_accepted_length": st["mean_accepted_length"],
        "rounds": st["rounds"],
        "plain_steps": st["plain_steps"],
        "reply_head": plain[0].text[:200],  # what the model wrote (is it a copy?)
        "plain_runs_tps": [d.timings.decode_tps for d in plain],
        "spec_runs_tps": [d.timings.decode_tps for d in spec],
    }


def run(args) -> dict:
    from engine import blas
    from engine.model.weight_policy import backend
    from engine.runtime import Engine

    rows = [int(x) for x in args.curve_rows.split(",")]
    result: dict = {"bench": "spec", "backend": backend(), "blas": blas.status(),
                    "machine": f"{platform.machine()} {platform.system()}",
                    "load_average": os.getloadavg(), "rounds": args.rounds, "scenarios": {}, "curves": {}}
    table = ["| scenario | profile | tokens | plain tok/s | spec tok/s | speedup | acceptance | mean accepted | identical |",
             "|---|---|---|---|---|---|---|---|---|"]
    # (profile, its scenarios' prompts, tokens per reply, whether to measure its verify curve)
    jobs: list[tuple[str, Callable[[Engine], dict[str, list[int]]], int, bool]] = []
    if args.profile:
        jobs.append((args.profile, lambda eng: scenarios(eng, args.max_tokens), args.max_tokens, True))
    if args.edit_profile:
        jobs.append((args.edit_profile,
                     lambda eng: {"copy_edit_file_step_copying_model_constrained": edit_step_prompt(eng)},
                     args.max_tokens, False))
    if args.pair_profile:
        jobs.append((args.pair_profile,
                     lambda eng: {"code_generation_pair": eng.chat_prompt([{"role": "user", "content": CODE}])},
                     args.pair_max_tokens, True))
    for profile, prompts_of, max_tokens, curve in jobs:
        eng = Engine.load(profile)
        try:
            if curve:
                result["curves"][profile] = {"model": eng.model_name, "weights": eng.weight_format,
                                             **verify_curve(eng, rows)}
            prompts = prompts_of(eng)
            for name, prompt in prompts.items():
                make = edit_step_constraint(eng, prompt, max_tokens) if name.endswith("_constrained") else None
                r = compare(eng, prompt, max_tokens, args.rounds, make)
                r["profile"] = profile
                result["scenarios"][name] = r
                print(f"bench spec: {name}: {json.dumps(r)}", file=sys.stderr, flush=True)  # progress
                table.append(f"| {name} | {profile} | {r['tokens']} | {r['plain_tps']} | {r['spec_tps']} | "
                             f"{r['speedup']}x | {r['acceptance_rate']:.0%} | {r['mean_accepted_length']} | "
                             f"{r['identical']} |")
        finally:
            eng.close()
    result["load_average_end"] = os.getloadavg()
    curve_lines = ["", "verify cost (ms per forward, 256-token context):"]
    for c in result["curves"].values():
        cells = ", ".join(f"{n} rows {v['ms']} ms ({v['vs_1_row']}x)" for n, v in c["rows"].items())
        curve_lines.append(f"  {c['model']} [{c['weights']}]: {cells}")
    result["summary"] = "\n".join(table + curve_lines)
    return result
