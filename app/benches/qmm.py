"""Quantized matmul microbench: the int8 many-row paths (AMX-INT8 tiles, AVX512-VNNI register
tiles) vs the float panels / int8 row path.

For each (M, N, K) -- the weight shapes of SmolLM2-135M and Qwen2.5-0.5B at prefill chunk sizes
(M >= 16) and multi-row step sizes (M < 16) -- the arms this CPU has, on the same random weights,
alternated in order then reversed (A/B/B/A) in one process:
  amx      engine.kernels.quantized_matmul with the AMX path on and the VNNI GEMM off
           (kernels.set_amx_min_rows(2) in this process, so M < 16 runs on tiles too)
  vnni512  the AVX512-VNNI GEMM (src/qmm_gemm512.cpp) on, AMX off: M >= 16 (kernels.dense_rows())
  int8     AVX2 / AVX-VNNI only: the int8 row path over every row for M >= 16 ("int8 many rows")
  float    both off (kernels.set_int8_prefill(False)): M >= 16 on the float panels
           (src/qmm_kernel.inc dense_run), M < 16 on the int8 row path (group_rows)
Reported per arm: the median process CPU time per call (steadier than wall time on a shared
machine; the kernel pool runs ``--threads`` threads), GOP/s from it (2 M N K / time), and each
int8 arm's speed-up over ``float``.
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
    from engine import kernels

    import mlx.core as mx
    import numpy as np

    if not kernels.available():
        return {"bench": "qmm", "skipped": f"CPU kernels unavailable: {kernels.status()['reason']}"}
    kernels.set_threads(args.threads)
    kernels.set_amx_min_rows(2)
    rows = [int(m) for m in args.rows.split(",")]
    ext = kernels._load()
    # (amx, vnni_gemm) switch settings per arm; only the paths this CPU has.
    settings = {"amx": (True, False), "vnni512": (False, True), "int8": (False, True), "float": (False, False)}
    wide = ext.isa() == "avx2+avx512vnni"
    names = [a for a, have in (("amx", ext.amx()), ("vnni512", wide), ("int8", not wide)) if have]
    names.append("float")
    out = []
    table = [
        "| model | M | N x K | " + " | ".join(f"{a} ms" for a in names) + " | "
        + " | ".join(f"{a} GOP/s" for a in names) + " | " + " | ".join(f"{a} speed-up" for a in names[:-1]) + " |",
        "|---" * (3 + 2 * len(names) + len(names) - 1) + "|",
    ]
    for model in args.models.split(","):
        for N, K in SHAPES[model]:
            rng = np.random.default_rng(N + K)
            w = mx.array(rng.standard_normal((N, K)).astype(np.float32))
            wq, s, b = mx.quantize(w, group_size=32, bits=args.bits)
            for M in rows:
                x = mx.array(rng.standard_normal((M, K)).astype(np.float32))
                mx.eval(wq, s, b, x)
                times: dict[str, list[float]] = {a: [] for a in names}
                for arm in names + names[::-1]:
                    was = kernels.set_amx(settings[arm][0]), kernels.set_vnni_gemm(settings[arm][1])
                    try:
                        mx.eval(kernels.quantized_matmul(x, wq, s, b, 32, args.bits))  # warm-up
                        for _ in range(args.reps):
                            t = time.process_time()
                            mx.eval(kernels.quantized_matmul(x, wq, s, b, 32, args.bits))
                            times[arm].append(time.process_time() - t)
                    finally:
                        kernels.restore_int8_prefill(was)
                ms = {k: statistics.median(v) * 1000 for k, v in times.items()}
                gops = {k: 2 * M * N * K / (v / 1000) / 1e9 for k, v in ms.items()}
                row = {"model": model, "M": M, "N": N, "K": K}
                row.update({f"{a}_ms": round(ms[a], 4) for a in names})
                row.update({f"{a}_gops": round(gops[a], 1) for a in names})
                row.update({f"{a}_speedup": round(ms["float"] / ms[a], 2) for a in names[:-1]})
                out.append(row)
                table.append(
                    f"| {model} | {M} | {N} x {K} | " + " | ".join(str(row[f"{a}_ms"]) for a in names) + " | "
                    + " | ".join(str(row[f"{a}_gops"]) for a in names) + " | "
                    + " | ".join(f"{row[f'{a}_speedup']}x" for a in names[:-1]) + " |"
                )
    return {
        "bench": "qmm",
        "kernels": kernels.status(),
        "threads": args.threads,
        "bits": args.bits,
        "arms": names,
        "load_avg": list(os.getloadavg()),
        "results": out,
        "summary": "\n".join(table),
    }
