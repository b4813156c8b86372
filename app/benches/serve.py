"""Serving: mlxterm serve vs llama.cpp's server, concurrent streaming clients on one GGUF.

Why: ``mlxterm serve`` should match llama.cpp's server on throughput and latency and beat it on
a follow-up turn (issue 31: tok/s >= 1.0x and p95 TTFT <= 1.0x at every N, follow-up TTFT <=
0.2x). Both servers run in their own processes on loopback (app/benches/serve_child.py) with the
same threads; client threads stream ``POST /v1/completions`` with the same token-id prompts,
greedy, ``ignore_eos``. Arms ``mlxterm`` and ``llama_cpp`` alternate in order then in reverse;
per N in --clients: ``tok_s`` and ``ttft_p95_ms``; then a follow-up turn after another client
used the slot, with what each server reused. How each is measured: docs/benches.md.
"""

from __future__ import annotations

import http.client
import json
import math
import os
import platform
import re
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from urllib.parse import urlparse

from app.benches.engine import PASSAGE

ARMS = ("mlxterm", "llama_cpp")
REPLY_TOKENS = 16  # the conversation's first turn
TAIL_TOKENS = 32  # what the follow-up turn adds
FOLLOW_UP_TOKENS = 8
_ANNOUNCE = re.compile(r" on (http://\S+)/v1")
METRICS = {
    "tok_s": "completion tokens of all requests in a run / wall time from the start to the last reply's end",
    "ttft_p95_ms": "95th percentile (nearest rank) over a run's requests of send -> first streamed text",
    "ttft_median_ms": "median over a run's requests of send -> first streamed text",
    "follow_up_ttft_ms": "send -> first text of the conversation's follow-up turn, after another client's turn",
    "ratio": "mlxterm / llama_cpp (median over runs each)",
}


def add_arguments(p) -> None:
    p.add_argument("--profile", default="smollm2-135m", help="a profile whose model.source is a GGUF")
    p.add_argument("--clients", default="1,4,8", help="comma list of concurrent client counts")
    p.add_argument("--requests", type=int, default=2, help="requests per client per run, one after another")
    p.add_argument("--prompt-tokens", type=int, default=128)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--conversation-tokens", type=int, default=4096, help="0 skips the follow-up turn")
    p.add_argument("--rounds", type=int, default=1, help="each round runs every arm twice (in order, then reversed)")
    p.add_argument("--arms", default="mlxterm,llama_cpp", help="comma list of: mlxterm, llama_cpp")
    p.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)),
                   help="llama.cpp threads (mlxterm's kernel pool uses the CPUs it may run on)")
    p.add_argument("--startup-s", type=float, default=600.0, help="how long a server may take to start")


