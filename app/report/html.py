"""The report page: one HTML string with inline CSS, a few lines of JS and SVG charts.

Every string that came from an input (model replies, tool output, file names, check output)
passes through ``esc``; the page loads nothing from anywhere.
"""

from __future__ import annotations

import base64
import json
import time
from html import escape
from pathlib import Path
from typing import Any

from app.report.inputs import Attempt, Item, Step
from app.report.svg import bar_chart, column_chart, line_chart

UNKNOWN = '<span class="unknown">unknown</span>'
TEXT_CHARS = 4000  # long texts (tool output, replies) are cut in the page; the files keep all
SHOT_BYTES = 600_000  # larger screenshots are linked by path only


def esc(value: Any) -> str:
    return escape(str(value), quote=True)


def num(value: Any, unit: str = "", digits: int = 1) -> str:
    """A measured number, or "unknown" (None): never a made-up zero."""
    if value is None:
        return UNKNOWN
    if isinstance(value, bool):
        return esc(value)
    if isinstance(value, int):
        return f"{value:,}{esc(unit)}"
    if isinstance(value, float):
        return f"{value:,.{digits}f}{esc(unit)}"
    return esc(value) + esc(unit)


def measured(value: Any) -> str:
    """A number from a bench JSON as written (no rounding away digits), or "unknown"."""
    if isinstance(value, float) and not isinstance(value, bool):
        return f"{value:,.1f}" if abs(value) >= 1000 else f"{round(value, 4):g}"
    return num(value)


def pct(value: float | None) -> str:
    return UNKNOWN if value is None else f"{value:.0%}"


def text_block(value: Any, cls: str = "") -> str:
    if value is None or value == "":
        return '<span class="muted">(none)</span>'
    s = value if isinstance(value, str) else json.dumps(value, ensure_ascii=False, indent=1)
    cut = f"\n… ({len(s) - TEXT_CHARS:,} more characters)" if len(s) > TEXT_CHARS else ""
    return f'<pre class="{esc(cls)}">{esc(s[:TEXT_CHARS])}{esc(cut)}</pre>'


def badge(status: Any) -> str:
    s = "unknown" if status is None else str(status)
    cls = {"passed": "ok", "pass": "ok", "failed": "bad", "fail": "bad", "error": "bad",
           "blocked": "warn", "cancelled": "warn", "running": "warn", "unchecked": "warn"}.get(s, "neutral")
    return f'<span class="badge {cls}">{esc(s)}</span>'


def status_cell(a: Attempt) -> str:
    """The status badge plus what qualifies it: nothing verified it (unchecked), no file in the
    workspace changed, or the checks passed only after repair rounds."""
    out = badge(a.status)
    if a.status == "unchecked":
        out += ' <span class="warn-t">no checks ran</span>'
    if a.workspace_changed is False:
        out += ' <span class="warn-t">workspace unchanged</span>'
    if a.repair_rounds:
        n = len(a.repair_rounds)
        ft = (a.first_try or {}).get("status")
        out += f' <span class="muted">first try {esc(ft or "unknown")}, {n} repair round{"s" if n != 1 else ""}</span>'
    return out


def repair_cell(a: Attempt) -> str:
    """First try and each repair round as "status (passed/failed)"."""
    if a.first_try is None and not a.repair_rounds:
        return '<span class="muted">no checks</span>' if a.status == "unchecked" else UNKNOWN

    def one(d: dict[str, Any]) -> str:
        return f"{badge(d.get('status'))} ({num(d.get('checks_passed'))} passed, {num(d.get('checks_failed'))} failed)"
    parts = [f"first try {one(a.first_try)}" if a.first_try else "first try unknown"]
    parts += [f"round {esc(r.get('round'))} {one(r)}" for r in a.repair_rounds]
    return " → ".join(parts)


def kv_table(rows: list[tuple[str, str]], cls: str = "kv") -> str:
    return f'<table class="{cls}">' + "".join(f"<tr><th>{esc(k)}</th><td>{v}</td></tr>" for k, v in rows) + "</table>"


def throughput(a: Attempt) -> str:
    if not a.counts_throughput:
        return f'<span class="muted">not counted ({esc(a.status or "unknown status")})</span>'
    return num(a.decode_tps, " tok/s")


