"""Engine decode/prefill speed vs stock mlx_lm.stream_generate and llama.cpp on the same model.

Why: the engine's claim is speed over what a user gets from mlx_lm today and parity with
llama.cpp; every arm runs the same prompt tokens and token count in one process, alternated in
order then in reverse each round (medians over rounds). Arms (``--arms``; default engine and
llama_cpp): the engine, its variants with one part switched off (fusions, decoder primitives,
int8 prefill, ...), stock mlx_lm on the same or as-loaded weights, llama.cpp mmapped or read.
Without ``--profile`` it runs ``STANDARD_PROFILES`` one after the other. Every result records
the CPU (the ratios depend on its family) and, for engine arms, CPU ms per decoded token.
Each arm in detail: docs/benches.md.
"""

from __future__ import annotations

import gc
import os
import platform
import statistics
import time

from app.benches import llama_peer

PASSAGE = (
    "The history of computing is a story of layers. At the bottom sit transistors, switching "
    "billions of times a second; above them, logic gates, then arithmetic units, caches and "
    "cores. Each layer hides the one below it behind a simpler contract, and each new contract "
    "lets more people build more things without knowing how the lower layers work. Compilers "
    "turned machine code into languages people could read. Operating systems turned a single "
    "machine into many isolated programs. Networks turned many machines into one system, and "
    "the web turned that system into a place where anyone could publish. "
)


# The standard set: the small models and the agent model (the one whose decode matters most).
STANDARD_PROFILES = ("smollm2-135m", "qwen2.5-coder-0.5b", "qwen2.5-coder-1.5b")
# CPU flags that decide which kernels run (engine/kernels: ISA dispatch).
ISA_FLAGS = ("avx2", "fma", "f16c", "avx_vnni", "avx512f", "avx512bw", "avx512vl", "avx512_vnni",
             "avx512_bf16", "amx_tile", "amx_int8")


def add_arguments(p) -> None:
    p.add_argument("--profile", default=None,
                   help="one profile (default: the standard set, " + ", ".join(STANDARD_PROFILES) + ")")
    p.add_argument("--profiles", default=",".join(STANDARD_PROFILES),
                   help="comma list of profiles run one after the other when --profile is not given")
    p.add_argument("--prompt-tokens", type=int, default=500)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--rounds", type=int, default=2, help="each round runs every arm twice (in order, then reversed)")
    p.add_argument("--arms", default="engine,llama_cpp",
                   help="comma list of: engine, engine_hybrid, stock_same, stock_loaded, engine_fp32, "
                        "engine_full_head, engine_unfused, engine_ops, engine_float_prefill, engine_x16, llama_cpp, "
                        "llama_cpp_read")
    p.add_argument("--threads", type=int, default=2, help="llama.cpp threads (and the kernel pool's)")


def _llama_cpp_arm(path, prompt: list[int], n: int, threads: int, read: bool = False):
    """A callable running llama.cpp on ``path`` -> (ttft s, decode tok/s, tokens), and its load
    seconds; or (None, reason) when xllamacpp is not installed. ``read``: load the weights into
    memory rather than mmap the file."""
    server, load_s = llama_peer.start_server(path, max(2048, len(prompt) + n + 16), threads, read=read)
    if server is None:
        return None, load_s

    def run_():
        tm = llama_peer.complete(server, prompt, n)
        return tm["prompt_ms"] / 1000, tm["predicted_per_second"], int(tm["predicted_n"])

    run_.server = server  # keep the model alive with the arm
    return run_, load_s


def _prompt_ids(tokenizer, n: int) -> list[int]:
    text = PASSAGE
    while len(tokenizer.encode(text)) < n:
        text += PASSAGE
    return tokenizer.encode(text)[:n]


