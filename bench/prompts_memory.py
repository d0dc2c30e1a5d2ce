"""Peak memory of the prompts stage at the real run's scale, and at a tenth of it.

The real run (config/qwen3.6-27b.yaml, DESIGN.md) reads 913,786 prompts from four sources:
ShareGPT conversations (chat), CodeAlpaca instructions (code), OpenAI-format reasoning prompts,
and 113,786 tool prompts carrying their function definitions. This bench writes a synthetic set
shaped like it (formats, categories, counts, sizes; ~1% duplicates, ~0.5% held out, a few prompts
too long for the context; ShareGPT as one JSON array with the quirks of the published file, the
others zstd JSONL) under --data (generated once per scale, reused), then runs
the stage (``build_prompts`` with ``PromptChecks``, the demo tokenizer with Qwen3.6's template,
context 32,768, max_tokens 4,096, shards of 500) in a child process per scale and prints its peak
RSS (``ru_maxrss`` from ``wait4``), the RSS once the tokenizer is loaded (before any record is
read), its wall time and the input size.

This bench measures a bound, not a ratio against a competitor: one run per scale. The stage's
memory must not grow with the records' bytes; it keeps ~350 bytes per record read (a content hash
for the dedup, the id, category and split for the stratification).

Usage: python bench/prompts_memory.py [--scales 0.1,1] [--data /tmp/dflash-prompts-bench]
"""
from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from dflash.core.io import dumps_line, jsonl_zst_writer  # noqa: E402
from dflash.core.units import human_bytes  # noqa: E402

FULL = {"sharegpt": 420_000, "code": 200_000, "reasoning": 180_000, "tools": 113_786}  # 913,786 prompts
SOURCES = [  # as config/qwen3.6-27b.yaml names them
    {"name": "sharegpt", "file": "sharegpt.json", "format": "sharegpt", "category": "chat"},  # an array, as published
    {"name": "code", "file": "code_alpaca.jsonl.zst", "format": "alpaca", "category": "code"},
    {"name": "reasoning", "file": "reasoning.jsonl.zst", "format": "openai", "category": "reasoning"},
    {"name": "tools", "file": "tool_prompts.jsonl.zst", "format": "openai", "category": "tool"},
]
GENERATOR_VERSION = 4  # bump when the records below change: the cached sets are regenerated

CHILD = """
import json, resource, sys, time
from transformers import AutoTokenizer
from dflash.prompts.checks import PromptChecks
from dflash.prompts.stage import build_prompts
sources, out, tokenizer = json.loads(sys.argv[1]), sys.argv[2], sys.argv[3]
checks = PromptChecks(AutoTokenizer.from_pretrained(tokenizer), 32768, 4096, True, "drop")
loaded = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
t = time.perf_counter()
m = build_prompts(sources, out, 500, checks)
print(json.dumps({"loaded_rss": loaded, "stage_s": time.perf_counter() - t, "prompts": m["prompts"],
                  "heldout": m["heldout"], "shards": len(m["shards"]), "dropped": m["dropped"]}))
"""


class Text:
    """Prose-like text drawn from a fixed pool of random words: zstd compresses it about as well
    as real prompts (a few times), not as well as a repeated filler."""

    def __init__(self, rng: random.Random):
        letters = "etaoinshrdlcumwfgypbvkjxqz"
        vocab = ["".join(rng.choices(letters, weights=range(26, 0, -1), k=rng.randint(1, 10))) for _ in range(5000)]
        self.words = rng.choices(vocab, k=4_000_000)
        self.rng = rng

    def __call__(self, lo: int, hi: int) -> str:
        n = self.rng.randint(lo, hi)
        start = self.rng.randrange(len(self.words) - n)
        return " ".join(self.words[start:start + n]).capitalize() + "."


def tool_definition(text: Text, rng: random.Random, k: int) -> dict:
    params = {f"arg_{j}": {"type": rng.choice(["string", "integer", "boolean"]), "description": text(6, 20)}
              for j in range(rng.randint(1, 5))}
    return {"type": "function", "function": {"name": f"tool_{k}", "description": text(15, 60), "parameters": {
        "type": "object", "properties": params, "required": list(params)[:1]}}}