def checks_cell(a: Attempt) -> str:
    if a.checks_passed is None and a.checks_failed is None and a.checks_blocked is None:
        return UNKNOWN
    parts = [f'<span class="ok-t">{num(a.checks_passed)} passed</span>',
             f'<span class="bad-t">{num(a.checks_failed)} failed</span>']
    if a.quality is not None or a.checks_blocked is not None:
        parts.append(f'<span class="warn-t">{num(a.checks_blocked)} blocked</span>')
    return " · ".join(parts)


# -- the overview --------------------------------------------------------------------------------
def overview(items: list[Item]) -> str:
    rows = [(item, a) for item in items for a in item.attempts]
    if not rows:
        return ""
    head = ("<tr><th>source</th><th>attempt</th><th>status</th><th>profile</th><th>output tokens</th>"
            "<th>wall time</th><th>decode after first output</th><th>summed TTFT</th><th>cached tokens</th>"
            "<th>checks</th><th>tool errors</th><th>requests</th></tr>")
    body = "".join(
        f"<tr><td>{esc(item.title)}</td><td>{esc(a.label)}</td><td>{status_cell(a)}</td><td>{num(a.profile)}</td>"
        f"<td class='n'>{num(a.completion_tokens)}</td><td class='n'>{num(a.wall_s, ' s')}</td>"
        f"<td class='n'>{throughput(a)}</td><td class='n'>{num(a.ttft_s_sum, ' s', 2)}</td>"
        f"<td class='n'>{pct(a.cached_ratio)}</td><td>{checks_cell(a)}</td><td class='n'>{num(a.tool_errors)}</td>"
        f"<td class='n'>{num(a.requests)}</td></tr>" for item, a in rows)
    names = [_chart_name(item, a) for item, a in rows]
    charts = [
        bar_chart("completed output tokens per attempt", [(n, a.completion_tokens) for n, (_, a) in zip(names, rows, strict=True)]),
        bar_chart("task wall time per attempt", [(n, a.wall_s) for n, (_, a) in zip(names, rows, strict=True)], " s"),
        bar_chart("checks passed per attempt", [(n, a.checks_passed) for n, (_, a) in zip(names, rows, strict=True)]),
        bar_chart("cached share of prompt tokens", [(n, None if a.cached_ratio is None else 100 * a.cached_ratio)
                                                    for n, (_, a) in zip(names, rows, strict=True)], " %"),
    ]
    return (f'<section id="overview"><h2>Runs and attempts side by side</h2>'
            f'<div class="scroll"><table class="grid">{head}{body}</table></div>'
            f'<p class="note">Throughput is decode speed after each request\'s first token (tokens after the first '
            f'÷ time after the first), counted only for runs that passed. Unknown means the input did not record it.</p>'
            f'<div class="charts">{"".join(charts)}</div></section>')


def _chart_name(item: Item, a: Attempt) -> str:
    """A short bar label: the run's or card's own name (plus the attempt for cards)."""
    if item.kind == "run":
        return a.label
    base = item.title.split(": ", 1)[-1]
    return f"{base} · {a.label}" if item.kind == "card" else base


# -- attempts ------------------------------------------------------------------------------------
def step_records(steps: list[Step]) -> str:
    if not steps:
        return '<p class="muted">No per-step records.</p>'
    out = []
    for s in steps:
        calls = "".join(
            f'<div class="call"><b>{esc(c.get("name") or "?")}</b> {badge("passed" if c.get("ok") else ("failed" if c.get("ok") is False else None))}'
            f'{" " + num(c.get("duration_ms"), " ms", 0) if c.get("duration_ms") is not None else ""}'
            f'{diff_size(c)}'
            f'{("<div class=lbl>arguments</div>" + text_block(c.get("arguments"))) if c.get("arguments") is not None else ""}'
            f'{("<div class=lbl>result</div>" + text_block(c.get("content"))) if c.get("content") is not None else ""}'
            f'{("<div class=lbl>error</div>" + text_block(c.get("error"))) if c.get("error") else ""}</div>'
            for c in s.tool_calls)
        summary = (f"request {num(s.request)}{f' (repair round {s.round})' if s.round else ''} · "
                   f"prompt {num(s.prompt_tokens)} · cached {num(s.cached_tokens)} "
                   f"({esc(s.cache_source or 'no cache source')}) · output {num(s.completion_tokens)} · "
                   f"TTFT {num(s.ttft_s, ' s', 2)} · {len(s.tool_calls)} tool call(s)")
        body = kv_table([("finish reason", num(s.finish_reason)), ("decode time after first token", num(s.decode_s, " s", 2))])
        if s.error:
            body += "<div class=lbl>error</div>" + text_block(s.error)
        if s.text is not None:
            body += "<div class=lbl>reply text</div>" + text_block(s.text, "reply")
        out.append(f'<details class="step"><summary>{summary}</summary>{body}{calls}</details>')
    return "".join(out)


