"""LoopWatch against its oracle, certain_loop on the text so far at every delta.

Property tests with fixed seeds (no hypothesis dependency): for every text and every chunking the
watch fires after exactly the first delta at which certain_loop holds on the text so far, with
repetition_loop's detail and find_loop's start as first_position; wherever certain_loop holds,
validation rejects the text so far (an aborted record is one it rejects). Then the corpus of
item 4: legitimately repetitive good outputs, none cut, though validation would reject some of
their prefixes."""
import json
import random
from itertools import islice

import pytest

from dflash.core.loops import LoopWatch, certain_loop, find_loop, repetition_loop
from dflash.validate.stage import judge
from tests.test_validate import (CFG, CODE_LISTING, GOOD, LOOPING_PARAGRAPH, NUMBERED, REASONING, STORY_LOOP, TABLE,
                                 record)

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

def real_loops() -> dict[str, str]:
    """The loops real Qwen3.6 writes that identical lines miss (issue 43), each in a realistic
    answer that goes on after the loop (most end with stop), in English and Chinese."""
    rng = random.Random(43)
    intro = f"{REASONING}\n</think>\n\nLet me work through the task before I answer.\n\n"
    outro = "\n\nSo the final answer is 42, and the check above confirms it.\n"
    sentence = "I need to double-check whether the sum of the first column matches the total. "
    words = ["total", "sum", "column", "row", "value", "result", "count", "price", "amount", "figure"]
    answer = ["## Summary", "", "The report has three parts:", "", "1. The revenue by region, from the Q3 sheet.",
              "2. The costs, split into fixed and variable.", "3. The margin, as revenue minus costs.", "",
              "| region | revenue |", "|---|---|", "| north | 120 |", "| south | 95 |", "",
              "The margin grew by 4 points over the quarter.", "", "## Details", "",
              "North led the quarter on the back of two large orders from the retail chain.",
              "South fell short of its target: the new store opened three weeks late.",
              "Fixed costs held flat; variable costs rose with the volume, as expected.",
              "The one surprise is freight, which doubled after the carrier changed its rates.", "",
              "## Next steps", "", "- Renegotiate the freight contract before the next quarter.",
              "- Move the south store's launch budget into the fourth quarter.",
              "- Report the margin per region every month, not every quarter."]
    block = ["def load(path):", "    with open(path) as f:", "        rows = [line.split(',') for line in f]",
             "    header, *body = rows", "    return header, body", "", "Now I run it on the sample file and look",
             "at the header again to see whether the columns line up.", "The header still has five columns.",
             "So the loader is fine; the bug must be elsewhere."]
    return {
        # one line: a sentence dozens of times, then the line (and the answer) goes on
        "one line": intro + "The table has five rows. " + sentence * 40 + "Done: the totals agree." + outro,
        "one line zh": intro + "表格一共有五行。" + "我需要再检查一下第一列的总和是否等于合计。" * 40 + "检查完毕，合计正确。" + outro,
        "counter": intro + "".join(f"Step {i}: Check the value again.\n" for i in range(1, 61)) + outro,
        "counter day": intro + "".join(f"Day {i}: Review.\n" for i in range(1, 80)) + outro,
        "counter zh": intro + "".join(f"第{i}步：检查。\n" for i in range(1, 80)) + outro,
        "near copies": intro + "".join(f"I should verify the {words[i % len(words)]} once more before I give the "
                                       f"final answer to the user.\n" for i in range(40)) + outro,
        "near copies zh": intro + "".join(f"我应该再确认一下这个{rng.choice(['结果', '数值', '总和', '金额'])}"
                                          "是否正确，然后再回答用户的问题。\n" for i in range(40)) + outro,
        "long block": intro + "\n".join(block * 5) + outro,
        "restarted answer": intro + "\n".join(answer * 6) + "\n## Summ",  # cut by the cap
        # a shorter answer written three times, the last copy without its separator
        "restarted 3 times": intro + "\n\n---\n\n".join(["\n".join(answer[:14])] * 3) + outro,
        # a span within one line, no sentence ends (a search query, SQL)
        "span in one line": intro + "<tool_call>\n<function=search_web>\n<parameter=query>\n"
                            + "Framework Laptop 16 review " * 30 + "\n</parameter>\n</function>\n</tool_call>",
        "span in sql": intro + "SELECT * FROM tickets WHERE (account_id = 4411" + " OR account_id = 4411" * 50
                       + ");" + outro,
        "tool xml argument": intro + "<tool_call>\n<function=write_file>\n<parameter=path>\nload.py\n"
                             "</parameter>\n<parameter=content>\n" + "\n".join(block * 5)
                             + "\n</parameter>\n</function>\n</tool_call>",
        "tool json argument": intro + '<tool_call>\n{"name": "write_file", "arguments": {"path": "notes.md", '
                              '"content": "# Notes\\n' + "Remember to check the totals before the review.\\n" * 30
                              + '"}}\n</tool_call>',
    }


