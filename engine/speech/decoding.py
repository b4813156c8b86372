"""Decode one 30-s window: greedy/sampled or beam search, with Whisper's logit rules.

Rules applied to every step's logits, in Whisper's order:
- suppress blank: at the first sampled position, forbid " " and end-of-text;
- suppress tokens: the model's list (non-speech symbols and task/special tokens);
- timestamps: ``<|notimestamps|>`` is never sampled; timestamps come in pairs (after a
  lone timestamp only another timestamp or EOT, after a pair only text); they never go
  back and a segment cannot be empty; the first token is a timestamp no later than
  ``max_initial_timestamp``; and when the summed probability of all timestamps beats the
  best text token, a timestamp is forced.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass, field

from engine.speech.loader import WhisperBundle
from engine.speech.tokenizer import TIME_PRECISION

import mlx.core as mx
import numpy as np


class Aborted(Exception):
    """Raised inside decoding when the caller's ``should_stop()`` turns true.

    ``tokens``: when raised during greedy decoding, the tokens decoded so far.
    """

    tokens: list[int] | None = None


@dataclass(frozen=True)
class DecodeOptions:
    temperature: float = 0.0
    beam_size: int | None = None  # beam search (temperature 0 only)
    max_initial_timestamp: float = 1.0
    sample_len: int | None = None  # default: half the text context (224)
    seed: int = 0  # sampling at temperature > 0 is reproducible


@dataclass
class DecodeResult:
    tokens: list[int]  # sampled tokens, timestamps included, EOT excluded
    text: str
    avg_logprob: float
    no_speech_prob: float
    temperature: float
    compression_ratio: float
    timings: dict = field(default_factory=dict)


def compression_ratio(text: str) -> float:
    """How well the text compresses: repetitive hallucinations compress far better."""
    raw = text.encode("utf-8")
    return len(raw) / len(zlib.compress(raw)) if raw else 0.0


class LogitRules:
    """Whisper's per-step logit filters for one window (see module docstring)."""

    def __init__(self, bundle: WhisperBundle, sample_begin: int, max_initial_timestamp: float | None):
        self.special = bundle.tokenizer.special
        self.sample_begin = sample_begin
        self.suppress = np.array(bundle.suppress_tokens, dtype=np.int64)
        self.blank = np.array(bundle.suppress_blank, dtype=np.int64)
        self.max_initial = None if max_initial_timestamp is None else round(max_initial_timestamp / TIME_PRECISION)

    def apply(self, logits: np.ndarray, sampled: list[list[int]]) -> np.ndarray:
        """Filter ``logits`` (beams, vocab) in place; ``sampled[i]`` = tokens after the prompt."""
        s, tb = self.special, self.special.timestamp_begin
        if not sampled[0]:
            logits[:, self.blank] = -np.inf
        logits[:, self.suppress] = -np.inf
        logits[:, s.no_timestamps] = -np.inf
        for row, seq in zip(logits, sampled, strict=True):
            last_ts = len(seq) >= 1 and seq[-1] >= tb
            penult_ts = len(seq) < 2 or seq[-2] >= tb
            if last_ts:
                if penult_ts:
                    row[tb:] = -np.inf  # a pair just closed: text must follow
                else:
                    row[:s.eot] = -np.inf  # a lone timestamp: close it (or end)
            stamps = [t for t in seq if t >= tb]
            if stamps:
                # never go back in time; a new segment must not start where the last ended
                last = stamps[-1] if (last_ts and not penult_ts) else stamps[-1] + 1
                row[tb:last] = -np.inf
        if not sampled[0]:
            logits[:, :tb] = -np.inf  # the first token is a timestamp
            if self.max_initial is not None:
                logits[:, tb + self.max_initial + 1:] = -np.inf
        logprobs = _log_softmax(logits)
        for row, lp in zip(logits, logprobs, strict=True):
            if _logsumexp(lp[tb:]) > lp[:tb].max():
                row[:tb] = -np.inf
        return logits