def diff_size(call: dict[str, Any]) -> str:
    """`` · path +added −removed`` for a call that changed a file, else nothing."""
    added, removed = call.get("lines_added"), call.get("lines_removed")
    if call.get("path") is None or (added is None and removed is None):
        return ""
    return f' · <span class="path">{esc(call["path"])}</span> +{num(added or 0)} −{num(removed or 0)} lines'


def screenshot(path: Any, status: Any) -> str:
    """The screenshot path; for a category that did not pass, the picture too (inline, so the
    page stays one file), folded away."""
    if not path:
        return "—"
    cell = esc(path)
    p = Path(str(path))
    if status != "pass" and p.suffix == ".png" and p.is_file() and p.stat().st_size <= SHOT_BYTES:
        data = base64.b64encode(p.read_bytes()).decode("ascii")
        cell += f'<details><summary>view</summary><img class="shot" alt="screenshot" src="data:image/png;base64,{data}"></details>'
    return cell


def quality_table(q: dict[str, Any]) -> str:
    cats = [c for c in q.get("categories") or [] if isinstance(c, dict)]
    rows = "".join(
        f"<tr><td>{badge(c.get('status'))}</td><td>{esc(c.get('title') or c.get('name'))}</td>"
        f"<td>{esc(c.get('evidence') or '')}</td><td class='path'>{screenshot(c.get('screenshot'), c.get('status'))}</td></tr>"
        for c in cats)
    head = (f"<p>{num(q.get('passed'))} of {num(q.get('total'))} categories passed · {num(q.get('failed'))} failed · "
            f"{num(q.get('blocked'))} blocked · scored in {num(q.get('wall_s'), ' s')}</p>")
    return head + f'<table class="grid"><tr><th>status</th><th>category</th><th>evidence</th><th>screenshot</th></tr>{rows}</table>'


def checks_table(checks: list[dict[str, Any]]) -> str:
    if not checks:
        return '<p class="muted">No checks recorded.</p>'
    rows = "".join(
        f"<tr><td>{badge('passed' if c.get('passed') else ('failed' if c.get('passed') is False else None))}</td>"
        f"<td>{esc(c.get('name') or '')}</td><td><details><summary>output</summary>{text_block(c.get('output'))}</details></td></tr>"
        for c in checks)
    return f'<table class="grid"><tr><th>result</th><th>check</th><th>output</th></tr>{rows}</table>'


def plan_list(plan: dict[str, Any]) -> str:
    """A planned run's checklist: each file, its features, done / given up / not reached."""
    rows = []
    for item in plan.get("items") or []:
        state = "done" if item.get("done") else ("given up" if item.get("given_up") else "not written")
        cls = "ok" if item.get("done") else "warn-t"
        feats = f": {esc(item.get('features'))}" if item.get("features") else ""
        rows.append(f"<li><span class='{cls}'>{state}</span> <code>{esc(item.get('path'))}</code>{feats}</li>")
    return f"<ol class='plan'>{''.join(rows)}</ol><p class='muted'>plan from the {esc(plan.get('source', 'model'))}</p>"


