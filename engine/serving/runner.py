"""``Runner``: lives on the engine thread; loads the profile's model and serves requests.

Requests are served by engine.serving.scheduler (continuous batching), which uses the
runner's model, tokenizer and prompt cache.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import Any

from engine.errors import ModelLoadError
from engine.generation.sampling import SamplingParams
from engine.generation.speculation.methods import Speculator
from engine.model.catalog import resolve_source
from engine.model.chat_template import CHATML_FALLBACK, ChatTemplate
from engine.model.loader import load_bundle
from engine.model.weight_policy import blas_note, choose_weights
from engine.profiles import Profile
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
        self.cache.companion = self.speculator  # a draft model's KV is checkpointed with the session's
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