def decode_window(bundle: WhisperBundle, cross: list, prompt: list[int], options: DecodeOptions,
                  should_stop=None, draft: list[int] | None = None) -> DecodeResult:
    """Decode one window given its cross-attention K/V and the previous-text prompt.

    ``should_stop()`` is polled before every step; when it returns true, :class:`Aborted`
    is raised (used to drop speculative work that has become stale). ``draft``: likely
    tokens for greedy decoding to verify in one pass (see :func:`_sample`).
    """
    tok, s = bundle.tokenizer, bundle.tokenizer.special
    n_ctx = bundle.model.dims.n_text_ctx
    initial = ([s.sot_prev] + prompt[-(n_ctx // 2 - 1):] if prompt else []) + tok.sot_sequence
    sample_len = min(options.sample_len or n_ctx // 2, n_ctx - len(initial))
    sot_index = initial.index(s.sot)
    rules = LogitRules(bundle, len(initial), options.max_initial_timestamp)
    decoder = bundle.model.decoder

    hidden, cache = decoder(mx.array([initial]), cross, None)
    first = decoder.logits(hidden[0, mx.array([sot_index, len(initial) - 1])])
    no_speech_prob = float(np.exp(_log_softmax(first[:1])[0, s.no_speech]))
    step_logits = first[1:]
    if should_stop is not None:
        rules = _Stoppable(rules, should_stop)
    if options.beam_size and options.temperature == 0.0:
        tokens, sum_lp = _beam_search(decoder, cross, cache, step_logits, rules, s.eot, sample_len, options.beam_size)
    else:
        tokens, sum_lp = _sample(decoder, cross, cache, step_logits, rules, s.eot, sample_len, options, draft)
    text = tok.decode(tokens).strip()
    return DecodeResult(
        tokens=tokens, text=text, avg_logprob=sum_lp / (len(tokens) + 1),
        no_speech_prob=no_speech_prob, temperature=options.temperature,
        compression_ratio=compression_ratio(text),
    )


class _Stoppable:
    """LogitRules wrapper polling ``should_stop`` once per decoding step."""

    def __init__(self, rules: LogitRules, should_stop):
        self.rules, self.should_stop = rules, should_stop

    def apply(self, logits: np.ndarray, sampled: list[list[int]]) -> np.ndarray:
        if self.should_stop():
            raise Aborted()
        return self.rules.apply(logits, sampled)


def _sample(decoder, cross, cache, logits, rules, eot, sample_len, options, draft=None) -> tuple[list[int], float]:
    """Greedy (temperature 0) or sampled decoding, one token per step.

    With a ``draft`` (greedy only: the tokens an earlier look-ahead decoded for this
    window, or for an earlier version of its audio), the decoder runs over a stretch of
    the draft in one pass (:class:`_Verifier`); each step checks the token it picks
    against the draft and, while they agree, takes the next logits from that pass
    instead of running the decoder again. At a disagreement the draft is realigned
    (:func:`_realign`: where it continues after the token just picked, e.g. past a
    changed word or timestamp) and verification resumes from there; without a match the
    step runs on its own. The chosen tokens are those of plain greedy decoding; only the
    arithmetic is batched.
    """
    rng = np.random.default_rng(options.seed)
    tokens: list[int] = []
    sum_lp = 0.0
    source = list(draft or [])[:sample_len] if options.temperature == 0.0 else []
    at = 0  # index into ``source`` of the token expected next
    span = _SPAN_MIN  # draft tokens verified per pass; doubles while they are all accepted
    verifier: _Verifier | None = None
    try:
        for _ in range(sample_len):
            logits = rules.apply(logits, [tokens])
            lp = _log_softmax(logits)[0]
            if options.temperature == 0.0:
                nxt = int(np.argmax(logits[0]))
            else:
                p = np.exp(_log_softmax(logits[0] / options.temperature))
                nxt = int(rng.choice(p.size, p=p / p.sum()))
            sum_lp += float(lp[nxt])
            if nxt == eot:
                return tokens, sum_lp
            tokens.append(nxt)
            if verifier is not None:
                if verifier.agrees(nxt):
                    at += 1
                    logits = verifier.next_logits()
                    if verifier.finished:
                        cache, verifier = verifier.cache, None
                        span = min(2 * span, _SPAN_MAX)
                    continue
                cache, verifier = verifier.agreed_cache(), None
                span = _SPAN_MIN
            proposal: list[int] = []
            if source:
                j = _realign(source, at, tokens)
                if j is not None:
                    at = j + 1
                    # positions stay within the text context (sample_len counts them)
                    proposal = source[at:at + min(span, sample_len - len(tokens))]
            if proposal:
                verifier = _Verifier(decoder, cross, cache, [nxt] + proposal)
                logits = verifier.next_logits()
            else:
                hidden, cache = decoder(mx.array([[nxt]]), cross, cache)
                logits = decoder.logits(hidden[:, -1])
    except Aborted as e:
        e.tokens = tokens  # what was decoded so far (a draft for later)
        raise
    return tokens, sum_lp


_SPAN_MIN, _SPAN_MAX = 16, 128  # draft tokens per verification pass: first, at most
_BLOCK_MIN = 32  # logits rows projected at once: a call costs about the same up to ~32 rows
_REALIGN_REACH = 24  # a lone token may realign the draft this far ahead


def _realign(source: list[int], at: int, tokens: list[int]) -> int | None:
    """Where in ``source`` the last picked token ``tokens[-1]`` is, expected at ``at``.

    Preferred: a place where the token before it matches too (nearest to ``at``, in
    either direction: the draft may have dropped or added words); else the token alone,
    a short way ahead (after a substituted word the draft continues a few tokens on). A
    wrong guess costs one cheap verification pass.
    """
    last = tokens[-1]
    prev = tokens[-2] if len(tokens) > 1 else None
    best = None
    for j, t in enumerate(source):
        if t == last and j > 0 and source[j - 1] == prev and (best is None or abs(j - at) < abs(best - at)):
            best = j
    if best is not None:
        return best
    for j in range(at, min(len(source), at + _REALIGN_REACH)):
        if source[j] == last:
            return j
    return None


def merge_draft(prefix: list[int], older: list[int] | None) -> list[int]:
    """A draft from ``prefix`` (the start of a newer, unfinished decoding) continued by
    ``older`` (an earlier complete decoding) from where ``prefix`` ends in it."""
    if not older or not prefix:
        return list(prefix or older or [])
    j = _realign(older, len(prefix), prefix)
    return list(prefix) + list(older[j + 1:] if j is not None else older[len(prefix):])


class _Verifier:
    """One decoder pass over ``seq`` = [token just picked] + draft tokens to verify.

    The hidden states of all positions come from that single pass; the output projection
    (most of a step's cost) is applied lazily in doubling blocks of rows, so a draft that
    is rejected early costs little more than a plain step.
    """

    def __init__(self, decoder, cross, cache, seq: list[int]):
        self.decoder, self.seq = decoder, seq
        self.base = cache[0][1].shape[2] if cache else 0
        hidden, self.cache = decoder(mx.array([seq]), cross, cache)
        self.hidden = hidden[0]
        self.rows: list[np.ndarray] = []  # projected blocks of logits
        self.n_rows = 0
        self.i = 0  # logits after seq[i] are returned next; seq[i + 1] is checked next

    @property
    def finished(self) -> bool:
        return self.i == len(self.seq)

    def agrees(self, token: int) -> bool:
        return token == self.seq[self.i]

    def next_logits(self) -> np.ndarray:
        i = self.i
        while i >= self.n_rows:
            size = max(_BLOCK_MIN, self.n_rows)
            block = self.decoder.logits(self.hidden[self.n_rows:self.n_rows + size])
            self.rows.append(block)
            self.n_rows += block.shape[0]
        self.i += 1
        start = 0
        for block in self.rows:
            if i < start + block.shape[0]:
                return block[i - start:i - start + 1].copy()
            start += block.shape[0]
        raise AssertionError("unreachable")

    def agreed_cache(self) -> list:
        """The self-attention cache up to the last agreed token (seq[:i])."""
        keep = self.base + self.i
        return self.decoder.cache_prefix(self.cache, keep)


def _beam_search(decoder, cross, cache, logits, rules, eot, sample_len, beam_size) -> tuple[list[int], float]:
    """Whisper's beam search (patience 1): keep ``beam_size`` live beams, stop once
    ``beam_size`` finished candidates exist, rank by mean log-probability per token."""
    beams: list[list[int]] = [[]]
    scores = [0.0]
    finished: dict[tuple[int, ...], float] = {}
    for _ in range(sample_len):
        logits = rules.apply(logits, beams)
        lp = _log_softmax(logits)
        candidates: dict[tuple[int, ...], tuple[float, int]] = {}
        for i, (seq, score) in enumerate(zip(beams, scores, strict=True)):
            for t in np.argsort(lp[i])[::-1][:beam_size + 1]:
                candidates[(*seq, int(t))] = (score + float(lp[i, t]), i)
        new_beams, new_scores, sources, step_finished = [], [], [], {}
        for seq, (score, src) in sorted(candidates.items(), key=lambda kv: -kv[1][0]):
            if seq[-1] == eot:
                step_finished[seq[:-1]] = score
            else:
                new_beams.append(list(seq))
                new_scores.append(score)
                sources.append(src)
                if len(new_beams) == beam_size:
                    break
        for seq in sorted(step_finished, key=step_finished.get, reverse=True):
            if len(finished) >= beam_size:
                break
            finished[seq] = step_finished[seq]
        if len(finished) >= beam_size or not new_beams:
            break
        beams, scores = new_beams, new_scores
        idx = mx.array(sources)
        cache = [(mx.take(k, idx, axis=0), mx.take(v, idx, axis=0)) for k, v in cache]
        hidden, cache = decoder(mx.array([[b[-1]] for b in beams]), cross, cache)
        logits = decoder.logits(hidden[:, -1])
    if len(finished) < beam_size:  # ran out of length: unfinished beams compete too
        for seq, score in sorted(zip(map(tuple, beams), scores, strict=True), key=lambda kv: -kv[1]):
            if len(finished) >= beam_size:
                break
            finished.setdefault(seq, score)
    best = max(finished, key=lambda seq: finished[seq] / max(len(seq), 1))
    return list(best), finished[best]


def _log_softmax(x: np.ndarray) -> np.ndarray:
    m = np.max(x, axis=-1, keepdims=True)
    m = np.where(np.isfinite(m), m, 0.0)
    shifted = x - m
    return shifted - np.log(np.sum(np.exp(shifted), axis=-1, keepdims=True))


def _logsumexp(x: np.ndarray) -> float:
    m = float(np.max(x))
    if not np.isfinite(m):
        return m
    return m + float(np.log(np.sum(np.exp(x - m))))