def attempt_block(a: Attempt) -> str:
    summary = kv_table([
        ("status", status_cell(a) + (f" ({esc(a.stop_reason)})" if a.stop_reason else "")),
        ("profile", num(a.profile)),
        ("completed output tokens", num(a.completion_tokens)),
        ("prompt tokens / cached", f"{num(a.prompt_tokens)} / {num(a.cached_tokens)} ({pct(a.cached_ratio)})"),
        ("task wall time", num(a.wall_s, " s")),
        ("decode after first output", throughput(a)),
        ("summed TTFT", num(a.ttft_s_sum, " s", 2)),
        ("requests", num(a.requests)),
        ("tool errors", num(a.tool_errors)),
        ("checks", checks_cell(a)),
        ("first try and repair rounds", repair_cell(a)),
        ("corrective turns", num(a.corrective_turns)),
        ("workspace changed", UNKNOWN if a.workspace_changed is None else
         ("yes" if a.workspace_changed else '<span class="warn-t">no: no file in the workspace changed</span>')),
        ("workspace", num(a.workspace)),
        ("started", num(a.started_at)),
    ])
    settings = kv_table([(k, esc(json.dumps(v, ensure_ascii=False)) if not isinstance(v, str) else esc(v))
                         for k, v in a.settings.items()]) if a.settings else '<p class="muted">No settings recorded.</p>'
    charts = "".join([
        column_chart("TTFT per request", {"TTFT": [s.ttft_s for s in a.steps]}, "request", " s"),
        column_chart("cache hits per request", {"prompt tokens": [s.prompt_tokens for s in a.steps],
                                                "cached": [s.cached_tokens for s in a.steps]}, "request", " tok"),
        column_chart("output tokens per request", {"output": [s.completion_tokens for s in a.steps]}, "request", " tok"),
    ])
    parts = [f'<div class="cols"><div>{summary}</div><div><h4>settings</h4>{settings}</div></div>']
    if charts:
        parts.append(f'<div class="charts">{charts}</div>')
    if a.plan:
        parts.append("<h4>plan</h4>" + plan_list(a.plan))
    if a.error:
        parts.append("<h4>error</h4>" + text_block(a.error))
    if a.quality:
        parts.append("<h4>acceptance categories</h4>" + quality_table(a.quality))
    parts.append("<details><summary>checks (" + str(len(a.checks)) + ")</summary>" + checks_table(a.checks) + "</details>")
    parts.append(f"<details class='steps'><summary>per-request records ({len(a.steps)})</summary>{step_records(a.steps)}</details>")
    if a.final_text:
        parts.append("<details><summary>final answer</summary>" + text_block(a.final_text, "reply") + "</details>")
    if a.diff:
        parts.append("<details><summary>workspace diff</summary>" + text_block(a.diff) + "</details>")
    if a.hashes:
        parts.append("<details><summary>evidence file hashes (SHA-256)</summary>" + hashes_table(a.hashes) + "</details>")
    return f'<div class="attempt"><h3>{esc(a.label)} {badge(a.status)}</h3>{"".join(parts)}</div>'


def hashes_table(hashes: dict[str, str]) -> str:
    return '<table class="grid hashes">' + "".join(
        f"<tr><td class='path'>{esc(k)}</td><td class='hash'>{esc(v)}</td></tr>" for k, v in sorted(hashes.items())) + "</table>"


# -- benches -------------------------------------------------------------------------------------
def _scalar(v: Any) -> bool:
    return v is None or isinstance(v, str | int | float | bool)


def dict_rows_table(rows: list[dict[str, Any]]) -> str:
    cols: list[str] = []
    for r in rows:
        cols += [k for k in r if k not in cols and _scalar(r[k])]
    head = "".join(f"<th>{esc(c)}</th>" for c in cols)
    body = "".join("<tr>" + "".join(f"<td class='n'>{measured(r.get(c)) if c in r else UNKNOWN}</td>" for c in cols) + "</tr>"
                   for r in rows)
    return f'<div class="scroll"><table class="grid"><tr>{head}</tr>{body}</table></div>'


RATIO_WORDS = ("ratio", "speedup", "speed_up", "vs_")


def _number(v: Any) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool)


def _is_table(v: Any) -> bool:
    """A mapping of named rows (``{"scenario": {"tps": ..}, ...}``): shown as one table."""
    return (isinstance(v, dict) and bool(v) and all(isinstance(x, dict) for x in v.values())
            and all(any(_scalar(y) for y in x.values()) for x in v.values()))


def _row_charts(title: str, rows: list[dict[str, Any]], label_key: str) -> str:
    """Bars for ratio-like and throughput columns of a table, one chart per column (at most 4)."""
    cols = [c for c in rows[0] if c != label_key and any(_number(r.get(c)) for r in rows)
            and (any(w in c.lower() for w in RATIO_WORDS) or c.lower().endswith("_tps"))]
    charts = []
    for c in cols[:4]:
        ratio = any(w in c.lower() for w in RATIO_WORDS)
        charts.append(bar_chart(f"{title}: {c}", [(str(r.get(label_key)), r.get(c) if _number(r.get(c)) else None) for r in rows],
                                "x" if ratio else "", reference=1.0 if ratio else None))
    return f'<div class="charts">{"".join(charts)}</div>' if charts else ""


