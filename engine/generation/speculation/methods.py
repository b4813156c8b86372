"""From a profile's ``speculation`` section to a per-request ``Speculation``.

``Speculator`` is built once per loaded model (it loads a draft model when one is named)
and hands each request a fresh ``Speculation``: the drafter, the draft-length policy and
new counters.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from engine.checkpoints import CheckpointStore, make_fingerprint, ssd_root
from engine.errors import ProfileError
from engine.generation.kv_cache import make_cache
from engine.generation.speculation.base import DraftPolicy, SpecStats, Speculation
from engine.generation.speculation.draft_model import DraftModelDrafter
from engine.generation.speculation.lookup import LookupDrafter, json_escaper
from engine.generation.speculation.mtp import make_mtp_drafter

if TYPE_CHECKING:
    from engine.checkpoints.store import DurabilityReport

_VOCAB_PROBE = "def main():\n    print('hello, world')  # 123 ü → ok\n"


def _draft_store(profile, path, weight_format: str, model):
    """The draft model's checkpoint store: the profile's RAM/SSD settings, the draft model's own
    fingerprint (so its files sit in their own directory under the same SSD root; the KV tag
    "draft" keeps them apart from the same model's checkpoints as a target)."""

    cache = profile.cache
    return CheckpointStore(make_fingerprint(path, weight_format, "draft", "same"), lambda: make_cache(model),
                           ram_bytes=cache.ram_bytes, ssd_dir=ssd_root(profile), ssd_bytes=cache.ssd_bytes)


class Speculator:
    def __init__(self, profile, bundle):
        spec = profile.speculation
        self.mode = spec.mode
        self.policy = DraftPolicy(spec.num_draft_tokens, spec.min_draft_tokens, spec.adaptive)
        self._spec = spec
        self._drafter = None
        self.draft_name: str | None = None
        self._store = None  # the draft model's checkpoint store (mode: draft)
        # lookup also drafts from the context's JSON-escaped tokens (an agent's tool-call strings)
        self._escaper = json_escaper(bundle.tokenizer) if spec.mode == "lookup" else None
        if spec.mode == "draft":
            self._drafter = self._load_draft(profile, bundle)
        elif spec.mode == "mtp":
            lm = bundle.loaded
            self._drafter = make_mtp_drafter(profile.where("speculation.mode"), profile.model.source,
                                             {**lm.config, "model_type": lm.model_type},
                                             getattr(lm, "metadata", None))

    def _load_draft(self, profile, bundle) -> DraftModelDrafter:
        from engine.model.loader import load_bundle
        from engine.model.weight_policy import choose_weights
        from engine.profiles import resolve_draft_source

        path, weights = resolve_draft_source(profile)
        draft = load_bundle(path, choose_weights(weights))
        where = profile.where("speculation.draft_model")
        tw = int(bundle.loaded.config.get("vocab_size") or bundle.tokenizer.vocab_size)
        dw = int(draft.loaded.config.get("vocab_size") or draft.tokenizer.vocab_size)
        same_text = bundle.tokenizer.encode(_VOCAB_PROBE) == draft.tokenizer.encode(_VOCAB_PROBE)
        if tw != dw or not same_text or bundle.tokenizer.eos_ids != draft.tokenizer.eos_ids:
            raise ProfileError(
                f"{where}: speculation.draft_model: {path.name} does not share the target's "
                f"tokenizer (vocabulary {dw} vs {tw} tokens, same ids for sample text: {same_text}); "
                "a draft model must use the same vocabulary")
        self.draft_name = path.name
        drafter = DraftModelDrafter(draft.model, dw, self._spec.draft_min_prob)
        self._store = _draft_store(profile, path, draft.loaded.weight_format, draft.model)
        drafter.use_store(self._store)
        return drafter

    def new(self) -> Speculation | None:
        """Everything one request needs, or None when the profile does not speculate."""
        if self.mode == "none":
            return None
        if self.mode == "lookup":
            drafter = LookupDrafter(self._spec.lookup_ngram, self._spec.lookup_max_ngram, self._escaper)
        else:
            drafter = self._drafter
        stats = SpecStats(self.mode)
        if isinstance(drafter, DraftModelDrafter):  # the drafter counts into it while it drafts
            stats.draft_restored, stats.draft_prefilled = 0, 0
        return Speculation(drafter, self.policy, stats)

    # -- the draft model's KV checkpoints, beside the target's (engine.serving.prompt_cache) ----
    def acquire(self, prompt: list[int], session_id: str | None, target_cached: int) -> None:
        if isinstance(self._drafter, DraftModelDrafter):
            self._drafter.acquire(prompt, session_id, target_cached)

    def release(self, tokens: list[int], session_id: str | None) -> None:
        if isinstance(self._drafter, DraftModelDrafter):
            self._drafter.release(tokens, session_id)

    def close(self, timeout: float | None = None) -> DurabilityReport | None:
        return self._store.close(timeout) if self._store is not None else None

    def flush(self, timeout: float | None = None) -> DurabilityReport | None:
        return self._store.flush(timeout) if self._store is not None else None