def sharegpt_turns(text: Text, rng: random.Random) -> list[dict]:
    """A conversation as ShareGPT_V3_unfiltered_cleaned_split.json holds them, with its quirks at
    the shares counted in that file (17,671 conversations): 0.7% empty, 0.8% with no user turn (a
    system turn only, or answers only), 0.06% with the roles chatgpt, bing or bard, and 36% that
    start with an assistant turn (the rest of an earlier conversation)."""
    draw = rng.random()
    if draw < 0.0071:
        return []
    if draw < 0.0155:
        return [{"from": "system", "value": text(10, 40)}] if rng.random() < 0.5 else \
            [{"from": "gpt", "value": text(30, 280)} for _ in range(rng.randint(1, 3))]
    assistant = rng.choice(["chatgpt", "bing", "bard"]) if draw < 0.0161 else "gpt"
    turns = [{"from": "system", "value": text(10, 40)}] if rng.random() < 0.2 else []
    if rng.random() < 0.36:
        turns.append({"from": assistant, "value": text(30, 280)})
    for _ in range(rng.choice([1, 1, 1, 2, 2, 3, 4])):
        turns += [{"from": "human", "value": text(10, 100)}, {"from": assistant, "value": text(30, 280)}]
    return turns


def records(name: str, n: int, text: Text, rng: random.Random):
    """``n`` source lines of one source; about 1% repeat an earlier line, 0.5% are held out, and
    1 in 5,000 is longer than the context leaves room for."""
    recent: list[dict] = []
    for i in range(n):
        if recent and rng.random() < 0.01:
            yield rng.choice(recent)
            continue
        if rng.random() < 0.0002:
            long = text(30_000, 32_000)
            rec = {"sharegpt": {"conversations": [{"from": "human", "value": long}]},
                   "code": {"instruction": long}}.get(name, {"messages": [{"role": "user", "content": long}]})
        elif name == "sharegpt":
            rec = {"id": f"{i:07x}_{rng.randrange(16)}", "conversations": sharegpt_turns(text, rng)}
        elif name == "code":
            rec = {"instruction": text(8, 40), "input": text(10, 80) if rng.random() < 0.4 else "",
                   "output": text(20, 200)}
        elif name == "reasoning":
            rec = {"messages": [{"role": "user", "content": text(20, 300)},
                                {"role": "assistant", "content": text(80, 400)}]}
        else:
            tools = [tool_definition(text, rng, k) for k in range(rng.randint(2, 6))]
            call = {"role": "assistant", "content": "", "tool_calls": [{"type": "function", "function": {
                "name": tools[0]["function"]["name"], "arguments": {"arg_0": text(1, 4)}}}]}
            messages = [{"role": "system", "content": text(20, 80)}, {"role": "user", "content": text(15, 80)}, call]
            if rng.random() < 0.3:  # a conversation with the tool's result: replayed by the generate stage
                messages += [{"role": "tool", "content": text(60, 300)}, {"role": "assistant", "content": text(30, 120)}]
            rec = {"messages": messages, "tools": tools}
        if rng.random() < 0.005:
            rec["split"] = "heldout"
        recent = (recent + [rec])[-100:]
        yield rec


def synthetic_set(data: Path, scale: float) -> tuple[list[dict], int]:
    """The sources for ``scale`` (generated unless already there) and their uncompressed bytes."""
    folder = data / f"scale-{scale:g}"
    stamp = folder / "done.json"
    if not stamp.exists() or json.loads(stamp.read_text()).get("version") != GENERATOR_VERSION:
        shutil.rmtree(folder, ignore_errors=True)
        folder.mkdir(parents=True)
        rng = random.Random(0)
        text, size = Text(rng), 0
        t = time.perf_counter()
        for src in SOURCES:
            lines = (dumps_line(rec) for rec in records(src["name"], round(FULL[src["name"]] * scale), text, rng))
            if src["file"].endswith(".json"):  # one JSON array, as ShareGPT is published
                with open(folder / src["file"], "wb") as f:
                    for n, line in enumerate(lines):
                        size += f.write((b",\n" if n else b"[\n") + line.rstrip(b"\n"))
                    size += f.write(b"\n]\n")
                continue
            with jsonl_zst_writer(folder / src["file"]) as write:
                for line in lines:
                    size += write(line)
        stamp.write_text(json.dumps({"version": GENERATOR_VERSION, "bytes": size}))
        print(f"generated scale {scale:g} in {time.perf_counter() - t:.0f} s", flush=True)
    sources = [{"name": s["name"], "path": str(folder / s["file"]), "format": s["format"], "category": s["category"]}
               for s in SOURCES]
    return sources, json.loads(stamp.read_text())["bytes"]


