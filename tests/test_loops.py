"""LoopWatch against its oracle, certain_loop on the text so far at every delta.

Property tests with fixed seeds (no hypothesis dependency): for every text and every chunking the
watch fires after exactly the first delta at which certain_loop holds on the text so far, with
repetition_loop's detail and find_loop's start as first_position; wherever certain_loop holds,
validation rejects the text so far (an aborted record is one it rejects). Then the corpus of
item 4: legitimately repetitive good outputs, none cut, though validation would reject some of
their prefixes."""
import json
import random

import pytest

from dflash.loops import LoopWatch, certain_loop, find_loop, repetition_loop
from tests.test_validate import (CODE_LISTING, GOOD, LOOPING_PARAGRAPH, NUMBERED, REASONING, STORY_LOOP, TABLE)

THRESHOLDS = [(4, 200), (2, 1), (3, 40), (10, 600)]  # the default, then looser and stricter


def chunkings(text: str, seed: int) -> dict[str, list[str]]:
    """The same text cut as a server could send it: char by char, in token-sized pieces (1 to 8
    characters), in pieces of up to 300 (several lines per delta), and whole."""
    rng = random.Random(seed)
    cuts = {"char": 1, "token": 8, "burst": 300}
    out = {"whole": [text]}
    for name, most in cuts.items():
        pieces, i = [], 0
        while i < len(text):
            n = rng.randint(1, most)
            pieces.append(text[i:i + n])
            i += n
        out[name] = pieces
    return out


def watch(pieces: list[str], min_repeats: int, min_chars: int) -> tuple[int | None, str | None, int | None]:
    """(how many pieces the watch took before firing, its detail, first_position), or (None, None, None)."""
    w = LoopWatch(min_repeats, min_chars)
    for i, piece in enumerate(pieces, 1):
        detail = w.feed(piece)
        if detail is not None:
            assert w.feed("more") == detail  # it stays fired
            return i, detail, w.first_position
    return None, None, None


def oracle(pieces: list[str], min_repeats: int, min_chars: int) -> tuple[int | None, str | None, int | None]:
    text = ""
    for i, piece in enumerate(pieces, 1):
        text += piece
        if piece and (loop := certain_loop(text, min_repeats, min_chars)):
            assert loop == find_loop(text, min_repeats, min_chars)
            assert loop.detail == repetition_loop(text, min_repeats, min_chars)
            return i, loop.detail, loop.start
    return None, None, None


def random_text(rng: random.Random) -> str:
    """Text that sometimes loops and often nearly does: lines and spans from a small stock (so
    lines recur by chance), blocks repeated a random number of times, with or without line
    breaks, a line that comes back often but irregularly, then more text after them."""
    stock = ["", "}", "    }", "x" * rng.randint(1, 30), "the answer is ", "<tool_call>", "</think>",
             "| 1 | 2 |", "Let me check the sum again.", "a", "ab", " "]
    out = []
    for _ in range(rng.randint(1, 12)):
        block = [rng.choice(stock) + (str(rng.randint(0, 3)) if rng.random() < 0.3 else "")
                 for _ in range(rng.randint(1, 9))]
        sep = rng.choice(["\n", "\n", "", " "])
        unit = sep.join(block) + sep
        out.append(unit * rng.randint(1, 12))
        if rng.random() < 0.2:  # one line coming back at uneven gaps, among others and blank lines
            common = rng.choice(stock[3:])
            out.append("\n".join(common if rng.random() < 0.55 else rng.choice(["", f"step {i}", f"{i} and {i}"])
                                  for i in range(rng.randint(10, 60))) + "\n")
        if rng.random() < 0.5:
            out.append(" ".join(rng.choice(["word", "other", "more", "x", "12"]) for _ in range(rng.randint(1, 40))))
    return "".join(out)


LOOPS = {"story": STORY_LOOP["text"], "paragraph": LOOPING_PARAGRAPH["text"],
         "tail": f"{REASONING}\n</think>\n\nThe answer " + "is the answer " * 400,
         "alternating": f"{REASONING}\n</think>\n\n" + "".join(f"Wait, let me re-check that.\nStep {i} is fine.\n"
                                                                   for i in range(200))}
