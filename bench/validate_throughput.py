"""Validation throughput against the read floor, on a synthetic set of realistic completion shards.

The set: N records (default 100,000) in shards of --shard-size, about 7 KB of text per record on
average (reasoning plus answer: prose, code listings, markdown tables, numbered lists), 15% tool
prompts with offered tools and XML calls (some malformed, unknown or off-schema), a few loops and
trivial answers, token ids as the generate stage writes them. Per shard, side by side in one run:

- read floor, same cut: zstd decompress, the token-id arrays cut out of each line with a bytes
              regex (validate leaves them unparsed too: no check reads them), ``json.loads``;
- read floor, whole lines: zstd decompress + ``json.loads`` of every line (what the first version
              of this bench compared with: it parses the arrays validate skips, and flattered us);
- validate:   ``dflash.validate.stage.validate_for_target``, the stage's job with the demo target (its special
              tokens, its XML call format) (every check, validated/rejected shards and the
              QA JSON written).

--rounds rounds (default 5) over every shard, the order of floor and validate alternating between
rounds; the ratio is taken per round and the median reported.

Peak memory: two child processes validate 1 shard and all shards; equal peaks mean memory is
bounded by the shard, not the data set.

Usage: python bench/validate_throughput.py [--records 100000] [--shard-size 5000] [--rounds 5] [--workdir DIR]
"""
from __future__ import annotations

import argparse
import io
import json
import random
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import zstandard

from dflash.core.config import load_config
from dflash.core.io import write_jsonl_zst
from dflash.validate.stage import validate_for_target

ROOT = Path(__file__).resolve().parents[1]
TARGET = ROOT / "data/demo/target"  # its special tokens (control_token_text) and call format (tool_format: target)
WORDS = ("the of and to in is that for it as with was on be by this are or from at which an not have has "
         "value result function list total step first then check case number answer user so we need because "
         "compute return index error sum each order time data table query model token check line").split()
SAMPLING = {"temperature": 1.0, "top_p": 0.95, "top_k": 20, "seed": 0, "max_tokens": 4096}
TOOLS = [{"type": "function", "function": {"name": name, "description": f"{name.replace('_', ' ')}.", "parameters": {
    "type": "object", "properties": props, "required": list(props)[:1], "additionalProperties": False}}}
    for name, props in [
        ("get_weather", {"city": {"type": "string"}, "days": {"type": "integer", "minimum": 1}}),
        ("search_web", {"query": {"type": "string"}, "max_results": {"type": "integer"}}),
        ("send_email", {"to": {"type": "array", "items": {"type": "string"}}, "subject": {"type": "string"},
                        "body": {"type": "string"}}),
        ("convert_currency", {"amount": {"type": "number"}, "from": {"type": "string"}, "to": {"type": "string"}}),
    ]]


def sentence(rng: random.Random) -> str:
    words = rng.choices(WORDS, k=rng.randint(8, 24))
    return " ".join(words).capitalize() + rng.choice([".", ".", ".", "?", ":"])


def prose(rng: random.Random, chars: int) -> str:
    out, n = [], 0
    while n < chars:
        para = " ".join(sentence(rng) for _ in range(rng.randint(2, 6)))
        out.append(para)
        n += len(para) + 2
    return "\n\n".join(out)


def code(rng: random.Random, lines: int) -> str:
    body = [f"    x{i} = data[{i}] * {rng.randint(2, 99)} + offset  # {rng.choice(WORDS)}" for i in range(lines)]
    return "```python\ndef compute(data, offset):\n" + "\n".join(body) + "\n    return x0\n```"


def table(rng: random.Random, rows: int) -> str:
    head = "| name | value | share |\n|---|---|---|\n"
    return head + "\n".join(f"| {rng.choice(WORDS)}_{i} | {rng.randint(1, 9999)} | {rng.random():.2f} |"
                            for i in range(rows))


def numbered(rng: random.Random, items: int) -> str:
    return "\n".join(f"{i}. {sentence(rng)}" for i in range(1, items + 1))


