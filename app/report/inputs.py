"""Loading report inputs and normalising them to a few record shapes.

Kinds: ``run`` (a headless run's ``result.json`` with its ``transcript.jsonl`` and
``quality.json`` beside it), ``card`` (a board-card export: ``{"kind": "board_card", "card",
"attempts"}``), ``quality`` (a ``quality.json`` alone), ``bench`` (``mlxterm bench`` output;
``engine``, ``resume`` and ``speech`` are known, anything else is shown generically) and
``json`` (any other JSON object, shown generically).

Task runs and board attempts both become ``Attempt`` records, so the report compares them in
one table. A value nobody measured is ``None`` and the page says "unknown".
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from engine.errors import MlxtermError


class ReportError(MlxtermError):
    """A report input is missing, unreadable or not a JSON object."""


@dataclass
class Step:
    request: int | None
    round: int = 0  # the repair round whose run made it (0: the first run)
    prompt_tokens: int | None = None
    cached_tokens: int | None = None
    completion_tokens: int | None = None
    cache_source: str | None = None
    ttft_s: float | None = None
    decode_s: float | None = None
    finish_reason: str | None = None
    text: str | None = None
    error: str | None = None
    tool_calls: list[dict[str, Any]] = field(default_factory=list)


@dataclass
class Attempt:
    label: str
    status: str | None = None
    profile: str | None = None
    settings: dict[str, Any] = field(default_factory=dict)
    wall_s: float | None = None
    prompt_tokens: int | None = None
    cached_tokens: int | None = None
    completion_tokens: int | None = None
    requests: int | None = None
    ttft_s_sum: float | None = None
    decode_tps: float | None = None
    tool_errors: int | None = None
    checks: list[dict[str, Any]] = field(default_factory=list)
    checks_passed: int | None = None
    checks_failed: int | None = None
    checks_blocked: int | None = None
    quality: dict[str, Any] | None = None
    steps: list[Step] = field(default_factory=list)
    stop_reason: str | None = None
    error: str | None = None
    final_text: str | None = None
    workspace: str | None = None
    diff: str | None = None
    started_at: str | None = None
    hashes: dict[str, str] = field(default_factory=dict)
    # repair inside the run / attempt (agents.repair): the checks at the first final answer,
    # the rounds that followed, answers sent back for not doing the work, and whether any
    # workspace file changed (None: the input did not record it)
    first_try: dict[str, Any] | None = None
    repair_rounds: list[dict[str, Any]] = field(default_factory=list)
    corrective_turns: int | None = None
    workspace_changed: bool | None = None
    plan: dict[str, Any] | None = None  # a planned run's plan with its ticks (agents.plan)

    @property
    def cached_ratio(self) -> float | None:
        if self.prompt_tokens is None or self.cached_tokens is None or self.prompt_tokens <= 0:
            return None
        return self.cached_tokens / self.prompt_tokens

    def set_repair(self, raw: dict[str, Any]) -> None:
        """Take the repair fields from a result.json or a board attempt (absent: unknown)."""
        ft = raw.get("first_try")
        self.first_try = ft if isinstance(ft, dict) else None
        rounds = raw.get("repair_rounds")
        self.repair_rounds = [r for r in rounds if isinstance(r, dict)] if isinstance(rounds, list) else []
        ct = raw.get("corrective_turns")
        self.corrective_turns = ct if isinstance(ct, int) and not isinstance(ct, bool) else None
        wc = raw.get("workspace_changed")
        self.workspace_changed = wc if isinstance(wc, bool) else None

    @property
    def counts_throughput(self) -> bool:
        """Only runs that passed report a throughput: a failed or broken run's speed says
        nothing about doing the task."""
        return self.status == "passed"


@dataclass
class Item:
    kind: str  # run | card | quality | bench | json
    title: str
    source: str | None
    data: dict[str, Any]
    attempts: list[Attempt] = field(default_factory=list)
    hashes: dict[str, str] = field(default_factory=dict)


def sha256_file(path: Path) -> str | None:
    try:
        h = hashlib.sha256()
        with open(path, "rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                h.update(block)
        return h.hexdigest()
    except OSError:
        return None


def read_json(path: Path) -> Any:
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ReportError(f"{path}: file not found") from None
    except (OSError, UnicodeDecodeError) as e:
        raise ReportError(f"{path}: cannot read ({getattr(e, 'strerror', None) or e})") from None
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise ReportError(f"{path}:{e.lineno}: not valid JSON ({e.msg})") from None


def load_input(x: Path | str | dict[str, Any]) -> Item:
    """One report input (a path or a loaded dict) as an ``Item``."""
    if isinstance(x, dict):
        return classify(x, None)
    path = Path(x)
    data = read_json(path)
    if not isinstance(data, dict):
        raise ReportError(f"{path}: expected a JSON object, got {type(data).__name__}")
    item = classify(data, path)
    item.hashes.setdefault(path.name, sha256_file(path) or "unreadable")
    return item


def classify(data: dict[str, Any], path: Path | None) -> Item:
    source = str(path) if path else None
    if data.get("kind") == "board_card":
        return _card(data, source)
    # a web-app task's browser checks (assets/tasks/webcheck.py): kanban_quality, expense_quality...
    if str(data.get("kind") or "").endswith("_quality"):
        return Item("quality", f"quality: {data.get('workspace') or source or 'workspace'}", source, data)
    if "status" in data and "checks" in data and ("task" in data or "name" in data):
        return _run(data, path)
    if isinstance(data.get("bench"), str):
        return Item("bench", f"bench {data['bench']}", source, data)
    if isinstance(data.get("clips"), list) and "model" in data:  # `mlxterm bench speech` has no "bench" key
        return Item("bench", "bench speech", source, {**data, "bench": "speech"})
    return Item("json", f"JSON: {path.name if path else 'input'}", source, data)


# -- task runs -----------------------------------------------------------------------------------
def _run(result: dict[str, Any], path: Path | None) -> Item:
    run_dir = path.parent if path else (Path(result["run_dir"]) if result.get("run_dir") else None)
    records = _transcript(run_dir / "transcript.jsonl") if run_dir else []
    quality = None
    hashes: dict[str, str] = {}
    if run_dir:
        qpath = run_dir / "quality.json"
        if qpath.is_file():
            try:
                quality = json.loads(qpath.read_text(encoding="utf-8"))
                hashes["quality.json"] = sha256_file(qpath) or "unreadable"
            except (OSError, ValueError):
                quality = None
        tpath = run_dir / "transcript.jsonl"
        if tpath.is_file():
            hashes["transcript.jsonl"] = sha256_file(tpath) or "unreadable"
        for c in (quality or {}).get("categories", []):
            shot = c.get("screenshot")
            if shot and Path(shot).is_file():
                hashes[f"screenshots/{Path(shot).name}"] = sha256_file(Path(shot)) or "unreadable"
    attempt = _run_attempt(result, records, quality)
    attempt.hashes = hashes
    if run_dir:  # runs of one task differ by their run directory (the run id)
        attempt.label = run_dir.name
    who = result.get("profile") or ("checks only" if result.get("checks_only") else None)
    title = f"task run: {result.get('name') or 'task'}" + (f" · {who}" if who else "")
    return Item("run", title, str(path) if path else None, result, [attempt], hashes)


def _transcript(path: Path) -> list[dict[str, Any]]:
    """The transcript's records; a torn last line (a killed run) is skipped, not fatal."""
    try:
        lines = path.read_text(encoding="utf-8", errors="replace").splitlines()
    except OSError:
        return []
    out = []
    for line in lines:
        try:
            rec = json.loads(line)
        except ValueError:
            continue
        if isinstance(rec, dict):
            out.append(rec)
    return out


