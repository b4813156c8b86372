"""Quantized matmul microbench: the int8 many-row paths (AMX-INT8 tiles, AVX512-VNNI register
tiles) vs the float panels / int8 row path.

For each (M, N, K) of a model's weight shapes, the arms this CPU has (amx, vnni512, int8, few,
float) on the same random weights, alternated A/B/B/A in one process; per arm the median process
CPU time per call, GOP/s, the speed-up over ``float`` and the time over one row. The arms and
``--scales gguf``: docs/benches.md ("mlxterm bench qmm").
"""

from __future__ import annotations

import os
import statistics
import time

SHAPES = {
    "smollm2-135m": [(576, 576), (1536, 576), (576, 1536), (192, 576)],
    "qwen2.5-0.5b": [(896, 896), (4864, 896), (896, 4864), (128, 896)],
    # q/o, k/v, gate/up, down, the tied head (8-bit in a Q4_K_M: Q6_K re-quantized)
    "qwen2.5-1.5b": [(1536, 1536), (256, 1536), (8960, 1536), (1536, 8960), (151936, 1536)],
}


def add_arguments(p) -> None:
    p.add_argument("--rows", default="8,12,16,64,512", help="comma list of M (activation rows)")
    p.add_argument(
        "--models", default="smollm2-135m,qwen2.5-0.5b", help="comma list of: " + ", ".join(SHAPES)
    )
    p.add_argument("--bits", type=int, default=4)
    p.add_argument("--group-size", type=int, default=32, choices=(32, 64, 128))
    p.add_argument("--scales", default="float32", choices=("float32", "gguf"),
                   help="float32: mx.quantize's; gguf: K-quant records (4/5-bit) or float16 symmetric (8-bit)")
    p.add_argument("--reps", type=int, default=9, help="calls per (M, arm) cell per pass (2 passes: in order, then reversed)")
    p.add_argument("--threads", type=int, default=1, help="kernel pool threads")


def _weights(N: int, K: int, bits: int, gs: int, scales: str, rng):
    """Random quantized weights (wq, scales, biases, symmetric) in the requested scale form."""
    import mlx.core as mx
    import numpy as np

    if scales == "float32":
        w = mx.array(rng.standard_normal((N, K)).astype(np.float32))
        return (*mx.quantize(w, group_size=gs, bits=bits), False)
    wq = mx.array(rng.integers(0, 2**32, (N, K * bits // 32), dtype=np.uint32))
    if bits == 8:  # symmetric: the bias is -128 * scale (read from the scale alone)
        s = mx.array(rng.uniform(1e-3, 2e-3, (N, K // gs)).astype(np.float16))
        return wq, s, s * -128, True
    if gs != 32 or K % 256:  # no K-quant form: float16 scales and biases (Q4_1 / Q5_1)
        s = mx.array(rng.uniform(1e-3, 2e-3, (N, K // gs)).astype(np.float16))
        return wq, s, (s * -7).astype(mx.float16), False
    from engine.kernels import kscales

    nsb = K // (32 * kscales.SUPER)  # 256-value super-blocks per row
    rec = rng.integers(0, 64, (N, nsb, kscales.RECORD_BYTES)).astype(np.uint8)  # sc, m in [0, 63]
    d = rng.uniform(1e-3, 2e-3, (N, nsb, 2)).astype(np.float16)  # d, dmin
    rec[:, :, :4] = d.view(np.uint8).reshape(N, nsb, 4)
    r = mx.array(rec.reshape(N, -1))
    return wq, r, r, False


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
    # (amx, vnni_gemm, small_rows, rows4) switch settings per arm; only the paths this CPU has.
    # "float" has every added path off: the float panels for 16+ rows, and for one 4-bit row the
    # transposing one-row path (row1_direct4) instead of the row-by-row one.
    settings = {"amx": (True, False, False, True), "vnni512": (False, True, False, True),
                "int8": (False, True, False, True), "few": (False, True, True, True),
                "float": (False, False, False, False)}
    wide = ext.isa() == "avx2+avx512vnni"
    have = (("amx", ext.amx()), ("vnni512", wide), ("int8", not wide), ("few", ext.isa() == "avx2"))
    names = [a for a, ok in have if ok]
    names.append("float")
    gs = args.group_size
    out = []
    one = 1 in rows
    table = [
        "| model | M | N x K | " + " | ".join(f"{a} ms" for a in names) + " | "
        + " | ".join(f"{a} GOP/s" for a in names) + " | " + " | ".join(f"{a} speed-up" for a in names[:-1])
        + (" | " + " | ".join(f"{a} x1" for a in names) if one else "") + " |",
        "|---" * (3 + 3 * len(names) - 1 + (len(names) if one else 0)) + "|",
    ]
    small_was, rows4_was = kernels.set_small_rows(True), kernels.set_rows4(True)
    try:
        for model in args.models.split(","):
            for N, K in SHAPES[model]:
                rng = np.random.default_rng(N + K)
                wq, s, b, sym = _weights(N, K, args.bits, gs, args.scales, rng)
                xs = {M: mx.array(rng.standard_normal((M, K)).astype(np.float32)) for M in rows}
                mx.eval(wq, s, b, *xs.values())
                cells = [(M, arm) for M in rows for arm in names]
                times: dict[tuple[int, str], list[float]] = {c: [] for c in cells}
                for M, arm in cells + cells[::-1]:
                    amx, vnni, few, rows4 = settings[arm]
                    was = kernels.set_amx(amx), kernels.set_vnni_gemm(vnni)
                    kernels.set_small_rows(few)
                    kernels.set_rows4(rows4)
                    try:
                        mx.eval(kernels.quantized_matmul(xs[M], wq, s, b, gs, args.bits, symmetric=sym))  # warm-up
                        for _ in range(args.reps):
                            t = time.process_time()
                            mx.eval(kernels.quantized_matmul(xs[M], wq, s, b, gs, args.bits, symmetric=sym))
                            times[(M, arm)].append(time.process_time() - t)
                    finally:
                        kernels.restore_int8_prefill(was)
                ms = {c: statistics.median(v) * 1000 for c, v in times.items()}
                for M in rows:
                    row = {"model": model, "M": M, "N": N, "K": K}
                    row.update({f"{a}_ms": round(ms[(M, a)], 4) for a in names})
                    row.update({f"{a}_gops": round(2 * M * N * K / ms[(M, a)] / 1e6, 1) for a in names})
                    row.update({f"{a}_speedup": round(ms[(M, "float")] / ms[(M, a)], 2) for a in names[:-1]})
                    if one:
                        row.update({f"{a}_x1": round(ms[(M, a)] / ms[(1, a)], 2) for a in names})
                    out.append(row)
                    table.append(
                        f"| {model} | {M} | {N} x {K} | " + " | ".join(str(row[f"{a}_ms"]) for a in names) + " | "
                        + " | ".join(str(row[f"{a}_gops"]) for a in names) + " | "
                        + " | ".join(f"{row[f'{a}_speedup']}x" for a in names[:-1])
                        + (" | " + " | ".join(f"{row[f'{a}_x1']}x" for a in names) if one else "") + " |"
                    )
    finally:
        kernels.set_small_rows(small_was)
        kernels.set_rows4(rows4_was)
    return {
        "bench": "qmm",
        "kernels": kernels.status(),
        "threads": args.threads,
        "bits": args.bits,
        "group_size": gs,
        "scales": args.scales,
        "arms": names,
        "load_avg": list(os.getloadavg()),
        "results": out,
        "summary": "\n".join(table),
    }
