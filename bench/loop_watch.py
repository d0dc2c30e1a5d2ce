"""Online loop detection's cost per streamed token: dflash.core.loops.LoopWatch against the floor and
the naive re-check, on long outputs that loop and that do not.

Outputs, 4 characters a token: a good one (reasoning prose, then an answer of prose, code
listings, markdown tables and numbered lists: validate_throughput.py's generator) of 4k and 32k
tokens; a good one with legitimate repetition (the same, with a numbered list to 300, a task list
repeating ``- Status: pending``, ``Let me check: ...`` lines, CSV rows, a switch statement and
numbered Chinese steps between its parts); a looping one of each length (the same good text,
then the story's ``<tool_call>\\n</think>\\n`` from 200 tokens before the end); and, at 4k tokens,
one for each loop of issue 43 (a counter loop, a sentence repeated inside one line, near copies
with one word changed, a Chinese counter loop, a block of 16 lines, from 750 tokens before the
end). Each is cut in deltas of 1 to 7
characters (4 on average: a token's worth, as a server streams them) and fed, side by side:

- floor:  a bare loop appending each delta to a string (what a client does with a stream anyway);
- watch:  ``LoopWatch.feed`` on each delta (min_repeats 4, min_chars 200: the default), up to the
          delta it fires at (a client then closes the stream);
- naive:  ``certain_loop`` (the validator's checks, held to what more text cannot undo) on the
          whole text so far after each delta, up to the same delta.
          It is quadratic: on the 32k-token outputs it runs after every 32nd delta only, and its
          time is multiplied by 32 (the cost of a call grows linearly with the text, so the
          sampled sum scaled is the full sum within a few percent).

--rounds rounds (default 5), the order of the three sides rotating between rounds; the ratios
are taken per round and the median reported, with the median microseconds per token (per delta).
Each output is checked first: the watch fires on the looping ones at the delta the naive check
does, and on no good one.

The server's side: the run in DESIGN.md made 25,000 output tokens/s on a 7x B200 node with
1,472 requests in flight (92 generate jobs x 16). A client sees a token of one sequence every
1,472 / 25,000 = 59 ms; a generate job (one Python process, one core, all its streams) a token
every 92 / 25,000 = 3.7 ms; and if one client process took the whole node's stream, a token every
40 us. The figure a watch must stay well under is the last, the tightest: the per-token time of
the client process, not of a sequence. For scale the bench also times what the client already
does per token: ``json.loads`` of one SSE chunk.

Usage: python bench/loop_watch.py [--rounds 5]
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import random
import statistics
import time
import timeit

from validate_throughput import answer_body, prose

from dflash.core.loops import LoopWatch, certain_loop, repetition_loop

MIN_REPEATS, MIN_CHARS = 4, 200
LOOP = "<tool_call>\n</think>\n"
NODE_TOKENS_PER_S, IN_FLIGHT, CLIENT_JOBS = 25_000, 1_472, 92
# One token of a vLLM stream as the client reads it (for scale: it parses one per token anyway).
SSE_CHUNK = (b'{"id":"chatcmpl-8f3a1c2d9e7b4a60","object":"chat.completion.chunk","created":1764633600,'
             b'"model":"Qwen/Qwen3.6-27B","choices":[{"index":0,"delta":{"content":" the"},"logprobs":null,'
             b'"finish_reason":null,"token_ids":[279]}]}')


BLOCK = ["def load(path):", "    with open(path) as f:", "        rows = [line.split(',') for line in f]",
         "    header, *body = rows", "    return header, body", "", "Now I run it on the sample file and look",
         "at the header again to see whether the columns line up.", "The header still has five columns.",
         "So the loader is fine; the bug must be elsewhere.", "Let me look at the loader once more.", "",
         "The parser splits on commas, but the third column holds quoted text with commas in it,",
         "so a row like 'Smith, John' becomes two fields and every column after it shifts by one.",
         "That explains the totals: the amounts are read from the wrong column for those rows.", ""]
# What each looping output ends in, copy i of it, and how many tokens before the end it starts.
LOOPS = {"story": (lambda i: LOOP, 200),
         "counter": (lambda i: f"Step {i}: Check the value again.\n", 750),
         "one line": (lambda i: "I need to double-check whether the sum of the first column matches the total. ", 750),
         "near copies": (lambda i: f"I should verify the {random.Random(i).choice(['total', 'sum', 'row', 'price'])} "
                                   "once more before I give the final answer.\n", 750),
         "counter zh": (lambda i: f"第{i}步：再检查一遍这个数值。\n", 750),
         "long block": (lambda i: "\n".join(BLOCK) + "\n", 750)}


def repetitive(rng: random.Random, chars: int) -> str:
    """Legitimate repetition that the loop checks must let pass, in parts of about ``chars``."""
    things = "apples pears plums cherries grapes lemons limes melons figs dates kiwis mangoes".split()
    places = "kitchen garage attic cellar garden office hallway porch".split()
    parts = ["\n".join(f"{i}. {rng.randint(1, 9)} {rng.choice(things)} from the {rng.choice(places)}"
                       for i in range(1, 301)),
             "\n\n".join(f"## {i}. Clean the {rng.choice(places)}\n\n- Status: pending" for i in range(1, 31)),
             "\n".join(f"Let me check: the {rng.choice(places)} list has {rng.randint(2, 40)} {rng.choice(things)}."
                       for _ in range(60)),
             "id,name,qty\n" + "\n".join(f"{i},{rng.choice(things)},{rng.randint(1, 50)}" for i in range(200)),
             "switch (op) {\n" + "".join(f"case {i}:\n    total += step_{i}(x);\n    break;\n" for i in range(40))
             + "}\n" * 4,
             "\n".join(f"第{i}步：{a}。" for i, a in enumerate(["打开配置文件", "找到连接地址", "修改端口", "保存文件",
                                                              "重启服务", "查看日志"], 1))]
    return "\n\n".join(rng.choice(parts)[:chars] for _ in range(4))


def output(tokens: int, kind: str, seed: int) -> tuple[str, int | None]:
    """(text, where its loop starts, or None for a good one)."""
    rng = random.Random(seed)
    chars = 4 * tokens
    text = prose(rng, chars // 3) + "\n</think>\n\n" + answer_body(rng, chars - chars // 3)
    if kind == "good repetitive":  # a part of legitimate repetition after every 4th part of the answer
        parts = text.split("\n\n")
        text = "\n\n".join(part + ("\n\n" + repetitive(rng, 1500)) * (i % 4 == 3) for i, part in enumerate(parts))
    if kind not in LOOPS:
        text = text[:chars]
        return text[:text.rfind("\n") + 1], None
    copy, before = LOOPS[kind]
    text = text[:chars - 4 * before]
    text, i = text[:text.rfind("\n") + 1], 0
    start = len(text)
    while len(text) < chars:
        i += 1
        text += copy(i)
    return text, start


def deltas(text: str, seed: int) -> list[str]:
    rng = random.Random(seed)
    out, i = [], 0
    while i < len(text):
        n = rng.randint(1, 7)
        out.append(text[i:i + n])
        i += n
    return out


def floor(pieces: list[str]) -> float:
    t = time.perf_counter()
    text = ""
    for piece in pieces:
        text += piece
    return time.perf_counter() - t


def watch(pieces: list[str]) -> tuple[float, int]:
    """(seconds, deltas fed) up to the one the watch fires at, or all."""
    t = time.perf_counter()
    w = LoopWatch(MIN_REPEATS, MIN_CHARS)
    for i, piece in enumerate(pieces, 1):
        if w.feed(piece) is not None:
            return time.perf_counter() - t, i
    return time.perf_counter() - t, len(pieces)


def naive(pieces: list[str], stride: int) -> tuple[float, int | None]:
    """(seconds, the delta it first flags at when checking every one), the check timed after
    every ``stride``-th delta and scaled by ``stride``."""
    spent, text, fired = 0.0, "", None
    for i, piece in enumerate(pieces, 1):
        text += piece
        if i % stride == 0 or i == len(pieces):
            t = time.perf_counter()
            hit = certain_loop(text, MIN_REPEATS, MIN_CHARS)
            spent += time.perf_counter() - t
            if hit:
                fired = i
                break
    return spent * stride, fired


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    print(f"python {platform.python_version()} on {platform.machine()}, min_repeats {MIN_REPEATS}, "
          f"min_chars {MIN_CHARS}, {args.rounds} rounds, order rotating, load average {os.getloadavg()[0]:.2f}")
    budget_us = 1e6 / NODE_TOKENS_PER_S
    print(f"server side: a token every {IN_FLIGHT / NODE_TOKENS_PER_S * 1e3:.0f} ms per sequence, "
          f"{CLIENT_JOBS / NODE_TOKENS_PER_S * 1e3:.1f} ms per generate job, {budget_us:.0f} us for one client "
          f"taking the whole node (DESIGN.md's run)")
    parse = statistics.median(timeit.repeat(lambda: json.loads(SSE_CHUNK), number=20_000, repeat=5)) / 20_000 * 1e6
    print(f"for scale: json.loads of one SSE chunk of one token (vLLM's): {parse:.2f} us")
    print(f"{'output':<24}{'deltas':>8}{'fed':>8}{'floor us/tok':>14}{'watch us/tok':>14}{'naive us/tok':>14}"
          f"{'watch/floor':>13}{'naive/watch':>13}{'watch/40us':>12}")
    cases = [(tokens, kind) for tokens in (4_000, 32_000) for kind in ("good", "good repetitive", "story")]
    cases += [(4_000, kind) for kind in LOOPS if kind != "story"]
    for tokens, kind in cases:
        stride = 1 if tokens <= 4_000 else 32
        text, loop_start = output(tokens, kind, seed=tokens)
        looping = loop_start is not None
        pieces = deltas(text, seed=tokens + looping)
        assert (repetition_loop(text, MIN_REPEATS, MIN_CHARS) is not None) == looping
        _, fed = watch(pieces)
        first = next((i for i in range(fed - 1, fed + 1)
                      if certain_loop("".join(pieces[:i]), MIN_REPEATS, MIN_CHARS)), None)
        assert (first == fed) if looping else (fed == len(pieces) and first is None), (tokens, looping)
        sides = {"floor": lambda: (floor(pieces[:fed]), fed), "watch": lambda: watch(pieces),
                 "naive": lambda: (naive(pieces[:fed], stride)[0], fed)}
        per: dict[str, list[float]] = {s: [] for s in sides}
        ratios: dict[str, list[float]] = {"watch/floor": [], "naive/watch": []}
        for r in range(args.rounds):
            names = list(sides)[r % 3:] + list(sides)[:r % 3]
            took = {name: sides[name]()[0] for name in names}
            for name, sec in took.items():
                per[name].append(sec / fed * 1e6)
            ratios["watch/floor"].append(took["watch"] / took["floor"])
            ratios["naive/watch"].append(took["naive"] / took["watch"])
        us = {name: statistics.median(v) for name, v in per.items()}
        name = f"{tokens // 1000}k {'looping ' * looping}{kind}"
        print(f"{name:<24}{len(pieces):>8}{fed:>8}{us['floor']:>14.3f}{us['watch']:>14.3f}{us['naive']:>14.1f}"
              f"{statistics.median(ratios['watch/floor']):>13.1f}{statistics.median(ratios['naive/watch']):>13.0f}"
              f"{us['watch'] / budget_us:>12.1%}")
        if looping:
            print(f"{'':<24}fired after {len(''.join(pieces[:fed])):,} of {len(text):,} characters "
                  f"(the loop starts at {loop_start:,})")
    print(f"load average at the end {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