def _num(x: Any) -> float | None:
    return x if isinstance(x, int | float) and not isinstance(x, bool) else None


def _run_attempt(result: dict[str, Any], records: list[dict[str, Any]], quality: dict | None) -> Attempt:
    tokens = result.get("tokens") if isinstance(result.get("tokens"), dict) else {}
    steps = _steps_from_transcript(records)
    run_rec = next((r for r in records if r.get("type") == "run"), {})
    req = next((r for r in records if r.get("type") == "request"), {})
    settings = {k: v for k, v in {
        "limits": run_rec.get("limits"), "sampling": req.get("sampling"),
        "constrained": (run_rec.get("agent") or {}).get("constrained"),
        "protocol": (run_rec.get("agent") or {}).get("protocol"),
        "checks_only": result.get("checks_only"),
    }.items() if v is not None}
    responses = [s for s in steps if s.ttft_s is not None]
    ttft = sum(s.ttft_s for s in responses) if responses else None
    dec_tokens = sum(max((s.completion_tokens or 0) - 1, 0) for s in responses)
    dec_time = sum(s.decode_s or 0 for s in responses)
    tool_results = [r for r in records if r.get("type") == "tool_result"]
    checks = result.get("checks") or []
    a = Attempt(
        label=str(result.get("name") or "run"), status=result.get("status"), profile=result.get("profile"),
        settings=settings, wall_s=_num(result.get("wall_s")),
        prompt_tokens=_num(tokens.get("prompt")) if tokens else None,
        cached_tokens=_num(tokens.get("cached")) if tokens else None,
        completion_tokens=_num(tokens.get("completion")) if tokens else None,
        requests=len(responses) if records else _num(result.get("steps")),
        ttft_s_sum=ttft, decode_tps=(dec_tokens / dec_time) if dec_time > 0 else None,
        tool_errors=sum(1 for r in tool_results if not r.get("ok")) if records else None,
        checks=[{"name": c.get("name"), "passed": c.get("passed"), "output": c.get("output")} for c in checks],
        checks_passed=_num(result.get("checks_passed")), checks_failed=_num(result.get("checks_failed")),
        quality=quality, steps=steps, stop_reason=result.get("stop_reason"), error=result.get("error"),
        final_text=result.get("final_text"), workspace=result.get("workspace"),
        plan=result.get("plan") if isinstance(result.get("plan"), dict) else None,
    )
    a.set_repair(result)
    if quality:
        a.checks_passed, a.checks_failed = _num(quality.get("passed")), _num(quality.get("failed"))
        a.checks_blocked = _num(quality.get("blocked"))
    return a


