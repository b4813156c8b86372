"""What an agent run is given: its options (tools, approvals, sampling, edit format, sandbox)
and limits (steps, tokens, wall time), and the error for an agent that cannot run."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from engine.errors import MlxtermError

from tools.sandbox import Limits


class AgentError(MlxtermError):
    """An agent cannot run with this engine, workspace or session."""


@dataclass
class AgentLimits:
    """Per-run limits; None falls back to the profile (steps) or means no limit."""

    steps: int | None = None
    tokens: int | None = None  # completion tokens over the whole run
    wall_s: float | None = None


@dataclass
class AgentOptions:
    """How the agent runs; every None falls back to the profile's ``agent:`` / ``sampling:``."""

    system_prompt: str | None = None  # base prompt (the tools block is added when needed)
    examples: bool = True  # few-shot example turns at the start of a new session
    tools: tuple[str, ...] | None = None
    approvals: Mapping[str, str] | None = None
    allow: tuple[str, ...] = ()  # tools allowed without asking (headless --allow)
    unconfined_allow: tuple[str, ...] | None = None  # explicit consent to run unsandboxed (None: allow)
    interactive: bool = True  # False: "ask" means deny (nobody to ask)
    constrained: bool | None = None
    temperature: float | None = None
    seed: int | None = None  # step n samples with seed + n
    max_tokens_per_step: int | None = None
    network: bool = False  # bash (and task checks) may reach the network from the sandbox
    edit_format: str | None = None  # whole | diff | json (profile agent.edit_format)
    corrective_turns: int = 1  # per run: "nothing was written" nudges before a final answer counts
    protected: tuple[str, ...] = ()  # workspace paths (globs) write_file / edit_file may not change
    sandbox_hide: tuple[str, ...] = ()  # host paths bash must not see (a task run's own directory)
    sandbox_limits: Limits | None = None  # a task's sandbox limits (None: the defaults)
