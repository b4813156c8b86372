"""``Engine``: a loaded profile (model, tokenizer, template) served by the engine thread.

Callers build prompts with ``chat_prompt`` / ``raw_prompt`` (token ids) and ``submit`` a
``GenerationRequest``; events stream back through a ``RequestHandle``.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from enum import IntEnum
from typing import Any

from engine.errors import MlxtermError
from engine.generation.sampling import SamplingParams
from engine.profiles import Profile, load_profile
from engine.serving.events import Done, Timings, Usage
from engine.serving.worker import EngineWorker, RequestHandle

log = logging.getLogger(__name__)


class Priority(IntEnum):
    """Who waits for a request: a person at the prompt first, then agent steps, then the rest."""

    BACKGROUND = 0
    AGENT = 1
    INTERACTIVE = 2


@dataclass
class GenerationRequest:
    prompt_ids: list[int]  # the whole context, already tokenized
    params: SamplingParams
    session_id: str | None = None  # checkpoint affinity
    split_reasoning: bool = True
    start_in_reasoning: bool = False  # the prompt itself opened a reasoning block
    # an engine.generation.constraints.TokenConstraint, used for this request only
    constraint: Any = None
    priority: int = 2  # admission and prefill order: Priority.INTERACTIVE > AGENT > BACKGROUND
    extra: dict[str, Any] = field(default_factory=dict)


class Engine:
    """A profile's model served on the engine thread. Construct with ``Engine.load``."""

    def __init__(self, profile: Profile, worker: EngineWorker, runner):
        self.profile = profile
        self._worker = worker
        self._runner = runner

    @classmethod
    def load(cls, profile: Profile | str | None = None) -> Engine:
        """Load ``profile`` (a Profile, a name/path, or None for the default) on a new engine thread."""
        from engine.profiles import DEFAULT_PROFILE
        from engine.serving.runner import Runner
        from engine.serving.scheduler import Scheduler

        if not isinstance(profile, Profile):
            profile = load_profile(profile or DEFAULT_PROFILE)
        if profile.model.remote is not None:
            raise MlxtermError(f"profile {profile.name} runs on a remote server (model.remote: "
                               f"{profile.model.remote.base_url}); it has no local model to load")
        worker = EngineWorker()

        def start() -> Runner:
            runner = Runner(profile)
            worker.attach(Scheduler(runner))
            return runner

        try:
            runner = worker.call(start).result()
        except BaseException:
            worker.close()
            raise
        return cls(profile, worker, runner)

    # -- facts about the loaded model ----------------------------------------------------
    @property
    def tokenizer(self):
        return self._runner.tokenizer

    @property
    def logits_width(self) -> int:
        """Length of the model's logits row (>= the tokenizer's vocabulary)."""
        return self._runner.logits_width

    @property
    def model_name(self) -> str:
        return self._runner.model_name

    @property
    def load_ms(self) -> float:
        return self._runner.load_ms

    @property
    def weight_format(self) -> str:
        return self._runner.weight_format

    def describe(self) -> dict[str, Any]:
        return self._runner.describe()

    # -- prompts -------------------------------------------------------------------------------
    def chat_prompt(
        self,
        messages: Sequence[Mapping[str, Any]],
        tools: Sequence[Mapping[str, Any]] | None = None,
        add_generation_prompt: bool = True,
    ) -> list[int]:
        """Token ids of ``messages`` rendered with the profile's chat template."""
        return self._runner.chat_prompt(messages, tools, add_generation_prompt)

    def render(
        self,
        messages: Sequence[Mapping[str, Any]],
        tools: Sequence[Mapping[str, Any]] | None = None,
        add_generation_prompt: bool = True,
    ) -> str:
        """Prompt text of ``messages`` exactly as given (no system prompt is added)."""
        return self._runner.render(messages, tools, add_generation_prompt)

    @property
    def completion_mode(self) -> bool:
        """True for profiles with ``chat.template: none`` (raw text in, text out)."""
        return self._runner.template is None

    def raw_prompt(self, text: str) -> list[int]:
        """Token ids for completion mode (BOS added when the model wants one)."""
        return self._runner.raw_prompt(text)

    def sampling(self, **overrides) -> SamplingParams:
        """The profile's sampling defaults with ``overrides`` (None values are ignored)."""
        return self._runner.default_params.with_overrides(**overrides)

    # -- generation ------------------------------------------------------------------------
    def submit(self, request: GenerationRequest) -> RequestHandle:
        if not request.prompt_ids:
            raise MlxtermError("empty prompt: nothing to generate from")
        return self._worker.submit(request)

    @property
    def active_requests(self) -> int:
        """Requests submitted and not yet answered (they share the engine's batch)."""
        return self._worker.active

    def generate(self, prompt_ids: list[int], **overrides) -> Done:
        """Blocking convenience: generate and return the final ``Done`` event."""
        req = GenerationRequest(prompt_ids, self.sampling(**overrides))
        return self.submit(req).result()

    def call(self, fn):
        """Run ``fn(runner)`` on the engine thread; returns a Future."""
        return self._worker.call(lambda: fn(self._runner))

    def scheduler_stats(self) -> dict[str, float]:
        """Where the engine thread's time went so far (engine.serving.scheduler.SchedulerStats):
        prefill forwards, serial-lane and batched steps; benchmarks diff two readings."""
        return self._worker.call(lambda: self._worker.scheduler.stats.as_dict()).result()

    def flush_checkpoints(self, timeout: float | None = None):
        """Wait for queued checkpoint writes; returns the durability report."""
        return self._worker.call(lambda: self._runner.cache.flush(timeout)).result()

    def close(self) -> None:
        """Finish checkpoint writes (durably) and stop the engine thread."""
        try:
            report = self._worker.call(self._runner.close).result()
            if report is not None and not report.durable:
                log.warning("checkpoints not all written at close: %s", report)
        finally:
            self._worker.close()

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


__all__ = ["Engine", "GenerationRequest", "Priority", "Done", "Usage", "Timings"]
