"""What a generation request streams back to its caller."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

FinishReason = Literal["stop", "length", "cancelled", "error", "context"]


@dataclass(frozen=True)
class TextDelta:
    text: str


@dataclass(frozen=True)
class ReasoningDelta:
    text: str


@dataclass(frozen=True)
class ToolCallDelta:
    """A piece of a tool call a server streams natively (OpenAI ``delta.tool_calls``): the first
    piece of call ``index`` carries its ``id`` and ``name``, later ones pieces of its JSON arguments."""

    index: int
    arguments: str = ""
    id: str | None = None
    name: str | None = None


@dataclass(frozen=True)
class TokenLogprobs:
    token: int
    logprob: float
    top: list[tuple[int, float]]


@dataclass(frozen=True)
class SpeculationProgress:
    """Running acceptance of a speculative request (emitted every few verification rounds)."""

    drafted: int
    accepted: int

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0


@dataclass(frozen=True)
class PrefillProgress:
    done: int
    total: int


@dataclass(frozen=True)
class Queued:
    """The request waits for admission (batch full or KV budget spent); sent once."""

    reason: str
    ahead: int  # requests admitted before this one


@dataclass
class Usage:
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0


@dataclass
class Timings:
    load_ms: float = 0.0
    restore_ms: float = 0.0
    ttft_ms: float = 0.0
    prefill_tps: float = 0.0
    decode_tps: float = 0.0
    total_ms: float = 0.0


@dataclass
class Done:
    text: str
    reasoning: str
    finish_reason: FinishReason
    usage: Usage
    timings: Timings
    peak_memory_bytes: int = 0
    prompt_token_ids: list[int] = field(default_factory=list)
    completion_token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    # "ram" | "ssd" | "none" | "server" (a remote server's own cache) | "twin" (a copy of the
    # cache another request of the same prompt prefilled meanwhile)
    cache_source: str = "none"
    error: str | None = None
    # speculative decoding counters (SpecStats.as_dict()); None when the profile does not speculate
    speculation: dict | None = None
    lane: str = "serial"  # "batched" once any token came from a batched step
    batch_min: int = 1  # rows decoding together while this request decoded
    batch_mean: float = 1.0
    batch_max: int = 1


Event = (TextDelta | ReasoningDelta | ToolCallDelta | TokenLogprobs | PrefillProgress | Queued | Done
         | SpeculationProgress)
