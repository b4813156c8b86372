"""One request in the scheduler (engine.serving.scheduler): its caches, sampler state and text
stream from admission to checkpoint."""

from __future__ import annotations

import time

from engine.generation.constraints import additive_mask
from engine.generation.sampling import SamplingParams, make_sampler, top_logprobs
from engine.generation.textstream import ReasoningSplitter, StopMatcher
from engine.serving.events import (
    Done,
    ReasoningDelta,
    TextDelta,
    Timings,
    TokenLogprobs,
    Usage,
)

import mlx.core as mx


class Row:
    """One request from admission to checkpoint: its caches, sampler state and text stream."""

    def __init__(self, req, handle, seq: int, params: SamplingParams, tokenizer):
        self.req, self.handle, self.seq = req, handle, seq
        self.priority = int(getattr(req, "priority", 1))
        self.params = params
        self.prompt: list[int] = list(req.prompt_ids)
        self.t_submit = getattr(handle, "t_submit", time.perf_counter())
        self.t_admit = self.t_first = 0.0
        self.cache: list | None = None
        self.cached = 0
        self.source = "none"
        self.restore_ms = 0.0
        self.filled = 0  # prompt tokens in the cache
        # requests of this very prompt admitted while it prefills: they get a copy of its cache
        # once the prompt is in it, instead of restoring and prefilling their own (scheduler)
        self.twins: list[Row] = []
        # ids generated so far: the handle's list, so a streaming reply can be saved before Done
        self.generated: list[int] = handle.token_ids
        self.spec = None  # serial lane: the request's speculative decoder, if its profile has one
        self.spec_shown = 0  # verification rounds already reported
        self.pending: int | None = None  # batched lane: sampled, not yet fed
        # the prompt's last logits, from the prefill chunk that ended it: the first token is
        # drawn from them (kept while the row runs: a live fork of its prompt draws from them too)
        self.first_logits: mx.array | None = None
        self.steps = None  # serial lane: the generate_step generator
        self.leaving = False
        self.final_fed = False  # leaving, and a launched step already feeds its last token
        self.cancel_seen = False  # handle.cancelled as the current batched step read it
        self.queued_said = False
        self.batched = False
        self.sizes = [0, 0, 0, 10**9]  # steps, sum, max, min of rows sharing each step
        # sampler state (mirrors generate_step so lanes agree token for token)
        self.sample = make_sampler(params)
        self.key: mx.array | None = None
        self.recent: mx.array | None = None
        self.skipped = 0  # tokens picked without advancing key and window (see catch_up)
        # text
        self.eos = (set() if params.ignore_eos else tokenizer.eos_ids) | set(params.stop_token_ids)
        self.detok = tokenizer.new_detokenizer()
        self.stops = StopMatcher(params.stop)
        markers = tokenizer.reasoning_markers or ("<think>", "</think>")
        self.splitter = (
            ReasoningSplitter(*markers, in_reasoning=req.start_in_reasoning)
            if req.split_reasoning
            else None
        )
        self.text: list[str] = []
        self.reasoning: list[str] = []
        self.logprobs: list[TokenLogprobs] = []

    @property
    def constraint(self):
        return self.req.constraint

    @property
    def rank(self) -> int:
        """Prefill urgency: the highest priority among this row and its twins."""
        return max([self.priority] + [t.priority for t in self.twins])

    def take_over(self, leader: Row) -> None:
        """Become the prefilling row in place of ``leader`` (cancelled): its cache, the tokens
        it restored and prefilled, and its other twins."""
        self.cache, self.cached, self.source = leader.cache, leader.cached, leader.source
        self.restore_ms, self.filled = leader.restore_ms, leader.filled
        self.twins, leader.twins, leader.cache = leader.twins, [], None

    def kv_need(self) -> int:
        """Tokens this request may hold in KV: its prompt plus every token it may generate."""
        return len(self.prompt) + self.params.max_tokens

    @property
    def decoded(self) -> bool:
        """Whether a decode step ran for this row (its first token comes from the prefill)."""
        return self.sizes[0] > 0

    def shared(self, rows: int) -> None:
        s = self.sizes
        s[0] += 1
        s[1] += rows
        s[2] = max(s[2], rows)
        s[3] = min(s[3], rows)

    # -- sampler state ---------------------------------------------------------------------
    def start_sampler(self) -> None:
        """PRNG key and repetition window as generate_step sets them up for this prompt."""
        window = max(1, self.params.repetition_context)
        past = self.prompt[-window:]
        self.recent = mx.array([-1] * (window - len(past)) + past, dtype=mx.int32)
        self.key = mx.random.key(self.params.seed)

    def resume_sampler(self) -> None:
        """State after ``len(generated)`` tokens: one key split per token, window of the context."""
        window = max(1, self.params.repetition_context)
        past = (self.prompt + self.generated)[-window:]
        self.recent = mx.array([-1] * (window - len(past)) + past, dtype=mx.int32)
        key = mx.random.key(self.params.seed)
        for _ in range(len(self.generated)):
            key = mx.random.split(key)[0]
        self.key = key

    def draw(self, logits: mx.array) -> tuple[mx.array, mx.array]:
        """Sample the next token from (1, vocab) logits under this row's mask."""
        allowed = self.constraint.allowed() if self.constraint is not None else None
        mask = None if allowed is None else additive_mask(allowed, logits.shape[-1])
        self.key, sub = mx.random.split(self.key)
        y, logprobs = self.sample(logits, sub, self.recent, mask)
        self.recent = mx.concatenate([self.recent[1:], y.astype(mx.int32)])
        return y, logprobs

    @property
    def plain_greedy(self) -> bool:
        """Greedy with no penalty, constraint or logprobs: the token is the logits' argmax."""
        p = self.params
        return (
            p.greedy and p.repetition_penalty == 1.0 and self.constraint is None and not p.logprobs
        )

    def catch_up(self) -> None:
        """Key and window as ``draw`` would have left them: a plain greedy row's tokens are
        picked outside it (one argmax for the batch) and nothing reads its key or window until
        it returns to the serial lane, so they are advanced only then."""
        if self.skipped:
            self.resume_sampler()
            self.skipped = 0

    # -- text stream -----------------------------------------------------------------------
    def accept(self, tok: int, logprobs: mx.array | None) -> str | None:
        """Record and stream one token; the finish reason when it ends the request."""
        if self.t_first == 0.0:
            self.t_first = time.perf_counter()
        self.generated.append(tok)
        if self.params.logprobs and logprobs is not None:
            lp = logprobs.reshape(-1)
            self.logprobs.append(
                TokenLogprobs(tok, float(lp[tok].item()), top_logprobs(lp, self.params.logprobs))
            )
        if tok in self.eos:
            return "stop"
        piece = self.stops.feed(self.detok.add(tok))
        if piece:
            self._emit_text(piece)
        if self.stops.stopped is not None:
            return "stop"
        if len(self.generated) >= self.params.max_tokens:
            return "length"
        return None

    def _emit_text(self, piece: str) -> None:
        for kind, chunk in self.splitter.feed(piece) if self.splitter else [("content", piece)]:
            self._emit_piece(kind, chunk)

    def _emit_piece(self, kind: str, chunk: str) -> None:
        if not chunk:
            return
        if kind == "reasoning":
            self.reasoning.append(chunk)
            self.handle.emit(ReasoningDelta(chunk))
        else:
            self.text.append(chunk)
            self.handle.emit(TextDelta(chunk))

    def done(self, finish: str, load_ms: float) -> None:
        """Flush the text stream and send ``Done``."""
        if finish != "stop" or self.stops.stopped is None:
            tail = self.stops.feed(self.detok.flush()) + self.stops.flush()
            if tail:
                self._emit_text(tail)
        if self.splitter:
            for kind, chunk in self.splitter.flush():
                self._emit_piece(kind, chunk)
        t_end = time.perf_counter()
        t_first = self.t_first or t_end
        t_admit = self.t_admit or self.t_submit
        prefill_s = max(t_first - t_admit, 1e-9)
        decode_s = max(t_end - t_first, 1e-9)
        n = len(self.generated)
        steps, total, biggest, smallest = self.sizes
        self.handle.emit(
            Done(
                text="".join(self.text),
                reasoning="".join(self.reasoning),
                finish_reason=finish,
                usage=Usage(len(self.prompt), self.cached, n),
                timings=Timings(
                    load_ms=round(load_ms, 1),
                    restore_ms=round(self.restore_ms, 2),
                    ttft_ms=round((t_first - self.t_submit) * 1000, 1),
                    prefill_tps=round((len(self.prompt) - self.cached) / prefill_s, 1),
                    decode_tps=round(max(n - 1, 0) / decode_s, 1),
                    total_ms=round((t_end - self.t_submit) * 1000, 1),
                ),
                peak_memory_bytes=int(mx.get_peak_memory()),
                prompt_token_ids=list(self.prompt),
                completion_token_ids=list(self.generated),
                logprobs=self.logprobs,
                cache_source=self.source,
                speculation=self.spec.stats.as_dict() if self.spec is not None else None,
                lane="batched" if self.batched else "serial",
                batch_min=smallest if steps else 1,
                batch_mean=round(total / steps, 2) if steps else 1.0,
                batch_max=biggest if steps else 1,
            )
        )
        self.first_logits = None  # answered: no live fork copies this row any more
