"""Tokenization throughput: the tokenize stage against a bare batched ``tokenizer(texts)`` and
against SpecForge 0.2.0's dataset preprocessing, on the same realistic records, side by side.

The set: N records (default 20,000) like ``validate_throughput.py`` makes them (reasoning plus
answer, about 7 KB of text each, prose, code, tables, lists; 15% tool prompts with offered tools
and XML calls), split into shards. Per shard, in turn, in one run (the same noise for all):

- raw:        ``tokenizer(prompt + text for each record)`` in one batched call, on strings
              rendered beforehand (the floor: nothing but the encode);
- text path:  ``tokenize_shard`` on records without token ids (reads the zstd shard, renders
              every prompt with the chat template, batch-encodes prompt and text, checks every
              prompt boundary, writes the safetensors rows and the index);
- ids path:   ``tokenize_shard`` on the same records with the ids the target produced (decodes
              every record to compare with its text, re-tokenizes the ``retokenize_sample``);
- SpecForge:  its ``build_eagle3_dataset``-style preprocessing of the same conversations (prompt
              messages + the assistant turn), in its own venv (``make specforge-venv``), timed by
              itself around the preprocessing only.

All run on ``--threads`` cores (default 1: the pipeline runs one tokenize job per core), pinned
to them with their threads and child processes: the Rust tokenizer's batch encode gets that many
threads, SpecForge that many ``datasets.map`` processes. Tokens/s count the tokens each produced. The tokenizer is the demo target's (byte-level BPE with
the Qwen3.5 pre-tokenizer and Qwen's special tokens, 4,096 ids): the real 248k vocabulary is not
on this machine; all four use the same one.

Usage: python bench/tokenize_throughput.py [--records 20000] [--shard-size 5000] [--threads 1]
       [--tokenizer DIR] [--specforge-python .venv-specforge/bin/python]
"""
from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from validate_throughput import make_record  # bench/ is on the path when run as a script

from dflash.config import load_config
from dflash.io import write_jsonl_zst
from dflash.chat import render_prompt
from dflash.tokenize import tokenize_shard

ROOT = Path(__file__).resolve().parents[1]


def demo_tokenizer(workdir: Path):
    """The demo target's tokenizer, built from the shipped conversations (seconds, no model)."""
    from dflash.target import build_tokenizer, load_conversations

    sources = [ROOT / s["path"] for s in load_config(ROOT / "config.yaml")["prompts"]["sources"]]
    tok = build_tokenizer(load_conversations(sources, split=None), 4096)
    tok.save_pretrained(workdir / "tokenizer")
    return tok, workdir / "tokenizer"


def records_for(tok, n: int) -> list[dict]:
    """Synthetic records with the ids the target would have produced (its own encoding)."""
    rng = random.Random(0)
    end = tok.convert_tokens_to_ids("<|im_end|>")
    out = []
    for i in range(n):
        rec = make_record(rng, i)
        rec["generation"]["enable_thinking"] = True
        prompt = render_prompt(rec, tok)
        rec["prompt_token_ids"] = tok(prompt, add_special_tokens=False)["input_ids"]
        ids = tok(rec["text"], add_special_tokens=False)["input_ids"]
        rec["output_token_ids"] = ids + ([end] if rec["finish_reason"] == "stop" else [])
        out.append(rec)
    return out


def conversation(rec: dict) -> dict:
    answer = {"role": "assistant", "reasoning_content": rec["reasoning"], "content": rec["content"]}
    return {"id": rec["id"], "messages": rec["messages"] + [answer], "tools": rec["tools"]}


