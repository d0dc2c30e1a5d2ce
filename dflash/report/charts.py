"""Charts for the report pages: inline SVG (axes, ticks, labels, values on the bars) so a page
has no external assets and ``snakemake --report`` can embed it. Imports no stage: the pages
hand it plain numbers."""
from __future__ import annotations

import html
import math


def fmt(v) -> str:
    """A number rounded for reading: 12345 -> '12,345', 3.14159 -> '3.14', 0.00123 -> '0.0012'."""
    if v is None:
        return "-"
    if isinstance(v, int) or float(v).is_integer():
        return f"{int(v):,}"
    a = abs(v)
    return (f"{v:,.0f}" if a >= 100 else f"{v:.1f}" if a >= 10 else f"{v:.2f}" if a >= 0.1 or a == 0
            else f"{v:.2g}")


# trained / untrained first (the report's pairs); the rest tell more series apart (the scale curve)
COLOURS = ["#1f77b4", "#aaaaaa", "#ff7f0e", "#2ca02c", "#9467bd", "#8c564b", "#e377c2", "#17becf"]
CHAR_PX = 6.2  # rough width of one character at font-size 11, to keep labels apart


def _ticks(lo: float, hi: float, n: int = 5) -> list[float]:
    """Round tick values (1, 2, 2.5 or 5 x 10^k apart) from at or below ``lo`` to at or above ``hi``."""
    if hi <= lo:
        hi = lo + 1
    raw = (hi - lo) / n
    mag = 10 ** math.floor(math.log10(raw))
    step = next(m * mag for m in (1, 2, 2.5, 5, 10) if m * mag >= raw)
    first = math.floor(lo / step + 1e-9) * step
    count = math.ceil((hi - first) / step - 1e-9)
    return [round(first + i * step, 10) for i in range(count + 1)]


def _text(x: float, y: float, s: str, size: int = 11, anchor: str = "start", extra: str = "") -> str:
    return (f'<text x="{x:.1f}" y="{y:.1f}" font-size="{size}" text-anchor="{anchor}" {extra}>'
            f"{html.escape(s)}</text>")


BOLD = 'font-weight="bold"'


def _svg(width: float, height: float, title: str, body: str) -> str:
    return (f'<svg xmlns="http://www.w3.org/2000/svg" width="{width:.0f}" height="{height:.0f}" '
            f'font-family="sans-serif" role="img" aria-label="{html.escape(title)}">'
            f'<rect width="100%" height="100%" fill="white"/>{_text(8, 16, title, 13, extra=BOLD)}{body}</svg>')


def _y_axis(ticks: list[float], left: float, right: float, y, label: str, top: float, bottom: float) -> str:
    """Grid lines and tick values at ``y(tick)``, the axis title turned along the axis."""
    out = "".join(f'<line x1="{left}" x2="{right}" y1="{y(t):.1f}" y2="{y(t):.1f}" stroke="#e5e5e5"/>'
                  + _text(left - 5, y(t) + 4, f"{t:,.6g}", 10, "end") for t in ticks)
    mid = (top + bottom) / 2
    return (out + f'<line x1="{left}" x2="{left}" y1="{top}" y2="{bottom}" stroke="#444"/>'
            + _text(13, mid, label, 11, "middle", f'transform="rotate(-90 13 {mid:.1f})"'))


