"""Continuous batching on the engine thread: concurrent requests decode together.

Each ``tick`` of the engine loop does, in order:

1. admission: waiting requests by priority, while the batch is under ``batch.cap`` and the
   KV the admitted rows may grow to stays within ``batch.kv_budget`` (else they wait and get
   a ``Queued`` event);
2. one prefill chunk of the most urgent admitted request, so running rows keep streaming;
3. one decode step: the *serial lane* (a request alone, driven through ``generate_step`` so
   speculation and the compiled step apply) or one *batched* step (every row advances one
   token; see engine.generation.batch).

Design notes, measurements and history: docs/engine-notes.md (scheduler.py).
"""

from __future__ import annotations

import functools
import heapq
import itertools
import logging
import os
import time
from dataclasses import asdict, dataclass
from typing import NamedTuple

from engine.generation.batch import BatchKV, batchable, batched_logits, prefill_together
from engine.generation.generate import PREFILL_CHUNK, generate_step, prefill
from engine.generation.kv_cache import StaticKVCache
from engine.generation.sampling import SamplingParams, greedy_tokens
from engine.serving.events import (
    Done,
    PrefillProgress,
    Queued,
    SpeculationProgress,
    Timings,
    Usage,
)
from engine.serving.row import Row

import mlx.core as mx

log = logging.getLogger(__name__)
PREFILL_TOKENS = 4 * PREFILL_CHUNK  # at most this many tokens in one joint prefill forward


@dataclass
class SchedulerStats:
    """Where the engine thread's time went since the engine started (seconds, counts): read
    by benchmarks through ``Engine.scheduler_stats`` to split an arm's wall time."""

    prefill_s: float = 0.0  # prompt forwards (chunks, joint chunks)
    prefill_forwards: int = 0
    prefill_tokens: int = 0
    serial_s: float = 0.0  # serial-lane steps (one token each, or a speculative round's)
    serial_steps: int = 0
    batched_s: float = 0.0  # batched steps: forward, sampling, streaming, checkpoint hand-off
    batched_steps: int = 0
    batched_rows: int = 0  # rows fed, summed over batched steps (tokens drawn + riders)
    batched_overlapped: int = 0  # batched steps streamed while the next one computed
    held_ticks: int = 0  # ticks whose decode step was held for a burst's prefill

    def as_dict(self) -> dict:
        return asdict(self)

    def lap(self, lane: str, seconds: float, count: bool = True) -> None:
        """One ``lane`` ("serial" or "batched") step that took ``seconds`` (``count``: one
        more step; the batched lane counts the forwards it launches instead)."""
        setattr(self, f"{lane}_s", getattr(self, f"{lane}_s") + seconds)
        if count:
            setattr(self, f"{lane}_steps", getattr(self, f"{lane}_steps") + 1)


def _timed(lane: str, count: bool = True):
    """Decorate a scheduler's step method: its time (and count) go to ``stats`` for ``lane``."""

    def wrap(step):
        @functools.wraps(step)
        def timed(self, *args, **kwargs) -> None:
            t = time.perf_counter()
            try:
                step(self, *args, **kwargs)
            finally:
                self.stats.lap(lane, time.perf_counter() - t, count)

        return timed

    return wrap