def real_goods() -> dict[str, str]:
    """Legitimate repetition alike the loops above: none is a loop."""
    rng = random.Random(44)
    fruits = ("apples pears plums cherries grapes lemons limes melons peaches oranges figs dates kiwis mangoes "
              "papayas guavas apricots quinces").split()
    places = "kitchen garage attic cellar garden office hallway bedroom porch".split()
    tasks = ["Write the migration script", "Review the API docs", "Set up the staging server", "Port the CLI",
             "Fix the flaky upload test", "Draft the release notes", "Rotate the signing keys", "Audit the logs"]
    numbered = "\n".join(f"{i}. {rng.randint(1, 9)} {rng.choice(fruits)} from the {rng.choice(places)}"
                          for i in range(1, 301))
    task_list = "\n\n".join(f"## {i}. {rng.choice(tasks)} ({rng.choice(places)})\n\n- Status: pending\n"
                             f"- Owner: {rng.choice(['Ana', 'Bo', 'Chen', 'Dev'])}" for i in range(1, 31))
    checks = "\n".join(f"Let me check: the {rng.choice(places)} list has {rng.randint(2, 40)} {rng.choice(fruits)}, "
                        f"and the {rng.choice(['invoice', 'receipt', 'order'])} says the same." for _ in range(60))
    switch = "switch (op) {\n" + "".join(f"case {i}:\n    total += step_{i}(x);\n    break;\n" for i in range(60)) \
        + "default:\n    break;\n}\n" + "}\n" * 5
    csv_rows = "id,name,qty,price\n" + "\n".join(f"{i},{rng.choice(fruits)},{rng.randint(1, 50)},"
                                                 f"{rng.randint(1, 9)}.{rng.randint(0, 99):02d}" for i in range(300))
    steps_zh = "\n".join(f"第{i}步：{a}。" for i, a in enumerate(
        ["打开配置文件", "找到数据库的连接地址", "把端口改成五四三二", "保存文件并退出", "重启服务", "查看日志确认没有报错",
         "运行测试用例", "提交修改", "通知团队成员", "更新文档"], 1))
    paragraph_zh = "".join(rng.sample(["今天的天气很好。", "我们去公园散步。", "公园里有很多人。", "孩子们在草地上玩耍。",
                                       "老人们在树下下棋。", "湖边有人在钓鱼。", "我们买了两瓶水。", "太阳快要下山了。",
                                       "我们决定回家。", "路上遇到了老朋友。"], 10))
    days = "\n".join(f"Day {i}: {rng.choice(['Run 5 km', 'Rest', 'Swim', 'Cycle 20 km', 'Yoga', 'Strength'])}."
                      for i in range(1, 31))
    draft = "\n".join(["def mean(xs):", "    if not xs:", "        raise ValueError('empty')", "    total = 0",
                        "    for x in xs:", "        total += x", "    return total / len(xs)", "", "print(mean([1, 2]))",
                        "# prints 1.5"])
    twice = f"My draft:\n\n{draft}\n\nIt works. The final version:\n\n{draft}\n\nThe same code, tested."
    plan = "\n".join(f"Week {w}: run {w * 2} km on Monday, swim on Wednesday, rest on Friday." for w in range(1, 9))
    chorus = "Hold the lantern, hold it high,\nwe walk the shore till the tide runs dry,\nand the morning sings."
    song = "\n\n".join(part for verse in ("Salt on the rope,\na gull on the mast.", "Boots by the door,\nnets on "
                                           "the sand.", "The storm will come,\nthe storm will go.") for part in (verse, chorus))
    one_liners = "\n".join(['<path d="M0 0 ' + "h10 v10 " * 40 + 'z"/>', "AAAA" * 80 + "SUVORK5CYII=",
                            json.dumps([0.0] * 96), "|" + "---|" * 40])
    return {"chorus": song, "repeating one-liners": one_liners, "numbered to 300": numbered, "task list": task_list, "let me check": checks, "switch": switch,
            "csv": csv_rows, "steps zh": steps_zh, "paragraph zh": paragraph_zh, "days": days,
            "draft then answer": twice, "weekly plan": plan}


