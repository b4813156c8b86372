"""Continuous batching: N concurrent sessions vs the same requests served one after another.

Why: the batched scheduler must serve N users faster than one at a time without slowing an
interactive request much. For each N in --sessions, arms ``serial`` and ``batched`` (alternated
serial, batched, batched, serial per round) serve the same requests from the same restored
prefix; ``replies_match`` checks that they returned the same tokens. Reported per arm:
aggregate and decode tok/s, CPU ms per token, TTFT and inter-token latency, the engine thread's
own prefill/decode split (``speedup_without_prefill``); then the TTFT of a short chat request
while cap-1 rows decode vs on an idle engine. ``METRICS`` (in the JSON) defines every field;
docs/benches.md has the details.
"""

from __future__ import annotations

import random
import statistics
import threading
import time

from app.benches import scratch_profile
from app.benches.engine import PASSAGE

PROMPT_LENGTHS = (40, 200, 80, 280, 60, 160, 120, 240)

METRICS = {
    "tok_s": "completion tokens of all N / wall time from the first submit to the last Done (prefill included)",
    "decode_tok_s": "tokens after each request's first / time at least one request was past its first token "
    "(client side; in the batched arm that span also holds the other rows' prefill)",
    "cpu_ms_per_token": "this process's CPU time over the arm / completion tokens",
    "engine_prefill_s": "engine thread: time in prompt forwards (same prompts, same work in both arms)",
    "engine_decode_s": "engine thread: time in serial-lane and batched decode steps",
    "engine_other_s": "wall - prefill - decode: scheduling, streaming, waiting for the client",
    "decode_ms_per_token": "engine_decode_s / completion tokens",
    "rows_per_step": "rows fed per batched step (decoding rows plus rows riding their last step)",
    "speedup": "batched tok_s / serial tok_s",
    "replies_match": "every arm of every round returned the same token ids for the same prompts",
    "tok_s_without_prefill": "completion tokens / (wall - engine_prefill_s)",
    "speedup_without_prefill": "batched / serial tok_s_without_prefill: the arms with their prompt forwards "
    "(the same work in both) taken out",
    "engine_decode_speedup": "serial decode_ms_per_token / batched decode_ms_per_token",
    "decode_ceiling": "completion tokens / the longest reply: the decode speedup a batch could reach "
    "if a step of N rows cost one row's (replies that end early at EOS lower it; --ignore-eos: N)",
}


def add_arguments(p) -> None:
    p.add_argument(
        "--profiles", default="smollm2-135m,qwen2.5-coder-0.5b", help="comma-separated profiles"
    )
    p.add_argument(
        "--sessions", default="1,2,4,8", help="comma-separated concurrent session counts"
    )
    p.add_argument(
        "--max-tokens", type=int, default=96, help="tokens each request generates (at most)"
    )
    p.add_argument(
        "--rounds", type=int, default=1, help="each round runs serial, batched, batched, serial"
    )
    p.add_argument(
        "--seed",
        type=int,
        default=None,
        help="seed the prompts' nonces: the same requests in every run (A/B across builds)",
    )
    p.add_argument(
        "--ignore-eos",
        action="store_true",
        help="every reply runs to --max-tokens (past end-of-sequence tokens): fixed reply "
        "lengths, so the arms compare the scheduler and not how early some replies end",
    )


# Each prompt's nonce starts with its own letter (the warm-up turn's with "Z"), so no two
# prompts share a token past the chat template's prefix: a serial request then cannot restore
# a token more from an earlier one's checkpoint than the batched arm does (its prompt chunks,
# and so its last bits and maybe a near-tie token, would differ between the arms).
TAGS = "ABCDEFGHIJKLMNOPQRSTUVWXY"

# The nonces' source: random per run by default; --seed makes two runs (two builds in an A/B)
# serve the same prompts, so they decode the same replies and take the same steps.
_nonces = random.Random()


