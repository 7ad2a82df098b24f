"""``spotrun report --html``: one self-contained page (inline SVG and CSS, a few lines of JS, nothing fetched).

The page shows, top to bottom: the headline numbers (effective training time, time lost, recoveries, steps
redone), the timeline (one row per agent, wall time across: training in green, each recovery stage in its
colour, faults as red lines across every row, notices, hangs and leaves as marks on their node's row; hover
for details), the time lost per cause, and one row per recovery with its stages as a stacked bar.

Pure string building from :mod:`elastic.timeline`'s dataclasses; :func:`write_html` is the only I/O.
"""

from __future__ import annotations

import html
import math
from collections.abc import Sequence

from elastic.timeline import NO_RECOVERY, STAGES, Recovery, Segment, Timeline, Totals, recovery_cost, steps_redone_text

FAULT_COLOUR = "#d32f2f"
"""Faults from the chaos journal: a line across every row."""

COLOURS = {
    "training": "#43a047",
    # Not a red: faults are red lines across the rows, and a detection bar must not read as one.
    "detection": "#795548",
    "stop": "#fb8c00",
    "rendezvous": "#fdd835",
    "start": "#1e88e5",
    "load": "#8e24aa",
    "first_step": "#00acc1",
}
"""Segment kind -> fill colour (also the legend, in this order)."""

STAGE_COLOURS = {"detection": COLOURS["detection"], "stop": COLOURS["stop"], "rendezvous": COLOURS["rendezvous"],
                 "process_start": COLOURS["start"], "checkpoint_load": COLOURS["load"],
                 "first_step": COLOURS["first_step"]}
MARKS = {"notice": ("#ef6c00", "notice"), "hang": ("#6a1b9a", "hang"), "leave": ("#455a64", "planned leave"),
         "failure": ("#ad1457", "failure detected"), "end": ("#263238", "run finished"),
         "lost": ("#000000", "gone (no more events)"), "straggler": ("#f9a825", "straggler")}
_LABEL_W, _ROW_H, _CHART_W, _TOP = 190, 30, 900, 34

_CSS = """
body{font:14px/1.45 system-ui,-apple-system,'Segoe UI',Roboto,sans-serif;margin:0;background:#f5f6f8;color:#1d2430}
header{background:#1d2430;color:#fff;padding:18px 32px}header h1{margin:0;font-size:20px;font-weight:600}
header p{margin:4px 0 0;color:#b7c0cc;font-size:13px}main{padding:20px 32px;max-width:1180px}
.cards{display:flex;gap:14px;flex-wrap:wrap;margin-bottom:18px}
.card{background:#fff;border-radius:10px;padding:12px 18px;box-shadow:0 1px 3px #0002;min-width:150px}
.card b{display:block;font-size:26px;font-weight:650}.card span{color:#5b6573;font-size:12px;text-transform:uppercase}
.good b{color:#2e7d32}.warn b{color:#ef6c00}.bad b{color:#c62828}
section{background:#fff;border-radius:10px;padding:14px 18px;margin-bottom:18px;box-shadow:0 1px 3px #0002}
h2{font-size:15px;margin:0 0 10px}.legend{display:flex;gap:14px;flex-wrap:wrap;font-size:12px;margin:6px 0}
.legend i{display:inline-block;width:12px;height:12px;border-radius:3px;margin-right:5px;vertical-align:-2px}
table{border-collapse:collapse;width:100%;font-size:13px}th,td{padding:5px 8px;text-align:left;border-bottom:1px solid #eceef1}
th{color:#5b6573;font-weight:600;font-size:12px}td.num{text-align:right;font-variant-numeric:tabular-nums}
svg text{font:11px system-ui,sans-serif;fill:#3b4452}svg .lbl{font-size:12px;fill:#1d2430}
svg rect.seg:hover,svg .mk:hover{stroke:#000;stroke-width:1.5}#tip{position:fixed;pointer-events:none;background:#1d2430;
color:#fff;padding:4px 8px;border-radius:5px;font-size:12px;display:none}
"""

_JS = """
(function(){var tip=document.getElementById('tip');
document.querySelectorAll('[data-tip]').forEach(function(el){
el.addEventListener('mousemove',function(ev){tip.textContent=el.getAttribute('data-tip');tip.style.display='block';
tip.style.left=(ev.clientX+12)+'px';tip.style.top=(ev.clientY+12)+'px';});
el.addEventListener('mouseleave',function(){tip.style.display='none';});});
document.documentElement.setAttribute('data-rendered',document.querySelectorAll('svg').length>0?'ok':'empty');})();
"""


def _esc(text: object) -> str:
    return html.escape(str(text), quote=True)


def _nice_step(span: float, ticks: int = 8) -> float:
    """A round tick interval (1, 2 or 5 x 10^k seconds) giving about ``ticks`` ticks over ``span``."""
    if span <= 0:
        return 1.0
    raw = span / ticks
    base = 10 ** math.floor(math.log10(raw))
    return next(m * base for m in (1, 2, 5, 10) if m * base >= raw)