REAL_LOOPS, REAL_GOODS = real_loops(), real_goods()
LOOPS.update({f"real: {k}": v for k, v in REAL_LOOPS.items()})

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
    # is " after "T"; the paragraph (100 characters: half min_chars) is certain at its third copy
    # (RESTART_COPIES), from its first; a line making half of the last 40
    # starts at its first copy among them (validation's own rule); "Step {i} is fine." is a counter
    # loop, certain at its 12th pair of lines (alike but for a number: NEAR_FACTOR * min_repeats)
    expected = {"story": (201, 0), "paragraph": (299, 0), "tail": (2049, 1), "alternating": (530, 0)}
    for name, text in islice(LOOPS.items(), 4):
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
              **{f"validator: {k}": v for k, v in VALIDATOR_GOOD.items()},
              **{f"real: {k}": v for k, v in REAL_GOODS.items()}}
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
        assert watch(pieces, 4, 200) == (None, None, None), how
        # The oracle re-checks the whole text at every delta: quadratic; on the long samples it
        # runs on the coarse chunkings only (the random texts hold the watch to it at every one).
        if how in ("burst", "whole") or len(text) <= 6_000:
            assert oracle(pieces, 4, 200) == (None, None, None), how


def test_find_loop_says_where_the_loop_begins():
    head = f"{REASONING}\n</think>\n\n"
    assert find_loop(STORY_LOOP["text"], 4, 200) == ("400 x '<tool_call>\\n</think>' (2 lines in a row)", len(head))
    # a tail far longer than the 2,048 characters the check reads: the start is still its first copy
    spans = find_loop(head + "Then: " + "ab c" * 3000, 4, 200)
    assert spans == ("the tail repeats 'ab c' (period 4 chars)", len(head + "Then: "))
    assert find_loop(head + "Then: " + "ab c" * 10, 4, 200) is None


# What each real loop is found as (the rule that catches it), and the text its first copy begins with.
REAL_RULES = {"one line": ("within one line", "I need to double"), "one line zh": ("within one line", "我需要再检查"),
              "counter": ("alike but for a number", "Step 1:"), "counter day": ("alike but for a number", "Day 1:"),
              "counter zh": ("alike but for a number", "第1步"), "near copies": ("alike but for a number or a word",
                                                                   "I should verify"),
              "near copies zh": ("alike but for a number or a word", "我应该再确认"),
              "long block": ("a block of 10 lines", "def load"), "restarted answer": ("a block of 27 lines", "## Summary"),
              "tool xml argument": ("a block of 10 lines", "def load"),
              "tool json argument": ("within one line", "Remember to"),
              "restarted 3 times": ("3 x '## Summary\\n\\nThe report has three parts:\\n\\n1. The revenue by r' (a block of 17 lines", "## Summary"),
              "span in one line": ("a span repeated within one line", "Framework Laptop"),
              "span in sql": ("a span repeated within one line", "account_id = 4411")}