def generic(data: dict[str, Any], skip: tuple[str, ...] = ("summary",), prefix: str = "") -> str:
    """Any JSON object: scalars as a key/value table (ratio-like ones also as bars), mappings of
    named rows and lists of objects as tables (with bars for ratio and tok/s columns), numeric
    lists as line plots, other nested objects section by section."""
    items = [(k, v) for k, v in data.items() if k not in skip]
    scalars = [(f"{prefix}{k}", v) for k, v in items if _scalar(v)]
    parts = [kv_table([(k, measured(v)) for k, v in scalars])] if scalars else []
    ratios = [(k, float(v)) for k, v in scalars if _number(v) and any(w in k.lower() for w in RATIO_WORDS)]
    if ratios:
        parts.append(bar_chart("ratios", ratios, "x", reference=1.0))
    for k, v in items:
        key = f"{prefix}{k}"
        if _scalar(v):
            continue
        if _is_table(v):
            rows = [{"name": name, **{c: x for c, x in row.items() if _scalar(x)}} for name, row in v.items()]
            parts.append(f"<h4>{esc(key)}</h4>" + dict_rows_table(rows) + _row_charts(key, rows, "name"))
            # what the table cannot show (nested objects, per-run series), folded per row
            rest = "".join(generic({c: x for c, x in row.items() if not _scalar(x)}, skip=(), prefix=f"{key}.{name}.")
                           for name, row in v.items() if any(not _scalar(x) for x in row.values()))
            if rest:
                parts.append(f"<details><summary>{esc(key)}: nested fields and series per row</summary>{rest}</details>")
        elif isinstance(v, dict):
            parts.append(generic(v, skip=(), prefix=key + "."))
        elif isinstance(v, list) and v and all(isinstance(x, dict) for x in v):
            parts.append(f"<h4>{esc(key)}</h4>" + dict_rows_table(v))
            numeric = {c: [r.get(c) if _number(r.get(c)) else None for r in v] for c in v[0] if _number(v[0].get(c))}
            if len(v) > 1 and numeric:
                parts.append(line_chart(f"{key} by row", dict(list(numeric.items())[:6]), "row"))
        elif isinstance(v, list) and len(v) > 1 and all(_number(x) for x in v):
            parts.append(line_chart(key, {k: [float(x) for x in v]}, "index"))
        elif isinstance(v, list) and v and not all(_scalar(x) for x in v):
            parts.append(f"<h4>{esc(key)}</h4>" + text_block(v))
        elif isinstance(v, list):
            parts.append(kv_table([(key, esc(", ".join(map(str, v))) if v else '<span class="muted">(empty)</span>')]))
    if not prefix and isinstance(data.get("summary"), str):
        parts.append("<details><summary>summary text</summary>" + text_block(data["summary"]) + "</details>")
    return "".join(parts)


def bench_engine(d: dict[str, Any]) -> str:
    if isinstance(d.get("runs"), list):  # the standard set: the CPU, then one section per model
        cpu = d.get("cpu") if isinstance(d.get("cpu"), dict) else {}
        head = kv_table([(k, num(cpu.get(k))) for k in ("model", "family", "kernel_isa", "cores")])
        return head + "".join(bench_engine(r) for r in d["runs"] if isinstance(r, dict))
    arms = d.get("arms") if isinstance(d.get("arms"), dict) else {}
    meta = kv_table([(k, num(d.get(k))) for k in ("profile", "model", "backend", "machine", "prompt_tokens", "max_tokens", "rounds")])
    rows = [{"arm": k, **{c: v.get(c) for c in ("prefill_tps", "decode_tps", "ttft_ms", "runs")}} for k, v in arms.items() if isinstance(v, dict)]
    ratios = d.get("ratios") if isinstance(d.get("ratios"), dict) else {}
    charts = [bar_chart("decode tok/s per arm", [(r["arm"], r.get("decode_tps")) for r in rows], " tok/s"),
              bar_chart("prefill tok/s per arm", [(r["arm"], r.get("prefill_tps")) for r in rows], " tok/s"),
              bar_chart("ratios", [(k, v) for k, v in ratios.items() if isinstance(v, int | float)], "x", reference=1.0)]
    return meta + dict_rows_table(rows) + f'<div class="charts">{"".join(charts)}</div>'


