"""Small inline SVG charts: horizontal bars and step lines. Labels are HTML-escaped; values
that are unknown are drawn as a hatched "unknown" placeholder, never as a zero-length bar."""

from __future__ import annotations

from html import escape

PALETTE = ("#3b76d6", "#e0803a", "#3aa37a", "#b354c2", "#c9455c", "#7d8a99")


def _fmt(v: float) -> str:
    if v == int(v) and abs(v) < 1e15:
        return f"{int(v):,}"
    if abs(v) >= 100:
        return f"{v:,.0f}"
    if abs(v) >= 10:
        return f"{v:.1f}"
    return f"{v:.2f}"


def bar_chart(title: str, rows: list[tuple[str, float | None]], unit: str = "", width: int = 520,
              reference: float | None = None) -> str:
    """Horizontal bars, one per (label, value); ``reference`` draws a dashed line (e.g. 1.0x)."""
    if not rows:
        return ""
    label_w, bar_h, gap, top = 190, 18, 6, 26
    height = top + len(rows) * (bar_h + gap) + 8
    known = [v for _, v in rows if v is not None]
    vmax = max(known + ([reference] if reference else []) + [1e-9])
    span = width - label_w - 80
    out = [f'<svg class="chart" role="img" aria-label="{escape(title)}" viewBox="0 0 {width} {height}" '
           f'width="{width}" height="{height}" xmlns="http://www.w3.org/2000/svg">',
           f'<text x="0" y="15" class="ct">{escape(title)}</text>']
    for i, (label, v) in enumerate(rows):
        y = top + i * (bar_h + gap)
        short = label if len(label) <= 28 else label[:27] + "…"
        out.append(f'<text x="{label_w - 6}" y="{y + 13}" text-anchor="end" class="cl"><title>{escape(label)}</title>{escape(short)}</text>')
        if v is None:
            out.append(f'<rect x="{label_w}" y="{y}" width="{span * 0.3:.1f}" height="{bar_h}" class="unk"/>'
                       f'<text x="{label_w + span * 0.3 + 6:.1f}" y="{y + 13}" class="cv">unknown</text>')
            continue
        w = max(span * (v / vmax), 1.5) if vmax > 0 and v > 0 else 1.5
        out.append(f'<rect x="{label_w}" y="{y}" width="{w:.1f}" height="{bar_h}" rx="2" fill="{PALETTE[i % len(PALETTE)]}"/>'
                   f'<text x="{label_w + w + 6:.1f}" y="{y + 13}" class="cv">{escape(_fmt(v))}{escape(unit)}</text>')
    if reference is not None and vmax > 0:
        x = label_w + span * reference / vmax
        out.append(f'<line x1="{x:.1f}" y1="{top - 4}" x2="{x:.1f}" y2="{height - 4}" class="ref"/>')
    out.append("</svg>")
    return "".join(out)


