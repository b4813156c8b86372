"""``Runner``: lives on the engine thread; loads the profile's model and serves requests.

``serve`` reads top to bottom: reuse the cached prefix, generate tokens, turn them into text
and reasoning deltas (stop strings, EOS), then report usage and timings in ``Done``.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping, Sequence
from typing import Any

from engine.errors import ModelLoadError
from engine.generation.generate import generate_step
from engine.generation.sampling import SamplingParams, top_logprobs
from engine.generation.speculation.methods import Speculator
from engine.generation.textstream import ReasoningSplitter, StopMatcher
from engine.model.catalog import resolve_source
from engine.model.chat_template import CHATML_FALLBACK, ChatTemplate
from engine.model.loader import load_bundle
from engine.model.weight_policy import blas_note, choose_weights
from engine.profiles import Profile
from engine.serving.events import (
    Done,
    PrefillProgress,
    ReasoningDelta,
    SpeculationProgress,
    TextDelta,
    Timings,
    TokenLogprobs,
    Usage,
)
from engine.serving.prompt_cache import PromptCache

import mlx.core as mx

log = logging.getLogger(__name__)

class Runner:
    def __init__(self, profile: Profile):
        self.profile = profile
        source = resolve_source(profile.model.source, profile.base_dir)
        self.weight_format = choose_weights(profile.model.weights)
        bundle = load_bundle(source, self.weight_format)
        self.bundle = bundle
        self.model = bundle.model
        self.tokenizer = bundle.tokenizer
        # the logits row can be wider than the tokenizer's vocabulary (padded embeddings)
        self.logits_width = int(bundle.loaded.config.get("vocab_size") or self.tokenizer.vocab_size)
        self.load_ms = bundle.load_ms
        self.model_name = source.name
        self.template = self._template(profile)
        self.default_params = _params_from_profile(profile)
        self.cache = PromptCache(self.model, profile)
        self.speculator = Speculator(profile, bundle)
        note = blas_note()
        if note:
            log.warning(note)

    # -- prompts ---------------------------------------------------------------------------
    def _template(self, profile: Profile) -> ChatTemplate | None:
        mode = profile.chat.template
        if mode == "none":
            return None
        if mode == "chatml":
            return ChatTemplate(CHATML_FALLBACK, origin="chatml")
        if mode != "auto":
            path = resolve_source(mode, profile.base_dir)
            specials = self.tokenizer.chat_template.special_tokens if self.tokenizer.chat_template else {}
            return ChatTemplate(path.read_text(), special_tokens=specials, origin=str(path))
        return self.tokenizer.chat_template or ChatTemplate(CHATML_FALLBACK, origin="chatml")

    def render(self, messages: Sequence[Mapping[str, Any]], tools=None, add_generation_prompt=True) -> str:
        """Prompt text of ``messages`` under the profile's chat template."""
        if self.template is None:
            raise ModelLoadError(
                f"profile {self.profile.name} runs in completion mode (chat.template: none); "
                "use a raw prompt"
            )
        return self.template.render(list(messages), tools=tools, add_generation_prompt=add_generation_prompt)

    def chat_prompt(self, messages: Sequence[Mapping[str, Any]], tools=None, add_generation_prompt=True) -> list[int]:
        msgs = list(messages)
        sys_prompt = self.profile.chat.system_prompt
        if sys_prompt and not any(m.get("role") == "system" for m in msgs):
            msgs.insert(0, {"role": "system", "content": sys_prompt})
        text = self.render(msgs, tools, add_generation_prompt)
        return self.tokenizer.encode(text, add_special_tokens=False)

    def raw_prompt(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=True)

    def close(self):
        """Finish pending checkpoint writes; returns the durability report."""
        return self.cache.close(timeout=60)

    def describe(self) -> dict[str, Any]:
        lm = self.bundle.loaded
        return {
            "profile": self.profile.name,
            "model": self.model_name,
            "model_type": lm.model_type,
            "file_type": lm.file_type,
            "weight_format": self.weight_format,
            "n_params": lm.n_params,
            "load_ms": round(self.load_ms, 1),
            "device": str(mx.default_device()),
        }

    # -- generation --------------------------------------------------------------------------
    def serve(self, req, handle) -> None:
        t0 = time.perf_counter()
        mx.reset_peak_memory()
        params: SamplingParams = req.params
        limit = self.profile.context.max_context
        if len(req.prompt_ids) >= limit:
            handle.emit(_error_done(f"prompt is {len(req.prompt_ids)} tokens; the context limit is {limit}", "context"))
            return
        params = params.with_overrides(max_tokens=min(params.max_tokens, limit - len(req.prompt_ids)))

        reuse = self.cache.acquire(req.prompt_ids, req.session_id)
        cache, cached = reuse.cache, reuse.cached_tokens
        new_tokens = req.prompt_ids[cached:]
        eos = self.tokenizer.eos_ids | set(params.stop_token_ids)
        detok = self.tokenizer.new_detokenizer()
        stops = StopMatcher(params.stop)
        markers = self.tokenizer.reasoning_markers or ("<think>", "</think>")
        splitter = ReasoningSplitter(*markers, in_reasoning=req.start_in_reasoning) if req.split_reasoning else None
        text_parts: list[str] = []
        reasoning_parts: list[str] = []
        logprobs_out: list[TokenLogprobs] = []
        generated: list[int] = handle.token_ids  # visible to the caller as it grows

        def emit_text(piece: str) -> None:
            for kind, chunk in splitter.feed(piece) if splitter else [("content", piece)]:
                _emit_piece(kind, chunk)

        def _emit_piece(kind: str, chunk: str) -> None:
            if not chunk:
                return
            if kind == "reasoning":
                reasoning_parts.append(chunk)
                handle.emit(ReasoningDelta(chunk))
            else:
                text_parts.append(chunk)
                handle.emit(TextDelta(chunk))

        def progress(done: int, total: int) -> None:
            if total > 512:
                handle.emit(PrefillProgress(done, total))

        finish = "length"
        t_first = None
        # A request may opt out (extra["speculation"] = False), e.g. a benchmark's baseline arm.
        spec = self.speculator.new() if req.extra.get("speculation", True) else None
        shown = 0
        steps = generate_step(
            self.model,
            new_tokens,
            cache,
            params,
            history=req.prompt_ids,
            progress=progress,
            should_stop=lambda: handle.cancelled,
            constraint=req.constraint,
            prefill_model=self.bundle.prefill_model,
            speculation=spec,
        )
        for out in steps:
            if t_first is None:
                t_first = time.perf_counter()
            tok = out.token
            if handle.cancelled:
                finish = "cancelled"
                break
            generated.append(tok)
            if spec is not None and spec.stats.rounds >= shown + 4:
                shown = spec.stats.rounds
                handle.emit(SpeculationProgress(spec.stats.drafted, spec.stats.accepted))
            if params.logprobs and out.logprobs is not None:
                lp = out.logprobs.reshape(-1)
                logprobs_out.append(TokenLogprobs(tok, float(lp[tok].item()), top_logprobs(lp, params.logprobs)))
            if tok in eos:
                finish = "stop"
                break
            piece = stops.feed(detok.add(tok))
            if piece:
                emit_text(piece)
            if stops.stopped is not None:
                finish = "stop"
                break
        else:
            if handle.cancelled and t_first is None:
                finish = "cancelled"
        if finish != "stop" or stops.stopped is None:
            tail = stops.feed(detok.flush())
            tail += stops.flush()
            if tail:
                emit_text(tail)
        if splitter:
            for kind, chunk in splitter.flush():
                _emit_piece(kind, chunk)
        steps.close()
        mx.synchronize()  # the pipelined step queued after the last token must finish first
        t_end = time.perf_counter()
        # The cache now covers a prefix of prompt + generated; remember it for the next turn.
        self.cache.release(req.prompt_ids + generated, cache, req.session_id)

        t_first = t_first or t_end
        prefill_s = max(t_first - t0, 1e-9)
        decode_s = max(t_end - t_first, 1e-9)
        usage = Usage(len(req.prompt_ids), cached, len(generated))
        timings = Timings(
            load_ms=round(self.load_ms, 1),
            restore_ms=round(reuse.restore_ms, 2),
            ttft_ms=round(prefill_s * 1000, 1),
            prefill_tps=round(len(new_tokens) / prefill_s, 1),
            decode_tps=round(max(len(generated) - 1, 0) / decode_s, 1),
            total_ms=round((t_end - t0) * 1000, 1),
        )
        handle.emit(
            Done(
                text="".join(text_parts),
                reasoning="".join(reasoning_parts),
                finish_reason=finish,
                usage=usage,
                timings=timings,
                peak_memory_bytes=int(mx.get_peak_memory()),
                prompt_token_ids=list(req.prompt_ids),
                completion_token_ids=generated,
                logprobs=logprobs_out,
                cache_source=reuse.source,
                speculation=spec.stats.as_dict() if spec is not None else None,
            )
        )


def _params_from_profile(profile: Profile) -> SamplingParams:
    s = profile.sampling
    return SamplingParams(
        temperature=s.temperature,
        top_p=s.top_p,
        top_k=s.top_k,
        min_p=s.min_p,
        repetition_penalty=s.repetition_penalty,
        repetition_context=s.repetition_context,
        seed=s.seed,
        max_tokens=s.max_tokens,
        stop=tuple(s.stop),
    )


def _error_done(message: str, reason: str = "error") -> Done:
    return Done("", "", reason, Usage(), Timings(), error=message)