def bench_resume(d: dict[str, Any]) -> str:
    rows = [r for r in d.get("rows") or [] if isinstance(r, dict)]
    bars = []
    for r in rows:
        for arm in ("cold", "ram", "ssd"):
            bars.append((f"{r.get('context_tokens')} tok · {arm}", r.get(f"{arm}_ttft_ms")))
    speed = [(f"{r.get('context_tokens')} tok · {a}", r.get(f"{a}_speedup")) for r in rows for a in ("ram", "ssd")]
    return (kv_table([("profile", num(d.get("profile")))]) + dict_rows_table(rows)
            + f'<div class="charts">{bar_chart("TTFT of the follow-up turn", bars, " ms")}'
            f'{bar_chart("speed-up over cold prefill", speed, "x", reference=1.0)}</div>')


def bench_speech(d: dict[str, Any]) -> str:
    clips = [c for c in d.get("clips") or [] if isinstance(c, dict)]
    meta = kv_table([(k, num(d.get(k))) for k in ("model", "beam_size", "load_s", "machine", "load_avg_1m")])
    stream = [(c.get("clip", "?"), (c.get("stream") or {}).get("finish_latency_median_s")) for c in clips if isinstance(c.get("stream"), dict)]
    charts = [bar_chart("real-time factor (lower is faster)", [(c.get("clip", "?"), c.get("real_time_factor")) for c in clips], "x", reference=1.0),
              bar_chart("word error rate", [(c.get("clip", "?"), c.get("wer")) for c in clips]),
              bar_chart("streaming finish latency (median)", stream, " s") if stream else ""]
    return meta + dict_rows_table(clips) + f'<div class="charts">{"".join(charts)}</div>'


def _pass_cell(v: Any) -> str:
    return badge(None if v is None else ("passed" if v else "failed"))


def _rate(n: Any, d: Any, p: Any) -> str:
    return UNKNOWN if p is None else f"{num(n)}/{num(d)} ({p:.1f}%)"


def bench_agent(d: dict[str, Any]) -> str:
    """``mlxterm bench agent``: the summary, aider's reference, one row per exercise."""
    ref = d.get("reference") if isinstance(d.get("reference"), dict) else None
    tokens = d.get("tokens") if isinstance(d.get("tokens"), dict) else {}
    meta = kv_table([
        ("profile", num(d.get("profile"))), ("model", num(d.get("model"))),
        ("split", f"{num(d.get('split'))} · {num(d.get('count'))} of {num(d.get('exercises_total'))} exercises"),
        ("split rule", num(d.get("split_rule"))),
        ("passed first try", _rate(d.get("passed_first_try"), d.get("first_try_known"), d.get("pct_first_try"))),
        ("passed after repair", _rate(d.get("passed_after_repair"), d.get("count"), d.get("pct_after_repair"))),
        ("repair rounds", num(d.get("repair_rounds")) if d.get("repair_rounds") is not None else "the profile's"),
        ("wall per exercise", f"median {num(d.get('wall_s_median'), ' s')} · p90 {num(d.get('wall_s_p90'), ' s')}"),
        ("tokens", f"prompt {num(tokens.get('prompt'))} · cached {num(tokens.get('cached'))} · "
                   f"completion {num(tokens.get('completion'))}"),
        ("engine load", num(d.get("load_s"), " s", 2)), ("bench wall", num(d.get("wall_s"), " s")),
        ("aider reference", f"{esc(ref.get('model'))}: {num(ref.get('pct_first_try'))}% first try / "
                            f"{num(ref.get('pct_after_repair'))}% after one round ({esc(ref.get('source'))})"
         if ref else '<span class="muted">none for this model</span>'),
        ("run directories", num(d.get("bench_dir"))),
    ])
    rows = [r for r in d.get("results") or [] if isinstance(r, dict)]
    head = ("<tr><th>exercise</th><th>first try</th><th>after repair</th><th>rounds</th><th>steps</th>"
            "<th>prompt tokens</th><th>cached</th><th>completion</th><th>agent wall</th><th>wall</th>"
            "<th>stop</th><th>error</th></tr>")
    body = "".join(
        f"<tr><td>{esc(r.get('slug'))}</td><td>{_pass_cell(r.get('passed_first_try'))}</td>"
        f"<td>{_pass_cell(r.get('passed_after_repair'))}</td><td class='n'>{num(r.get('rounds'))}</td>"
        f"<td class='n'>{num(r.get('steps'))}</td><td class='n'>{num(r.get('prompt_tokens'))}</td>"
        f"<td class='n'>{num(r.get('cached_tokens'))}</td><td class='n'>{num(r.get('completion_tokens'))}</td>"
        f"<td class='n'>{num(r.get('agent_wall_s'), ' s')}</td><td class='n'>{num(r.get('wall_s'), ' s')}</td>"
        f"<td>{num(r.get('stop_reason'))}</td><td>{esc(r.get('error') or '')}</td></tr>" for r in rows)
    rates = [("this run: first try", d.get("pct_first_try")), ("this run: after repair", d.get("pct_after_repair"))]
    if ref:
        rates += [("aider: first try", ref.get("pct_first_try")), ("aider: after one round", ref.get("pct_after_repair"))]
    charts = [bar_chart("exercises passed", rates, " %"),
              bar_chart("wall time per exercise", [(str(r.get("slug")), r.get("wall_s")) for r in rows], " s")]
    failed = "".join(f"<details><summary>{esc(r.get('slug'))}: test output</summary>{text_block(r.get('score_output'))}"
                     f'<p class="path">{esc(r.get("run_dir") or "")}</p></details>'
                     for r in rows if not r.get("passed_after_repair"))
    return (meta + f'<h4>exercises</h4><div class="scroll"><table class="grid">{head}{body}</table></div>'
            f'<div class="charts">{"".join(charts)}</div>'
            + (f"<h4>failed exercises</h4>{failed}" if failed else ""))


