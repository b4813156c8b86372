"""Engine decode/prefill speed vs stock mlx_lm.stream_generate on the same model.

Arms, alternated in order then in reverse each round (medians over rounds):
  engine        mlxterm's generate_step (compiled static-cache decode, pipelined) on the model in
                the engine's weight format for this backend (``auto`` policy)
  engine_hybrid the engine with ``hybrid`` weights: dense fp32 prefill, packed quantized decode
  stock_same    mlx_lm.stream_generate on the very same in-memory model object
  stock_loaded  mlx_lm.stream_generate on the model as a user gets it today: the GGUF's weights
                as ``mx.load`` returns them (quantized), no engine policy
"""

from __future__ import annotations

import platform
import statistics
import time

PASSAGE = (
    "The history of computing is a story of layers. At the bottom sit transistors, switching "
    "billions of times a second; above them, logic gates, then arithmetic units, caches and "
    "cores. Each layer hides the one below it behind a simpler contract, and each new contract "
    "lets more people build more things without knowing how the lower layers work. Compilers "
    "turned machine code into languages people could read. Operating systems turned a single "
    "machine into many isolated programs. Networks turned many machines into one system, and "
    "the web turned that system into a place where anyone could publish. "
)


def add_arguments(p) -> None:
    p.add_argument("--profile", default="smollm2-135m")
    p.add_argument("--prompt-tokens", type=int, default=500)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--rounds", type=int, default=2, help="each round runs every arm twice (in order, then reversed)")


def _prompt_ids(tokenizer, n: int) -> list[int]:
    text = PASSAGE
    while len(tokenizer.encode(text)) < n:
        text += PASSAGE
    return tokenizer.encode(text)[:n]


def _time_stream(tokens_iter) -> tuple[float, float, int]:
    """(seconds to first token, decode tokens/s after it, tokens) of an iterator of tokens."""
    t0 = time.perf_counter()
    stamps = [time.perf_counter() for _ in tokens_iter]
    n = len(stamps)
    ttft = stamps[0] - t0
    decode = (n - 1) / (stamps[-1] - stamps[0]) if n > 1 else 0.0
    return ttft, decode, n


def run(args) -> dict:
    from engine import blas
    from engine.generation.generate import generate_step
    from engine.generation.kv_cache import make_cache
    from engine.model.catalog import resolve_source
    from engine.model.loader import load_bundle
    from engine.model.weight_policy import backend, choose_weights
    from engine.profiles import load_profile
    from engine.sampling import SamplingParams

    import mlx.core as mx
    from mlx_lm.generate import stream_generate
    from mlx_lm.sample_utils import make_sampler as stock_sampler
    from mlx_lm.tokenizer_utils import TokenizerWrapper
    from transformers import PreTrainedTokenizerFast

    profile = load_profile(args.profile)
    source = resolve_source(profile.model.source, profile.base_dir)
    fmt = choose_weights(profile.model.weights)
    t = time.perf_counter()
    ours = load_bundle(source, fmt)
    load_engine_ms = (time.perf_counter() - t) * 1000
    t = time.perf_counter()
    stock = load_bundle(source, "quantized") if fmt != "quantized" else ours
    load_stock_ms = (time.perf_counter() - t) * 1000
    hybrid = load_bundle(source, "hybrid")

    tok = ours.tokenizer
    hf_tok = PreTrainedTokenizerFast(tokenizer_object=tok.backend)
    wrapper = TokenizerWrapper(hf_tok, eos_token_ids=sorted(tok.eos_ids))
    prompt = _prompt_ids(tok, args.prompt_tokens)
    n = args.max_tokens
    # Greedy, and no EOS stop for our arm either: every arm decodes the same number of tokens.
    params = SamplingParams(temperature=0.0, max_tokens=n)

    def engine_arm(bundle):
        def run_():
            cache = make_cache(bundle.model)
            steps = generate_step(bundle.model, prompt, cache, params, prefill_model=bundle.prefill_model)
            return _time_stream(o.token for o in steps)

        return run_

    def stock_arm(model):
        def run_():
            gen = stream_generate(model, wrapper, prompt, max_tokens=n, sampler=stock_sampler(temp=0.0))
            return _time_stream(r.token for r in gen)

        return run_

    arms = {
        "engine": engine_arm(ours),
        "engine_hybrid": engine_arm(hybrid),
        "stock_same": stock_arm(ours.model),
        "stock_loaded": stock_arm(stock.model),
    }
    for fn in arms.values():  # warm-up: compile traces, allocator, BLAS threads
        fn()
    results: dict[str, list[tuple[float, float, int]]] = {k: [] for k in arms}
    order = list(arms)
    for _ in range(args.rounds):
        for name in order + order[::-1]:
            results[name].append(arms[name]())
            mx.clear_cache()

    summary = {}
    for name, runs in results.items():
        summary[name] = {
            "prefill_tps": round(statistics.median(len(prompt) / r[0] for r in runs), 1),
            "decode_tps": round(statistics.median(r[1] for r in runs), 2),
            "ttft_ms": round(statistics.median(r[0] for r in runs) * 1000, 1),
            "tokens": [r[2] for r in runs],
            "runs": len(runs),
        }
    e, s, q = summary["engine"], summary["stock_same"], summary["stock_loaded"]
    ratios = {
        "decode_vs_stock_same": round(e["decode_tps"] / s["decode_tps"], 2),
        "prefill_vs_stock_same": round(e["prefill_tps"] / s["prefill_tps"], 2),
        "decode_vs_stock_loaded": round(e["decode_tps"] / q["decode_tps"], 2),
        "prefill_vs_stock_loaded": round(e["prefill_tps"] / q["prefill_tps"], 2),
        "hybrid_decode_vs_engine": round(summary["engine_hybrid"]["decode_tps"] / e["decode_tps"], 2),
        "hybrid_decode_vs_stock_loaded": round(summary["engine_hybrid"]["decode_tps"] / q["decode_tps"], 2),
    }
    table = ["| arm | weights | prefill tok/s | decode tok/s | TTFT ms |", "|---|---|---|---|---|"]
    weights = {"engine": fmt, "engine_hybrid": "hybrid", "stock_same": fmt, "stock_loaded": stock.loaded.weight_format}
    for name, w in weights.items():
        r = summary[name]
        table.append(f"| {name} | {w} | {r['prefill_tps']} | {r['decode_tps']} | {r['ttft_ms']} |")
    table.append("")
    table.append(", ".join(f"{k} = {v}x" for k, v in ratios.items()))
    return {
        "bench": "engine",
        "profile": profile.name,
        "model": source.name,
        "backend": backend(),
        "blas": blas.status(),
        "machine": f"{platform.machine()} {platform.system()}",
        "prompt_tokens": len(prompt),
        "max_tokens": n,
        "rounds": args.rounds,
        "weight_format_engine": fmt,
        "weight_format_stock_loaded": stock.loaded.weight_format,
        "load_ms": {"engine": round(load_engine_ms), "stock_loaded": round(load_stock_ms)},
        "arms": summary,
        "ratios": ratios,
        "summary": "\n".join(table),
    }