VALIDATOR_GOOD = {"good": GOOD["text"], "code": CODE_LISTING, "table": TABLE, "numbered": NUMBERED,
                  "braces": "}\n" * 6 + "done", "rule": "=" * 120}


@pytest.mark.parametrize("name", [*LOOPS, *VALIDATOR_GOOD])
@pytest.mark.parametrize("min_repeats,min_chars", THRESHOLDS)
def test_fires_exactly_where_certain_loop_first_holds(name, min_repeats, min_chars):
    text = {**LOOPS, **VALIDATOR_GOOD}[name]
    for how, pieces in chunkings(text, seed=len(name)).items():
        assert watch(pieces, min_repeats, min_chars) == oracle(pieces, min_repeats, min_chars), how


@pytest.mark.parametrize("seed", range(100))
def test_fires_exactly_where_certain_loop_first_holds_on_random_texts(seed):
    rng = random.Random(seed)
    text = random_text(rng)
    min_repeats, min_chars = rng.choice(THRESHOLDS + [(4, 60), (2, 300)])
    for how, pieces in chunkings(text, seed).items():
        assert watch(pieces, min_repeats, min_chars) == oracle(pieces, min_repeats, min_chars), (how, text[:200])


def test_loops_abort_early_and_say_where():
    """Each kind of loop the validator finds is cut early, at the first delta that ends where
    certain_loop holds, as a record validation rejects, with first_position where the loop begins:
    blocks of lines once they qualify, a tail once it fills the 2,048 characters the tail check
    reads, a line coming back between others once it makes half of 160 lines."""
    head = len(f"{REASONING}\n</think>\n\n")
    # (characters after the answer's '</think>' where the loop is certain, first_position - head):
    # the story is certain 9 spans into 400, at its first copy; the tail's loop starts at "he answer
    # is " after "T"; the paragraph's at the blank line before it; a line making half of the last 40
    # starts at its first copy among them (validation's own rule)
    expected = {"story": (201, 0), "paragraph": (399, -1), "tail": (2049, 1), "alternating": (3573, 2690)}
    for name, text in LOOPS.items():
        certain = next(n for n in range(head, len(text)) if certain_loop(text[:n], 4, 200))
        assert (certain - head, find_loop(text[:certain], 4, 200).start - head) == expected[name], name
        assert certain < len(text)
        for how, pieces in chunkings(text, seed=7).items():
            fired, detail, first = watch(pieces, 4, 200)
            received = "".join(pieces[:fired])
            # a line making half of the last 40 flickers as the next line starts (validation's rule)
            assert certain <= len(received) < certain + 2 * max(map(len, pieces)), (name, how)
            assert detail == repetition_loop(received, 4, 200) is not None
            assert first == find_loop(received, 4, 200).start


