"""Online loop detection: the validator's ``repetition_loop``, on a streamed text, only where more
text cannot save it.

Validation judges a whole text; a stream must judge a prefix, and a prefix that validation would
reject can still end as a good record: a 300-character '=' rule ends a prefix in a repeating tail,
and a switch statement's ``break;`` makes half of the last 40 lines for a while. So the watch
fires on the validator's checks held to what a continuation cannot undo (``certain_loop``):

- identical lines or blocks repeated ``min_repeats`` times over ``min_chars`` among the complete
  lines: a stretch that qualifies still does whatever follows it;
- a tail repeating one span over the whole window the tail check reads (2,048 characters at the
  defaults), not only over ``min_chars``;
- one line making half of the last 160 non-empty complete lines (four of the validator's windows),
  and half of its last 40.

Each implies ``repetition_loop`` on the text so far, which gives the detail and start, so a record
cut at that point is one validation rejects. A ``LoopWatch`` fires after exactly the first delta at
which ``certain_loop`` holds, at a small cost per delta instead of a re-check of the whole text;
tests/test_loops.py holds it to ``certain_loop`` at every delta of many chunkings."""
from __future__ import annotations

from collections import Counter

from dflash.validate import (BLOCK_LINES, RECENT_CHARS, RECENT_LINES, Loop, find_loop, line_blocks, recent_line,
                             tail_span, tail_window)

CERTAIN_LINES = 4 * RECENT_LINES  # the non-empty lines a line must make half of before it is a loop


def certain_loop(text: str, min_repeats: int, min_chars: int) -> Loop | None:
    """``find_loop`` of a text that loops whatever comes after it (the checks above), else None."""
    lines = text.split("\n")
    complete, window = lines[:-1], tail_window(min_chars)
    tail = text[-window:]
    span = tail_span(tail, min_repeats, min_chars) if len(tail) == window else None
    recent = [ln for ln in complete if ln.strip()][-CERTAIN_LINES:]
    common = Counter(ln for ln in recent if len(ln.strip()) >= RECENT_CHARS).most_common(1)
    if (line_blocks(complete, min_repeats, min_chars)
            or (span and tail[span[1]:] == tail[:-span[1]])
            or (common and common[0][1] * 2 >= CERTAIN_LINES and recent_line(lines))):
        return find_loop(text, min_repeats, min_chars)
    return None


class LoopWatch:
    """One per streamed request: ``feed`` each text delta; from the first delta after which
    ``certain_loop`` holds on the text so far, it returns the loop's detail (the string
    ``repetition_loop`` gives), else None; ``first_position`` is then where the loop starts (a
    character offset in the whole text). Thresholds: ``validate.repetition``.

    What it keeps between deltas only says when a check can find something and how far back it can
    reach: a run counter per block size k (a stretch that newly qualifies ends at a line this delta
    completed, its lines each equal the line k before for k*(min_repeats-1) lines in a row, and its
    shortest qualifying end part spans at most max(8*min_repeats, min_chars) lines: fewer would
    fail the count, or hold under min_chars characters), the tail window as a string, and counts of
    the long lines among the last 160 non-empty ones."""

    def __init__(self, min_repeats: int, min_chars: int):
        self.min_repeats, self.min_chars = min_repeats, min_chars
        self.loop: str | None = None
        self.first_position: int | None = None
        self._lines: list[str] = []  # the complete lines (the text is "\n".join(lines + [partial]))
        # The partial last line in pieces (joined only when a check needs it: one long line would
        # otherwise be copied at every delta).
        self._partial: list[str] = []
        self._tail, self._window = "", tail_window(min_chars)
        # _equal[k]: how many complete lines in a row, up to the last, equal the line k before them
        self._equal = [0] * (BLOCK_LINES + 1)
        self._need = [k * (min_repeats - 1) for k in range(BLOCK_LINES + 1)]
        self._reach = max(BLOCK_LINES * min_repeats, min_chars)  # lines a newly qualifying stretch needs
        self._nonempty: list[int] = []  # indexes of the non-empty complete lines
        self._long = Counter()  # the long ones among the last CERTAIN_LINES of them (recent_line's kind)
        self._common = False  # one of those makes half of CERTAIN_LINES

    def feed(self, text_delta: str) -> str | None:
        if self.loop is not None or not text_delta:
            return self.loop
        self._tail = (self._tail + text_delta)[-self._window:]
        lines = self._lines
        lo = None  # the first line a block check must see, when one is due
        if "\n" in text_delta:
            first, *complete, last = text_delta.split("\n")
            self._partial.append(first)
            for line in ("".join(self._partial), *complete):
                lo = self._complete(line, lo)
            self._partial = [last]
            self._common = max(self._long.values(), default=0) * 2 >= CERTAIN_LINES
        else:
            self._partial.append(text_delta)
        hit = lo is not None and line_blocks(lines[lo:], self.min_repeats, self.min_chars)
        if not hit and len(self._tail) == self._window:
            span = tail_span(self._tail, self.min_repeats, self.min_chars)
            hit = span and self._tail[span[1]:] == self._tail[:-span[1]]
        if not hit and self._common:  # the partial line can tip the last 40 at any delta
            start = self._nonempty[-RECENT_LINES] if len(self._nonempty) >= RECENT_LINES else 0
            hit = recent_line(lines[start:] + [self._line()])
        if hit:
            # The detail and start repetition_loop gives for the whole text (once).
            self.loop, self.first_position = find_loop("\n".join([*lines, self._line()]), self.min_repeats,
                                                       self.min_chars)
        return self.loop

    def _line(self) -> str:
        """The partial last line, joined."""
        if len(self._partial) > 1:
            self._partial = ["".join(self._partial)]
        return self._partial[0] if self._partial else ""

    def _complete(self, line: str, lo: int | None) -> int | None:
        """Takes one more complete line; returns the first line a block check must see (``lo``,
        lowered when this line ends a run long enough to qualify)."""
        lines, equal, need = self._lines, self._equal, self._need
        n = len(lines)
        lines.append(line)
        for k in range(1, BLOCK_LINES + 1):
            equal[k] = equal[k] + 1 if n >= k and line == lines[n - k] else 0
            if equal[k] >= need[k]:
                first = max(n + 1 - equal[k] - k, n - self._reach + 1)  # the run is lines[first..n]
                lo = first if lo is None else min(lo, first)
        if line.strip():
            nonempty = self._nonempty
            nonempty.append(n)
            if len(line.strip()) >= RECENT_CHARS:
                self._long[line] += 1
            if len(nonempty) > CERTAIN_LINES:
                gone = lines[nonempty[-CERTAIN_LINES - 1]]
                if len(gone.strip()) >= RECENT_CHARS:
                    self._long[gone] -= 1
                    if not self._long[gone]:
                        del self._long[gone]
        return lo
