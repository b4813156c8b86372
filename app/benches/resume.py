"""Resume cost: cold prefill vs RAM-hit vs SSD-restore time to first token, per context size.

Why: checkpoints must make a follow-up turn far cheaper than prefilling the conversation again.
For each context size the same prefix is timed cold (a fresh nonce, no checkpoint matches),
from the RAM tier and from the SSD tier (a second engine with an empty RAM tier), arms
alternated. ``--long-context N`` instead times a cold prefill of N tokens and decode at N vs at
~100 tokens (paired chunks, since this VM has slow and fast phases), for the engine's attention
arms and llama.cpp, after timing the attention op alone at N keys. Arms and fields in detail:
docs/benches.md.
"""

from __future__ import annotations

import statistics
import uuid

from app.benches import llama_peer, scratch_profile
from app.benches.engine import PASSAGE, _prompt_ids

# llama.cpp arms of the long-context bench -> the K/V cache type each runs with.
LLAMA_ARMS = {"llama_cpp": "f16", "llama_cpp_q8": "q8_0"}
ENGINE_ARMS = ("engine", "flash", "flash-kv16", "flash-q8", "softmax", "today")


def add_arguments(p) -> None:
    p.add_argument("--profile", default="smollm2-135m")
    p.add_argument("--contexts", default="1024,4096,8000", help="comma-separated token counts")
    p.add_argument("--repeats", type=int, default=1, help="rounds per context (each runs every arm twice)")
    p.add_argument("--long-context", type=int, default=0, metavar="N",
                   help="run the long-context arm at N tokens instead (kernels vs fp32 path)")
    p.add_argument("--decode-tokens", type=int, default=64,
                   help="long-context arm: tokens decoded at each context")
    p.add_argument("--chunk", type=int, default=8,
                   help="long-context arm: tokens per turn when the two decodes alternate")
    p.add_argument("--arms", default="engine,today",
                   help="long-context arm: arms to run (engine, flash, flash-kv16, flash-q8, softmax, today, "
                        "llama_cpp, llama_cpp_q8)")
    p.add_argument("--threads", type=int, default=2, help="long-context arm: llama.cpp threads (and the kernel pool's)")


def _llama_cpp_long(source, long_ids: list[int], short_ids: list[int], chunk: int, turns: int, threads: int,
                    kv_type: str):
    """One run of a llama.cpp arm, as ``run_arm`` times the engine's: (cold prefill s, tok/s per
    chunk at the long context, at ~100 tokens, paired ratios); or (None, reason) without
    xllamacpp. A fresh server per run (two in one process slow each other) with two slots,
    one per context; after the cold prefill the two decodes alternate in chunks, each chunk a
    request of ``chunk`` + 1 tokens on its slot's cached prompt: llama.cpp evaluates the prompt's
    last token again (that step yields the first token) and the ``chunk`` decode steps after it
    are the chunk's tok/s (its ``predicted_per_second``, timed inside the server loop). Every
    chunk restarts from the same prompt, so each decodes at contexts N..N+chunk, where the
    engine's chunks move on through N..N+decode-tokens."""
    n_ctx = len(long_ids) + chunk + 16
    server, info = llama_peer.start_server(source, n_ctx, threads, slots=2, kv_type=kv_type)
    if server is None:
        return None, info
    slots = {"long": (0, long_ids), "short": (1, short_ids)}
    try:
        cold = llama_peer.complete(server, long_ids, 1, slot=0, cache_prompt=True)["prompt_ms"] / 1000
        llama_peer.complete(server, short_ids, 1, slot=1, cache_prompt=True)
        tps: dict[str, list[float]] = {"long": [], "short": []}
        for i in range(turns):
            for name in ("long", "short") if i % 2 == 0 else ("short", "long"):
                slot, ids = slots[name]
                tm = llama_peer.complete(server, ids, chunk + 1, slot=slot, cache_prompt=True)
                if tm["prompt_n"] > 1:  # the slot lost its context: this chunk timed a prefill
                    raise RuntimeError(f"llama.cpp slot {slot} re-evaluated {tm['prompt_n']} prompt tokens")
                tps[name].append(tm["predicted_per_second"])
    finally:
        del server  # frees the model and both contexts before the next arm runs
    return cold, tps["long"], tps["short"], [a / b for a, b in zip(tps["long"], tps["short"], strict=True)]