def answer_body(rng: random.Random, chars: int) -> str:
    parts, n = [], 0
    while n < chars:
        kind = rng.random()
        part = (code(rng, rng.randint(5, 40)) if kind < 0.25 else table(rng, rng.randint(4, 20)) if kind < 0.4
                else numbered(rng, rng.randint(3, 10)) if kind < 0.55 else prose(rng, rng.randint(200, 1200)))
        parts.append(part)
        n += len(part)
    return "\n\n".join(parts)


def tool_call(rng: random.Random) -> str:
    roll = rng.random()
    if roll < 0.06:
        return '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"\n</tool_call>'  # bad JSON
    name, args = ("lookup_stock", {"symbol": "AAPL"}) if roll < 0.1 else \
        ("get_weather", {"city": "Paris", "days": "soon" if roll < 0.15 else rng.randint(1, 7)})
    params = "".join(f"<parameter={k}>\n{v}\n</parameter>\n" for k, v in args.items())
    return f"<tool_call>\n<function={name}>\n{params}</function>\n</tool_call>"


def make_record(rng: random.Random, i: int) -> dict:
    tool = rng.random() < 0.15
    category = "tool" if tool else rng.choice(["chat", "code", "reasoning"])
    total = int(rng.lognormvariate(8.68, 0.6))  # text characters: mean about 7 KB, a long tail
    roll = rng.random()
    if roll < 0.02:  # a trivial answer
        reasoning, content = "\n\n", "\nOK."
    elif roll < 0.03:  # a loop until the cap
        reasoning, content = prose(rng, 400) + "\n", "\n\n" + "<tool_call>\n</think>\n" * (total // 20)
    elif tool:
        reasoning = prose(rng, min(total, 3000)) + "\n"
        content = "\n\n" + (sentence(rng) + "\n\n" if rng.random() < 0.3 else "") + tool_call(rng)
    else:
        split = int(total * rng.uniform(0.3, 0.7))
        reasoning, content = prose(rng, split) + "\n", "\n\n" + answer_body(rng, total - split)
    text = reasoning + "</think>" + content
    n_out = min(len(text) // 4, SAMPLING["max_tokens"])  # a text past the cap was cut there: finish_reason length
    return {
        "id": f"{i:016x}", "prompt_id": f"{i:016x}", "source": "synthetic", "category": category,
        "messages": [{"role": "user", "content": sentence(rng)}], "tools": TOOLS if tool else None,
        "text": text, "reasoning": reasoning, "content": content,
        "finish_reason": "length" if roll < 0.03 or n_out == SAMPLING["max_tokens"] else "stop",
        "prompt_token_ids": [rng.randrange(150000) for _ in range(40)],
        "output_token_ids": [rng.randrange(150000) for _ in range(n_out)],
        "usage": {"prompt_tokens": 40, "completion_tokens": n_out},
        "generation": {"backend": "openai", "engine_version": "synthetic", "enable_thinking": True, "model": "synthetic",
                       "sampling": SAMPLING}, "error": None,
    }


def build(workdir: Path, records: int, shard_size: int) -> list[Path]:
    shards = []
    rng = random.Random(0)
    for s, start in enumerate(range(0, records, shard_size)):
        path = workdir / f"shard-{s:05d}.jsonl.zst"
        shards.append(path)
        if not path.exists():
            write_jsonl_zst(path, (make_record(rng, i) for i in range(start, min(records, start + shard_size))))
    return shards


ARRAYS = re.compile(rb'"(prompt_token_ids|output_token_ids)": \[[^\]]*\]')


def read_floor(path: Path, cut: bool) -> tuple[int, int]:
    n = size = 0
    with open(path, "rb") as raw:
        for line in io.BufferedReader(zstandard.ZstdDecompressor().stream_reader(raw), 1 << 20):
            json.loads(ARRAYS.sub(rb'"\1": null', line) if cut else line)
            n += 1
            size += len(line)
    return n, size


def peak_rss_mb(shards: list[Path], cfg_path: Path) -> float:
    """Peak RSS of a child that validates ``shards``."""
    code = ("import sys, resource, json; from pathlib import Path; from dflash.validate.stage import validate_for_target\n"
            "cfg, target = json.loads(sys.argv[1]), sys.argv[2]; out = Path(sys.argv[3])\n"
            "for p in sys.argv[4:]:\n"
            "    validate_for_target(p, out / 'v.zst', out / 'r.zst', out / 'q.json', cfg, None, target)\n"
            "print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)")
    with tempfile.TemporaryDirectory() as out:
        run = subprocess.run([sys.executable, "-c", code, cfg_path.read_text(), str(TARGET), out,
                              *map(str, shards)], capture_output=True, text=True, check=True, cwd=ROOT)
    return float(run.stdout.split()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--records", type=int, default=100_000)
    ap.add_argument("--shard-size", type=int, default=5_000)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--workdir", type=Path, help="keep the synthetic shards here (default: a temp folder)")
    a = ap.parse_args()
    cfg = load_config(ROOT / "config.yaml")["validate"]
    cfg = {**cfg, "checks": {}}  # the schema's defaults: every check on
    with tempfile.TemporaryDirectory() as tmp:
        workdir = a.workdir or Path(tmp) / "shards"
        workdir.mkdir(parents=True, exist_ok=True)
        t0 = time.perf_counter()
        shards = build(workdir, a.records, a.shard_size)
        print(f"synthetic set: {a.records} records in {len(shards)} shards "
              f"({sum(p.stat().st_size for p in shards) / 1e6:.0f} MB zstd) ready in {time.perf_counter() - t0:.0f} s")
        out = Path(tmp) / "out"
        ratios, whole_ratios, totals = [], [], {"cut": 0.0, "whole": 0.0, "validate": 0.0}
        records = size = text = tool = rejected = 0
        for r in range(a.rounds):
            seconds = {"cut": 0.0, "whole": 0.0, "validate": 0.0}
            for path in shards:
                order = ["cut", "whole", "validate"] if r % 2 == 0 else ["validate", "whole", "cut"]
                for what in order:
                    t = time.perf_counter()
                    if what == "validate":
                        qa = validate_for_target(path, out / "v.jsonl.zst", out / "r.jsonl.zst", out / "qa.json", cfg,
                                          None, TARGET)
                    else:
                        n, b = read_floor(path, cut=what == "cut")
                    seconds[what] += time.perf_counter() - t
                if r == 0:
                    records, size, rejected = records + n, size + b, rejected + qa["rejected"]
                    tool += qa["categories"].get("tool", {}).get("records", 0)
                    text += sum(k["reasoning_chars"]["sum"] + k["content_chars"]["sum"] for k in qa["lengths"].values())
            ratios.append(seconds["cut"] / seconds["validate"])
            whole_ratios.append(seconds["whole"] / seconds["validate"])
            totals = {k: totals[k] + v for k, v in seconds.items()}
            print(f"round {r + 1}: validate / floor (same cut) {ratios[-1]:.3f}, validate / floor (whole lines) "
                  f"{whole_ratios[-1]:.3f}")
        print(f"python {sys.version.split()[0]}, zstandard {zstandard.__version__}, orjson not used (json)")
        print(f"mean text per record {text / records / 1000:.1f} KB (mean JSONL line {size / records / 1000:.1f} KB), "
              f"tool prompts {tool / records:.1%}, rejected {rejected / records:.1%}")
        for label, key in [("read floor, same cut (zstd + cut + json.loads)", "cut"),
                           ("read floor, whole lines (zstd + json.loads)", "whole"),
                           ("validate (all checks, writes)", "validate")]:
            rate = records * a.rounds / totals[key]
            print(f"{label:48s} {rate:9.0f} records/s  {size * a.rounds / totals[key] / 1e6:7.1f} MB/s")
        print(f"ratio validate / floor, same cut: median {statistics.median(ratios):.3f} of {a.rounds} rounds "
              f"(whole-line floor: {statistics.median(whole_ratios):.3f})")
        cfg_path = Path(tmp) / "cfg.json"
        cfg_path.write_text(json.dumps(cfg))
        one, every = peak_rss_mb(shards[:1], cfg_path), peak_rss_mb(shards, cfg_path)
        print(f"peak RSS: {one:.0f} MB validating 1 shard, {every:.0f} MB validating all {len(shards)} "
              f"(bounded by the shard: {every <= one * 1.25 + 20})")


if __name__ == "__main__":
    main()
