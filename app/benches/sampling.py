"""Sampler cost per token: top-p by sorting the vocabulary vs the CPU kernel's O(vocab) filter.

Why: sorting the whole vocabulary per token cost more than SmolLM2's whole forward
(docs/benchmarks-log.md, round 17).
Two parts, each alternating its arms A/B/C/C/B/A every round: ``sampler`` times
``make_sampler``'s sample() on synthetic logits per ``--vocabs`` size (arms ``sort``, ``mlx``,
``kernel``); ``decode`` (with ``--profiles``) decodes with each profile's own sampling, arms
``sort`` and ``kernel``, tok/s and CPU ms per token. Reported: medians per arm and the ratios to
``sort``. Details: docs/benches.md.
"""

from __future__ import annotations

import os
import statistics
import time

PROMPT = "Write a long story about a robot."


def add_arguments(p) -> None:
    p.add_argument("--vocabs", default="49152,151936", help="comma list of vocabulary sizes")
    p.add_argument("--rows", default="1,4", help="comma list of rows sampled per step")
    p.add_argument("--reps", type=int, default=7, help="steps per arm per pass (sampler part)")
    p.add_argument("--rounds", type=int, default=1, help="decode part: each round runs A/B/B/A")
    p.add_argument("--profiles", default="", help="comma list of profiles for the decode part ('' skips it)")
    p.add_argument("--max-tokens", type=int, default=200)


def sort_top_p(logits, top_p: float):
    """The top-p filter before the kernel: a sort of the vocabulary and one more to undo it."""
    import mlx.core as mx

    order = mx.argsort(-logits, axis=-1)
    sorted_logits = mx.take_along_axis(logits, order, axis=-1)
    probs = mx.softmax(sorted_logits, axis=-1)
    cum = mx.cumsum(probs, axis=-1)
    filtered_sorted = mx.where((cum - probs) < top_p, sorted_logits, -mx.inf)
    return mx.take_along_axis(filtered_sorted, mx.argsort(order, axis=-1), axis=-1)


def _filters() -> dict:
    from engine import kernels
    from engine.generation import sampling

    arms = {"sort": sort_top_p, "mlx": sampling._top_p}
    if kernels.available() and kernels.has("top_p_filter"):
        arms["kernel"] = kernels.top_p_filter
    return arms


class _Using:
    """``sampling.top_p_filter`` replaced by one arm's filter for a ``with`` block."""

    def __init__(self, fn) -> None:
        self.fn = fn

    def __enter__(self) -> None:
        from engine.generation import sampling

        self.was = sampling.top_p_filter
        sampling.top_p_filter = self.fn

    def __exit__(self, *exc) -> None:
        from engine.generation import sampling

        sampling.top_p_filter = self.was


def _step(sample, logits: list, keys, recent) -> None:
    """One batched step's draws: each row on its own, as the scheduler's batched lane does."""
    import mlx.core as mx

    mx.eval([sample(row, keys[r], recent) for r, row in enumerate(logits)])


def _sampler_part(args, arms: dict) -> tuple[list[dict], list[str]]:
    from engine.generation.sampling import SamplingParams, make_sampler

    import mlx.core as mx

    names = list(arms)
    params = SamplingParams(temperature=0.7, top_p=0.9, repetition_penalty=1.1)
    recent = mx.arange(64, dtype=mx.int32)
    out, table = [], [
        "| vocab | rows | " + " | ".join(f"{a} ms/step" for a in names) + " | "
        + " | ".join(f"{a} vs sort" for a in names[1:]) + " |",
        "|---" * (2 + 2 * len(names) - 1) + "|",
    ]
    for V in (int(v) for v in args.vocabs.split(",")):
        for R in (int(r) for r in args.rows.split(",")):
            logits = [mx.random.normal((1, V), key=mx.random.key(V + r)) * 4 for r in range(R)]
            keys = mx.random.split(mx.random.key(1), R)
            mx.eval(logits, keys)
            times: dict[str, list[float]] = {a: [] for a in names}
            for arm in names + names[::-1]:
                with _Using(arms[arm]):
                    sample = make_sampler(params)
                    _step(sample, logits, keys, recent)  # warm-up
                    for _ in range(args.reps):
                        t = time.perf_counter()
                        _step(sample, logits, keys, recent)
                        times[arm].append(time.perf_counter() - t)
            ms = {a: statistics.median(v) * 1000 for a, v in times.items()}
            row = {"vocab": V, "rows": R}
            row.update({f"{a}_ms": round(ms[a], 3) for a in names})
            row.update({f"{a}_speedup": round(ms["sort"] / ms[a], 3) for a in names[1:]})
            out.append(row)
            table.append(
                f"| {V} | {R} | " + " | ".join(str(row[f"{a}_ms"]) for a in names) + " | "
                + " | ".join(f"{row[f'{a}_speedup']}x" for a in names[1:]) + " |"
            )
    return out, table


