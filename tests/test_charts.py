"""The report's and the benches' SVG charts."""
import re

from dflash.report.charts import CHAR_PX, bars_svg


def test_many_series_get_their_own_colours_and_a_legend_that_wraps_inside_the_chart():
    """The scale curve draws five trainers and more in one group (issue 44's first chart painted
    them in two alternating colours, and its legend ran past the right edge)."""
    names = ["dflash-pipeline", "ours (min_lr_ratio 0.1)", "ours (lr 0.006)", "speculators 0.9.0 (dpace, muon)",
             "speculators 0.9.0 (dpace, adamw)"]
    svg = bars_svg("acceptance length by rows", ["1,024 rows"], {n: [1.1 + i / 100] for i, n in enumerate(names)},
                   "rows", "tokens per target forward", baseline=(1.0, "1.0 = no speed-up"))
    width, height = (float(v) for v in re.search(r'<svg [^>]*width="([\d.]+)" height="([\d.]+)"', svg).groups())
    bars = re.findall(r'<rect x="[\d.]+" y="([\d.]+)" width="\d+" height="[\d.]+" fill="(#\w+)"><title>', svg)
    assert len({fill for _, fill in bars}) == len(names)
    swatches = re.findall(r'<rect x="([\d.]+)" y="([\d.]+)" width="11" height="11" fill="(#\w+)"/><text[^>]*>([^<]+)<',
                          svg)
    assert [(fill, name) for _, _, fill, name in swatches] == [(fill, name) for (_, fill), name in zip(bars, names)]
    assert all(float(x) + 15 + len(name) * CHAR_PX <= width for x, _, _, name in swatches)
    rows = sorted({float(y) for _, y, _, _ in swatches})
    assert len(rows) > 1 and max(rows) + 11 < min(float(y) for y, _ in bars) < height