BENCHES = {"engine": bench_engine, "resume": bench_resume, "speech": bench_speech,
           "agent": bench_agent}


# -- the page ------------------------------------------------------------------------------------
def item_section(i: int, item: Item) -> str:
    if item.kind in ("run", "card"):
        intro = ""
        if item.kind == "card":
            card = item.data.get("card") if isinstance(item.data.get("card"), dict) else {}
            intro = kv_table([(k, text_block(v) if isinstance(v, str) and len(v) > 80 else num(v) if _scalar(v) else text_block(v))
                              for k, v in card.items()])
        body = intro + ("".join(attempt_block(a) for a in item.attempts) or '<p class="muted">No attempts yet.</p>')
    elif item.kind == "quality":
        body = quality_table(item.data)
    elif item.kind == "bench":
        fn = BENCHES.get(str(item.data.get("bench")))
        body = fn(item.data) if fn else '<p class="note">A benchmark kind this report has no special view for: every field below.</p>' + generic(item.data)
        body += "<details><summary>summary text and raw fields</summary>" + generic(item.data, skip=()) + "</details>" if fn else ""
    else:
        body = generic(item.data, skip=())
    src = f'<p class="path">{esc(item.source)}</p>' if item.source else ""
    hashes = ("<details><summary>input file hash (SHA-256)</summary>" + hashes_table(
        {k: v for k, v in item.hashes.items() if "/" not in k and k in (item.source or "")} or item.hashes) + "</details>"
              if item.hashes and item.kind not in ("run",) else "")
    return f'<section class="item" id="item-{i}"><h2>{esc(item.title)}</h2>{src}{body}{hashes}</section>'