def _short(node: str, width: int = 26) -> str:
    return node if len(node) <= width else "…" + node[-(width - 1):]


def timeline_svg(line: Timeline) -> str:
    """Nodes x time: one row per node, segments coloured by kind, markers on top, faults across every row."""
    span = max(line.t1 - line.t0, 1e-6)
    height = _TOP + _ROW_H * max(len(line.nodes), 1) + 26
    width = _LABEL_W + _CHART_W + 20

    def x(t: float) -> float:
        return _LABEL_W + (t - line.t0) / span * _CHART_W

    row = {node: i for i, node in enumerate(line.nodes)}
    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" id="timeline" width="{width}" height="{height}" '
             f'viewBox="0 0 {width} {height}" role="img" aria-label="timeline">']
    for node, i in row.items():
        y = _TOP + i * _ROW_H
        fill = "#fafbfc" if i % 2 else "#ffffff"
        parts.append(f'<rect x="0" y="{y}" width="{width}" height="{_ROW_H}" fill="{fill}"/>'
                     f'<text class="lbl" x="8" y="{y + _ROW_H / 2 + 4:.1f}"><title>{_esc(node)}</title>'
                     f'{_esc(_short(node))}</text>')
    step = _nice_step(span)
    tick = 0.0
    while tick <= span + 1e-9:
        tx = x(line.t0 + tick)
        parts.append(f'<line x1="{tx:.1f}" y1="{_TOP - 4}" x2="{tx:.1f}" y2="{height - 22}" stroke="#dde1e6"/>'
                     f'<text x="{tx:.1f}" y="{height - 8}" text-anchor="middle">{tick:g}s</text>')
        tick += step
    for seg in _draw_order(line.segments):
        if seg.node not in row or seg.end <= seg.start:
            continue
        y = _TOP + row[seg.node] * _ROW_H + 5
        w = max(x(seg.end) - x(seg.start), 1.0)
        tip = f"{seg.node}: {seg.kind.replace('_', ' ')} {seg.end - seg.start:.2f} s (+{seg.start - line.t0:.2f} s)"
        parts.append(f'<rect class="seg" x="{x(seg.start):.1f}" y="{y}" width="{w:.1f}" height="{_ROW_H - 10}" '
                     f'rx="3" fill="{COLOURS.get(seg.kind, "#9e9e9e")}" data-tip="{_esc(tip)}">'
                     f'<title>{_esc(tip)}</title></rect>')
    for mark in line.markers:
        tip = f"+{mark.t - line.t0:.2f} s {mark.node + ': ' if mark.node else ''}{mark.label}"
        if mark.node is None:
            mx = x(mark.t)
            parts.append(f'<g class="mk" data-tip="{_esc("fault " + tip)}"><title>{_esc("fault " + tip)}</title>'
                         f'<line x1="{mx:.1f}" y1="{_TOP - 6}" x2="{mx:.1f}" y2="{height - 22}" stroke="{FAULT_COLOUR}" '
                         f'stroke-width="2" stroke-dasharray="5 3"/><path d="M{mx - 6:.1f} {_TOP - 16} h12 l-6 9 z" '
                         f'fill="{FAULT_COLOUR}"/><text x="{mx + 8:.1f}" y="{_TOP - 8}" fill="{FAULT_COLOUR}">'
                         f'{_esc(mark.label)}</text></g>')
            continue
        if mark.node not in row:
            continue
        colour, _ = MARKS.get(mark.kind, ("#000", mark.kind))
        cx, cy = x(mark.t), _TOP + row[mark.node] * _ROW_H + _ROW_H / 2
        parts.append(f'<path class="mk" d="M{cx:.1f} {cy - 8:.1f} l7 8 l-7 8 l-7 -8 z" fill="{colour}" '
                     f'stroke="#fff" stroke-width="1.2" data-tip="{_esc(tip)}"><title>{_esc(tip)}</title></path>')
    parts.append("</svg>")
    return "".join(parts)


def _draw_order(segments: Sequence[Segment]) -> list[Segment]:
    """Training first, recovery stages over it (load and first step overlay the start of training)."""
    return sorted(segments, key=lambda s: (s.kind != "training", s.start))


def lost_by_cause_svg(tot: Totals) -> str:
    """Horizontal bars: seconds lost per recovery cause."""
    items = sorted(tot.lost_by_cause.items(), key=lambda kv: -kv[1])
    if not items:
        return "<p>No time lost to recoveries.</p>"
    top = max(v for _, v in items) or 1.0
    h = 26 * len(items) + 6
    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="760" height="{h}" viewBox="0 0 760 {h}">']
    for i, (cause, seconds) in enumerate(items):
        y = 4 + i * 26
        w = seconds / top * 480
        share = 100 * seconds / tot.span if tot.span else 0.0
        parts.append(f'<text class="lbl" x="0" y="{y + 15}">{_esc(cause)}</text>'
                     f'<rect x="130" y="{y}" width="{max(w, 1):.1f}" height="20" rx="3" fill="#e57373"/>'
                     f'<text x="{136 + w:.1f}" y="{y + 15}">{seconds:.2f} s ({share:.1f}% of the run)</text>')
    parts.append("</svg>")
    return "".join(parts)