def line_chart(title: str, series: dict[str, list[float | None]], x_label: str = "", y_unit: str = "",
               width: int = 520, height: int = 200) -> str:
    """One line per series over x = 1..n; gaps where a value is unknown."""
    if not series or not any(v is not None for vals in series.values() for v in vals):
        return ""
    left, right, top, bottom = 64, 12, 40, 34
    n = max(len(v) for v in series.values())
    vmax = max(v for vals in series.values() for v in vals if v is not None) or 1.0
    pw, ph = width - left - right, height - top - bottom

    def xy(i: int, v: float) -> tuple[float, float]:
        x = left + (pw * i / (n - 1) if n > 1 else pw / 2)
        return x, top + ph - ph * v / vmax

    out = [f'<svg class="chart" role="img" aria-label="{escape(title)}" viewBox="0 0 {width} {height}" '
           f'width="{width}" height="{height}" xmlns="http://www.w3.org/2000/svg">',
           f'<text x="0" y="15" class="ct">{escape(title)}</text>',
           f'<line x1="{left}" y1="{top + ph}" x2="{left + pw}" y2="{top + ph}" class="ax"/>',
           f'<line x1="{left}" y1="{top}" x2="{left}" y2="{top + ph}" class="ax"/>',
           f'<text x="{left - 4}" y="{top + 4}" text-anchor="end" class="cl">{escape(_fmt(vmax))}{escape(y_unit)}</text>',
           f'<text x="{left - 4}" y="{top + ph}" text-anchor="end" class="cl">0</text>',
           f'<text x="{left + pw / 2}" y="{height - 6}" text-anchor="middle" class="cl">{escape(x_label)} (1–{n})</text>']
    for k, (name, vals) in enumerate(series.items()):
        color = PALETTE[k % len(PALETTE)]
        segments, cur = [], []
        for i, v in enumerate(vals):
            if v is None:
                if cur:
                    segments.append(cur)
                cur = []
            else:
                cur.append(xy(i, v))
        if cur:
            segments.append(cur)
        for seg in segments:
            pts = " ".join(f"{x:.1f},{y:.1f}" for x, y in seg)
            out.append(f'<polyline points="{pts}" fill="none" stroke="{color}" stroke-width="2"/>')
            out += [f'<circle cx="{x:.1f}" cy="{y:.1f}" r="2.5" fill="{color}"/>' for x, y in seg]
        if len(series) > 1:
            out.append(f'<text x="{left + 110 * k}" y="{top - 10}" class="cl" style="fill:{color}">■ {escape(name)}</text>')
    out.append("</svg>")
    return "".join(out)


def column_chart(title: str, series: dict[str, list[float | None]], x_label: str = "", y_unit: str = "",
                 width: int = 520, height: int = 200) -> str:
    """Grouped vertical bars per x = 1..n (one bar per series); an unknown value is a dashed
    outline labelled "?", not an empty slot that reads as zero."""
    if not series or not any(v is not None for vals in series.values() for v in vals):
        return ""
    left, right, top, bottom = 64, 12, 40, 30
    n, k = max(len(v) for v in series.values()), len(series)
    vmax = max(v for vals in series.values() for v in vals if v is not None) or 1.0
    pw, ph = width - left - right, height - top - bottom
    slot = pw / n
    bw = max(min(slot * 0.8 / k, 28), 1.5)
    out = [f'<svg class="chart" role="img" aria-label="{escape(title)}" viewBox="0 0 {width} {height}" '
           f'width="{width}" height="{height}" xmlns="http://www.w3.org/2000/svg">',
           f'<text x="0" y="15" class="ct">{escape(title)}</text>',
           f'<line x1="{left}" y1="{top + ph}" x2="{left + pw}" y2="{top + ph}" class="ax"/>',
           f'<text x="{left - 4}" y="{top + 4}" text-anchor="end" class="cl">{escape(_fmt(vmax))}{escape(y_unit)}</text>',
           f'<text x="{left - 4}" y="{top + ph}" text-anchor="end" class="cl">0</text>',
           f'<text x="{left + pw / 2}" y="{height - 6}" text-anchor="middle" class="cl">{escape(x_label)} 1–{n}</text>']
    if k > 1:
        out += [f'<text x="{left + 120 * j}" y="{top - 10}" class="cl" style="fill:{PALETTE[j % len(PALETTE)]}">■ {escape(name)}</text>'
                for j, name in enumerate(series)]
    for j, vals in enumerate(series.values()):
        color = PALETTE[j % len(PALETTE)]
        for i, v in enumerate(vals):
            x = left + slot * i + (slot - bw * k) / 2 + bw * j
            if v is None:
                out.append(f'<rect x="{x:.1f}" y="{top + ph - 14}" width="{bw:.1f}" height="14" class="unk">'
                           f'<title>unknown</title></rect>')
                continue
            h = max(ph * v / vmax, 1.0)
            out.append(f'<rect x="{x:.1f}" y="{top + ph - h:.1f}" width="{bw:.1f}" height="{h:.1f}" fill="{color}">'
                       f'<title>{escape(x_label)} {i + 1}: {escape(_fmt(v))}{escape(y_unit)}</title></rect>')
    out.append("</svg>")
    return "".join(out)