def _nonce(digits: int) -> str:
    return f"{_nonces.getrandbits(4 * digits):0{digits}x}"


def _prompt(engine, n_tokens: int, tag: str = "") -> list[int]:
    text = f"[{tag}{_nonce(12)}] Continue this text.\n"
    while len(engine.tokenizer.encode(text)) < n_tokens:
        text += PASSAGE
    ids = engine.chat_prompt([{"role": "user", "content": text}])
    return ids[: n_tokens - 8] + ids[-8:] if len(ids) > n_tokens else ids


class _Timed:
    """Client-side clock of one request: submit, first text, Done."""

    def __init__(self, handle):
        from engine.serving.events import Done, TextDelta

        self.t_submit = time.perf_counter()
        self.t_first = None
        self.done = None
        for ev in handle:
            if isinstance(ev, TextDelta) and self.t_first is None:
                self.t_first = time.perf_counter()
            if isinstance(ev, Done):
                self.done = ev
        self.t_done = time.perf_counter()
        self.t_first = self.t_first or self.t_done

    @property
    def ttft_ms(self) -> float:
        return (self.t_first - self.t_submit) * 1000

    @property
    def itl_ms(self) -> float:
        n = self.done.usage.completion_tokens
        return (self.t_done - self.t_first) * 1000 / max(n - 1, 1)


def _prompts(engine, n: int) -> list[list[int]]:
    return [
        _prompt(engine, PROMPT_LENGTHS[i % len(PROMPT_LENGTHS)], TAGS[i % len(TAGS)])
        for i in range(n)
    ]


def _fresh_checkpoints(engine) -> None:
    """Empty the checkpoint store, then checkpoint one chat turn built as the arms' prompts are
    (so it shares with each of them exactly what they share with each other: the template up
    to the nonce): each arm starts from this same store, and every request of either arm
    restores the same prefix."""
    from engine.runtime import GenerationRequest

    def clear(runner) -> None:
        if runner.cache.store is not None:
            runner.cache.store.clear()

    engine.call(clear).result(60)
    params = engine.sampling(temperature=0.0, max_tokens=1)
    engine.submit(GenerationRequest(_prompt(engine, min(PROMPT_LENGTHS), "Z"), params)).result(60)