# -- servers --------------------------------------------------------------------------------------
class Child:
    """A server process started by serve_child, its URL, and its log (stdout + stderr)."""

    def __init__(self, args: list[str], log: Path, startup_s: float):
        self.log = log
        self.proc = subprocess.Popen([sys.executable, "-m", "app.benches.serve_child", *args],
                                     stdout=subprocess.PIPE, stderr=log.open("w"), text=True,
                                     cwd=Path(__file__).resolve().parents[2])
        self.url = self._announced(startup_s)

    def _announced(self, startup_s: float) -> str:
        found: list[str] = []
        lines: list[str] = []

        def pump() -> None:
            for line in self.proc.stdout:
                lines.append(line)
                m = _ANNOUNCE.search(line)
                if m and not found:
                    found.append(m.group(1))

        t = threading.Thread(target=pump, daemon=True)
        t.start()
        end = time.monotonic() + startup_s
        while not found and self.proc.poll() is None and time.monotonic() < end:
            time.sleep(0.05)
        if found:
            return found[0]
        self.stop()
        t.join(5)
        tail = "".join(lines)[-500:] + self.log.read_text(errors="replace")[-1500:]
        raise RuntimeError(f"bench serve: the server did not start:\n{tail}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def _gguf(profile) -> Path:
    from engine.errors import MlxtermError
    from engine.model.catalog import resolve_source

    if profile.model.source is None:
        raise MlxtermError(f"bench serve: profile {profile.name} has no local model (model.remote)")
    source = resolve_source(profile.model.source, profile.base_dir)
    if not (source.is_file() and source.suffix == ".gguf"):
        raise MlxtermError(f"bench serve: profile {profile.name}'s model is {source}, not a GGUF file: "
                           "llama.cpp needs the same GGUF")
    return source


def _tokenizer(path: Path):
    from engine.model.gguf import read_gguf
    from engine.model.tokenizer import Tokenizer

    return Tokenizer.from_gguf_metadata(read_gguf(path).metadata, str(path))


# -- one streamed request ---------------------------------------------------------------------------
def stream(url: str, body: dict, timeout: float = 600.0) -> dict:
    """POST /v1/completions with ``stream: true``; {ttft_s, end_s (from sending), tokens,
    usage, timings}. Raises RuntimeError on an HTTP error or a stream without text."""
    u = urlparse(url)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=timeout)
    try:
        t0 = time.perf_counter()
        conn.request("POST", "/v1/completions", body=json.dumps({**body, "stream": True}),
                     headers={"Content-Type": "application/json"})
        resp = conn.getresponse()
        if resp.status != 200:
            raise RuntimeError(f"{url}: HTTP {resp.status}: {resp.read()[:300]!r}")
        first, usage, timings = None, None, None
        for raw in resp:
            line = raw.decode("utf-8", "replace").strip()
            if not line.startswith("data: "):
                continue
            data = line[len("data: "):]
            if data == "[DONE]":
                break
            chunk = json.loads(data)
            if "error" in chunk:
                raise RuntimeError(f"{url}: {chunk['error']}")
            if first is None and any(c.get("text") for c in chunk.get("choices") or []):
                first = time.perf_counter()
            usage = chunk.get("usage") or usage
            timings = chunk.get("timings") or timings
        end = time.perf_counter()
    finally:
        conn.close()
    if first is None:
        raise RuntimeError(f"{url}: the stream carried no text")
    tokens = (usage or {}).get("completion_tokens") or body["max_tokens"]
    return {"ttft_s": first - t0, "end_s": end - t0, "tokens": tokens, "usage": usage, "timings": timings}


def _body(arm: str, model: str, prompt: list[int], max_tokens: int, **extra) -> dict:
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0,
            "ignore_eos": True, "stream_options": {"include_usage": True}}
    if arm == "mlxterm":
        body["repetition_penalty"] = 1.0  # the profile's default may differ; llama.cpp's is 1.0
    else:
        body.update(repeat_penalty=1.0, cache_prompt=True, **extra)
    return body


# -- prompts ----------------------------------------------------------------------------------------
class Prompts:
    """Token-id prompts that no server has seen: a fresh nonce ahead of the passage."""

    def __init__(self, tokenizer):
        self.tok = tokenizer
        self.n = 0
        self.passage = tokenizer.encode(PASSAGE * 4)

    def new(self, n_tokens: int) -> list[int]:
        self.n += 1
        ids = self.tok.encode(f"[{self.n:05d}] ")
        while len(ids) < n_tokens:
            ids += self.passage
        return ids[:n_tokens]


def percentile(xs: list[float], q: float) -> float:
    """Nearest-rank percentile (q in 0-100)."""
    s = sorted(xs)
    return s[max(0, math.ceil(q / 100 * len(s)) - 1)]


def concurrent_run(url: str, arm: str, model: str, prompts: Prompts, clients: int, requests: int,
                   prompt_tokens: int, max_tokens: int) -> dict:
    """``clients`` threads start together, each streams ``requests`` requests one by one."""
    plans = [[prompts.new(prompt_tokens) for _ in range(requests)] for _ in range(clients)]
    results: list[list[dict]] = [[] for _ in range(clients)]
    errors: list[BaseException] = []
    barrier = threading.Barrier(clients + 1)

    def client(i: int) -> None:
        barrier.wait()
        try:
            for p in plans[i]:
                results[i].append(stream(url, _body(arm, model, p, max_tokens)))
        except BaseException as e:  # noqa: BLE001 -- re-raised in the caller's thread
            errors.append(e)

    threads = [threading.Thread(target=client, args=(i,)) for i in range(clients)]
    for t in threads:
        t.start()
    barrier.wait()
    t0 = time.perf_counter()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    if errors:
        raise errors[0]
    flat = [r for rs in results for r in rs]
    ttfts = [r["ttft_s"] * 1000 for r in flat]
    return {"tok_s": sum(r["tokens"] for r in flat) / wall, "ttft_p95_ms": percentile(ttfts, 95),
            "ttft_median_ms": statistics.median(ttfts), "wall_s": wall, "requests": len(flat)}


