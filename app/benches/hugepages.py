"""Huge pages on vs off: engine (and llama.cpp) decode/prefill, each arm a fresh process.

Huge pages are a property of the process (glibc reads its tunable at start, see
engine/hugepages.py), so each arm runs ``mlxterm bench engine`` -- and with ``--long-context N``
also ``mlxterm bench resume --long-context N`` -- as a child process with ``MLXTERM_HUGEPAGES``
on or off, alternated on/off/off/on per round. Reports medians per arm and on/off ratios, and
how much memory each child had on huge pages (``anon_huge_mib``: its arms' weights, caches and
buffers, llama.cpp's included when that arm runs).
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys


def add_arguments(p) -> None:
    p.add_argument("--profile", default="smollm2-135m")
    p.add_argument("--rounds", type=int, default=1, help="each round runs on, off, off, on")
    p.add_argument("--prompt-tokens", type=int, default=500)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--arms", default="engine,llama_cpp,llama_cpp_read", help="bench engine arms run in each child")
    p.add_argument("--long-context", type=int, default=0, metavar="N",
                   help="also run bench resume's long-context arm (engine) at N tokens")


def _child(argv: list[str], on: bool) -> dict:
    env = dict(os.environ, MLXTERM_HUGEPAGES="on" if on else "off")
    proc = subprocess.run([sys.executable, "-m", "app", "bench", *argv, "--json"], env=env,
                          capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"bench {argv[0]} (huge pages {'on' if on else 'off'}) failed:\n{proc.stderr[-2000:]}")
    return json.loads(proc.stdout)


def _median(values: list[float]) -> float | None:
    values = [v for v in values if v is not None]
    return round(statistics.median(values), 2) if values else None


def run(args) -> dict:
    engine_argv = ["engine", "--profile", args.profile, "--rounds", "1", "--arms", args.arms,
                   "--prompt-tokens", str(args.prompt_tokens), "--max-tokens", str(args.max_tokens)]
    long_argv = ["resume", "--profile", args.profile, "--long-context", str(args.long_context),
                 "--repeats", "1", "--arms", "engine"]
    samples: dict[str, dict[str, list]] = {"on": {}, "off": {}}
    children: list[dict] = []
    for _ in range(args.rounds):
        for on in (True, False, False, True):
            side = samples["on" if on else "off"]
            result = _child(engine_argv, on)
            children.append({"bench": "engine", "on": on, "hugepages": result.get("hugepages")})
            for arm, r in result.get("arms", {}).items():
                for key in ("prefill_tps", "decode_tps"):
                    side.setdefault(f"{arm}.{key}", []).append(r.get(key))
            if args.long_context:
                result = _child(long_argv, on)
                children.append({"bench": "resume-long", "on": on, "hugepages": result.get("hugepages")})
                r = result["arms"]["engine"]
                for key in ("decode_tps_at_context", "decode_tps_at_100", "decode_ratio_context_vs_100"):
                    side.setdefault(f"engine.{key}", []).append(r.get(key))
    medians = {side: {k: _median(v) for k, v in samples[side].items()} for side in samples}
    ratios = {k: round(medians["on"][k] / medians["off"][k], 2)
              for k in medians["on"] if medians["on"][k] and medians["off"].get(k)}
    table = ["| measure | huge pages on | off | on / off |", "|---|---|---|---|"]
    table += [f"| {k} | {medians['on'][k]} | {medians['off'].get(k)} | {ratios.get(k, '-')} |" for k in medians["on"]]
    def huge_mib(on: bool) -> list:
        return [(c["hugepages"] or {}).get("anon_huge_mib") for c in children if c["on"] == on]

    table.append(f"anon MiB on huge pages per child (on / off): {huge_mib(True)} / {huge_mib(False)}")
    return {"bench": "hugepages", "profile": args.profile, "rounds": args.rounds, "order": "on, off, off, on",
            "engine_argv": engine_argv, "long_context_argv": long_argv if args.long_context else None,
            "medians": medians, "ratios": ratios, "samples": samples, "children": children,
            "load_avg": [round(x, 2) for x in os.getloadavg()], "summary": "\n".join(table)}