def _run_arm(
    engine,
    arm: str,
    n: int,
    max_tokens: int,
    prompts: list[list[int]] | None = None,
    ignore_eos: bool = False,
) -> dict:
    from engine.runtime import GenerationRequest

    prompts = prompts or _prompts(engine, n)
    params = engine.sampling(
        temperature=0.0, max_tokens=max_tokens, repetition_penalty=1.0, ignore_eos=ignore_eos
    )
    timed: list[_Timed | None] = [None] * n
    s0 = engine.scheduler_stats()
    t0, c0 = time.perf_counter(), time.process_time()
    if arm == "serial":
        for i, p in enumerate(prompts):
            timed[i] = _Timed(engine.submit(GenerationRequest(p, params)))
    else:
        handles = [engine.submit(GenerationRequest(p, params)) for p in prompts]

        def follow(i: int) -> None:
            timed[i] = _Timed(handles[i])

        threads = [threading.Thread(target=follow, args=(i,)) for i in range(n)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        # each handle's clock starts at its own submit; they were all submitted at t0
        for t in timed:
            t.t_submit = t0
    wall = time.perf_counter() - t0
    cpu = time.process_time() - c0  # every thread of this process: the engine's work
    s1 = engine.scheduler_stats()
    d = {k: s1[k] - s0[k] for k in s0}
    tokens = sum(t.done.usage.completion_tokens for t in timed)
    decode_s = d["serial_s"] + d["batched_s"]
    decode_tokens = sum(max(t.done.usage.completion_tokens - 1, 0) for t in timed)
    return {
        "wall_s": wall,
        "tokens": tokens,
        "tok_s": tokens / wall,
        "cpu_ms_per_token": cpu * 1000 / max(tokens, 1),
        "decode_tok_s": decode_tokens / _union([(t.t_first, t.t_done) for t in timed]),
        "ttft_ms": [round(t.ttft_ms, 1) for t in timed],
        "itl_ms": [round(t.itl_ms, 2) for t in timed],
        "lanes": sorted({t.done.lane for t in timed}),
        "batch_max": max(t.done.batch_max for t in timed),
        "engine_prefill_s": d["prefill_s"],
        "engine_decode_s": decode_s,
        "engine_other_s": wall - d["prefill_s"] - decode_s,
        "tok_s_without_prefill": tokens / max(wall - d["prefill_s"], 1e-9),
        "decode_ms_per_token": decode_s * 1000 / max(tokens, 1),
        "decode_steps": d["serial_steps"] + d["batched_steps"],
        "rows_per_step": d["batched_rows"] / d["batched_steps"] if d["batched_steps"] else 1.0,
        "held_ticks": d["held_ticks"],
        "replies": [list(t.done.completion_token_ids) for t in timed],
        "decode_ceiling": _decode_ceiling([t.done.usage.completion_tokens for t in timed]),
        "cached": [t.done.usage.cached_tokens for t in timed],
    }


def _decode_ceiling(lengths: list[int]) -> float:
    """The most any batching can gain on decode for replies of these lengths: all tokens over
    the longest reply (the steps a batch needs even if a step of N rows cost one row's time)."""
    return sum(lengths) / max(max(lengths), 1)


def _union(spans: list[tuple[float, float]]) -> float:
    """Seconds covered by at least one span: time some request was decoding."""
    total, end = 0.0, float("-inf")
    for a, b in sorted(spans):
        if b > end:
            total += b - max(a, end)
            end = b
    return max(total, 1e-9)


def _interactive(engine, cap: int, max_tokens: int) -> dict:
    """TTFT of a short chat turn: idle engine vs while cap-1 background rows decode."""
    from engine.runtime import GenerationRequest, Priority
    from engine.serving.events import TextDelta

    params = engine.sampling(temperature=0.0, max_tokens=16)

    def chat_ttft() -> float:
        p = engine.chat_prompt(
            [{"role": "user", "content": f"[{_nonce(8)}] Hello, how are you?"}]
        )
        return _Timed(
            engine.submit(GenerationRequest(p, params, priority=Priority.INTERACTIVE))
        ).ttft_ms

    idle, busy, rows_seen = [], [], []
    for arm in ("idle", "busy", "busy", "idle"):
        if arm == "idle":
            idle.append(chat_ttft())
            continue
        bg_params = engine.sampling(
            temperature=0.0, max_tokens=max_tokens * 4, repetition_penalty=1.0
        )
        handles = [
            engine.submit(
                GenerationRequest(
                    _prompt(engine, PROMPT_LENGTHS[i % 8]), bg_params, priority=Priority.BACKGROUND
                )
            )
            for i in range(cap - 1)
        ]
        for h in handles:  # wait until every background row streams
            for ev in h:
                if isinstance(ev, TextDelta):
                    break
        busy.append(chat_ttft())
        rows_seen.append(engine.active_requests)
        for h in handles:
            h.cancel()
        for h in handles:
            h.result()
    return {
        "idle_ttft_ms": round(statistics.median(idle), 1),
        "busy_ttft_ms": round(statistics.median(busy), 1),
        "ratio": round(statistics.median(busy) / statistics.median(idle), 2),
        "background_rows": cap - 1,
        "target_ratio_max": 2.0,
    }


def run(args) -> dict:
    import os

    from engine.generation import batch
    from engine.runtime import Engine

    _nonces.seed(args.seed)  # None: fresh randomness
    out: dict = {
        "load_avg_start": os.getloadavg()[0],
        "max_tokens": args.max_tokens,
        "ignore_eos": args.ignore_eos,
        "seed": args.seed,
        "models": [],
    }
    sessions = [int(x) for x in args.sessions.split(",")]
    for name in args.profiles.split(","):
        with scratch_profile(name, "mlxterm-bench-batch-") as prof_path:
            engine = Engine.load(str(prof_path))
            cap = engine.profile.batch.cap
            traces0 = batch.traces()
            rows = []
            try:
                _run_arm(engine, "batched", 2, 8)  # warm-up: compile the solo step, touch weights
                for n in sessions:
                    arms: dict[str, list[dict]] = {"serial": [], "batched": []}
                    match = True
                    for _ in range(args.rounds):
                        prompts = _prompts(engine, n)  # the same requests in every arm of the round
                        replies = []
                        for arm in ("serial", "batched", "batched", "serial"):
                            _fresh_checkpoints(engine)
                            arms[arm].append(
                                _run_arm(engine, arm, n, args.max_tokens, prompts, args.ignore_eos)
                            )
                            replies.append(arms[arm][-1]["replies"])
                        match = match and all(r == replies[0] for r in replies)
                    row = {"sessions": n, "replies_match": match}
                    for arm, runs in arms.items():
                        row[arm] = {
                            "tok_s": round(statistics.median(r["tok_s"] for r in runs), 1),
                            "decode_tok_s": round(
                                statistics.median(r["decode_tok_s"] for r in runs), 1
                            ),
                            "cpu_ms_per_token": round(
                                statistics.median(r["cpu_ms_per_token"] for r in runs), 2
                            ),
                            "tokens": runs[-1]["tokens"],
                            "ttft_ms_median": round(
                                statistics.median(x for r in runs for x in r["ttft_ms"]), 1
                            ),
                            "ttft_ms_max": round(max(x for r in runs for x in r["ttft_ms"]), 1),
                            "itl_ms_median": round(
                                statistics.median(x for r in runs for x in r["itl_ms"]), 2
                            ),
                            "lanes": runs[-1]["lanes"],
                            "batch_max": runs[-1]["batch_max"],
                        }
                        for key, digits in (
                            ("wall_s", 2),
                            ("engine_prefill_s", 2),
                            ("engine_decode_s", 2),
                            ("engine_other_s", 2),
                            ("decode_ms_per_token", 2),
                            ("decode_steps", 1),
                            ("rows_per_step", 2),
                            ("held_ticks", 1),
                            ("tok_s_without_prefill", 1),
                            ("decode_ceiling", 2),
                        ):
                            row[arm][key] = round(statistics.median(r[key] for r in runs), digits)
                    row["speedup"] = round(row["batched"]["tok_s"] / row["serial"]["tok_s"], 2)
                    row["decode_speedup"] = round(
                        row["batched"]["decode_tok_s"] / row["serial"]["decode_tok_s"], 2
                    )
                    # CPU time per token (prefill included): what the arms cost on a shared machine.
                    row["cpu_speedup"] = round(
                        row["serial"]["cpu_ms_per_token"] / row["batched"]["cpu_ms_per_token"], 2
                    )
                    row["speedup_without_prefill"] = round(
                        row["batched"]["tok_s_without_prefill"]
                        / row["serial"]["tok_s_without_prefill"],
                        2,
                    )
                    row["engine_decode_speedup"] = round(
                        row["serial"]["decode_ms_per_token"] / row["batched"]["decode_ms_per_token"], 2
                    )
                    # compiles of the batched step so far
                    row["batched_traces"] = batch.traces() - traces0
                    rows.append(row)
                interactive = _interactive(engine, cap, args.max_tokens)
            finally:
                engine.close()
            out["models"].append(
                {
                    "profile": name,
                    "model": engine.model_name,
                    "cap": cap,
                    "rows": rows,
                    "interactive": interactive,
                }
            )
    out["load_avg_end"] = os.getloadavg()[0]
    out["metrics"] = METRICS
    out["targets"] = {"speedup_at_4": 1.8, "speedup_at_8": 3.0, "interactive_ttft_ratio": 2.0}
    return out