def _steps_from_transcript(records: list[dict[str, Any]]) -> list[Step]:
    calls: dict[str, dict[str, Any]] = {}
    for r in records:
        msg = r.get("message") if r.get("type") == "message" else None
        if isinstance(msg, dict) and msg.get("role") == "assistant" and not (msg.get("meta") or {}).get("example"):
            for tc in msg.get("tool_calls") or []:
                fn = tc.get("function") or {}
                calls[str(tc.get("id"))] = {"name": fn.get("name"), "arguments": fn.get("arguments")}
    # each run of an attempt (the first, then each repair round) numbers its steps from 1: a
    # step is (run, step), listed as request 1, 2, ... in order
    steps: dict[tuple[int, int], Step] = {}
    run = 0
    for r in records:
        kind, n = r.get("type"), r.get("step")
        if kind == "run":
            run += 1
        if kind not in ("request", "response", "tool_result") or not isinstance(n, int):
            continue
        s = steps.get((run, n))
        if s is None:
            s = steps[(run, n)] = Step(request=len(steps) + 1, round=max(0, run - 1))
        if kind == "request":
            s.prompt_tokens = _num(r.get("prompt_tokens"))
        elif kind == "response":
            usage, timings = r.get("usage") or {}, r.get("timings") or {}
            s.prompt_tokens = _num(usage.get("prompt_tokens")) or s.prompt_tokens
            s.cached_tokens = _num(usage.get("cached_tokens"))
            s.completion_tokens = _num(usage.get("completion_tokens"))
            ttft, total = _num(timings.get("ttft_ms")), _num(timings.get("total_ms"))
            s.ttft_s = ttft / 1000 if ttft is not None else None
            s.decode_s = (total - ttft) / 1000 if ttft is not None and total is not None and total >= ttft else None
            s.cache_source, s.finish_reason = r.get("cache_source"), r.get("finish_reason")
            s.text, s.error = r.get("text"), r.get("error")
        else:
            call = calls.get(str(r.get("call_id")), {})
            data = r.get("data") or {}
            s.tool_calls.append({"name": r.get("name") or call.get("name"), "ok": r.get("ok"),
                                 "arguments": call.get("arguments"), "content": r.get("content"),
                                 "error": r.get("error"), "duration_ms": r.get("duration_ms"),
                                 "path": data.get("path"), "lines_added": data.get("lines_added"),
                                 "lines_removed": data.get("lines_removed")})
    return [steps[k] for k in sorted(steps)]


