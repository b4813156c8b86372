"""Quantized matmul microbench: the AMX-INT8 tile path vs the float panels / int8 row path.

For each (M, N, K) -- the weight shapes of SmolLM2-135M and Qwen2.5-0.5B at prefill chunk sizes
(M >= 16) and multi-row step sizes (M < 16) -- two arms on the same random 4-bit weights,
alternated A/B/B/A in one process:
  amx   engine.kernels.quantized_matmul with the AMX path on (MLXTERM_AMX_MIN_M is set to 2 in
        this process, so M < 16 runs on tiles too)
  off   the same call with kernels.set_amx(False): M >= 16 on the float panels (src/qmm_kernel.inc
        dense_run), M < 16 on the int8 row path (group_rows)
Reported per arm: the median process CPU time per call (steadier than wall time on a shared
machine; the kernel pool runs ``--threads`` threads) and GOP/s from it (2 M N K / time).
"""

from __future__ import annotations

import os
import statistics
import time

SHAPES = {
    "smollm2-135m": [(576, 576), (1536, 576), (576, 1536), (192, 576)],
    "qwen2.5-0.5b": [(896, 896), (4864, 896), (896, 4864), (128, 896)],
}


def add_arguments(p) -> None:
    p.add_argument("--rows", default="8,12,16,64,512", help="comma list of M (activation rows)")
    p.add_argument(
        "--models", default="smollm2-135m,qwen2.5-0.5b", help="comma list of: " + ", ".join(SHAPES)
    )
    p.add_argument("--bits", type=int, default=4)
    p.add_argument("--reps", type=int, default=9, help="calls per arm per pass (4 passes: A/B/B/A)")
    p.add_argument("--threads", type=int, default=1, help="kernel pool threads")


def run(args) -> dict:
    os.environ.setdefault("MLXTERM_AMX_MIN_M", "2")  # read at the first matmul of the process
    from engine import kernels

    import mlx.core as mx
    import numpy as np

    if not kernels.available():
        return {"bench": "qmm", "skipped": f"CPU kernels unavailable: {kernels.status()['reason']}"}
    kernels.set_threads(args.threads)
    rows = [int(m) for m in args.rows.split(",")]
    out = []
    table = [
        "| model | M | N x K | amx ms | off ms | amx GOP/s | off GOP/s | speed-up |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for model in args.models.split(","):
        for N, K in SHAPES[model]:
            rng = np.random.default_rng(N + K)
            w = mx.array(rng.standard_normal((N, K)).astype(np.float32))
            wq, s, b = mx.quantize(w, group_size=32, bits=args.bits)
            for M in rows:
                x = mx.array(rng.standard_normal((M, K)).astype(np.float32))
                mx.eval(wq, s, b, x)
                times: dict[str, list[float]] = {"amx": [], "off": []}
                for arm in ("amx", "off", "off", "amx"):
                    was = kernels.set_amx(arm == "amx")
                    try:
                        mx.eval(kernels.quantized_matmul(x, wq, s, b, 32, args.bits))  # warm-up
                        for _ in range(args.reps):
                            t = time.process_time()
                            mx.eval(kernels.quantized_matmul(x, wq, s, b, 32, args.bits))
                            times[arm].append(time.process_time() - t)
                    finally:
                        kernels.set_amx(was)
                ms = {k: statistics.median(v) * 1000 for k, v in times.items()}
                gops = {k: 2 * M * N * K / (v / 1000) / 1e9 for k, v in ms.items()}
                row = {
                    "model": model,
                    "M": M,
                    "N": N,
                    "K": K,
                    "amx_ms": round(ms["amx"], 4),
                    "off_ms": round(ms["off"], 4),
                    "amx_gops": round(gops["amx"], 1),
                    "off_gops": round(gops["off"], 1),
                    "speedup": round(ms["off"] / ms["amx"], 2),
                }
                out.append(row)
                table.append(
                    f"| {model} | {M} | {N} x {K} | {row['amx_ms']} | {row['off_ms']} | {row['amx_gops']} "
                    f"| {row['off_gops']} | {row['speedup']}x |"
                )
    return {
        "bench": "qmm",
        "kernels": kernels.status(),
        "threads": args.threads,
        "bits": args.bits,
        "load_avg": list(os.getloadavg()),
        "results": out,
        "summary": "\n".join(table),
    }
