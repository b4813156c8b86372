"""The two servers ``bench serve`` compares, each in its own process, announced on stdout.

``python -m app.benches.serve_child mlxterm PROFILE SSD_DIR``: ``mlxterm serve`` on the
profile with its checkpoints' SSD tier in SSD_DIR (the bench's temporary directory, so the
user's store is left alone), on a free loopback port.

``python -m app.benches.serve_child llama_cpp GGUF N_CTX SLOTS THREADS``: llama.cpp's own HTTP
server (PyPI ``xllamacpp``) on the GGUF: SLOTS parallel slots over one unified KV buffer of
N_CTX tokens, llama.cpp's defaults otherwise (its prompt cache in RAM included), until
SIGTERM. Exits with 3 and ``llama_peer.MISSING`` when xllamacpp is not installed.

Both print one line ``... on http://127.0.0.1:PORT/v1`` once they accept requests. A process
each keeps the clients' Python (in the bench) off the servers' interpreters.
"""

from __future__ import annotations

import os
import signal
import sys


def mlxterm(profile_name: str, ssd_dir: str) -> int:
    from dataclasses import replace

    from engine.profiles import load_profile
    from engine.runtime import Engine

    from app.serve.app import ServerState
    from app.serve.server import serve

    profile = load_profile(profile_name)
    profile = replace(profile, cache=replace(profile.cache, ssd_dir=ssd_dir))
    engine = Engine.load(profile)
    serve(ServerState(engine, max_queue=256), "127.0.0.1", 0)
    os._exit(0)  # the bench throws its checkpoints away with SSD_DIR: no flush on the way out


def llama_cpp(gguf: str, n_ctx: int, slots: int, threads: int) -> int:
    from app.benches.llama_peer import MISSING

    try:
        import xllamacpp as xl
    except ImportError:
        print(MISSING, flush=True)
        return 3
    stop = {signal.SIGTERM, signal.SIGINT}
    signal.pthread_sigmask(signal.SIG_BLOCK, stop)  # llama.cpp's threads inherit the mask
    p = xl.CommonParams()
    p.model.path = gguf
    p.n_ctx = n_ctx
    p.n_parallel = slots
    p.kv_unified = True
    p.n_batch = p.n_ubatch = 512
    p.n_threads_http = slots + 4  # every client's connection served at once
    p.cpuparams.n_threads = threads
    p.cpuparams_batch.n_threads = threads
    p.warmup = False
    server = xl.Server(p)
    print(f"llama.cpp server on {server.listening_address}/v1", flush=True)
    signal.sigwait(stop)
    del server
    return 0


def main(argv: list[str]) -> int:
    if len(argv) == 3 and argv[0] == "mlxterm":
        return mlxterm(argv[1], argv[2])
    if len(argv) == 5 and argv[0] == "llama_cpp":
        return llama_cpp(argv[1], int(argv[2]), int(argv[3]), int(argv[4]))
    print(__doc__, file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