def good_corpus() -> dict[str, str]:
    """Legitimately repetitive good outputs, as a reasoning model writes them: built here, no
    downloads. Every one must pass validation whole."""
    rng = random.Random(18)
    words = "value total check the of and to result item list order first then case".split()
    table = "| # | name | qty | price | in stock |\n|---|---|---|---|---|\n" + "\n".join(
        f"| {i} | {rng.choice(words)}-{i} | {rng.randint(1, 9)} | {rng.randint(1, 99)}.00 | "
        f"{rng.choice(['yes', 'no'])} |" for i in range(400))
    sparse = "| key | a | b | c |\n|---|---|---|---|\n" + "\n".join(
        f"| k{i} | 0 | 0 | {'x' if i % 7 == 0 else '0'} |" for i in range(150))
    c_code = "\n".join(f"static int handler_{i}(struct ctx *c)\n{{\n    if (!c) {{\n        return -1;\n    }}\n"
                       f"    return c->slot[{i}];\n}}\n" for i in range(60))
    nested = "def build():\n    return " + "[" * 30 + "1" + "]" * 30 + "\n" + "\n".join(
        " " * (4 * d) + "}" for d in range(20, -1, -1))
    python = "\n".join(f"    def test_case_{i}(self):\n        self.assertEqual(run({i}), {i * i})\n"
                       for i in range(80))
    numbered = "\n".join(f"{i}. Verify that the value in row {i} matches the total." for i in range(1, 150))
    bullets = "\n".join(f"- [ ] Step {i}: check the {rng.choice(words)} and the {rng.choice(words)}"
                        for i in range(120))
    csv_data = "date,open,high,low,close\n" + "\n".join(
        f"2024-{m:02d}-{d:02d},{rng.randint(100, 200)},{rng.randint(200, 300)},{rng.randint(50, 100)},"
        f"{rng.randint(100, 300)}"
        for m in range(1, 13) for d in range(1, 29))
    json_data = json.dumps([{"id": i, "name": f"user{i}", "active": i % 3 != 0, "roles": ["reader"], "score": 0}
                            for i in range(120)], indent=2)
    log = "\n".join(f"2024-05-01 12:{i // 60:02d}:{i % 60:02d} INFO worker-{i % 4} processed batch {i} in "
                    f"{rng.randint(10, 99)} ms" for i in range(300))
    refrain = "\n\n".join(f"Verse {v}: the {rng.choice(words)} of the {rng.choice(words)} turns again,\n"
                          f"and {rng.choice(words)} falls on the {rng.choice(words)} plain.\n"
                          "Oh, row the boat, row the boat home,\nrow the boat home tonight." for v in range(1, 9))
    dots = "Loading" + "." * 40 + " done\n" + "\n".join(f"{i:>4} | {'#' * rng.randint(1, 60)}" for i in range(100))
    math = "\n".join(f"x_{i} = x_{i - 1} + {i} = {i * (i + 1) // 2}" for i in range(1, 200))
    # Two whose prefixes validation would reject (a tail repeating '=' over 200 characters; one line
    # making half of the last 40), kept whole: a stream must not cut them there.
    banner = "\n".join(["=" * 300, "QUARTERLY REPORT", "=" * 300, *(f"Region {i}: {rng.randint(1, 99)} units"
                                                                  for i in range(30))])
    dispatch = "def dispatch(op, x):\n    if op == 0:\n        return handle(x)\n" + "".join(
        f"    elif op == {i}:\n        return handle(x)\n" for i in range(1, 40)) + "    raise ValueError(op)\n\n" + \
        "\n".join(f"Case {i} covers the {rng.choice(words)} of the {rng.choice(words)}." for i in range(30))
    corpus = {"table": table, "sparse table": sparse, "c code": c_code, "nested brackets": nested,
              "python tests": python, "numbered list": numbered, "checklist": bullets, "csv": csv_data,
              "json": json_data, "log": log, "poem refrain": refrain, "progress dots and bars": dots, "math": math,
              "banner": banner, "dispatch chain": dispatch,
              **{f"validator: {k}": v for k, v in VALIDATOR_GOOD.items()}}
    return {name: f"{REASONING}\n</think>\n\nHere it is.\n\n{body}\n\nThat is the whole output."
            for name, body in corpus.items()}


GOOD_CORPUS = good_corpus()


def test_the_corpus_holds_prefixes_validation_would_reject():
    for name in ("banner", "dispatch chain"):
        text = GOOD_CORPUS[name]
        assert any(repetition_loop(text[:n], 4, 200) for n in range(len(text))), name


@pytest.mark.parametrize("name", GOOD_CORPUS)
def test_no_good_sample_is_cut(name):
    text = GOOD_CORPUS[name]
    assert repetition_loop(text, 4, 200) is None and len(text) > 100
    for how, pieces in chunkings(text, seed=len(name)).items():
        if how == "char" and len(text) > 8_000:
            continue  # the oracle re-checks at every character: quadratic (token-sized pieces cover it)
        assert watch(pieces, 4, 200) == (None, None, None) == oracle(pieces, 4, 200), how


def test_find_loop_says_where_the_loop_begins():
    head = f"{REASONING}\n</think>\n\n"
    assert find_loop(STORY_LOOP["text"], 4, 200) == ("400 x '<tool_call>\\n</think>' (2 lines in a row)", len(head))
    # a tail far longer than the 2,048 characters the check reads: the start is still its first copy
    spans = find_loop(head + "Then: " + "ab c" * 3000, 4, 200)
    assert spans == ("the tail repeats 'ab c' (period 4 chars)", len(head + "Then: "))
    assert find_loop(head + "Then: " + "ab c" * 10, 4, 200) is None
