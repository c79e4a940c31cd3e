"""A grouped bar chart written as a self-contained SVG by hand (the tools add no dependencies).

    write_svg("out.svg", groups=["w2 replicate", ...], series={"loaded": [3.1, ...], ...},
              title="ms/step", notes=["0.85x", ...])

One group per configuration, one bar per series side by side, the value printed on each bar.
The y axis switches to a log scale when values span more than 20x, so a 2-layer model and a
12-layer one stay readable in one picture.
"""

from __future__ import annotations

import math
from xml.sax.saxutils import escape

__all__ = ["write_svg"]

COLORS = ["#3b6fb6", "#9a9a9a", "#e08a2c", "#5aa469", "#b65f9c"]


def _ticks(lo: float, hi: float, log: bool) -> list[float]:
    if log:
        ticks = []
        for exp in range(math.floor(math.log10(lo)), math.ceil(math.log10(hi)) + 1):
            ticks += [m * 10.0 ** exp for m in (1, 2, 5) if lo <= m * 10.0 ** exp <= hi]
        return ticks
    step = 10.0 ** math.floor(math.log10(hi / 5))
    step *= next(m for m in (1, 2, 5, 10) if hi / (step * m) <= 6)
    return [i * step for i in range(int(hi / step) + 1)]


def write_svg(path, groups: list[str], series: dict[str, list[float | None]], title: str,
              y_label: str = "ms/step", notes: list[str] | None = None) -> None:
    """Write the chart; ``None`` values leave a gap; ``notes`` are printed above each group."""
    values = [v for vs in series.values() for v in vs if v]
    hi, lo = max(values), min(values)
    log = hi / lo > 20
    y_lo = 10.0 ** math.floor(math.log10(lo)) if log else 0.0
    y_hi = 10.0 ** math.ceil(math.log10(hi)) if log else hi * 1.15
    bar_w, gap, left, top, plot_h, bottom = 22, 26, 70, 60, 320, 110
    group_w = bar_w * len(series) + gap
    width = max(left + group_w * len(groups) + 20 + 150, left + int(7.5 * len(title)) + 20)
    height = top + plot_h + bottom

    def y(v: float) -> float:
        if log:
            frac = (math.log10(v) - math.log10(y_lo)) / (math.log10(y_hi) - math.log10(y_lo))
        else:
            frac = v / y_hi
        return top + plot_h * (1 - frac)

    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
           f'font-family="sans-serif" font-size="11">',
           f'<rect width="{width}" height="{height}" fill="white"/>',
           f'<text x="{left}" y="24" font-size="14" font-weight="bold">{escape(title)}</text>',
           f'<text x="16" y="{top + plot_h / 2}" transform="rotate(-90 16 {top + plot_h / 2})" '
           f'text-anchor="middle">{escape(y_label)}{" (log scale)" if log else ""}</text>']
    for t in _ticks(max(lo / 2, y_lo) if log else 0.0, y_hi, log):
        if log and t < y_lo:
            continue
        ty = y(t)
        out.append(f'<line x1="{left}" x2="{left + group_w * len(groups)}" y1="{ty:.1f}" y2="{ty:.1f}" '
                   f'stroke="#e4e4e4"/>')
        out.append(f'<text x="{left - 6}" y="{ty + 4:.1f}" text-anchor="end">{t:g}</text>')
    out.append(f'<line x1="{left}" x2="{left}" y1="{top}" y2="{top + plot_h}" stroke="black"/>')
    out.append(f'<line x1="{left}" x2="{left + group_w * len(groups)}" y1="{top + plot_h}" '
               f'y2="{top + plot_h}" stroke="black"/>')
    for g, label in enumerate(groups):
        x0 = left + g * group_w + gap / 2
        for s, (name, vs) in enumerate(series.items()):
            v = vs[g]
            if not v:
                continue
            x, ty = x0 + s * bar_w, y(v)
            out.append(f'<rect x="{x:.1f}" y="{ty:.1f}" width="{bar_w - 2}" height="{top + plot_h - ty:.1f}" '
                       f'fill="{COLORS[s % len(COLORS)]}"><title>{escape(name)}: {v:.2f}</title></rect>')
            out.append(f'<text x="{x + bar_w / 2 - 1:.1f}" y="{ty - 3:.1f}" font-size="8" '
                       f'text-anchor="middle">{v:.3g}</text>')
        cx = x0 + bar_w * len(series) / 2
        if notes and notes[g]:
            out.append(f'<text x="{cx:.1f}" y="{top - 8}" text-anchor="middle" font-size="10">'
                       f'{escape(notes[g])}</text>')
        for i, line in enumerate(label.split("\n")):
            out.append(f'<text x="{cx:.1f}" y="{top + plot_h + 16 + 13 * i}" text-anchor="middle">'
                       f'{escape(line)}</text>')
    lx = left + group_w * len(groups) + 20
    for s, name in enumerate(series):
        ly = top + 10 + 18 * s
        out.append(f'<rect x="{lx}" y="{ly - 9}" width="12" height="12" fill="{COLORS[s % len(COLORS)]}"/>')
        out.append(f'<text x="{lx + 18}" y="{ly + 1}">{escape(name)}</text>')
    out.append("</svg>")
    with open(path, "w") as f:
        f.write("\n".join(out) + "\n")