def run_specforge(python: Path, conversations: Path, tokenizer_dir: Path, max_length: int, threads: int) -> dict:
    """SpecForge's builder with one ``datasets.map`` process per core we get (its own default is 8)."""
    out = subprocess.run([str(python), str(ROOT / "bench" / "specforge_preprocess.py"), "--conversations",
                          str(conversations), "--tokenizer", str(tokenizer_dir), "--max-length", str(max_length),
                          "--num-proc", str(threads)],
                         capture_output=True, text=True, cwd=ROOT, env={**os.environ, "RAYON_NUM_THREADS": "1"})
    if out.returncode != 0:
        raise RuntimeError(f"SpecForge preprocessing failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--records", type=int, default=20_000)
    ap.add_argument("--shard-size", type=int, default=5_000)
    ap.add_argument("--tokenizer", type=Path, help="a tokenizer folder (default: build the demo one)")
    ap.add_argument("--specforge-python", type=Path, default=ROOT / ".venv-specforge" / "bin" / "python")
    ap.add_argument("--threads", type=int, default=1, help="cores for each method (default 1)")
    a = ap.parse_args()
    os.environ["RAYON_NUM_THREADS"] = str(a.threads)  # before the tokenizer's first batch encode
    # Every method gets the same cores, threads and child processes included.
    os.sched_setaffinity(0, sorted(os.sched_getaffinity(0))[:a.threads])
    specforge = a.specforge_python.exists()
    if not specforge:
        print(f"{a.specforge_python} not found (make specforge-venv): SpecForge is left out", file=sys.stderr)
    # Rows are not cut (every method counts the same tokens); the ids path checks its default sample.
    cfg = {**load_config(ROOT / "config.yaml")["tokenize"], "max_length": 1 << 30}
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        if a.tokenizer:
            from transformers import AutoTokenizer

            tok, tok_dir = AutoTokenizer.from_pretrained(a.tokenizer), a.tokenizer
        else:
            tok, tok_dir = demo_tokenizer(tmp)
        t0 = time.perf_counter()
        recs = records_for(tok, a.records)
        shards = []
        for s, start in enumerate(range(0, len(recs), a.shard_size)):
            part = recs[start:start + a.shard_size]
            paths = {"ids": tmp / f"ids-{s}.jsonl.zst", "text": tmp / f"text-{s}.jsonl.zst",
                     "conv": tmp / f"conv-{s}.jsonl"}
            write_jsonl_zst(paths["ids"], part)
            write_jsonl_zst(paths["text"], [{**r, "prompt_token_ids": None, "output_token_ids": None} for r in part])
            paths["conv"].write_text("".join(json.dumps(conversation(r), ensure_ascii=False) + "\n" for r in part),
                                     encoding="utf-8")
            full = [render_prompt(r, tok) + r["text"] for r in part]
            shards.append((paths, full))
        print(f"threads per method: {a.threads}")
        print(f"set: {len(recs)} records in {len(shards)} shards, mean text {sum(len(r['text']) for r in recs) / len(recs) / 1000:.1f} KB, "
              f"tool prompts {sum(r['tools'] is not None for r in recs) / len(recs):.0%}, ready in {time.perf_counter() - t0:.0f} s")
        seconds = {"raw": 0.0, "text": 0.0, "ids": 0.0, "specforge": 0.0}
        tokens = dict.fromkeys(seconds, 0)
        counts: dict[str, int] = {}
        for paths, full in shards:  # alternate per shard: every method sees the same noise
            t = time.perf_counter()
            ids = tok(full, add_special_tokens=False)["input_ids"]
            seconds["raw"] += time.perf_counter() - t
            tokens["raw"] += sum(map(len, ids))
            for path in ("text", "ids"):
                t = time.perf_counter()
                stats = tokenize_shard(paths[path], tmp / "t.safetensors", tmp / "t.json", tok, cfg)
                seconds[path] += time.perf_counter() - t
                tokens[path] += stats["tokens"]
                for k in ("boundary_checked", "boundary_unstable", "retokenize_checked", "retokenize_differs",
                          "text_mismatch"):
                    counts[k] = counts.get(k, 0) + stats[k]
            if specforge:
                sf = run_specforge(a.specforge_python, paths["conv"], tok_dir, 1 << 20, a.threads)
                seconds["specforge"] += sf["seconds"]
                tokens["specforge"] += sf["tokens"]
        rate = {k: tokens[k] / seconds[k] for k in seconds if seconds[k]}
        names = {"raw": "raw tokenizer(texts), batched", "text": "tokenize stage, rows from text",
                 "ids": "tokenize stage, rows from ids", "specforge": "SpecForge 0.2.0 preprocessing"}
        for k in rate:
            print(f"{names[k]:34s} {rate[k]:12,.0f} tokens/s  ({tokens[k]:,} tokens in {seconds[k]:.1f} s)")
        print(f"checks: {counts}")
        print(f"ratio text path / raw: {rate['text'] / rate['raw']:.2f} (target >= 0.8)")
        print(f"ratio ids path / raw:  {rate['ids'] / rate['raw']:.2f}")
        if specforge:
            print(f"ratio text path / SpecForge: {rate['text'] / rate['specforge']:.2f} (target >= 3)")
            print(f"ratio ids path / SpecForge:  {rate['ids'] / rate['specforge']:.2f}")


if __name__ == "__main__":
    main()