def tokenizer_dir(data: Path) -> Path:
    """The demo tokenizer (byte-level BPE, Qwen's special tokens, Qwen3.6's chat template)."""
    path = data / "tokenizer"
    if not path.exists():
        from dflash.target.teach import build_tokenizer, load_conversations

        tok = build_tokenizer(load_conversations(sorted((ROOT / "data/demo").glob("*.jsonl")), None), 4096)
        tok.save_pretrained(path)
    return path


def run_stage(sources: list[dict], out: Path, tokenizer: Path) -> dict:
    shutil.rmtree(out, ignore_errors=True)
    t = time.perf_counter()
    log = out.with_name("stage.log")  # the stage's warnings (each prompt dropped as too long)
    with open(log, "w") as err:
        child = subprocess.Popen([sys.executable, "-c", CHILD, json.dumps(sources), str(out), str(tokenizer)],
                                 stdout=subprocess.PIPE, stderr=err, text=True, cwd=ROOT,
                                 env={**os.environ, "PYTHONPATH": str(ROOT), "TOKENIZERS_PARALLELISM": "false"})
        stdout = child.stdout.read()
        _, status, usage = os.wait4(child.pid, 0)
    if os.waitstatus_to_exitcode(status):
        sys.exit(f"the stage failed (exit {os.waitstatus_to_exitcode(status)}): {log.read_text().strip().splitlines()[-1]}")
    result = json.loads(stdout)
    result.update(peak_rss=usage.ru_maxrss * 1024, wall_s=time.perf_counter() - t,
                  output_bytes=sum(p.stat().st_size for p in out.iterdir()))
    shutil.rmtree(out)
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--scales", default="0.1,1", help="fractions of the real run's 913,786 prompts (default 0.1,1)")
    ap.add_argument("--data", type=Path, default=Path("/tmp/dflash-prompts-bench"))
    a = ap.parse_args()
    import numpy
    import tokenizers
    import transformers
    import zstandard

    print(f"prompts stage, one run per scale (a bound, not a comparison); Python {sys.version.split()[0]}, "
          f"numpy {numpy.__version__}, zstandard {zstandard.__version__}, transformers {transformers.__version__}, "
          f"tokenizers {tokenizers.__version__}, {os.cpu_count()} CPUs", flush=True)
    a.data.mkdir(parents=True, exist_ok=True)
    tokenizer = tokenizer_dir(a.data)
    rows = []
    for scale in (float(s) for s in a.scales.split(",")):
        sources, size = synthetic_set(a.data, scale)
        zst = sum(Path(s["path"]).stat().st_size for s in sources)
        r = run_stage(sources, a.data / "out", tokenizer)
        rows.append((scale, size, zst, r))
        print(f"scale {scale:g}: {r['prompts'] + r['heldout']:,} prompts kept ({r['prompts']:,} in {r['shards']:,} "
              f"shards, {r['heldout']:,} held out; dropped {r['dropped']}) from {human_bytes(size)} of JSON "
              f"({human_bytes(zst)} zstd)", flush=True)
    print(f"\n{'scale':>6} {'input JSON':>12} {'peak RSS':>10} {'tokenizer loaded':>17} {'stage':>10} "
          f"{'stage/record':>13} {'wall s':>7}")
    for scale, size, _, r in rows:
        kept = r["prompts"] + r["heldout"]
        print(f"{scale:>6g} {human_bytes(size):>12} {human_bytes(r['peak_rss']):>10} {human_bytes(r['loaded_rss']):>17} "
              f"{human_bytes(r['peak_rss'] - r['loaded_rss']):>10} {(r['peak_rss'] - r['loaded_rss']) / kept:>11.0f} B "
              f"{r['wall_s']:>7.0f}")
    if len(rows) > 1:
        (s0, b0, _, r0), (s1, b1, _, r1) = rows[0], rows[-1]
        print(f"\nfrom scale {s0:g} to {s1:g}: input +{human_bytes(b1 - b0)}, peak RSS "
              f"+{human_bytes(r1['peak_rss'] - r0['peak_rss'])} "
              f"({(r1['peak_rss'] - r0['peak_rss']) / (b1 - b0):.3f} bytes of memory per byte of input)")


if __name__ == "__main__":
    main()