def _rss_mb() -> float:
    """Resident set size of this process in MiB (Linux), else 0."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return 0.0


def _load_avg() -> list[float] | None:
    try:
        import os

        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return None


def _time_stream(tokens_iter) -> tuple[float, float, int, float]:
    """(seconds to first token, decode tokens/s after it, tokens, process CPU ms per decoded
    token) of an iterator of tokens."""
    t0 = time.perf_counter()
    stamps, cpu = [], []
    for _ in tokens_iter:
        stamps.append(time.perf_counter())
        cpu.append(time.process_time())
    n = len(stamps)
    ttft = stamps[0] - t0
    decode = (n - 1) / (stamps[-1] - stamps[0]) if n > 1 else 0.0
    cpu_ms = (cpu[-1] - cpu[0]) * 1000 / (n - 1) if n > 1 else 0.0
    return ttft, decode, n, cpu_ms


def cpu_info(cpuinfo: str | None = None) -> dict:
    """The CPU this run measured: model name, its family by the kernels' instruction sets
    ("amx", "avx512-vnni", "avx-vnni", "avx2" or "other"), the ISA flags it has (``ISA_FLAGS``)
    and the instruction set the kernels run on (``kernels.status()``). ``cpuinfo``: the text of
    /proc/cpuinfo (read here when None; empty off Linux)."""
    from engine import kernels

    if cpuinfo is None:
        try:
            with open("/proc/cpuinfo") as f:
                cpuinfo = f.read()
        except OSError:
            cpuinfo = ""
    name, flags = None, None
    for line in cpuinfo.splitlines():  # the first core's lines
        key, _, value = line.partition(":")
        if key.strip() == "model name" and name is None:
            name = value.strip()
        elif key.strip() == "flags" and flags is None:
            flags = set(value.split())
    name = name or platform.processor() or platform.machine()
    flags = flags or set()
    have = [f for f in ISA_FLAGS if f in flags]
    if "amx_int8" in flags:
        family = "amx"
    elif "avx512_vnni" in flags:
        family = "avx512-vnni"
    elif "avx_vnni" in flags:
        family = "avx-vnni"
    elif "avx2" in flags:
        family = "avx2"
    else:
        family = "other"
    st = kernels.status()
    return {"model": name, "family": family, "flags": have, "kernel_isa": st.get("isa"),
            "cores": os.cpu_count()}


def _installed(name: str) -> str | None:
    """None when profile ``name``'s model is there to run, else why not (a note)."""
    from engine.errors import MlxtermError
    from engine.model.catalog import resolve_source
    from engine.profiles import load_profile

    try:
        profile = load_profile(name)
        resolve_source(profile.model.source, profile.base_dir)
    except MlxtermError as e:
        return f"{name} skipped: {e}"
    return None


def run(args) -> dict:
    """One profile (``--profile``), or the standard set with a row per model."""
    from engine.errors import MlxtermError

    if getattr(args, "profile", None):
        out = _run_profile(args, args.profile)
        out["cpu"] = cpu_info()
        return out
    names = [n.strip() for n in args.profiles.split(",") if n.strip()]
    if not names:
        raise MlxtermError("bench engine: --profiles names no profile")
    runs, notes = [], []
    for name in names:
        why = _installed(name)
        if why is not None:
            notes.append(why)
            continue
        runs.append(_run_profile(args, name))
        gc.collect()  # the last model and its llama.cpp server go before the next one loads
    cpu = cpu_info()
    rows = ["| model | engine decode tok/s | llama.cpp decode tok/s | decode ratio | prefill ratio |",
            "|---|---|---|---|---|"]
    for r in runs:
        eng, peer = r["arms"].get("engine", {}), r["arms"].get("llama_cpp", {})
        rows.append(f"| {r['profile']} | {eng.get('decode_tps', '-')} | {peer.get('decode_tps', '-')} "
                    f"| {r['ratios'].get('decode_vs_llama_cpp', '-')} | {r['ratios'].get('prefill_vs_llama_cpp', '-')} |")
    head = f"CPU: {cpu['model']} ({cpu['family']}; kernels on {cpu['kernel_isa']}), {args.threads} threads"
    summary = "\n\n".join([head, "\n".join(rows + notes)] + [f"{r['profile']}:\n{r['summary']}" for r in runs])
    return {"bench": "engine", "profiles": names, "cpu": cpu, "runs": runs, "notes": notes,
            "table": "\n".join(rows), "summary": summary}