def _attention_op(model, n_keys: int, kv_dtype) -> dict:
    """Median ms of one attention call at ``n_keys`` keys per implementation: a causal prefill
    chunk (the last PREFILL_CHUNK queries) and a decode step over a static cache buffer."""
    import statistics
    import time

    from engine.generation.generate import PREFILL_CHUNK
    from engine.kernels import attention

    import mlx.core as mx

    args = model.args
    H, Hk = args.num_attention_heads, args.num_key_value_heads
    D = getattr(args, "head_dim", None) or args.hidden_size // H
    cap = ((n_keys + 511) // 512) * 512
    from engine.generation.kv_cache import _stored

    k, v = _stored(kv_dtype, mx.random.normal((1, Hk, cap, D)), mx.random.normal((1, Hk, cap, D)))
    L = min(PREFILL_CHUNK, n_keys)
    cases = {
        "prefill_chunk": (mx.random.normal((1, H, L, D)), k[:, :, :n_keys], v[:, :, :n_keys], "causal"),
        "decode_step": (mx.random.normal((1, H, 1, D)), k, v, mx.arange(cap) <= n_keys - 1),
    }
    out: dict = {}
    prev, attention._active.on = attention.impl, True
    try:
        for case, (q, kk, vv, mask) in cases.items():
            mx.eval(q, kk, vv)
            times: dict[str, list[float]] = {}
            for impl in ("flash", "softmax", "mlx", "mlx", "softmax", "flash") * 2:
                attention.impl = impl
                f = attention.scaled_dot_product_attention
                mx.eval(f(q, kk, vv, None, D**-0.5, mask))  # warm
                t0 = time.perf_counter()
                mx.eval(f(q, kk, vv, None, D**-0.5, mask))
                times.setdefault(impl, []).append((time.perf_counter() - t0) * 1e3)
            out[case] = {impl: round(statistics.median(t), 2) for impl, t in times.items()}
    finally:
        attention.impl, attention._active.on = prev, False
    out["decode_layers"] = _decode_layers(model, n_keys, kv_dtype, cap, D)
    return out


def _decode_layers(model, n_keys: int, kv_dtype, cap: int, D: int, rounds: int = 5) -> dict:
    """Median ms per fused decode attention call at ``n_keys`` keys: ``hot`` calls one layer's
    K/V over and over (it stays in cache), ``streamed`` cycles through one K/V buffer per layer
    of the model (a decode step's memory traffic: at 8k keys that is far more than L3).
    Rounds alternate hot / streamed / streamed / hot ..."""
    import time

    from engine.generation.kv_cache import _stored
    from engine.kernels import attention

    import mlx.core as mx

    args = model.args
    H, Hk = args.num_attention_heads, args.num_key_value_heads
    layers = args.num_hidden_layers
    kv = [_stored(kv_dtype, mx.random.normal((1, Hk, cap, D)), mx.random.normal((1, Hk, cap, D)))
          for _ in range(layers)]
    q, mask = mx.random.normal((1, H, 1, D)), mx.arange(cap) <= n_keys - 1
    mx.eval(q, mask, *[a for pair in kv for a in pair])
    calls = 3 * layers
    times: dict[str, list[float]] = {"hot": [], "streamed": []}
    prev, attention._active.on, attention.impl = attention.impl, True, "flash"
    try:
        f = attention.scaled_dot_product_attention
        mx.eval(f(q, *kv[0], None, D**-0.5, mask))  # warm
        for r in range(rounds):
            for mode in ("hot", "streamed") if r % 2 == 0 else ("streamed", "hot"):
                t0 = time.perf_counter()
                for i in range(calls):
                    mx.eval(f(q, *kv[0 if mode == "hot" else i % layers], None, D**-0.5, mask))
                times[mode].append((time.perf_counter() - t0) / calls * 1e3)
    finally:
        attention.impl, attention._active.on = prev, False
    res = {mode: round(statistics.median(t), 3) for mode, t in times.items()}
    res["layers"] = layers
    return res


def _long_context(args) -> dict:
    import os
    import time

    from engine import hugepages, kernels
    from engine.checkpoints.fingerprint import live_kv_format
    from engine.generation.generate import generate_step
    from engine.generation.kv_cache import Q8, live_kv_dtype, make_cache
    from engine.kernels import attention, hook
    from engine.model.catalog import resolve_source
    from engine.model.loader import load_bundle
    from engine.model.weight_policy import backend
    from engine.profiles import load_profile
    from engine.sampling import SamplingParams

    import mlx.core as mx

    profile = load_profile(args.profile)
    source = resolve_source(profile.model.source, profile.base_dir)
    fast = load_bundle(source, "quantized")
    tok = fast.tokenizer
    long_ids = _prompt_ids(tok, args.long_context)  # bench engine's prompt: the passage repeated
    short_ids = long_ids[:100]
    chunk = max(1, args.chunk)
    turns = max(1, args.decode_tokens // chunk)
    params = SamplingParams(temperature=0.0, max_tokens=turns * chunk + 2)

    def run_arm(bundle, kv_dtype=None):
        """(cold prefill s, tok/s per chunk at the long context, at ~100 tokens, paired ratios)."""
        t0 = time.perf_counter()
        gens = {"long": generate_step(bundle.model, long_ids, make_cache(bundle.model, kv_dtype=kv_dtype), params)}
        next(gens["long"])
        cold = time.perf_counter() - t0
        gens["short"] = generate_step(bundle.model, short_ids, make_cache(bundle.model, kv_dtype=kv_dtype), params)
        next(gens["short"])
        mx.synchronize()
        tps: dict[str, list[float]] = {"long": [], "short": []}
        for i in range(turns):
            for name in ("long", "short") if i % 2 == 0 else ("short", "long"):
                t = time.perf_counter()
                for _ in range(chunk):
                    next(gens[name])
                mx.synchronize()  # the step it queued belongs to this window, not the other's
                tps[name].append(chunk / (time.perf_counter() - t))
        for g in gens.values():
            g.close()
        return cold, tps["long"], tps["short"], [a / b for a, b in zip(tps["long"], tps["short"], strict=True)]

    def arm(name):
        if name in LLAMA_ARMS:
            return _llama_cpp_long(source, long_ids, short_ids, chunk, turns, args.threads, LLAMA_ARMS[name])
        if name == "today":
            attention.uninstall()  # today's path: MLX attention, fp32 weights
            try:
                return run_arm(today)
            finally:
                attention.install()
        attention.install()
        kv = {"flash-kv16": mx.float16, "flash-q8": q8, "engine": engine_dtype}.get(name)
        impl = "flash" if name in ("engine", "flash-q8") else name.removesuffix("-kv16")
        prev, attention.impl = attention.impl, impl
        try:
            return run_arm(fast, kv)
        finally:
            attention.impl = prev

    if not kernels.available():
        return {"bench": "resume-long", "skipped": f"CPU kernels unavailable: {kernels.status()['reason']}"}
    kernels.set_threads(args.threads)
    hook.install(fast.model)
    engine_kv = live_kv_format(profile.kv_cache, backend(), fast.model)  # as PromptCache.new_cache
    engine_dtype = live_kv_dtype(engine_kv)
    q8 = engine_dtype if isinstance(engine_dtype, Q8) else Q8(64)
    arms = [a for a in args.arms.split(",") if a]
    unknown = set(arms) - set(ENGINE_ARMS) - set(LLAMA_ARMS)
    if unknown:
        raise SystemExit(f"bench resume: unknown arm(s) {', '.join(sorted(unknown))}")
    today = load_bundle(source, "fp32") if "today" in arms else None
    op = {"kv_float32": _attention_op(fast.model, len(long_ids), mx.float32),
          "kv_float16": _attention_op(fast.model, len(long_ids), mx.float16),
          q8.name: _attention_op(fast.model, len(long_ids), q8)}
    order = arms + arms[::-1]
    res: dict[str, list] = {name: [] for name in arms}
    notes: list[str] = []
    for _ in range(args.repeats):
        for name in order[: len(arms) if args.repeats == 1 else len(order)]:
            if name not in res:
                continue  # skipped
            r = arm(name)
            if r[0] is None:
                notes.append(f"{name} arm skipped: {r[1]}")
                del res[name]
                continue
            res[name].append(r)
            mx.clear_cache()
    out = {}
    for name, runs in res.items():
        at_context = [x for r in runs for x in r[1]]
        at_100 = [x for r in runs for x in r[2]]
        ratios = [x for r in runs for x in r[3]]
        out[name] = {
            "cold_prefill_s": round(statistics.median(r[0] for r in runs), 3),
            "decode_tps_at_context": round(statistics.median(at_context), 2),
            "decode_tps_at_100": round(statistics.median(at_100), 2),
            "runs": len(runs),
            "chunk_tokens": chunk,
            # Every chunk, so the spread is visible next to the medians (the machine is shared).
            "decode_tps_at_context_runs": [round(x, 1) for x in at_context],
            "decode_tps_at_100_runs": [round(x, 1) for x in at_100],
            # Adjacent chunks' ratios (both decodes under the same machine phase) and their median.
            "decode_ratio_runs": [round(x, 3) for x in ratios],
            "decode_ratio_context_vs_100": round(statistics.median(ratios), 2),
        }
        if name in LLAMA_ARMS:
            out[name]["kv_cache"] = LLAMA_ARMS[name]
    table = ["| arm | cold prefill s | decode tok/s at context (min-max) | decode tok/s at 100 (min-max) | ratio |",
             "|---|---|---|---|---|"]

    def spread(xs: list[float]) -> str:
        return f"{min(xs)}-{max(xs)}"

    for name, r in out.items():
        table.append(f"| {name} | {r['cold_prefill_s']} | {r['decode_tps_at_context']} "
                     f"({spread(r['decode_tps_at_context_runs'])}) | {r['decode_tps_at_100']} "
                     f"({spread(r['decode_tps_at_100_runs'])}) | {r['decode_ratio_context_vs_100']} |")
    vs_llama = _vs_llama_cpp(out)
    for key, r in vs_llama.items():
        table.append(f"{key}: decode at {len(long_ids)} tokens {r['decode_at_context']}x, at 100 "
                     f"{r['decode_at_100']}x, cold prefill {r['cold_prefill']}x")
    table += notes
    speedups = {}
    if "today" in out:
        for name in out:
            if name != "today":
                speedups[name] = round(out["today"]["cold_prefill_s"] / out[name]["cold_prefill_s"], 2)
                table.append(f"cold prefill speed-up today / {name}: {speedups[name]}x")
    table.append(f"attention op ms at {len(long_ids)} keys: {op}")
    for fmt, o in op.items():
        dl = o["decode_layers"]
        table.append(f"fused decode attention at {len(long_ids)} keys, {fmt}: {dl['hot']} ms per layer call hot, "
                     f"{dl['streamed']} streamed; x {dl['layers']} layers = {dl['streamed'] * dl['layers']:.1f} ms "
                     f"per token")
    return {"bench": "resume-long", "profile": profile.name, "context_tokens": len(long_ids),
            "engine_kv_format": engine_kv, "kernel_isa": kernels.status().get("isa"),
            "hugepages": hugepages.status(), "threads": args.threads, "arms": out, "prefill_speedup": speedups,
            "vs_llama_cpp": vs_llama, "notes": notes, "attention_op_ms": op,
            "load_avg": list(os.getloadavg()), "summary": "\n".join(table)}


def _vs_llama_cpp(out: dict) -> dict:
    """Each engine arm over each llama.cpp arm that ran ("engine / llama_cpp": ...): decode
    tok/s at the context and at ~100 tokens, and cold prefill speed (llama.cpp's seconds over
    the arm's). The arms' runs alternate whole (A/B/B/A), not chunk by chunk."""
    res = {}
    for name, r in out.items():
        if name in LLAMA_ARMS:
            continue
        for peer in LLAMA_ARMS:
            if peer in out:
                p = out[peer]
                res[f"{name} / {peer}"] = {
                    "decode_at_context": _ratio(r["decode_tps_at_context"], p["decode_tps_at_context"]),
                    "decode_at_100": _ratio(r["decode_tps_at_100"], p["decode_tps_at_100"]),
                    "cold_prefill": _ratio(p["cold_prefill_s"], r["cold_prefill_s"]),
                }
    return res


def _ratio(a: float, b: float) -> float | None:
    return round(a / b, 2) if b else None

def _conversation(engine, n_tokens: int, nonce: str) -> list[int]:
    text = f"[{nonce}] Summarise this text.\n"
    while len(engine.tokenizer.encode(text)) < n_tokens:
        text += PASSAGE
    ids = engine.chat_prompt([{"role": "user", "content": text}])
    return ids[: n_tokens - 16] + ids[-16:] if len(ids) > n_tokens else ids


def _room_for_8k(data: dict) -> None:
    data["cache"]["ram_bytes"] = 8 * 1024**3
    data["context"]["max_context"] = max(data["context"]["max_context"], 8192 + 64)


def run(args) -> dict:
    if args.long_context:
        return _long_context(args)
    from engine.profiles import load_profile

    with scratch_profile(args.profile, "mlxterm-bench-resume-", _room_for_8k) as prof_path:
        return _resume_arms(args, str(prof_path), load_profile(args.profile).name)


def _resume_arms(args, prof_path: str, profile_name: str) -> dict:
    from engine.runtime import Engine, GenerationRequest

    warm = Engine.load(prof_path)
    contexts = [int(x) for x in args.contexts.split(",")]
    follow = warm.tokenizer.encode("<|im_end|>\n<|im_start|>user\nAnd in one word?<|im_end|>\n<|im_start|>assistant\n")
    rows = []
    try:
        for n in contexts:
            times: dict[str, list[float]] = {"cold": [], "ram": [], "ssd": []}
            restored: dict[str, list[int]] = {"ram": [], "ssd": []}
            for _ in range(args.repeats):
                for arm in ("cold", "ram", "ssd", "ssd", "ram", "cold"):
                    sid = f"bench-{uuid.uuid4().hex[:8]}"
                    prompt = _conversation(warm, n, sid)  # a new nonce: nothing cached yet
                    if arm == "cold":
                        done = warm.submit(GenerationRequest(prompt, warm.sampling(max_tokens=1, temperature=0), session_id=sid)).result()
                        times["cold"].append(done.timings.ttft_ms)
                        continue
                    # Build the session's checkpoint (untimed), then time the follow-up.
                    first = warm.submit(GenerationRequest(prompt, warm.sampling(max_tokens=1, temperature=0), session_id=sid)).result()
                    follow_up = prompt + first.completion_token_ids + follow
                    # Let the background SSD write finish first (a user takes longer than that to
                    # type a follow-up): on 2 cores it would otherwise compete with the timed turn.
                    warm.flush_checkpoints()
                    if arm == "ram":
                        eng = warm
                    else:
                        eng = Engine.load(prof_path)  # empty RAM tier: must read the SSD file
                    done = eng.submit(GenerationRequest(follow_up, eng.sampling(max_tokens=1, temperature=0), session_id=sid)).result()
                    if eng is not warm:
                        eng.close()
                    assert done.cache_source == arm, (arm, done.cache_source)
                    times[arm].append(done.timings.ttft_ms)
                    restored[arm].append(done.usage.cached_tokens)
            med = {k: statistics.median(v) for k, v in times.items()}
            rows.append({
                "context_tokens": n,
                "cold_ttft_ms": round(med["cold"], 1),
                "ram_ttft_ms": round(med["ram"], 1),
                "ssd_ttft_ms": round(med["ssd"], 1),
                "ram_speedup": round(med["cold"] / med["ram"], 1),
                "ssd_speedup": round(med["cold"] / med["ssd"], 1),
                "restored_tokens": restored["ssd"][0],
                "runs": {k: [round(x, 1) for x in v] for k, v in times.items()},
            })
    finally:
        warm.close()
    table = ["| context | cold prefill TTFT ms | RAM hit TTFT ms | SSD restore TTFT ms | RAM speed-up | SSD speed-up |",
             "|---|---|---|---|---|---|"]
    for r in rows:
        table.append(f"| {r['context_tokens']} | {r['cold_ttft_ms']} | {r['ram_ttft_ms']} | {r['ssd_ttft_ms']} | {r['ram_speedup']}x | {r['ssd_speedup']}x |")
    return {"bench": "resume", "profile": profile_name, "rows": rows, "summary": "\n".join(table)}