def bars_svg(title: str, labels: list[str], series: dict[str, list[float]], x_label: str, y_label: str,
              baseline: tuple[float, str] | None = None, height: int = 250) -> str:
    """Grouped bars, one group per label and one bar per series, each bar's value on top;
    ``baseline``: (value, words) drawn as a dashed line."""
    n, k = len(labels), len(series)
    bar = 40 if k == 1 else 34
    group = bar * k + 12
    label_px = max((len(str(lab)) for lab in labels), default=1) * CHAR_PX
    turn = label_px > group - 4  # labels wider than their group are turned, so none overlap
    left, right = 58, 16
    bottom = 44 + (label_px * 0.65 if turn else 0)
    width = max(left + right + n * group, len(title) * 7.5 + 16, 300)
    # the legend, in rows under the title (wrapped at the chart's width): each series' colour, then
    # the baseline's dashes
    legend = [(name, 30 + len(name) * CHAR_PX) for name in (series if k > 1 else [])]
    legend += [(None, 35 + len(baseline[1]) * CHAR_PX)] if baseline else []
    placed, x, row = [], left, 0
    for name, w in legend:
        if x + w > width - right and x > left:
            x, row = left, row + 1
        placed.append((name, x, 25 + 16 * row))
        x += w
    top = 36 + 16 * (row + 1) if legend else 36
    height += 16 * row
    plot_w = width - left - right
    group = plot_w / max(1, n)
    values = [v for vs in series.values() for v in vs if v is not None]
    ticks = _ticks(0, max(values + [baseline[0] if baseline else 0], default=0) or 1)
    y0, y1 = height - bottom, top

    def y(v: float) -> float:
        return y0 - (y0 - y1) * v / ticks[-1]

    out = [_y_axis(ticks, left, width - right, y, y_label, y1, y0)]
    for j, (name, vs) in enumerate(series.items()):
        for i, v in enumerate(vs):
            if v is None:
                continue
            x = left + i * group + (group - bar * k) / 2 + j * bar
            out.append(f'<rect x="{x:.1f}" y="{y(v):.1f}" width="{bar - 2}" height="{y0 - y(v):.1f}" '
                       f'fill="{COLOURS[j % len(COLOURS)]}"><title>{html.escape(f"{name} {labels[i]}: {fmt(v)}")}'
                       f"</title></rect>")
            if v:
                out.append(_text(x + (bar - 2) / 2, y(v) - 3, fmt(v), 10, "middle"))
    for i, lab in enumerate(labels):
        cx = left + (i + 0.5) * group
        out.append(_text(cx, y0 + 14, str(lab), 11, "end", f'transform="rotate(-40 {cx:.1f} {y0 + 14:.1f})"')
                   if turn else _text(cx, y0 + 15, str(lab), 11, "middle"))
    out.append(f'<line x1="{left}" x2="{width - right}" y1="{y0}" y2="{y0}" stroke="#444"/>'
               + _text(left + plot_w / 2, height - 6, x_label, 11, "middle"))
    dash = 'stroke="#d62728" stroke-dasharray="6 4" stroke-width="1.5"'
    if baseline:
        at = y(baseline[0])
        out.append(f'<line x1="{left}" x2="{width - right}" y1="{at:.1f}" y2="{at:.1f}" {dash}/>')
    for j, (name, x, at) in enumerate(placed):
        out.append(f'<rect x="{x}" y="{at}" width="11" height="11" fill="{COLOURS[j % len(COLOURS)]}"/>'
                   + _text(x + 15, at + 10, name, 11) if name is not None else
                   f'<line x1="{x}" x2="{x + 22}" y1="{at + 5.5}" y2="{at + 5.5}" {dash}/>'
                   + _text(x + 27, at + 10, baseline[1], 11))
    return _svg(width, height, title, "".join(out))


def histogram_svg(title: str, bins: list[int], counts: list[int], x_label: str) -> str:
    """Counts over length bins, shown up to the bin holding the longest: each labelled with its range."""
    last = max((i for i, c in enumerate(counts) if c), default=0)
    labels = [f"{lo}-{bins[i + 1] - 1}" if i + 1 < len(bins) else f"{lo}+" for i, lo in enumerate(bins[:last + 1])]
    return bars_svg(title, labels, {"records": counts[:last + 1]}, x_label, "records")


def loss_svg(curve: list[list[float]], width: int = 600, height: int = 270) -> str:
    # None: a window whose steps were all skipped (train.max_nonfinite_steps)
    drawn = [c for c in curve if c[1] is not None and math.isfinite(c[1])]
    lost = len(curve) - len(drawn)
    skipped = f"<p>{lost} logged losses are not finite or missing (not drawn)</p>" if lost else ""
    if len(drawn) < 2:
        return skipped + "<p>no loss curve</p>"
    curve = drawn
    left, right, top, bottom = 58, 20, 34, 44
    xs, ys = [c[0] for c in curve], [c[1] for c in curve]
    xt, yt = _ticks(min(xs), max(xs), 6), _ticks(min(ys), max(ys), 5)

    def x(v: float) -> float:
        return left + (width - left - right) * (v - xt[0]) / ((xt[-1] - xt[0]) or 1)

    def y(v: float) -> float:
        return height - bottom - (height - top - bottom) * (v - yt[0]) / ((yt[-1] - yt[0]) or 1)

    points = " ".join(f"{x(a):.1f},{y(b):.1f}" for a, b in curve)
    out = [_y_axis(yt, left, width - right, y, "loss", top, height - bottom),
           f'<line x1="{left}" x2="{width - right}" y1="{height - bottom}" y2="{height - bottom}" stroke="#444"/>',
           *(f'<line x1="{x(t):.1f}" x2="{x(t):.1f}" y1="{height - bottom}" y2="{height - bottom + 4}" stroke="#444"/>'
             + _text(x(t), height - bottom + 16, fmt(t), 10, "middle") for t in xt),
           _text(left + (width - left - right) / 2, height - 6, "training step", 11, "middle"),
           f'<polyline fill="none" stroke="{COLOURS[0]}" stroke-width="2" points="{points}"/>']
    for a, b, anchor in ((xs[0], ys[0], "start"), (xs[-1], ys[-1], "end")):
        out.append(f'<circle cx="{x(a):.1f}" cy="{y(b):.1f}" r="3" fill="{COLOURS[0]}"/>'
                   + _text(x(a) + (6 if anchor == "start" else -6), y(b) - 6, f"{b:.2f} at step {fmt(a)}", 10, anchor))
    return skipped + _svg(width, height, f"training loss: {ys[0]:.2f} to {ys[-1]:.2f} in {fmt(xs[-1])} steps",
                          "".join(out))
