"""Online loop detection's cost per streamed token: dflash.loops.LoopWatch against the floor and
the naive re-check, on long outputs that loop and that do not.

Outputs, 4 characters a token: a good one (reasoning prose, then an answer of prose, code
listings, markdown tables and numbered lists: validate_throughput.py's generator) of 4k and 32k
tokens, and a looping one of each length (the same good text, then the story's
``<tool_call>\\n</think>\\n`` from 200 tokens before the end). Each is cut in deltas of 1 to 7
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

from dflash.loops import LoopWatch, certain_loop, repetition_loop

MIN_REPEATS, MIN_CHARS = 4, 200
LOOP = "<tool_call>\n</think>\n"
NODE_TOKENS_PER_S, IN_FLIGHT, CLIENT_JOBS = 25_000, 1_472, 92
# One token of a vLLM stream as the client reads it (for scale: it parses one per token anyway).
SSE_CHUNK = (b'{"id":"chatcmpl-8f3a1c2d9e7b4a60","object":"chat.completion.chunk","created":1764633600,'
             b'"model":"Qwen/Qwen3.6-27B","choices":[{"index":0,"delta":{"content":" the"},"logprobs":null,'
             b'"finish_reason":null,"token_ids":[279]}]}')


def output(tokens: int, looping: bool, seed: int) -> str:
    rng = random.Random(seed)
    chars = 4 * tokens
    text = prose(rng, chars // 3) + "\n</think>\n\n" + answer_body(rng, chars - chars // 3)
    text = text[:chars - (800 if looping else 0)]
    text = text[:text.rfind("\n") + 1]
    return text + LOOP * ((chars - len(text)) // len(LOOP)) if looping else text


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
    print(f"{'output':<22}{'deltas':>8}{'fed':>8}{'floor us/tok':>14}{'watch us/tok':>14}{'naive us/tok':>14}"
          f"{'watch/floor':>13}{'naive/watch':>13}{'watch/40us':>12}")
    for tokens in (4_000, 32_000):
        stride = 1 if tokens <= 4_000 else 32
        for looping in (False, True):
            text = output(tokens, looping, seed=tokens)
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
            name = f"{tokens // 1000}k {'looping' if looping else 'good'}"
            print(f"{name:<22}{len(pieces):>8}{fed:>8}{us['floor']:>14.3f}{us['watch']:>14.3f}{us['naive']:>14.1f}"
                  f"{statistics.median(ratios['watch/floor']):>13.1f}{statistics.median(ratios['naive/watch']):>13.0f}"
                  f"{us['watch'] / budget_us:>12.1%}")
            if looping:
                print(f"{'':<22}fired after {len(''.join(pieces[:fed])):,} of {len(text):,} characters "
                      f"(the loop starts at {text.index(LOOP):,})")
    print(f"load average at the end {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
