"""Numbers as the pipeline writes them for people: sizes, shares, durations and rates."""
from __future__ import annotations


def human_bytes(n: float) -> str:
    """1234567 -> '1.2 MB' (decimal units, as disks and clouds bill)."""
    for unit in ("B", "KB", "MB", "GB", "TB", "PB"):
        if n < 1000 or unit == "PB":
            return f"{n:.1f} {unit}"
        n /= 1000


def human_count(x: float) -> str:
    """1.64e9 -> '1.64e9', 4321 -> '4,321'."""
    return f"{x:,.0f}" if x < 1e6 else f"{x:.3g}".replace("e+0", "e").replace("e+", "e")


def percent(share: float) -> str:
    """0.0857 -> '8.6%'."""
    return f"{share:.1%}"


def human_duration(seconds: float) -> str:
    """Seconds as a reader weighs them: '42 s', '15.2 min', '17.5 h', '16.5 days'."""
    hours = seconds / 3600
    if hours < 1 / 60:
        return f"{seconds:.0f} s"
    if hours < 1:
        return f"{hours * 60:.1f} min"
    return f"{hours:,.1f} h" if hours < 48 else f"{hours / 24:,.1f} days"


def plural(unit: str) -> str:
    return unit if unit == "it" or unit.endswith("s") else unit + "s"


def rate_text(per_second: float, unit: str) -> str:
    """3.1 steps/s, or 12.5 s/step when slower than one a second."""
    if per_second >= 1:
        return f"{per_second:,.{0 if per_second >= 100 else 1}f} {plural(unit)}/s"
    return f"{1 / per_second:,.1f} s/{unit}"


def clock(seconds: float) -> str:
    """42s, 15m02s, 2h05m: a progress bar's elapsed time and ETA, which a reader compares at a glance."""
    s = round(seconds)
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s // 3600}h{s % 3600 // 60:02d}m"
