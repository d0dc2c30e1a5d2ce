"""Repetition loops, found one way everywhere: the scan validation runs on a whole text
(``find_loop``, the ``repetition_loop`` check), the watch a stream runs on each prefix
(``certain_loop``, ``LoopWatch``), and the tag loops ``dflash check tools`` counts
(``loop_patterns``); each over ``periodic_runs``.

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

import re
from functools import lru_cache
from collections import Counter, deque
from itertools import accumulate, islice
from typing import Iterator, NamedTuple, Sequence


def periodic_runs(items: Sequence, period: int) -> Iterator[tuple[int, int]]:
    """Each stretch of ``items`` with period ``period``: (index of its first item, how many items
    in a row equal the one ``period`` before them, at least 1). The stretch repeats its first
    ``period`` items (equal + period) / period times."""
    equal = 0
    for i in range(period, len(items) + 1):
        if i < len(items) and items[i] == items[i - period]:
            equal += 1
        elif equal:
            yield i - equal - period, equal
            equal = 0


BLOCK_LINES = 8  # the longest block of lines a loop repeats
TAIL_PROBE = 32  # the tail's last this many characters must recur for it to repeat a span
# one line of 8 characters or more (stripped) making half of the last 40 non-empty lines (20 at least)
RECENT_LINES, RECENT_MIN, RECENT_CHARS = 40, 20, 8


class Loop(NamedTuple):
    detail: str  # what repeats, as repetition_loop says it
    start: int  # character offset of the loop's first repetition


def tail_window(min_chars: int) -> int:
    """How many characters at the end of a text the tail check looks at."""
    return 4 * max(min_chars, 512)


def frequent_lines(counts: Counter, least: int) -> set[str]:
    """The non-blank lines that come ``least`` times or more."""
    return {line for line, n in counts.items() if n >= least and line.strip()} \
        if max(counts.values(), default=0) >= least else set()


def line_blocks(lines: list[str], min_repeats: int, min_chars: int,
                frequent: set[str] | None = None) -> tuple[str, int] | None:
    """Identical lines or blocks of up to 8 lines repeated ``min_repeats`` times in a row over
    ``min_chars`` characters: (detail, index of the stretch's first line), or None. A stretch that
    qualifies still does with more lines after it, and inside any run of lines holding it.
    ``frequent``: frequent_lines(Counter(lines), min(min_repeats, 10)), when already known (10: see find_loop)."""
    if frequent is None:
        frequent = frequent_lines(Counter(lines), min(min_repeats, RECENT_MIN // 2))
    # A loop of blocks of up to 8 lines brings some frequent line back within 8 lines; most texts
    # have none, and skip the scans below.
    close_repeat, last_seen = False, {}
    for i in [i for i, line in enumerate(lines) if line in frequent] if frequent else ():
        close_repeat = close_repeat or i - last_seen.get(lines[i], -BLOCK_LINES - 1) <= BLOCK_LINES
        last_seen[lines[i]] = i
    if close_repeat:
        ends = list(accumulate(len(ln) + 1 for ln in lines))  # ends[j]: chars up to the end of line j
    for k in range(1, BLOCK_LINES + 1) if close_repeat else ():
        for first, equal in periodic_runs(lines, k):
            last = first + k + equal - 1
            if (equal >= k * (min_repeats - 1) and ends[last] - (ends[first - 1] if first else 0) >= min_chars
                    and any(ln.strip() for ln in lines[first:first + k])):
                unit = "\n".join(lines[first:first + k])
                return f"{(equal + k) // k} x {unit[:60]!r} ({k} line{'s' * (k > 1)} in a row)", first
    return None


def tail_span(tail: str, min_repeats: int, min_chars: int) -> tuple[str, int] | None:
    """A text's last ``tail_window`` characters that end in one span over and over (no line breaks
    needed): (detail, the span's period), or None."""
    probe = tail[-TAIL_PROBE:]
    previous = tail.rfind(probe, 0, len(tail) - 1) if len(probe) == TAIL_PROBE else -1
    if previous >= 0:
        period = len(tail) - TAIL_PROBE - previous
        run = max(period * (min_repeats - 1), min_chars - period)
        if run + period <= len(tail) and tail[-run:] == tail[-run - period:-period]:
            return f"the tail repeats {tail[-period:][:60]!r} (period {period} chars)", period
    return None


def recent_line(lines: list[str]) -> tuple[str, int] | None:
    """One line of 8 characters or more making up half of the last 40 non-empty lines (20 at
    least): (detail, index of its first line among them), or None. Looks at the end only."""
    recent = list(islice((i for i in range(len(lines) - 1, -1, -1) if lines[i].strip()), RECENT_LINES))
    common = Counter(lines[i] for i in recent if len(lines[i].strip()) >= RECENT_CHARS).most_common(1)
    if len(recent) >= RECENT_MIN and common and common[0][1] * 2 >= len(recent):
        line = common[0][0]
        return (f"{common[0][1]} of the last {len(recent)} lines are {line[:60]!r}",
                min(i for i in recent if lines[i] == line))
    return None


# Loops of units that are not identical lines (issue 43, real Qwen3.6 loops): lines alike but for a
# number or a word (counter loops, near copies), blocks of 9 to 64 lines, a long block 3 times (an
# answer written again), and runs of sentences or spans inside one line (no line breaks). Code,
# tables and data never count as alike: a unit is "prose" (its words compared) only with letters,
# at most two numbers and no code marks.
NEAR_FACTOR = 3  # units alike but not identical need NEAR_FACTOR * min_repeats copies in a row
ALIKE_SLACK = 20  # alike units differ in length by this many characters at most
LONG_BLOCK = 64  # the longest block a loop repeats (a restarted answer); from BLOCK_LINES + 1 up
RESTART_COPIES = 3  # copies in a row that make a loop of a block of half min_chars or more
CODE_MARKS = re.compile(r"[|(){}\[\]<>=;_\\#`$@^~/&+]")
CJK = "\u3040-\u30ff\u3400-\u4dbf\u4e00-\u9fff\uf900-\ufaff\uac00-\ud7af"
CJK_CHAR = re.compile(rf"[{CJK}]")
WORD = re.compile(rf"[{CJK}]|[^\s{CJK}]+")  # a CJK character is a word of its own
FOUR_LETTERS = re.compile(r"[^\W\d_](?:.*?[^\W\d_]){3}", re.S)
THREE_NUMBERS = re.compile(r"\d(?:\D+\d+){2}")
NUMBER = re.compile(r"\d+")
# where a sentence ends: after . ! ? and the spaces that follow, a CJK stop and any spaces, or a
# literal backslash-n (a JSON string's line break); only the match's end is used
SENTENCE_END = re.compile(r"[.!?]\s+|[。！？；]\s*|\\n")


@lru_cache(maxsize=4096)  # the stream watch's oracle and find_loop see the same lines again and again
def prose_words(unit: str) -> tuple[str, ...] | None:
    """The words of a prose unit, else None (code, tables, data, short units: those only ever match
    when identical)."""
    if CODE_MARKS.search(unit) or THREE_NUMBERS.search(unit) or not FOUR_LETTERS.search(unit):
        return None
    return tuple(WORD.findall(unit) if not unit.isascii() and CJK_CHAR.search(unit) else unit.split())


UNSEEN = object()  # a unit's words not yet needed


def alike(a: tuple[str, ...] | None, b: tuple[str, ...] | None) -> bool:
    """Two prose units the same but for one number (a counter), or, of 6 words or more, for one
    word in 8. Two numbers changing (data: 'Region 3: 41 units') is no counter."""
    if a is None or b is None or len(a) != len(b):
        return False
    diff = [(x, y) for x, y in zip(a, b) if x != y]
    return (len(diff) <= (max(1, len(a) // 8) if len(a) >= 6 else 0)
            or len(diff) == 1 and NUMBER.sub("0", diff[0][0]) == NUMBER.sub("0", diff[0][1]))


class Runs:
    """Units (the lines of a text, or the sentences of one line) taken one at a time; ``add``
    says whether a stretch that repeats ends at the unit added (once: the first such stretch);
    ``found`` then says what repeats and where. The stretches, each over min_chars characters
    (each still qualifies with more units after it, so whether one holds is decided by the units
    so far, and the stream watch feeds its complete lines to the same rules):

    - ``alike`` units, or blocks of up to 8 (lines alike but for a counter, sentences with one word
      changed), NEAR_FACTOR * min_repeats times in a row;
    - identical blocks of 9 to 64 units, min_repeats times in a row;
    - identical blocks of up to 64 units over half min_chars characters, RESTART_COPIES times in a row
      (the last copy may lack a quarter: its closing separator);
    - (sentences) identical sentences or blocks of up to 8, min_repeats times in a row;
    - (lines) one of the above among the sentences of a line of min_chars characters or more, or a
      span repeated within it (span_run).

    A run starts at a non-blank unit (blank lines go on runs, never start one). Cost per unit: one
    step per run going on (few), a look at the lengths of the last 8 units and at the recent copies
    of the unit; its words only when a unit of about its length (ALIKE_SLACK) is among the last 8."""

    def __init__(self, min_repeats: int, min_chars: int, what: str = "line"):
        self.min_repeats, self.min_chars, self.what = min_repeats, min_chars, what
        self.sep = what == "line"  # lines are joined by a line break, sentences by nothing
        self.units: list[str] = []
        self.lengths: list[int] = []
        self._words: list = []  # prose_words of each unit, once a comparison needed them (else UNSEEN)
        self.ends = [0]  # ends[i]: characters before unit i
        # period -> the first unit of the run, up to the last unit, of units that equal (alike: are
        # alike) the unit ``period`` before them
        self.same: dict[int, int] = {}
        self.alike: dict[int, int] = {}
        self.recent: dict[str, deque] = {}  # unit -> its indexes among the last LONG_BLOCK units
        self.hit: tuple[str, int, int] | None = None  # (kind, period, first unit)
        self.inline: tuple[str, int] | None = None  # found(), for a stretch of sentences in one line

    def add(self, unit: str) -> bool:
        n, units, lengths, size = len(self.units), self.units, self.lengths, len(unit)
        units.append(unit)
        lengths.append(size)
        self._words.append(UNSEEN)
        self.ends.append(self.ends[-1] + len(unit) + self.sep)
        if self.hit:
            return False
        if self.sep and len(unit) >= self.min_chars:
            inline = inline_runs(unit, self.min_repeats, self.min_chars)
            if inline:
                self.hit, self.inline = ("inline", 0, n), (inline[0], self.ends[n] + inline[1])
                return True
        same = {period: first for period, first in self.same.items() if units[n - period] == unit} \
            if self.same else {}
        near = {k: first for k, first in self.alike.items()
                if units[n - k] == unit or self.alike_units(n, n - k)} if self.alike else {}
        if unit.strip():
            recent = self.recent.get(unit)
            if recent is None:
                self.recent[unit] = deque((n,))
            else:
                while recent and recent[0] < n - LONG_BLOCK:
                    recent.popleft()
                for p in recent:
                    same.setdefault(n - p, n)
                    if n - p <= BLOCK_LINES:
                        near.setdefault(n - p, n)
                recent.append(n)
            window = lengths[n - BLOCK_LINES if n > BLOCK_LINES else 0:n]
            if window and min(window) <= size + ALIKE_SLACK and max(window) >= size - ALIKE_SLACK \
                    and self.unit_words(n) is not None:  # a unit that is not prose starts no run of alike ones
                for k in range(1, min(n, BLOCK_LINES) + 1):
                    if k not in near and abs(lengths[n - k] - size) <= ALIKE_SLACK and self.alike_units(n, n - k):
                        near[k] = n
        self.same, self.alike = same, near
        if not same and not near:
            return False
        # (kind, period, first unit of the stretch) of the runs long enough, in the order they count
        kinds = sorted([("long" if period > BLOCK_LINES else "same", period, first - period)
                        for period, first in same.items() if self.repeats(period, first, n)]
                       + [("alike", k, first - k) for k, first in near.items()
                          if n + 1 - first >= k * (NEAR_FACTOR * self.min_repeats - 1)], key=lambda kind: kind[1])
        for kind, k, first in kinds:
            if self.ends[n + 1] - self.ends[first] >= self.min_chars:
                self.hit = (kind, k, first)
                return True
        return False

    def repeats(self, period: int, first: int, n: int) -> bool:
        """Whether units first - period to n, each from ``first`` on equal to the one ``period``
        before, repeat a block often enough: min_repeats times (blocks of up to 8 lines are
        line_blocks's), or RESTART_COPIES times a block of half min_chars characters or more (an
        answer written again), the last copy maybe short of its closing lines (a separator)."""
        if (period > BLOCK_LINES or not self.sep) and n + 1 - first >= period * (self.min_repeats - 1):
            return True
        block = self.ends[first] - self.ends[first - period]
        return (block >= self.min_chars // 2
                and 4 * (self.ends[n + 1] - self.ends[first - period]) >= (4 * RESTART_COPIES - 1) * block)

    def alike_units(self, i: int, j: int) -> bool:
        """Whether units i and j are alike (see ``alike``), their lengths ALIKE_SLACK apart at most."""
        return abs(self.lengths[i] - self.lengths[j]) <= ALIKE_SLACK and alike(self.unit_words(i), self.unit_words(j))

    def unit_words(self, i: int) -> tuple[str, ...] | None:
        """prose_words of unit i, worked out once."""
        if self._words[i] is UNSEEN:
            self._words[i] = prose_words(self.units[i])
        return self._words[i]

    def found(self) -> tuple[str, int] | None:
        """The stretch found, if any: (what repeats, with its copies among the units so far;
        character offset of its first unit)."""
        if self.hit is None:
            return None
        kind, k, first = self.hit
        if kind == "inline":
            return self.inline
        unit = ("\n" if self.sep else "").join(self.units[first:first + k])
        # copies in characters, rounded: a last copy short of its separator counts
        block = self.ends[first + k] - self.ends[first]
        copies = round((self.ends[first + k + self.count()] - self.ends[first]) / block)
        where = "" if self.sep else " within one line"
        if kind == "same":
            detail = f"{copies} x {unit[:60]!r} ({k} {self.what}{'s' * (k > 1)} in a row{where})"
        elif kind == "alike":
            detail = (f"{copies} x {unit[:60]!r} ({k} {self.what}{'s' * (k > 1)} in a row{where}, alike but for a "
                      "number or a word)")
        else:
            detail = f"{copies} x {unit[:60]!r} (a block of {k} {self.what}s in a row{where})"
        return detail, self.ends[first]

    def count(self) -> int:
        """How many units of the stretch found so far match the unit a period before them."""
        kind, k, first = self.hit
        i = first + k
        while i < len(self.units) and (self.units[i] == self.units[i - k]
                                       or kind == "alike" and self.alike_units(i, i - k)):
            i += 1
        return i - first - k


@lru_cache(maxsize=1024)  # a stream's oracle (certain_loop at every delta) sees each line again and again
def inline_runs(line: str, min_repeats: int, min_chars: int) -> tuple[str, int] | None:
    """A stretch of one line that repeats: sentences (see Runs), or a span (see span_run):
    (detail, offset in the line). Most lines are spared both scans (see may_repeat_inline)."""
    if not may_repeat_inline(line, min_repeats, min_chars):
        return None
    return sentence_runs(line, min_repeats, min_chars) or span_run(line, min_repeats, min_chars)


SPAN_PROBE = 16  # characters of a line looked up further on, to find a span that repeats
SPAN_WORD = re.compile(r"[^\W\d_]{2}")
SENTENCE_MARKS = (".", "!", "?", "。", "！", "？", "；", "\\n")
PROBED_LINE = 4096  # longer lines are scanned whatever (the probes below cost their length each)


def may_repeat_inline(line: str, min_repeats: int, min_chars: int) -> bool:
    """False only where inline_runs finds nothing. A stretch of identical sentences (or blocks of
    them) and a span that repeats are each a periodic stretch of min_chars characters or more, two
    copies at least: with min_chars of 64 or more, one of span_run's probes (every max(16,
    min_chars / 4) characters) falls inside its first copies and comes back further on. Alike
    sentences need NEAR_FACTOR * min_repeats sentences, so as many sentence ends but one."""
    if min_chars < 4 * SPAN_PROBE or len(line) > PROBED_LINE:
        return True
    if sum(map(line.count, SENTENCE_MARKS)) >= NEAR_FACTOR * min_repeats - 1:
        return True
    find = line.find
    for i in range(0, len(line) - SPAN_PROBE + 1, max(SPAN_PROBE, min_chars // 4)):
        if find(line[i:i + SPAN_PROBE], i + 1) >= 0:
            return True
    return False


def span_run(line: str, min_repeats: int, min_chars: int) -> tuple[str, int] | None:
    """A span of 2 to 2 x min_chars characters repeated min_repeats times in a row over min_chars
    characters anywhere in one line, sentence ends or not ('Laptop 16 review Laptop 16 review ...',
    ' OR id = 4411 OR id = 4411 ...' in a tool's argument): (detail, offset), or None. The span
    holds a word (two letters in a row): a rule of '=', a row of zeros or of '|---' is no loop.
    Probes every min_chars / 4 characters, so at least three fall inside any such stretch."""
    stride, size = max(SPAN_PROBE, min_chars // 4), len(line)
    i = 0
    while i + SPAN_PROBE <= size:
        j = line.find(line[i:i + SPAN_PROBE], i + 1, i + 2 * min_chars + SPAN_PROBE)
        period = j - i
        if j < 0 or period < 2:
            i += stride
            continue
        end = i  # line[start:end + period] repeats line[start:start + period]
        while end + 2 * period <= size and line[end + period:end + 2 * period] == line[end:end + period]:
            end += period
        while end + period < size and line[end] == line[end + period]:
            end += 1
        start = i
        while start >= period and line[start - period:start] == line[start:start + period]:
            start -= period
        while start and line[start - 1] == line[start - 1 + period]:
            start -= 1
        span, copies = line[start:start + period], (end + period - start) // period
        if copies >= min_repeats and end + period - start >= min_chars and SPAN_WORD.search(span):
            return f"{copies} x {span[:60]!r} (a span repeated within one line)", start
        i = max(i + stride, end)
    return None


def sentence_runs(line: str, min_repeats: int, min_chars: int) -> tuple[str, int] | None:
    """A stretch of sentences of one line that repeats (see Runs): (detail, offset in the line)."""
    ends = [m.end() for m in SENTENCE_END.finditer(line)]
    units = [line[a:b] for a, b in zip([0, *ends], [*ends, len(line)]) if b > a]
    # Most lines hold no sentence twice, and too few sentences for a run of alike ones.
    if len(units) < NEAR_FACTOR * min_repeats and len(set(units)) == len(units) or not may_run(units, min_repeats):
        return None
    runs = Runs(min_repeats, min_chars, "sentence")
    for unit in units:
        runs.add(unit)
    return runs.found()


def line_runs(lines: Sequence[str], min_repeats: int, min_chars: int) -> tuple[str, int] | None:
    """The first stretch of lines that repeats as Runs finds them: (detail, character offset)."""
    if not may_run(lines, min_repeats) and not any(
            len(line) >= min_chars and inline_runs(line, min_repeats, min_chars) for line in lines):
        return None
    runs = Runs(min_repeats, min_chars)
    for line in lines:
        runs.add(line)
    return runs.found()


def may_run(units: Sequence[str], min_repeats: int) -> bool:
    """Whether Runs can find a stretch of identical or alike units among ``units`` (the stretches
    within one line aside): False only where it cannot, from what each kind of stretch needs, most
    of it at C speed (Runs itself takes Python steps for every unit: most texts are spared them).

    - identical copies: a non-blank unit (a stretch's first) at min(min_repeats, RESTART_COPIES)
      equal steps of LONG_BLOCK units at most (a restarted answer's last copy holds its first unit);
    - alike ones, in blocks of k units (k up to BLOCK_LINES): NEAR_FACTOR * min_repeats units k
      apart, each equal to the one before, or both prose with as many words (prose_words) and
      lengths ALIKE_SLACK characters apart at most."""
    counts, copies = Counter(units), min(min_repeats, RESTART_COPIES)
    if max(counts.values(), default=0) >= copies:
        repeated = {unit for unit, n in counts.items() if n >= copies and unit.strip()}
        where: dict[str, list[int]] = {unit: [] for unit in repeated}
        for i, unit in enumerate(units):
            if unit in where:
                where[unit].append(i)
        for at in where.values():
            present = set(at)
            for n, a in enumerate(at):
                for b in islice(at, n + 1, None):
                    if b - a > LONG_BLOCK:
                        break
                    if all(a + j * (b - a) in present for j in range(2, copies)):
                        return True
    need = NEAR_FACTOR * min_repeats
    if len(units) < need:
        return False
    joined = "".join(units)
    if not joined.isascii() and CJK_CHAR.search(joined):  # prose_words counts a CJK character as a word
        words = [len(WORD.findall(unit)) if CJK_CHAR.search(unit) else len(unit.split()) for unit in units]
    else:
        words = [len(unit.split()) for unit in units]
    common = {w for w, n in Counter(words).items() if n >= need and w}
    if not common:
        return False
    candidates = [i for i, w in enumerate(words) if w in common]
    prose = {i: units[i] if prose_words(units[i]) is not None else None for i in candidates}
    # Identical copies at equal steps being ruled out above, no chain holds two equal pairs in a
    # row: it holds an alike pair, two prose units (most code and tables end here)
    if sum(1 for unit in prose.values() if unit) < 2:
        return False
    for k in range(1, BLOCK_LINES + 1):
        chain: dict[int, int] = {}  # unit -> units k apart up to it, each equal to or alike the one before
        for i in candidates:
            j = i - k
            chain[i] = chain[j] + 1 if j in chain and (units[i] == units[j] or prose[i] and prose[j] and (
                words[j] == words[i] and abs(len(units[i]) - len(units[j])) <= ALIKE_SLACK)) else 1
            if chain[i] >= need:
                return True
    return False


def find_loop(text: str, min_repeats: int, min_chars: int) -> Loop | None:
    """Where the text loops, or None: identical lines or blocks of up to 8 lines repeated
    ``min_repeats`` times in a row over ``min_chars`` characters; a tail that is one span over and
    over (no line breaks needed); one line making up half of the last 40; or a stretch of Runs
    (alike prose, long blocks, a restarted answer, sentences or a span within one line). Code,
    tables, numbered lists and data lines that are alike but not identical never count. The start
    of a repeating tail is where the span begins to repeat, however far back."""
    lines = text.split("\n")
    counts = Counter(lines)
    # 10 (half of RECENT_MIN) and not more: recent_line needs a line 10 times or more
    frequent = frequent_lines(counts, min(min_repeats, RECENT_MIN // 2))
    hit = line_blocks(lines, min_repeats, min_chars, frequent)
    if hit is None and (span := tail_span(text[-tail_window(min_chars):], min_repeats, min_chars)):
        period, start = span[1], len(text) - span[1]
        while start >= period and text[start - period:start] == text[start:start + period]:
            start -= period
        while start and text[start - 1] == text[start - 1 + period]:
            start -= 1
        return Loop(span[0], start)
    if hit is None and any(counts[line] >= RECENT_MIN // 2 for line in frequent):  # most texts have none
        hit = recent_line(lines)
    if hit is None and (runs := line_runs(lines, min_repeats, min_chars)):
        return Loop(*runs)
    return hit and Loop(hit[0], sum(len(ln) + 1 for ln in islice(lines, hit[1])))


def repetition_loop(text: str, min_repeats: int, min_chars: int) -> str | None:
    """What repeats where the text loops (see find_loop), or None: the check of the same name."""
    loop = find_loop(text, min_repeats, min_chars)
    return loop.detail if loop else None


# Tag loops: the model's own markup (think, tool-call and tool-response tags, function and parameter
# tags, special tokens) with only whitespace between, a unit of 1 to LOOP_UNIT_MAX tags repeated
# LOOP_MIN_REPEATS times or more in a row, e.g. "<tool_call> </think>" x 40. Parallel calls never
# match: their arguments stand between the tags.
MARKUP = re.compile(r"</?(?:think|tool_call|tool_response)>|<(?:function|parameter)=[^<>\n]{1,60}>|"
                    r"</(?:function|parameter)>|<\|[a-z_]+\|>")
LOOP_UNIT_MAX = 4
LOOP_MIN_REPEATS = 3


def loop_patterns(text: str) -> dict[tuple[str, ...], int]:
    """Each tag loop of the text (its unit: a tuple of tags) with its longest run in a row."""
    found: dict[tuple[str, ...], int] = {}
    runs, last_end = [], None
    for m in MARKUP.finditer(text):
        if last_end is None or text[last_end:m.start()].strip():
            runs.append([])
        runs[-1].append(m.group())
        last_end = m.end()
    for tags in runs:
        for k in range(1, LOOP_UNIT_MAX + 1):
            for first, equal in periodic_runs(tags, k):
                repeats = (equal + k) // k
                if repeats >= LOOP_MIN_REPEATS:
                    unit = tags[first:first + k]
                    # one name per loop, wherever it starts: from its first opening tag
                    start = next((j for j, tag in enumerate(unit) if not tag.startswith("</")), 0)
                    unit = tuple(unit[start:] + unit[:start])
                    found[unit] = max(found.get(unit, 0), repeats)
    # a unit of two tags repeated is also a unit of four: keep the shortest
    return {u: n for u, n in found.items()
            if not any(len(o) < len(u) and len(u) % len(o) == 0 and u == o * (len(u) // len(o)) for o in found)}


CERTAIN_LINES = 4 * RECENT_LINES  # the non-empty lines a line must make half of before it is a loop


def certain_loop(text: str, min_repeats: int, min_chars: int) -> Loop | None:
    """``find_loop`` of a text that loops whatever comes after it (the checks above), else None."""
    lines = text.split("\n")
    complete, window = lines[:-1], tail_window(min_chars)
    tail = text[-window:]
    span = tail_span(tail, min_repeats, min_chars) if len(tail) == window else None
    recent = [ln for ln in complete if ln.strip()][-CERTAIN_LINES:]
    common = Counter(ln for ln in recent if len(ln.strip()) >= RECENT_CHARS).most_common(1)
    if (line_blocks(complete, min_repeats, min_chars) or line_runs(complete, min_repeats, min_chars)
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
        self._runs = Runs(min_repeats, min_chars)  # the complete lines, for the loops of Runs
        self._runs_hit = False

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
        hit = self._runs_hit or (lo is not None and line_blocks(lines[lo:], self.min_repeats, self.min_chars))
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
        self._runs_hit = self._runs.add(line) or self._runs_hit
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
