"""Several processes and threads writing one session database at once."""

from __future__ import annotations

import multiprocessing as mp
import threading
from pathlib import Path

from engine.sessions import SessionStore

WRITES = 60


def _writer(path: str, shared_id: str, tag: str, barrier, errors) -> None:
    """Interleave appends to a shared session, a private session, and reads."""
    try:
        store = SessionStore(Path(path), timeout=0.0)
        barrier.wait()
        own = store.create(title=f"own {tag}")
        for i in range(WRITES):
            ids = list(range(i % 7 + 1))
            store.add_message(shared_id, "user", f"{tag} {i}", token_ids=ids)
            store.add_message(own.id, "assistant", f"{tag} {i}", token_ids=ids)
            if i % 10 == 0:
                store.list("shared")
                store.context_tokens(shared_id)
                store.fork(own.id, i, title=f"fork {tag} {i}")
        store.close()
    except BaseException as e:  # reported to the parent; a locked DB would land here
        errors.put(f"{tag}: {type(e).__name__}: {e}")


def _check_consistent(store: SessionStore, sid: str, expected: int) -> None:
    s = store.get(sid)
    msgs = store.messages(sid)
    assert s.message_count == len(msgs) == expected
    assert [m.index for m in msgs] == list(range(expected))
    start = 0
    for m in msgs:
        assert m.context_start == start
        start += m.token_count
    assert s.token_count == start == len(store.context_tokens(sid))


def test_processes_and_threads_write_concurrently(tmp_path):
    path = tmp_path / "sessions.sqlite3"
    main = SessionStore(path)
    shared = main.create(title="shared")
    ctx = mp.get_context("spawn")  # a fresh interpreter, like a second mlxterm
    errors = ctx.Queue()
    n_procs, n_threads = 2, 2
    barrier = ctx.Barrier(n_procs + n_threads)
    procs = [ctx.Process(target=_writer, args=(str(path), shared.id, f"p{i}", barrier, errors))
             for i in range(n_procs)]
    threads = [threading.Thread(target=_writer,
                                args=(str(path), shared.id, f"t{i}", barrier, errors))
               for i in range(n_threads)]
    for w in procs + threads:
        w.start()
    for w in procs + threads:
        w.join(timeout=120)
    problems = []
    while not errors.empty():
        problems.append(errors.get())
    assert problems == []
    assert all(p.exitcode == 0 for p in procs)
    writers = n_procs + n_threads
    _check_consistent(main, shared.id, writers * WRITES)
    contents = {m.content for m in main.messages(shared.id, tokens=False)}
    assert len(contents) == writers * WRITES  # nothing lost, nothing doubled
    owns = [s for s in main.list() if s.title.startswith("own ")]
    assert len(owns) == writers
    for s in owns:
        _check_consistent(main, s.id, WRITES)
    forks = [main.get(s.id) for s in main.list() if s.title.startswith("fork ")]
    assert len(forks) == writers * (WRITES // 10)
    for f in forks:
        _check_consistent(main, f.id, f.fork_at)
    main.close()


def _create_and_write(path: str, barrier, errors) -> None:
    try:
        barrier.wait()
        store = SessionStore(Path(path), timeout=0.0)  # all race to create the schema
        s = store.create()
        store.add_message(s.id, "user", "hi", token_ids=[1])
        store.close()
    except BaseException as e:
        errors.put(f"{type(e).__name__}: {e}")


def test_many_processes_create_the_database_at_once(tmp_path):
    path = tmp_path / "fresh.sqlite3"
    ctx = mp.get_context("spawn")
    errors, barrier = ctx.Queue(), ctx.Barrier(4)
    procs = [ctx.Process(target=_create_and_write, args=(str(path), barrier, errors))
             for _ in range(4)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=60)
    problems = []
    while not errors.empty():
        problems.append(errors.get())
    assert problems == [] and all(p.exitcode == 0 for p in procs)
    with SessionStore(path) as store:
        assert [s.message_count for s in store.list()] == [1, 1, 1, 1]


def _append_from_forked_child(store: SessionStore, sid: str) -> None:
    store.add_message(sid, "user", "from child", token_ids=[5])


def test_store_inherited_through_fork_reconnects(tmp_path):
    store = SessionStore(tmp_path / "s.sqlite3")
    s = store.create()
    store.add_message(s.id, "user", "from parent", token_ids=[4])
    child = mp.get_context("fork").Process(target=_append_from_forked_child, args=(store, s.id))
    child.start()
    child.join(timeout=60)
    assert child.exitcode == 0
    store.add_message(s.id, "assistant", "parent again", token_ids=[6])  # parent's connection still fine
    assert [m.content for m in store.messages(s.id)] == ["from parent", "from child", "parent again"]
    assert store.context_tokens(s.id) == [4, 5, 6]
    store.close()