class Scheduler:
    """Admission, chunked prefill and batched decode for one loaded ``Runner``."""

    def __init__(self, runner, cap: int | None = None, kv_budget: int | None = None):
        self.runner = runner
        self.model = runner.model
        self.prefill_model = runner.bundle.prefill_model or runner.model
        profile = runner.profile
        self.cap = cap or profile.batch.cap
        self.kv_budget = kv_budget or profile.batch.kv_budget
        probe = runner.cache.new_cache()
        # Quantized live caches (GPU backends) decode in the serial lane, one at a time.
        self.can_batch = batchable(probe)
        if not self.can_batch:
            self.cap = 1
        # Joint prefill of newcomers: full-attention float caches (no sliding-window rings).
        self.prefill_rows = self.can_batch and all(type(c) is StaticKVCache for c in probe)
        self._token_bytes: int | None = None
        self._seq = itertools.count()
        self.waiting: list[tuple[int, int, Row]] = []  # heap of (-priority, seq, row)
        self.prefilling: list[Row] = []
        self.solo: Row | None = None  # the serial lane
        self.rows: list[Row] = []  # batched lane, in BatchKV row order
        self.kv = BatchKV()
        self.inflight: tuple | None = None  # launched batched step not yet streamed
        self.stats = SchedulerStats()

    # -- queue -------------------------------------------------------------------------------
    @property
    def busy(self) -> bool:
        return bool(self.waiting or self.prefilling or self.solo or self.rows)

    @property
    def active(self) -> int:
        """Requests in the engine that have not been answered yet."""
        live = sum(1 for r in self.rows if not r.leaving)
        prefilling = len(self.prefilling) + len(self._twins())
        return len(self.waiting) + prefilling + (self.solo is not None) + live

    def _twins(self) -> list[Row]:
        """Admitted requests waiting for a prefilling row of the same prompt (its twins)."""
        return [t for r in self.prefilling for t in r.twins]

    def add(self, req, handle) -> None:
        limit = self.runner.profile.context.max_context
        if len(req.prompt_ids) >= limit:
            handle.emit(
                _error_done(
                    f"prompt is {len(req.prompt_ids)} tokens; the context limit is {limit}",
                    "context",
                )
            )
            return
        params: SamplingParams = req.params
        # A concrete seed lets a row that migrates from the serial lane continue its key schedule.
        seed = params.seed if params.seed is not None else int.from_bytes(os.urandom(4), "little")
        params = params.with_overrides(
            max_tokens=min(params.max_tokens, limit - len(req.prompt_ids)), seed=seed
        )
        row = Row(req, handle, next(self._seq), params, self.runner.tokenizer)
        heapq.heappush(self.waiting, (-row.priority, row.seq, row))

    def settle(self) -> None:
        """Checkpoint rows that already answered (before a ``call`` that may read checkpoints)."""
        if not any(r.leaving for r in self.rows):
            return  # nothing to checkpoint: a step in flight stays in flight
        self._flush()
        while any(r.leaving for r in self.rows):
            self._batched_step(pipelined=False)

    def abort(self, message: str) -> None:
        """Answer every request still in the engine (engine shutting down)."""
        rows = (
            [r for _, _, r in self.waiting]
            + self.prefilling
            + self._twins()
            + self.rows
            + ([self.solo] if self.solo else [])
        )
        for r in rows:
            if r.handle._done is None:
                r.handle.emit(_error_done(message))
        self.waiting, self.prefilling, self.rows, self.solo = [], [], [], None
        self.kv = BatchKV()
        self.inflight = None

    # -- one tick ------------------------------------------------------------------------------
    def tick(self) -> None:
        self._drop_cancelled()
        decoded = False
        if any(r.leaving for r in self.rows):
            # Checkpoint answered rows first: a follow-up turn being admitted may extend them.
            self._decode()
            decoded = True
        # Newcomers go before the decode step, so a request's first token waits for at most
        # one step of the running rows (and one prefill chunk of a more urgent request).
        self._admit()
        if self.prefilling:
            t = time.perf_counter()
            self._prefill_chunk()
            self.stats.prefill_s += time.perf_counter() - t
        if decoded:
            return
        if self._hold():
            self.stats.held_ticks += 1
        else:
            self._decode()

    def _hold(self) -> bool:
        """Hold the decode step for a burst: the batched rows are newcomers that have not
        decoded yet (none answered, leaving or cancelled), more newcomers are prefilling with
        at most PREFILL_TOKENS prompt tokens left, and no held row outranks them. The burst
        then starts decoding in full steps instead of ramping up one row per prefill chunk;
        the tokens do not change (each row's are its solo run's), only when steps run."""
        if self.solo is not None or not self.rows or not self.prefilling:
            return False
        if any(r.decoded or r.leaving or r.handle.cancelled for r in self.rows):
            return False
        if max(r.priority for r in self.rows) > min(r.priority for r in self.prefilling + self._twins()):
            return False
        return sum(_left(r) for r in self.prefilling) <= PREFILL_TOKENS

    def _decode(self) -> None:
        if self._alone():
            self._flush()  # the row's pending token and sampler state: its last streamed token's
            if self._alone():
                self._return_solo()
        if self.solo is not None:
            if self.rows:
                self._migrate_solo()
                self._batched_step()
            else:
                self._serial_step()
        elif self.rows:
            self._batched_step()

    def _drop_cancelled(self) -> None:
        gone = [item[2] for item in self.waiting if item[2].handle.cancelled]
        if gone:
            self.waiting = [item for item in self.waiting if not item[2].handle.cancelled]
            heapq.heapify(self.waiting)
        for r in gone:
            r.done("cancelled", self.runner.load_ms)
        for r in self.prefilling:
            for t in [t for t in r.twins if t.handle.cancelled]:
                r.twins.remove(t)
                t.done("cancelled", self.runner.load_ms)
        for r in [r for r in self.prefilling if r.handle.cancelled]:
            r.done("cancelled", self.runner.load_ms)
            if r.twins:  # its first twin goes on with its cache and answers the others
                heir = r.twins.pop(0)
                heir.take_over(r)
                self.prefilling[self.prefilling.index(r)] = heir
                continue
            self.prefilling.remove(r)
            self.runner.cache.release(r.prompt[: r.filled], r.cache, r.req.session_id)

    # -- admission -------------------------------------------------------------------------------
    def _admit(self) -> None:
        while self.waiting:
            row = self.waiting[0][2]
            running = self.prefilling + self._twins() + self.rows + ([self.solo] if self.solo else [])
            live = [r for r in running if not r.leaving]
            reason = None
            if len(live) >= self.cap:
                reason = f"batch full ({self.cap} requests decoding)"
            elif running and self._kv_bytes(running) + self._kv_bytes([row]) > self.kv_budget:
                reason = "waiting for KV memory"
            if reason is not None:
                for i, (_, _, r) in enumerate(sorted(self.waiting)):
                    if not r.queued_said:
                        r.queued_said = True
                        r.handle.emit(Queued(reason, len(live) + i))
                return
            heapq.heappop(self.waiting)
            row.t_admit = time.perf_counter()
            if not running:
                mx.reset_peak_memory()  # peak memory of this busy period
            # A request of a prompt being prefilled (candidate drafts: one prompt, several
            # seeds) waits for that prefill and decodes from a copy of its cache: the prompt's
            # KV does not depend on sampling, constraint or session, only on its tokens.
            leader = next((r for r in self.prefilling if r.prompt == row.prompt), None)
            if leader is not None:
                leader.twins.append(row)
                continue
            if self._fork_live(row):
                continue
            reuse = self.runner.cache.acquire(row.prompt, row.req.session_id)
            row.cache, row.cached, row.source, row.restore_ms = (
                reuse.cache,
                reuse.cached_tokens,
                reuse.source,
                reuse.restore_ms,
            )
            row.filled = row.cached
            self.prefilling.append(row)

    def _kv_bytes(self, rows: list[Row]) -> int:
        if self._token_bytes is None:
            self._token_bytes = _kv_bytes_per_token(
                self.prefill_model, self.runner.cache.new_cache()
            )
        limit = self.runner.profile.context.max_context
        return sum(min(r.kv_need(), limit) for r in rows) * self._token_bytes

    # -- prefill -----------------------------------------------------------------------------------
    def _prefill_chunk(self) -> None:
        """One prefill chunk of the most urgent newcomer, run in one forward with the same
        chunk of every other newcomer at the same position with as much prompt left (rows
        whose solo prefill would run that very chunk shape); rows whose prompt is then in the
        cache start decoding, their first token drawn from the chunk's last logits (as
        ``generate_step`` draws it after its own prefill: no separate pass for the last token)."""
        urgent = sorted(self.prefilling, key=lambda r: (-r.rank, r.seq))
        row = urgent[0]
        group = [row]
        n = min(PREFILL_CHUNK, _left(row))
        if n > 0:
            if self.prefill_rows:
                # Only rows whose next chunk is the one their solo prefill runs (same start,
                # same length): attention and matmul results depend on the pass shape in the
                # last bits (summation blocks over keys, padding shifts), so another split
                # could flip a near-tie token against the row's solo run.
                fits = [
                    r
                    for r in urgent[1:]
                    if r.filled == row.filled and min(PREFILL_CHUNK, _left(r)) == n
                ]
                group += fits[: max(0, PREFILL_TOKENS // n - 1)]
            ends = [_left(r) == n for r in group]  # chunks that end their prompt give logits
            if len(group) > 1:
                caches, logits = prefill_together(
                    self.prefill_model,
                    [r.cache for r in group],
                    [r.prompt[r.filled : r.filled + n] for r in group],
                    logits=any(ends),
                )
                for i, (r, cache) in enumerate(zip(group, caches, strict=True)):
                    r.cache = cache
                    if ends[i]:
                        r.first_logits = logits[i : i + 1]
            else:  # a prompt body's logits are never read
                out = prefill(
                    self.prefill_model,
                    row.cache,
                    row.prompt[row.filled : row.filled + n],
                    logits=ends[0],
                )
                if ends[0]:
                    row.first_logits = out
            self.stats.prefill_forwards += 1
            self.stats.prefill_tokens += n * len(group)
            for r in group:
                r.filled += n
                total = len(r.prompt) - r.cached
                if total > 512:
                    for x in (r, *r.twins):
                        x.handle.emit(PrefillProgress(r.filled - r.cached, total))
        ready = [r for r in group if _left(r) == 0]
        for r in ready:
            self.prefilling.remove(r)
        ready = [x for r in ready for x in (r, *self._fork(r))]
        for r in ready:
            alone = len(ready) == 1 and not self.prefilling and not self.waiting
            if self.solo is None and not self.rows and (alone or not self.can_batch):
                self._start_solo(r)
            else:
                self._join_batch(r)

    def _fork_live(self, row: Row) -> bool:
        """Admit ``row`` with a copy of the prompt KV of a decoding row of the same prompt (a
        draft that arrived after its twin's prefill ended): the prompt's positions hold exactly
        what its prefill computed, and its first token is drawn from the same prompt logits.
        Full-attention caches only (a sliding window may have dropped them); the row then
        starts decoding at the next chunk."""
        if not self.prefill_rows or len(row.prompt) < 2:
            return False
        same = [r for r in ([self.solo] if self.solo else []) + self.rows if r.prompt == row.prompt]
        same = [r for r in same if not r.leaving and not r.handle.cancelled]
        if not same:
            return False
        src = same[0]
        cache = src.cache if src is self.solo else self.kv.take(self.rows.index(src))
        got = self.runner.cache.fork(cache, row.prompt, row.req.session_id, use=len(row.prompt))
        row.cache, row.cached, row.source = got.cache, got.cached_tokens, got.source
        row.first_logits = src.first_logits
        row.restore_ms, row.filled = got.restore_ms, got.cached_tokens
        self.prefilling.append(row)
        return True

    def _fork(self, row: Row) -> list[Row]:
        """``row``'s twins, each given a copy of its cache (the whole prompt) and its prompt
        logits: they decode as if they had restored and prefilled it themselves, which would
        have computed the same KV and logits (same restored prefix, same chunks). Their Done
        says so: cache_source "twin", every prefilled token counted as cached."""
        twins, row.twins = row.twins, []
        for t in twins:
            got = self.runner.cache.fork(row.cache, t.prompt, t.req.session_id)
            t.cache, t.cached, t.source = got.cache, got.cached_tokens, got.source
            t.restore_ms, t.filled = got.restore_ms, row.filled
            t.first_logits = row.first_logits
        return twins

    def _start_solo(self, row: Row) -> None:
        # Speculation runs in the serial lane only; a request may opt out (extra["speculation"]
        # = False, e.g. a benchmark's baseline arm). Its decoder stays with the row if it later
        # joins a batch, so Done still reports the rounds it ran.
        if row.spec is None and row.req.extra.get("speculation", True):
            row.spec = self.runner.speculator.new()
        row.steps = generate_step(
            self.model,
            [],
            row.cache,
            row.params,
            history=row.prompt,
            should_stop=lambda: row.handle.cancelled,
            constraint=row.constraint,
            speculation=row.spec,
            logits=row.first_logits,
        )
        self.solo = row

    def _join_batch(self, row: Row) -> None:
        """Add a prefilled row to the batch: its first reply token, drawn from its prompt
        logits as the serial lane draws it, streams now; the next batched step feeds it."""
        row.start_sampler()
        first = row.draw(row.first_logits)
        self.kv.add(row.cache)
        row.cache = None
        self.rows.append(row)
        self._took(row, *first)

    def _alone(self) -> bool:
        """One batched row left, nothing joining or leaving: it can decode in the serial lane."""
        return (
            self.solo is None
            and len(self.rows) == 1
            and not self.rows[0].leaving
            and not self.prefilling
            and not self.waiting
            and self.can_batch
        )

    def _return_solo(self) -> None:
        """Move the last batched row to the serial lane at a token boundary: its cache holds the
        context minus the pending token, which ``generate_step`` feeds first, continuing the
        row's key schedule, window and constraint; speculation applies again."""
        row = self.rows[0]
        row.cache = self.kv.take(0)
        row.catch_up()
        self.kv.keep([])
        self.rows = []
        if row.spec is None and row.req.extra.get("speculation", True):
            row.spec = self.runner.speculator.new()
        params = row.params.with_overrides(max_tokens=row.params.max_tokens - len(row.generated))
        row.steps = generate_step(
            self.model,
            [row.pending],
            row.cache,
            params,
            history=row.prompt + row.generated,
            should_stop=lambda: row.handle.cancelled,
            constraint=row.constraint,
            speculation=row.spec,
            key=row.key,
        )
        row.pending = None
        self.solo = row

    # -- decode lanes --------------------------------------------------------------------------------
    @_timed("serial")
    def _serial_step(self) -> None:
        row = self.solo
        finish = None
        if row.handle.cancelled:
            finish = "cancelled"
        else:
            try:
                out = next(row.steps)
            except StopIteration:
                finish = "cancelled" if row.handle.cancelled else "length"
            else:
                row.shared(1)
                finish = (
                    "cancelled" if row.handle.cancelled else row.accept(out.token, out.logprobs)
                )
                if row.spec is not None and row.spec.stats.rounds >= row.spec_shown + 4:
                    row.spec_shown = row.spec.stats.rounds
                    row.handle.emit(
                        SpeculationProgress(row.spec.stats.drafted, row.spec.stats.accepted)
                    )
        if finish is None:
            return
        row.steps.close()
        mx.synchronize()  # the pipelined step queued after the last token must finish first
        self.solo = None
        row.done(finish, self.runner.load_ms)
        # The cache covers prompt + reply (the last token was fed); checkpoint it.
        self.runner.cache.release(row.prompt + row.generated, row.cache, row.req.session_id)
        row.cache = None

    def _migrate_solo(self) -> None:
        """Move the serial request into the batch at a token boundary."""
        row, self.solo = self.solo, None
        row.steps.close()
        if not row.generated:  # nothing yielded yet: the prompt is in the cache, not its reply
            self._join_batch(row)
            return
        # The generator has fed its last yielded token (and maybe more: a pipelined or drafted
        # step we drop). The row joins with prompt + reply minus that token, so the batch
        # feeds it and draws the same next token under the same key schedule.
        upto = len(row.prompt) + len(row.generated) - 1
        if row.cache[0].offset < upto:  # a lane that committed tokens without feeding them
            context = row.prompt + row.generated
            prefill(self.prefill_model, row.cache, context[row.cache[0].offset : upto])
        row.pending = row.generated[-1]
        row.resume_sampler()
        self.kv.add(row.cache, upto)
        row.cache = None
        self.rows.append(row)

    @_timed("batched", count=False)  # a pipelined call may only stream the last step
    def _batched_step(self, pipelined: bool = True) -> None:
        """One batched step. Pipelined: launch step n+1 (its inputs are step n's lazily drawn
        tokens), then stream step n's tokens while n+1 computes, as ``generate_step`` overlaps
        its steps. Synchronous (a constrained row needs its token before its next mask; a row
        was cancelled; ``pipelined=False``): the step in flight is streamed first, then a step
        is launched and streamed at once."""
        for r in self.rows:
            r.cancel_seen = r.handle.cancelled  # one reading per step: the handle may flip meanwhile
        if not pipelined or any(r.constraint is not None or r.cancel_seen for r in self.rows):
            self._flush()
            step = self._launch()
            if step is not None:
                self._finish(*step)
            return
        prev, self.inflight = self.inflight, self._launch()
        if prev is not None:
            self.stats.batched_overlapped += self.inflight is not None
            self._finish(*prev)

    def _flush(self) -> None:
        """Stream the step in flight, if any: every row's sampler state is then its last
        streamed token's (as a synchronous step leaves it)."""
        if self.inflight is not None:
            step, self.inflight = self.inflight, None
            self._finish(*step)

    def _launch(self) -> tuple[list, int, mx.array | None] | None:
        """Queue one step: every batched row feeds its pending token, live rows draw their
        next one (lazily, evaluated in the background); rows whose reply is complete once it
        is fed are checkpointed and let go. Returns (rows' draws, live rows, the plain greedy
        rows' argmax) for ``_finish``."""
        # Answered rows whose last token an earlier step already fed (they were answered
        # while that step computed): checkpoint them and let go before this step.
        gone = [(r, self.kv.take(i)) for i, r in enumerate(self.rows) if r.leaving and r.final_fed]
        if gone:
            self._keep([i for i, r in enumerate(self.rows) if not (r.leaving and r.final_fed)])
        rows = self.rows
        step = None
        if rows:
            self.stats.batched_steps += 1
            self.stats.batched_rows += len(rows)
            live = [r for r in rows if not r.leaving and not r.cancel_seen]
            logits = batched_logits(self.model, _inputs([r.pending for r in rows]), self.kv)
            drawn = []
            plain_rows = [i for i, r in enumerate(rows) if r in live and r.plain_greedy]
            plain = {i: j for j, i in enumerate(plain_rows)}  # batch row -> its argmax entry
            picks = None
            if plain:  # one argmax for every row whose sampler is a bare argmax
                of = logits if len(plain) == len(rows) else logits[mx.array(plain_rows)]
                picks = greedy_tokens(of)
            drawn_arrays = [picks] if plain else []
            for i, r in enumerate(rows):
                if r in live:
                    if r.plain_greedy:
                        r.skipped += 1
                        drawn.append((r, _Pick(picks, plain[i]), None))
                    else:
                        y, logprobs = r.draw(logits[i : i + 1])
                        drawn.append((r, y, logprobs))
                        # Keys and windows too, so their lazy graphs do not grow step after step.
                        drawn_arrays += [y, r.key, r.recent]
            for r, y, _ in drawn:
                r.pending = y  # the next step feeds it, streamed or not
            mx.async_eval(drawn_arrays)
            step = (drawn, len(live), picks)
            # Rows answered before this step (their last token is fed by it) and cancelled
            # rows: checkpoint them and let go.
            keep = []
            for i, r in enumerate(rows):
                if r.leaving:
                    gone.append((r, self.kv.take(i)))
                elif r.cancel_seen:
                    r.leaving = True  # not counted as active once its caller sees Done
                    r.done("cancelled", self.runner.load_ms)
                    gone.append((r, self.kv.take(i)))
                else:
                    keep.append(i)
            self._keep(keep)
        for r, cache in gone:
            self.runner.cache.release(r.prompt + r.generated, cache, r.req.session_id)
        return step

    def _keep(self, keep: list[int]) -> None:
        if len(keep) != len(self.rows):
            self.kv.keep(keep)
            self.rows = [self.rows[i] for i in keep]

    def _finish(self, drawn: list, live: int, picks: mx.array | None) -> None:
        """Stream a launched step's tokens. A row answered by an earlier token drew one more
        in a step built before that token was read: its draw is dropped (the serial lane drops
        its pipelined step the same way)."""
        picked = picks.tolist() if picks is not None else None  # one read for the argmax rows
        for r, y, logprobs in drawn:
            if r.leaving:
                continue
            r.shared(live)
            self._took(r, y, logprobs, picked[y.j] if isinstance(y, _Pick) else None)

    def _took(self, row: Row, y, logprobs: mx.array | None, tok: int | None = None) -> None:
        """A batched row drew ``y`` (token ``tok``, read from ``y`` if not given): advance its
        constraint, make it the token the next step feeds (unless a launched step already
        feeds it), stream it (and answer the request if it ends it)."""
        if tok is None:
            tok = int(y.item())
        if row.constraint is not None:
            row.constraint.advance(tok)
        fed = row.pending is not None and row.pending is not y  # a later step took it as input
        if not fed:
            row.pending = tok
        row.batched = True
        finish = row.accept(tok, logprobs)
        if finish is not None:
            row.leaving = True  # answered now; checkpointed once a step has fed it
            row.final_fed = fed
            row.done(finish, self.runner.load_ms)


class _Pick(NamedTuple):
    """Row ``j``'s token in one argmax over several plain greedy rows' logits (``picks``)."""

    picks: mx.array
    j: int


def _inputs(pending: list) -> list | mx.array:
    """A step's input tokens from the rows' pending ones (ints, drawn arrays, ``_Pick``s):
    when every row's is its own entry of one argmax, in order, that argmax itself."""
    first = pending[0]
    if (
        isinstance(first, _Pick)
        and first.picks.shape[0] == len(pending)
        and all(isinstance(p, _Pick) and p.picks is first.picks and p.j == i for i, p in enumerate(pending))
    ):
        return first.picks
    return [p.picks[p.j : p.j + 1] if isinstance(p, _Pick) else p for p in pending]


def _left(row: Row) -> int:
    """Prompt tokens still to prefill (the last chunk's logits give the first reply token)."""
    return len(row.prompt) - row.filled


def _kv_bytes_per_token(model, cache: list) -> int:
    """Live KV bytes one token takes in ``model``'s caches (measured on a one-token forward)."""
    prefill(model, cache, [0])
    total = 0
    for c in cache:
        for a in (c.keys, c.values):
            if isinstance(a, mx.array):
                total += a.nbytes // max(1, a.shape[2])
    return max(total, 1)


def _error_done(message: str, reason: str = "error") -> Done:
    return Done("", "", reason, Usage(), Timings(), error=message)