def _decode_part(args, arms: dict) -> tuple[list[dict], list[str]]:
    from engine.generation import generate
    from engine.generation.generate import generate_step
    from engine.generation.kv_cache import make_cache
    from engine.model.catalog import resolve_source
    from engine.model.loader import load_bundle
    from engine.model.weight_policy import choose_weights
    from engine.profiles import load_profile
    from engine.serving.runner import _params_from_profile

    from app.benches.engine import _time_stream

    names = [a for a in ("sort", "kernel") if a in arms]
    out, table = [], [
        "| profile | top_p | " + " | ".join(f"{a} tok/s" for a in names) + " | "
        + " | ".join(f"{a} CPU ms/token" for a in names) + " | "
        + " | ".join(f"{a} vs sort" for a in names[1:]) + " |",
        "|---" * (2 + 3 * len(names) - 1) + "|",
    ]
    for name in (p.strip() for p in args.profiles.split(",") if p.strip()):
        profile = load_profile(name)
        bundle = load_bundle(resolve_source(profile.model.source, profile.base_dir), choose_weights(profile.model.weights))
        params = _params_from_profile(profile).with_overrides(seed=1, max_tokens=args.max_tokens, ignore_eos=True)
        prompt = bundle.tokenizer.encode(PROMPT)
        speeds: dict[str, list[float]] = {a: [] for a in names}
        cpu: dict[str, list[float]] = {a: [] for a in names}
        for _ in range(args.rounds):
            for arm in names + names[::-1]:
                with _Using(arms[arm]):
                    generate._steps.pop(id(bundle.model), None)  # trace the step with this arm's filter
                    cache = make_cache(bundle.model)
                    steps = generate_step(bundle.model, prompt, cache, params,
                                          prefill_model=bundle.prefill_model)
                    _, tps, _, cpu_ms = _time_stream(o.token for o in steps)
                    speeds[arm].append(tps)
                    cpu[arm].append(cpu_ms)
        med = {a: statistics.median(v) for a, v in speeds.items()}
        row = {"profile": name, "top_p": params.top_p, "temperature": params.temperature,
               "tokens": args.max_tokens, "runs": {a: [round(s, 2) for s in v] for a, v in speeds.items()}}
        row.update({f"{a}_tok_s": round(med[a], 2) for a in names})
        row.update({f"{a}_cpu_ms_per_token": round(statistics.median(cpu[a]), 2) for a in names})
        row.update({f"{a}_speedup": round(med[a] / med["sort"], 2) for a in names[1:]})
        out.append(row)
        table.append(
            f"| {name} | {params.top_p} | " + " | ".join(str(row[f"{a}_tok_s"]) for a in names) + " | "
            + " | ".join(str(row[f"{a}_cpu_ms_per_token"]) for a in names) + " | "
            + " | ".join(f"{row[f'{a}_speedup']}x" for a in names[1:]) + " |"
        )
    return out, table


def run(args) -> dict:
    from app.benches.engine import cpu_info

    arms = _filters()
    sampler, table = _sampler_part(args, arms)
    result = {"bench": "sampling", "cpu": cpu_info(), "arms": list(arms), "sampler": sampler}
    if args.profiles:
        decode, dtable = _decode_part(args, arms)
        result["decode"] = decode
        table += [""] + dtable
    result["load_avg"] = list(os.getloadavg())
    result["summary"] = "\n".join(table)
    return result