CSS = """
:root{--bg:#f7f8fa;--fg:#1c2230;--panel:#fff;--line:#d9dee7;--muted:#667085;--ok:#1f8a4c;--bad:#c23b3b;--warn:#b7791f;--accent:#3b76d6}
@media (prefers-color-scheme:dark){:root{--bg:#14171d;--fg:#e3e7ee;--panel:#1e232c;--line:#343b48;--muted:#9aa4b5;--ok:#4cc07f;--bad:#f07171;--warn:#e0b050;--accent:#7aa7ff}}
*{box-sizing:border-box}body{margin:0;background:var(--bg);color:var(--fg);font:14px/1.45 system-ui,-apple-system,Segoe UI,sans-serif}
header.top{padding:18px 28px;border-bottom:1px solid var(--line);background:var(--panel);display:flex;gap:16px;align-items:baseline;flex-wrap:wrap}
header.top h1{margin:0;font-size:20px}header.top .muted{flex:1}
main{padding:8px 28px 40px;max-width:1500px}
section{background:var(--panel);border:1px solid var(--line);border-radius:10px;padding:14px 18px;margin:16px 0}
h2{font-size:17px;margin:0 0 8px}h3{font-size:15px;margin:14px 0 8px}h4{font-size:13px;margin:12px 0 6px;color:var(--muted);text-transform:uppercase;letter-spacing:.03em}
nav a{margin-right:12px;color:var(--accent);text-decoration:none}
table{border-collapse:collapse}table.grid{width:100%;margin:6px 0}table.grid th,table.grid td{border-bottom:1px solid var(--line);padding:5px 8px;text-align:left;vertical-align:top}
table.grid th{font-weight:600;color:var(--muted);font-size:12px;white-space:nowrap}td.n{text-align:right;white-space:nowrap;font-variant-numeric:tabular-nums}
table.kv th{text-align:left;color:var(--muted);font-weight:500;padding:2px 14px 2px 0;white-space:nowrap;vertical-align:top}table.kv td{padding:2px 0}
.badge{display:inline-block;padding:0 8px;border-radius:9px;font-size:12px;font-weight:600;border:1px solid currentColor}
.badge.ok,.ok-t{color:var(--ok)}.badge.bad,.bad-t{color:var(--bad)}.badge.warn,.warn-t{color:var(--warn)}.badge.neutral{color:var(--muted)}
.unknown{color:var(--muted);font-style:italic}.muted,.note{color:var(--muted)}.note{font-size:12px}
.path,.hash{font-family:ui-monospace,Menlo,monospace;font-size:12px;word-break:break-all;color:var(--muted)}
pre{background:var(--bg);border:1px solid var(--line);border-radius:6px;padding:8px;max-height:320px;overflow:auto;white-space:pre-wrap;word-break:break-word;font-size:12px;margin:4px 0}
details{margin:6px 0}summary{cursor:pointer;color:var(--accent)}details.step{border-left:3px solid var(--line);padding-left:10px}details.step summary{color:var(--fg);font-variant-numeric:tabular-nums}
.call{margin:6px 0 6px 8px}.lbl{font-size:11px;color:var(--muted);margin-top:4px}
.attempt{border-top:1px dashed var(--line);margin-top:10px}.cols{display:flex;gap:32px;flex-wrap:wrap}
.charts{display:flex;flex-wrap:wrap;gap:18px;margin:10px 0}.chart{background:var(--bg);border-radius:8px;padding:4px;max-width:100%;height:auto}
.chart .ct{font-size:12px;font-weight:600;fill:var(--fg)}.chart .cl{font-size:11px;fill:var(--muted)}.chart .cv{font-size:11px;fill:var(--fg)}
.chart .ax{stroke:var(--line)}.chart .ref{stroke:var(--muted);stroke-dasharray:4 3}.chart .unk{fill:none;stroke:var(--muted);stroke-dasharray:3 3}
.scroll{overflow-x:auto}img.shot{max-width:640px;border:1px solid var(--line);border-radius:6px;margin-top:4px}button.tool{font:inherit;background:var(--panel);color:var(--fg);border:1px solid var(--line);border-radius:6px;padding:3px 10px;cursor:pointer}
"""

JS = """
document.querySelectorAll('button[data-expand]').forEach(function (b) {
  b.addEventListener('click', function () {
    var open = b.getAttribute('data-expand') === 'open';
    document.querySelectorAll('details').forEach(function (d) { d.open = open; });
  });
});
"""


def render_report(items: list[Item], title: str = "mlxterm report") -> str:
    nav = "".join(f'<a href="#item-{i}">{esc(item.title)}</a>' for i, item in enumerate(items))
    sections = "".join(item_section(i, item) for i, item in enumerate(items))
    when = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    return (f'<!doctype html><html lang="en"><head><meta charset="utf-8">'
            f'<meta name="viewport" content="width=device-width,initial-scale=1">'
            f"<meta http-equiv=\"Content-Security-Policy\" content=\"default-src 'none'; style-src 'unsafe-inline'; "
            f"script-src 'unsafe-inline'; img-src data:\">"
            f"<title>{esc(title)}</title><style>{CSS}</style></head><body>"
            f'<header class="top"><h1>{esc(title)}</h1><span class="muted">{len(items)} input(s) · generated {when}</span>'
            f'<button class="tool" type="button" data-expand="open">expand all</button>'
            f'<button class="tool" type="button" data-expand="close">collapse all</button></header>'
            f"<main><nav>{nav}</nav>{overview(items)}{sections}</main><script>{JS}</script></body></html>")