def stage_bar_svg(rec: Recovery, scale: float) -> str:
    """A recovery's stages as one stacked bar (each stage from the previous one's end), ``scale`` px/s."""
    parts = ['<svg xmlns="http://www.w3.org/2000/svg" width="320" height="16" viewBox="0 0 320 16">']
    prev = 0.0
    for stage in STAGES:
        at = rec.stages.get(stage)
        if at is None or at < prev:
            continue
        w = (at - prev) * scale
        if w > 0:
            tip = f"{stage.replace('_', ' ')}: {at - prev:.2f} s (at {at:.2f} s)"
            parts.append(f'<rect x="{prev * scale:.1f}" y="2" width="{w:.1f}" height="12" '
                         f'fill="{STAGE_COLOURS[stage]}" data-tip="{_esc(tip)}"><title>{_esc(tip)}</title></rect>')
        prev = at
    parts.append("</svg>")
    return "".join(parts)


def recoveries_table(recs: Sequence[Recovery], tot: Totals, t0: float) -> str:
    done = [r for r in recs if r.cause != NO_RECOVERY]
    longest = max((max([v for v in r.stages.values() if v is not None], default=0.0) for r in done), default=1.0)
    scale = 310 / max(longest, 1e-6)
    rows = []
    for i, rec in enumerate(recs, 1):
        if rec.cause == NO_RECOVERY:
            rows.append(f"<tr><td>{i}</td><td class=num>+{rec.origin - t0:.1f} s</td><td>{_esc(rec.kind)}</td>"
                        f"<td>no restart</td><td></td><td class=num>0</td><td class=num>0.00 s</td></tr>")
            continue
        redone = "n/a" if rec.steps_lost is None else str(rec.steps_lost)
        rows.append(f"<tr><td>{i}</td><td class=num>+{rec.origin - t0:.1f} s</td><td>{_esc(rec.kind)}</td>"
                    f"<td>{_esc(rec.cause)}</td><td>{stage_bar_svg(rec, scale)}</td><td class=num>{redone}</td>"
                    f"<td class=num>{recovery_cost(rec, tot.step_time):.2f} s</td></tr>")
    return ("<table><tr><th>#</th><th>at</th><th>fault</th><th>cause</th><th>stages (from the fault)</th>"
            "<th>steps redone</th><th>cost</th></tr>" + "".join(rows) + "</table>")


def _legend(items: Sequence[tuple[str, str]]) -> str:
    return '<div class="legend">' + "".join(f'<span><i style="background:{c}"></i>{_esc(n)}</span>'
                                            for n, c in items) + "</div>"


def render_page(line: Timeline, recs: Sequence[Recovery], tot: Totals, *, title: str = "spotrun report") -> str:
    """The whole page as one string (no external resource)."""
    ratio = tot.effective_ratio
    tone = "good" if ratio >= 0.95 else "warn" if ratio >= 0.8 else "bad"
    cards = [(f"{100 * ratio:.1f}%", "effective training time", tone), (f"{tot.span:.1f} s", "run span", ""),
             (f"{tot.lost:.1f} s", "lost to recoveries", "bad" if tot.lost else "good"),
             (str(tot.recoveries), "recoveries", ""), (steps_redone_text(tot), "steps redone", "")]
    stage_legend = [(k.replace("_", " "), c) for k, c in COLOURS.items()]
    mark_legend = [("fault (chaos journal)", FAULT_COLOUR)] + [(name, c) for c, name in MARKS.values()]
    body = (
        f"<header><h1>{_esc(title)}</h1><p>{len(line.nodes)} agents, +0 s = first event; hover a bar or mark for "
        f"details</p></header><main>"
        + '<div class="cards">' + "".join(f'<div class="card {t}"><b>{_esc(v)}</b><span>{_esc(n)}</span></div>'
                                          for v, n, t in cards) + "</div>"
        + "<section><h2>Timeline</h2>" + _legend(stage_legend) + _legend(mark_legend)
        + f'<div style="overflow-x:auto">{timeline_svg(line)}</div></section>'
        + "<section><h2>Time lost by cause</h2>" + lost_by_cause_svg(tot) + "</section>"
        + "<section><h2>Recoveries</h2>" + _legend([(k.replace("_", " "), c) for k, c in STAGE_COLOURS.items()])
        + recoveries_table(recs, tot, line.t0) + "</section></main>"
    )
    return (f'<!DOCTYPE html><html lang="en"><head><meta charset="utf-8"><title>{_esc(title)}</title>'
            f'<meta name="viewport" content="width=device-width,initial-scale=1"><style>{_CSS}</style></head>'
            f'<body>{body}<div id="tip"></div><script>{_JS}</script></body></html>')


def write_html(path: str, line: Timeline, recs: Sequence[Recovery], tot: Totals, *,
               title: str = "spotrun report") -> None:
    """Write :func:`render_page` to ``path`` (UTF-8)."""
    with open(path, "w", encoding="utf-8") as handle:
        handle.write(render_page(line, recs, tot, title=title))