def follow_up_run(url: str, arm: str, model: str, prompts: Prompts, conversation_tokens: int) -> dict:
    """TTFT of a conversation's follow-up turn after another client's turn on the same slot."""
    pin = {"id_slot": 0} if arm == "llama_cpp" else {}
    conv = prompts.new(conversation_tokens)
    stream(url, _body(arm, model, conv, REPLY_TOKENS, **pin))
    stream(url, _body(arm, model, prompts.new(max(64, conversation_tokens // 4)), REPLY_TOKENS, **pin))
    tail = prompts.tok.encode(" Thanks. Now say it again in fewer words, and name the layer that matters most.")
    r = stream(url, _body(arm, model, conv + tail[:TAIL_TOKENS], FOLLOW_UP_TOKENS, **pin))
    reused = (((r["usage"] or {}).get("prompt_tokens_details") or {}).get("cached_tokens")
              if arm == "mlxterm" else (r["timings"] or {}).get("cache_n"))
    return {"ttft_ms": r["ttft_s"] * 1000, "reused_tokens": reused, "prompt_tokens": len(conv) + len(tail[:TAIL_TOKENS])}


# -- the bench ------------------------------------------------------------------------------------
def _order(arms: list[str], rounds: int) -> list[str]:
    return [a for _ in range(rounds) for a in (*arms, *reversed(arms))]


def _load_avg() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


def run(args) -> dict:
    from engine.errors import MlxtermError
    from engine.profiles import find_profile, load_profile

    from app.benches import llama_peer

    clients = [int(c) for c in str(args.clients).split(",") if c.strip()]
    want = [a.strip() for a in args.arms.split(",") if a.strip()]
    bad = [a for a in want if a not in ARMS]
    if bad or not want or not clients or min(clients) < 1:
        raise MlxtermError(f"bench serve: --arms takes {', '.join(ARMS)}; --clients positive integers")
    profile = load_profile(args.profile)
    gguf = _gguf(profile)
    prompts = Prompts(_tokenizer(gguf))
    notes: list[str] = []
    if "llama_cpp" in want:
        import importlib.util

        if importlib.util.find_spec("xllamacpp") is None:
            want.remove("llama_cpp")
            notes.append(f"llama_cpp arm skipped: {llama_peer.MISSING}")
    slots = max(clients)
    n_ctx = max(args.conversation_tokens + 256, slots * (args.prompt_tokens + args.max_tokens + 16))
    n_ctx = -(-n_ctx // 256) * 256
    out: dict = {
        "bench": "serve", "profile": profile.name, "gguf": str(gguf), "threads": args.threads,
        "clients": clients, "requests_per_client": args.requests, "prompt_tokens": args.prompt_tokens,
        "max_tokens": args.max_tokens, "conversation_tokens": args.conversation_tokens, "rounds": args.rounds,
        "arms": want, "llama_cpp_config": {"slots": slots, "n_ctx": n_ctx, "kv_unified": True,
                                           "prompt_cache_ram": "llama.cpp default"},
        "machine": {"platform": platform.platform(), "cpus": len(os.sched_getaffinity(0)),
                    "load_avg_before": _load_avg()},
        "metrics": METRICS, "notes": notes,
    }
    with tempfile.TemporaryDirectory(prefix="mlxterm-bench-serve-") as tmp:
        servers: dict[str, Child] = {}
        try:
            for arm in want:
                cmd = (["mlxterm", str(find_profile(args.profile).resolve()), str(Path(tmp) / "checkpoints")]
                       if arm == "mlxterm"
                       else ["llama_cpp", str(gguf), str(n_ctx), str(slots), str(args.threads)])
                servers[arm] = Child(cmd, Path(tmp) / f"{arm}.log", args.startup_s)
            model = profile.name
            for arm in want:  # warm-up: each batch shape once, the allocators, the thread pools
                for c in clients:
                    concurrent_run(servers[arm].url, arm, model, prompts, c, 1, args.prompt_tokens, 4)
            out["concurrency"] = {}
            for c in clients:
                runs: dict[str, list[dict]] = {a: [] for a in want}
                for arm in _order(want, args.rounds):
                    runs[arm].append(concurrent_run(servers[arm].url, arm, model, prompts, c, args.requests,
                                                    args.prompt_tokens, args.max_tokens))
                out["concurrency"][str(c)] = _concurrency_row(runs)
            if args.conversation_tokens > 0:
                fruns: dict[str, list[dict]] = {a: [] for a in want}
                for arm in _order(want, args.rounds):
                    fruns[arm].append(follow_up_run(servers[arm].url, arm, model, prompts,
                                                    args.conversation_tokens))
                out["follow_up"] = _follow_up_row(fruns)
        finally:
            for s in servers.values():
                s.stop()
    out["machine"]["load_avg_after"] = _load_avg()
    out["targets"] = {"tok_s_ratio_min": 1.0, "ttft_p95_ratio_max": 1.0, "follow_up_ttft_ratio_max": 0.2}
    out["summary"] = _summary(out)
    return out


def _concurrency_row(runs: dict[str, list[dict]]) -> dict:
    row: dict = {}
    for arm, rs in runs.items():
        row[arm] = {
            "tok_s": round(statistics.median(r["tok_s"] for r in rs), 1),
            "ttft_p95_ms": round(statistics.median(r["ttft_p95_ms"] for r in rs), 1),
            "ttft_median_ms": round(statistics.median(r["ttft_median_ms"] for r in rs), 1),
            "tok_s_runs": [round(r["tok_s"], 1) for r in rs],
            "ttft_p95_ms_runs": [round(r["ttft_p95_ms"], 1) for r in rs],
            "requests_per_run": rs[0]["requests"],
        }
    if set(runs) == set(ARMS):
        a, b = row["mlxterm"], row["llama_cpp"]
        row["ratio"] = {"tok_s": round(a["tok_s"] / b["tok_s"], 2),
                        "ttft_p95": round(a["ttft_p95_ms"] / b["ttft_p95_ms"], 2)}
    return row


def _follow_up_row(runs: dict[str, list[dict]]) -> dict:
    row: dict = {}
    for arm, rs in runs.items():
        row[arm] = {"ttft_ms": round(statistics.median(r["ttft_ms"] for r in rs), 1),
                    "ttft_ms_runs": [round(r["ttft_ms"], 1) for r in rs],
                    "reused_tokens": [r["reused_tokens"] for r in rs],
                    "prompt_tokens": rs[0]["prompt_tokens"]}
    if set(runs) == set(ARMS):
        row["ratio"] = round(row["mlxterm"]["ttft_ms"] / row["llama_cpp"]["ttft_ms"], 3)
    return row


def _summary(out: dict) -> str:
    lines = [f"bench serve: {out['profile']} ({Path(out['gguf']).name}), {out['threads']} threads, "
             f"{out['prompt_tokens']}-token prompts, {out['max_tokens']} tokens each, load avg "
             f"{out['machine']['load_avg_before']} -> {out['machine']['load_avg_after']}"]
    for c, row in out.get("concurrency", {}).items():
        parts = [f"{arm} {row[arm]['tok_s']} tok/s, p95 TTFT {row[arm]['ttft_p95_ms']} ms"
                 for arm in ARMS if arm in row]
        ratio = row.get("ratio")
        tail = f"  (ratio tok/s {ratio['tok_s']}x, p95 TTFT {ratio['ttft_p95']}x)" if ratio else ""
        lines.append(f"  {c} client(s): " + "; ".join(parts) + tail)
    fu = out.get("follow_up")
    if fu:
        parts = [f"{arm} {fu[arm]['ttft_ms']} ms (reused {fu[arm]['reused_tokens']})" for arm in ARMS if arm in fu]
        tail = f"  (ratio {fu['ratio']}x)" if "ratio" in fu else ""
        lines.append(f"  follow-up TTFT, {out['conversation_tokens']}-token conversation: "
                     + "; ".join(parts) + tail)
    lines += [f"  note: {n}" for n in out["notes"]]
    return "\n".join(lines)