# -- board cards ----------------------------------------------------------------------------------
def _card(data: dict[str, Any], source: str | None) -> Item:
    card = data.get("card") if isinstance(data.get("card"), dict) else {}
    attempts = []
    for i, raw in enumerate(data.get("attempts") or []):
        if not isinstance(raw, dict):
            continue
        tokens = raw.get("tokens") if isinstance(raw.get("tokens"), dict) else {}
        checks = [c for c in raw.get("checks") or [] if isinstance(c, dict)]
        steps = []
        for j, st in enumerate(raw.get("steps") or []):
            if not isinstance(st, dict):
                continue
            tc = st.get("tool_calls")
            if isinstance(tc, list):
                calls = [c if isinstance(c, dict) else {"name": str(c)} for c in tc]
            elif isinstance(tc, int):
                calls = [{"name": f"{tc} call(s)"}] if tc else []
            else:
                calls = []
            steps.append(Step(request=_num(st.get("request")) if st.get("request") is not None else j + 1,
                              prompt_tokens=_num(st.get("prompt_tokens")), cached_tokens=_num(st.get("cached_tokens")),
                              completion_tokens=_num(st.get("completion_tokens")), cache_source=st.get("cache_source"),
                              ttft_s=_num(st.get("ttft_s")), tool_calls=calls))
        known = [c for c in checks if isinstance(c.get("passed"), bool)]
        attempt = Attempt(
            label=f"attempt {raw.get('number') if raw.get('number') is not None else i + 1}",
            status=raw.get("status"), profile=raw.get("profile") or card.get("profile"),
            settings={k: raw[k] for k in ("session_id", "finished_at") if raw.get(k) is not None},
            wall_s=_num(raw.get("wall_s")), prompt_tokens=_num(tokens.get("prompt")),
            cached_tokens=_num(tokens.get("cached")), completion_tokens=_num(tokens.get("completion")),
            requests=_num(raw.get("requests")), ttft_s_sum=_num(raw.get("ttft_s_sum")),
            decode_tps=_num(raw.get("decode_tps")), tool_errors=_num(raw.get("tool_errors")),
            checks=checks,
            checks_passed=sum(1 for c in known if c["passed"]) if checks else None,
            checks_failed=sum(1 for c in known if not c["passed"]) if checks else None,
            steps=steps, workspace=raw.get("workspace"), diff=raw.get("diff"), started_at=raw.get("started_at"),
            stop_reason=raw.get("stop_reason"), error=raw.get("error"), final_text=raw.get("final_text"),
        )
        attempt.set_repair(raw)
        attempts.append(attempt)
    title = f"board card: {card.get('title') or card.get('id') or 'card'}"
    return Item("card", title, source, data, attempts)
