"""Load on one ``mlxterm serve``: 32 clients x 8 streamed requests, some hanging up mid-stream.

Every reply that completes must be its prompt's solo greedy text (the batch, the checkpoint
prefixes restored between requests and the cancelled neighbours change nothing); the server's
/health counters must account for each request exactly once (none lost, none counted twice);
afterwards no request is left in the engine and the server's resident memory is back near
where it was before the load.

Memory: the baseline is read after a warm-up burst (one request per client: the server's
threads, allocator arenas and the batch's peak shapes exist by then). The checkpoint store
keeps finished requests' KV in its RAM tier by design, so the profile bounds that tier
(``cache.ram_bytes``, 8 MiB) and the margin is that bound plus ``RSS_SLACK`` (16 MiB) for
allocator noise: 24 MiB over 256 requests, so a leak of ~100 KiB per request fails. Measured
on the 2-core dev box: +4 to +6 MiB after the load (+20 MiB without the warm-up, then +1 to
+2 MiB per further round of 256).
"""

from __future__ import annotations

import http.client
import json
import random
import threading
from concurrent.futures import ThreadPoolExecutor
from urllib.parse import urlparse

import pytest

from tests.serve_server import running_server

CLIENTS = 32
REQUESTS = 8
SEED = 31
HANG_UP_P = 0.25  # chance that a request is dropped mid-stream
MAX_TOKENS = 24
RAM_TIER = 8 * 1024**2
RSS_SLACK = 16 * 1024**2
PROMPTS = [f"load prompt {i}: " + "lorem ipsum dolor " * (i % 5) + "sit amet" for i in range(10)]


@pytest.fixture(scope="module")
def server(tmp_path_factory, tiny_llama_dir):
    from tests.tiny_models import write_profile

    prof = write_profile(tmp_path_factory.mktemp("load") / "load.yaml", tiny_llama_dir,
                         context={"max_context": 8192}, batch={"cap": 8}, cache={"ram_bytes": RAM_TIER})
    with running_server(prof, tmp_path_factory.mktemp("load-home")) as s:
        yield s


def _rss(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS in /proc status")


def _stream(url: str, prompt: str, hang_up_after: int | None) -> dict:
    """One streamed chat request; with ``hang_up_after`` the socket is closed after that many
    events (of a reply far longer than that). Returns the text or the hang-up."""
    u = urlparse(url)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=120)
    body = {"model": "load", "stream": True, "temperature": 0, "max_tokens": MAX_TOKENS,
            "messages": [{"role": "user", "content": prompt}]}
    if hang_up_after is not None:
        body.update(max_tokens=4096, ignore_eos=True)
    try:
        conn.request("POST", "/v1/chat/completions", body=json.dumps(body),
                     headers={"Content-Type": "application/json"})
        resp = conn.getresponse()
        if resp.status != 200:
            return {"status": resp.status, "error": resp.read().decode()}
        text, ids, seen, finish = [], set(), 0, None
        for raw in resp.fp:
            line = raw.decode().strip()
            if not line.startswith("data: "):
                continue
            data = line[len("data: "):]
            if data == "[DONE]":
                return {"status": 200, "text": "".join(text), "ids": ids, "finish": finish}
            chunk = json.loads(data)
            ids.add(chunk["id"])
            choice = chunk["choices"][0]
            text.append(choice["delta"].get("content") or "")
            finish = choice["finish_reason"] or finish
            seen += 1
            if hang_up_after is not None and seen >= hang_up_after:
                conn.sock.shutdown(2)
                return {"status": 200, "hung_up": True}
        return {"status": 200, "error": "stream ended without [DONE]"}
    finally:
        conn.close()


def _solo(url: str, prompt: str) -> str:
    r = _stream(url, prompt, None)
    assert r["status"] == 200 and "text" in r, r
    return r["text"]


def _burst(url: str, plans: list[list[tuple[str, int | None]]]) -> list[tuple[str, int | None, dict]]:
    """Each plan on its own client thread, all starting together; the results in plan order."""
    start = threading.Barrier(len(plans))

    def client(plan):
        start.wait()
        return [(prompt, cut, _stream(url, prompt, cut)) for prompt, cut in plan]

    with ThreadPoolExecutor(len(plans)) as pool:
        return [r for rs in pool.map(client, plans) for r in rs]


def test_32_clients_with_random_hang_ups(server):
    solo = {p: _solo(server.url, p) for p in PROMPTS}
    assert len(set(solo.values())) > 1  # the prompts give different replies
    # warm-up: one request per client (server threads, allocator arenas, the batch's peak shapes)
    _burst(server.url, [[(PROMPTS[c % len(PROMPTS)], 3 if c % 4 == 0 else None)] for c in range(CLIENTS)])
    before = server.wait_idle()
    rss_before = _rss(server.proc.pid)

    plans = []  # per client: [(prompt, hang_up_after or None)] * REQUESTS, seeded
    for c in range(CLIENTS):
        rng = random.Random(SEED * 1000 + c)
        plans.append([(rng.choice(PROMPTS), rng.randint(2, 6) if rng.random() < HANG_UP_P else None)
                      for _ in range(REQUESTS)])
    results = _burst(server.url, plans)
    assert len(results) == CLIENTS * REQUESTS
    assert all(r["status"] == 200 for _, _, r in results), [r for _, _, r in results if r["status"] != 200][:3]
    hung = [r for _, cut, r in results if cut is not None]
    done = [(prompt, r) for prompt, cut, r in results if cut is None]
    assert hung and all(r.get("hung_up") for r in hung)
    wrong = [(prompt, r.get("text"), solo[prompt]) for prompt, r in done if r.get("text") != solo[prompt]]
    assert not wrong, f"{len(wrong)} of {len(done)} replies differ from their solo text, e.g. {wrong[0]}"
    assert all(len(r["ids"]) == 1 for _, r in done)  # one completion id per reply
    assert len({next(iter(r["ids"])) for _, r in done}) == len(done)  # and no reply sent twice

    # /health: every request finished exactly once, the hung-up ones as cancelled
    total = sum(before["finished"].values()) + len(results)
    after = server.wait_for(lambda h: h["active"] == 0 and sum(h["finished"].values()) >= total, 30)
    delta = {k: v - before["finished"].get(k, 0) for k, v in after["finished"].items()}
    assert after["active"] == 0
    assert sum(delta.values()) == len(results), delta
    assert delta.get("cancelled", 0) == len(hung), delta
    assert after["disconnected"] - before["disconnected"] == len(hung)
    assert delta.get("stop", 0) + delta.get("length", 0) == len(done), delta

    rss_after = _rss(server.proc.pid)
    grown = rss_after - rss_before
    print(f"\nserver RSS {rss_before / 2**20:.0f} MiB -> {rss_after / 2**20:.0f} MiB "
          f"({grown / 2**20:+.1f} MiB; margin {(RAM_TIER + RSS_SLACK) / 2**20:.0f} MiB)")
    assert grown <= RAM_TIER + RSS_SLACK