@pytest.mark.parametrize("name", REAL_LOOPS)
def test_real_loops_are_found_cut_and_rejected(name):
    """Each loop real Qwen3.6 writes is found by its rule where it begins, certain in the stream
    and rejected by validation as repetition_loop."""
    text = REAL_LOOPS[name]
    loop = find_loop(text, 4, 200)
    rule, first = REAL_RULES[name]
    assert loop and rule in loop.detail and loop.start == text.index(first), loop
    assert certain_loop(text, 4, 200) == loop  # the stream watch cuts it (at the latest once its line ends)
    reasons, _, _, details = judge(record(text), CFG)
    assert "repetition_loop" in reasons and details["repetition_loop"] == loop.detail


@pytest.mark.parametrize("name", REAL_GOODS)
def test_real_repetition_that_is_no_loop_passes_validation(name):
    assert "repetition_loop" not in judge(record(f"{REASONING}\n</think>\n\nHere it is.\n\n{REAL_GOODS[name]}"), CFG)[0]


def near_miss_text(rng: random.Random) -> str:
    """Text built to sit near the rules' thresholds: prose alike but for a counter or a word, a
    sentence or a span a few times in a row within one line, blocks of lines 1 to 5 times with and
    without a separator, CJK steps, code and blank lines between."""
    words = ["value", "total", "row", "sum", "price"]
    pieces = []
    for _ in range(rng.randint(2, 10)):
        kind, n = rng.randrange(6), rng.randint(1, 14)
        if kind == 0:
            pieces.append("\n".join(f"Step {i}: check the {rng.choice(words[:2])} again." for i in range(n)))
        elif kind == 1:
            sep = rng.choice([" ", "", "  "])
            pieces.append(sep.join([rng.choice(["Let me verify the sum once more.", "第1步：检查。", "Wait."])] * n)
                          + sep + "Then it is done.")
        elif kind == 2:
            pieces.append("SELECT a FROM t WHERE (id = 7" + rng.choice([" OR id = 7", " OR x", " review X"]) * n + ")")
        elif kind == 3:
            block = "\n".join(rng.choice(["## Summary", "", "The margin grew by four points over the quarter.",
                                          "- Renegotiate the freight contract.", "    return total", "|---|---|"])
                              for _ in range(rng.randint(1, 12)))
            pieces.append(rng.choice(["\n", "\n\n---\n\n", "\n\n"]).join([block] * rng.randint(1, 5)))
        elif kind == 4:
            pieces.append(" ".join(f"I should check the {rng.choice(words)} now." for _ in range(n)))
        else:
            pieces.append(rng.choice(["", "x = f(y)  # first", "    }", "Done."]))
    return rng.choice(["\n", "\n\n", " "]).join(pieces)


@pytest.mark.parametrize("seed", range(40))
def test_the_gates_spare_only_texts_without_a_stretch(seed, monkeypatch):
    """may_run and may_repeat_inline only let Runs skip texts and lines where it finds nothing:
    with both gates open, every text near the thresholds gets the same answer."""
    import dflash.core.loops as loops
    rng = random.Random(seed)
    for _ in range(10):
        lines = near_miss_text(rng).split("\n")
        for min_repeats, min_chars in THRESHOLDS + [(2, 64), (3, 100), (4, 64)]:
            loops.inline_runs.cache_clear()
            gated = (loops.line_runs(lines, min_repeats, min_chars),
                     [loops.inline_runs(line, min_repeats, min_chars) for line in lines])
            with monkeypatch.context() as m:
                m.setattr(loops, "may_run", lambda *a: True)
                m.setattr(loops, "may_repeat_inline", lambda *a: True)
                loops.inline_runs.cache_clear()
                assert gated == (loops.line_runs(lines, min_repeats, min_chars),
                                 [loops.inline_runs(line, min_repeats, min_chars) for line in lines]), lines
    loops.inline_runs.cache_clear()