def _run_profile(args, name: str) -> dict:
    from engine import blas, hugepages, kernels
    from engine.errors import MlxtermError
    from engine.generation.generate import generate_step
    from engine.generation.kv_cache import make_cache
    from engine.kernels import hook
    from engine.model.catalog import resolve_source
    from engine.model.gguf import cache as gguf_cache
    from engine.model.loader import load_bundle
    from engine.model.weight_policy import backend, choose_weights
    from engine.profiles import load_profile
    from engine.sampling import SamplingParams

    import mlx.core as mx
    from mlx.utils import tree_flatten
    from mlx_lm.generate import stream_generate
    from mlx_lm.sample_utils import make_sampler as stock_sampler
    from mlx_lm.tokenizer_utils import TokenizerWrapper
    from transformers import PreTrainedTokenizerFast

    want = [a.strip() for a in args.arms.split(",") if a.strip()]
    want = ["engine_float_prefill" if a == "engine_noamx" else a for a in want]  # the older name
    if "llama_cpp" in want and "llama_cpp_read" in want:
        # Two llama.cpp servers in one process slow each other (its decode measured 54-58 tok/s
        # with both loaded vs 80 alone on the 2-core VM): one of them per run.
        raise MlxtermError("bench engine: run llama_cpp and llama_cpp_read in separate runs "
                           "(two llama.cpp servers in one process slow each other)")
    kernels.set_threads(args.threads)
    profile = load_profile(name)
    source = resolve_source(profile.model.source, profile.base_dir)
    fmt = choose_weights(profile.model.weights)
    cache_mode = gguf_cache.mode(fmt) if source.is_file() and gguf_cache.enabled() else None
    gguf_cache_state = "off" if cache_mode is None else (
        "warm" if gguf_cache.entry_path(source, cache_mode).exists() else "cold")
    rss0 = _rss_mb()
    t = time.perf_counter()
    ours = load_bundle(source, fmt)
    load_engine_ms = (time.perf_counter() - t) * 1000
    mx.clear_cache()  # conversion temporaries are not weights
    weights_rss_mb = _rss_mb() - rss0
    load_ms = {"engine": round(load_engine_ms)}
    stock = ours
    if "stock_loaded" in want:
        t = time.perf_counter()
        stock = load_bundle(source, "quantized")
        hook.uninstall(stock.model)  # MLX's own quantized ops, as a user gets them today
        load_ms["stock_loaded"] = round((time.perf_counter() - t) * 1000)
    hybrid = load_bundle(source, "hybrid") if "engine_hybrid" in want else None
    dense = None
    if "engine_fp32" in want:
        t = time.perf_counter()
        dense = ours if fmt == "fp32" else load_bundle(source, "fp32")
        load_ms["engine_fp32"] = round((time.perf_counter() - t) * 1000)

    unfused = None
    if "engine_unfused" in want:
        unfused = load_bundle(source, fmt)
        hook.remove_fused(unfused.model)
    oplayers = None
    if "engine_ops" in want:
        oplayers = load_bundle(source, fmt)
        hook.remove_blocks(oplayers.model)

    tok = ours.tokenizer
    hf_tok = PreTrainedTokenizerFast(tokenizer_object=tok.backend)
    wrapper = TokenizerWrapper(hf_tok, eos_token_ids=sorted(tok.eos_ids))
    prompt = _prompt_ids(tok, args.prompt_tokens)
    n = args.max_tokens
    # Greedy, and no EOS stop for our arm either: every arm decodes the same number of tokens.
    params = SamplingParams(temperature=0.0, max_tokens=n)

    def engine_arm(bundle, prefill_model=None):
        def run_():
            cache = make_cache(bundle.model)
            steps = generate_step(bundle.model, prompt, cache, params,
                                  prefill_model=prefill_model or bundle.prefill_model)
            return _time_stream(o.token for o in steps)

        return run_

    def float_prefill(fn):
        def run_():
            was = kernels.set_int8_prefill(False)
            try:
                return fn()
            finally:
                kernels.restore_int8_prefill(was)

        return run_

    def x16(fn):
        def run_():
            was = kernels.set_x16(True)
            try:
                return fn()
            finally:
                kernels.set_x16(was)

        return run_

    def whole_forward(model):
        # No model_type: last_logits runs the model whole and takes the last row of its logits.
        return lambda inputs, cache=None: model(inputs, cache=cache)

    def stock_arm(model):
        def run_():
            gen = stream_generate(model, wrapper, prompt, max_tokens=n, sampler=stock_sampler(temp=0.0))
            return _time_stream(r.token for r in gen)

        return run_

    notes = []
    arms = {
        "engine": engine_arm(ours),
        "engine_hybrid": engine_arm(hybrid) if hybrid else None,
        "stock_same": stock_arm(ours.model),
        "stock_loaded": stock_arm(stock.model),
        "engine_fp32": engine_arm(dense) if dense else None,
        "engine_full_head": engine_arm(ours, whole_forward(ours.prefill_model or ours.model)),
        "llama_cpp": None,
        "llama_cpp_read": None,
        "engine_unfused": engine_arm(unfused) if unfused else None,
        "engine_ops": engine_arm(oplayers) if oplayers else None,
        "engine_float_prefill": float_prefill(engine_arm(ours)),
        "engine_x16": x16(engine_arm(ours)),
    }
    for name in ("llama_cpp", "llama_cpp_read"):
        if name not in want:
            continue
        fn, info = _llama_cpp_arm(source, prompt, n, args.threads, read=name == "llama_cpp_read")
        if fn is None:
            notes.append(f"{name} arm skipped: {info}")
        else:
            arms[name] = fn
            load_ms[name] = round(info * 1000)
    arms = {k: v for k, v in arms.items() if k in want and v is not None}
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
            "decode_cpu_ms": round(statistics.median(r[3] for r in runs), 2) if len(runs[0]) > 3 else None,
            "runs": len(runs),
        }
    def ratio(a: str, b: str, key: str):
        if a in summary and b in summary and summary[b][key]:
            return round(summary[a][key] / summary[b][key], 2)
        return None

    ratios = {}
    for other in ("llama_cpp", "llama_cpp_read", "engine_fp32", "stock_same", "stock_loaded", "engine_hybrid",
                  "engine_unfused", "engine_full_head", "engine_ops", "engine_float_prefill", "engine_x16"):
        for key, label in (("decode_tps", "decode"), ("prefill_tps", "prefill")):
            r = ratio("engine", other, key)
            if r is not None:
                ratios[f"{label}_vs_{other}"] = r
    table = ["| arm | weights | prefill tok/s | decode tok/s | TTFT ms | decode CPU ms/token |",
             "|---|---|---|---|---|---|"]
    weights = {"engine": fmt, "engine_hybrid": "hybrid", "stock_same": fmt,
               "stock_loaded": "quantized (MLX ops)", "engine_fp32": "fp32", "llama_cpp": "GGUF",
               "llama_cpp_read": "GGUF, read into memory",
               "engine_unfused": f"{fmt}, no fusions", "engine_full_head": fmt,
               "engine_ops": f"{fmt}, layers op by op", "engine_float_prefill": f"{fmt}, float-panel prefill",
               "engine_x16": f"{fmt}, 16-bit activations"}
    for name in arms:
        r = summary[name]
        table.append(f"| {name} | {weights[name]} | {r['prefill_tps']} | {r['decode_tps']} | {r['ttft_ms']} "
                     f"| {r['decode_cpu_ms'] if r['decode_cpu_ms'] is not None else '-'} |")
    table.append("")
    table.append(", ".join(f"{k} = {v}x" for k, v in ratios.items()))
    table += notes
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
        "kernels": kernels.status(),
        "hugepages": hugepages.status(),
        "load_ms": load_ms,
        "gguf_cache": gguf_cache_state,  # converted-GGUF cache before the engine's load (cold = converted)
        "weights_rss_mb": round(weights_rss_mb, 1),  # process RSS growth over the load
        "weights_mb": round(sum(v.nbytes for _, v in tree_flatten(ours.model.parameters())) / 2**20, 1),
        "gguf_mb": round(source.stat().st_size / 2**20, 1) if source.is_file() else None,
        "load_avg": _load_avg(),
        "notes": notes,
        "arms": summary,
        "ratios": ratios,
        "summary": "\n".join(table),
    }
