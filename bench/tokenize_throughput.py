"""Tokenization throughput: the tokenize stage against the Rust tokenizer's bare batch encode and
against SpecForge 0.2.0's own preprocessing (its conversation path and its pre-tokenized path), on
the same realistic records, in alternating rounds.

The set: N records (default 1,000, about 3.6 M tokens: a whole run takes about 10 minutes on a
quiet machine) built offline by a seeded generator from a large vocabulary, so the tokenizer's
word cache misses as it does on real data: long English reasoning (docstrings of this Python's
standard library, worked arithmetic), code (lines of the standard library's sources in fenced
blocks), and chat in about 100 languages and a dozen scripts (the gettext translations under
/usr/share/locale: glib, gtk, coreutils, git, postgres, ...), 15% tool prompts with offered tools
and XML calls (as ``validate_throughput.py`` makes them). The words come from this machine's
files, so the set depends on the Python version and installed locales: the bench prints its size,
distinct words and languages.

Methods, on the same records, each round in turn (the order reversed every other round):

- floor:          ``tokenizer.backend_tokenizer.encode_batch_fast`` over the strings the text path
                  encodes (every rendered prompt and every text), rendered beforehand, one call:
                  nothing but the encode, no offsets, no Python-side wrapper;
- text path:      ``tokenize_shard`` on records without token ids (reads the zstd shard, renders
                  every prompt and conversation with the chat template, batch-encodes prompt and
                  text, checks every prompt boundary, writes the safetensors rows and the index);
- ids path:       ``tokenize_shard`` on the same records with the ids the target produced (decodes
                  every record to compare with its text, re-tokenizes the ``retokenize_sample``);
- SpecForge text: ``build_eagle3_dataset`` on the same conversations (prompt messages + the
                  assistant turn), what its ``prepare_prompt_tasks`` runs for raw conversations;
- SpecForge ids:  ``prepare_prompt_tasks`` on a JSONL of the same rows as ``input_ids`` +
                  ``loss_mask``, its pre-tokenized path (standard-library JSON, no tokenizer).

SpecForge runs in its own venv (``make specforge-venv``), one process per call, timed by itself
around the preprocessing only (``bench/specforge_preprocess.py``). All run on ``--threads`` cores
(default 1: the pipeline runs one tokenize job per core), pinned to them with their threads and
child processes: the Rust batch encode gets that many threads, SpecForge that many
``datasets.map`` processes (on one core, its own process). One warm-up round is not counted.
Tokens/s count the tokens each produced; the figures are the median over rounds, and each ratio
is the median of the per-round ratios. The tokenizer is the demo target's (byte-level BPE with
the Qwen3.5 pre-tokenizer and Qwen's special tokens, 4,096 ids): the real 248k vocabulary is not
on this machine; all use it.

Usage: python bench/tokenize_throughput.py [--records 1000] [--rounds 5] [--threads 1]
       [--tokenizer DIR] [--specforge-python .venv-specforge/bin/python]
"""
from __future__ import annotations

import argparse
import ast
import gettext
import importlib.metadata
import json
import logging
import os
import platform
import random
import statistics
import subprocess
import sys
import sysconfig
import tempfile
import time
import unicodedata
from pathlib import Path

from validate_throughput import SAMPLING, TOOLS, tool_call  # bench/ is on the path when run as a script

from dflash.core.chat import render_prompt
from dflash.core.config import load_config
from dflash.core.io import write_jsonl_zst
from dflash.tokenize.stage import tokenize_shard

ROOT = Path(__file__).resolve().parents[1]
LOCALES = Path("/usr/share/locale")


class Corpus:
    """Sentences, paragraphs and code lines from files on this machine, read in a fixed order."""

    def __init__(self, rng: random.Random):
        stdlib = Path(sysconfig.get_paths()["stdlib"])
        sources = sorted(p for p in stdlib.rglob("*.py") if not {"test", "tests", "site-packages"} & set(p.parts))
        self.code: list[list[str]] = []
        self.prose: list[str] = []
        for path in rng.sample(sources, min(300, len(sources))):
            text = path.read_text(encoding="utf-8", errors="replace")
            self.code.append(text.splitlines())
            try:
                tree = ast.parse(text)
            except SyntaxError:
                continue
            for node in ast.walk(tree):
                if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                    doc = ast.get_docstring(node)
                    self.prose += [" ".join(p.split()) for p in (doc or "").split("\n\n") if len(p) > 40]
        # Translations of the programs' messages: real sentences in many languages and scripts
        # (the ISO code lists are left out: names, not sentences).
        self.languages: dict[str, list[str]] = {}
        for path in sorted(LOCALES.glob("*/LC_MESSAGES/*.mo")):
            if path.name.startswith("iso"):
                continue
            try:
                with open(path, "rb") as f:
                    catalog = gettext.GNUTranslations(f)._catalog
            except (OSError, ValueError, LookupError):  # a catalog gettext cannot read
                continue
            self.languages.setdefault(path.parts[-3], []).extend(
                v for k, v in catalog.items() if k and isinstance(v, str) and len(v) > 20 and v != k)
        self.languages = {k: v for k, v in self.languages.items() if len(v) >= 200}
        # NFC, as the tokenizer normalizes: a model's text is what its ids decode to
        self.prose = [unicodedata.normalize("NFC", p) for p in self.prose]
        self.code = [[unicodedata.normalize("NFC", line) for line in lines] for lines in self.code]
        self.languages = {k: [unicodedata.normalize("NFC", s) for s in v] for k, v in self.languages.items()}
        if not self.prose or not self.languages:
            raise SystemExit(f"no text to build the set from: standard library at {stdlib}, translations under "
                             f"{LOCALES} ({len(self.prose)} paragraphs, {len(self.languages)} languages)")
        self.language_names = sorted(self.languages)

    def paragraphs(self, rng: random.Random, chars: int, language: str | None = None) -> str:
        out, n = [], 0
        while n < chars:
            if language is None:
                para = rng.choice(self.prose)
            else:
                para = " ".join(rng.choice(self.languages[language]) for _ in range(rng.randint(2, 6)))
            out.append(para)
            n += len(para) + 2
        return "\n\n".join(out)

    def reasoning(self, rng: random.Random, chars: int) -> str:
        """Long reasoning: the prose interleaved with worked arithmetic, as a model thinks aloud."""
        out, n = [], 0
        while n < chars:
            if rng.random() < 0.3:
                a, b = rng.randint(2, 99_999), rng.randint(2, 9_999)
                step = f"So {a} * {b} = {a * b}, and {a * b} - {b} = {a * b - b}; dividing by {b} gives {a - 1}."
            else:
                step = rng.choice(self.prose)
            out.append(step)
            n += len(step) + 2
        return "\n\n".join(out)

    def snippet(self, rng: random.Random) -> str:
        lines = rng.choice(self.code)
        start = rng.randrange(max(1, len(lines) - 10))
        return "```python\n" + "\n".join(lines[start:start + rng.randint(5, 60)]) + "\n```"

    def answer(self, rng: random.Random, chars: int, language: str | None) -> str:
        parts, n = [], 0
        while n < chars:
            part = self.snippet(rng) if rng.random() < 0.35 else self.paragraphs(rng, rng.randint(200, 1200), language)
            parts.append(part)
            n += len(part)
        return "\n\n".join(parts)

    def record(self, rng: random.Random, i: int) -> dict:
        tool = rng.random() < 0.15
        category = "tool" if tool else rng.choice(["chat", "code", "reasoning"])
        language = rng.choice(self.language_names) if category == "chat" and rng.random() < 0.8 else None
        total = int(rng.lognormvariate(8.68, 0.6))  # text characters: mean about 7 KB, a long tail
        roll = rng.random()
        if roll < 0.02:  # a trivial answer
            reasoning, content = "\n\n", "\nOK."
        elif roll < 0.03:  # a loop until the cap
            reasoning, content = self.reasoning(rng, 400) + "\n", "\n\n" + "<tool_call>\n</think>\n" * (total // 20)
        elif tool:
            reasoning = self.reasoning(rng, min(total, 3000)) + "\n"
            content = "\n\n" + tool_call(rng)
        else:
            split = int(total * rng.uniform(0.3, 0.7))
            reasoning = self.reasoning(rng, split) + "\n"
            content = "\n\n" + self.answer(rng, total - split, language)
        text = reasoning + "</think>" + content
        question = self.paragraphs(rng, rng.randint(50, 600), language)
        return {"id": f"{i:016x}", "prompt_id": f"{i:016x}", "source": "synthetic", "category": category,
                "messages": [{"role": "user", "content": question}], "tools": TOOLS if tool else None,
                "text": text, "reasoning": reasoning, "content": content,
                "finish_reason": "length" if roll < 0.03 else "stop",
                "generation": {"backend": "openai", "engine_version": "synthetic", "enable_thinking": True,
                               "model": "synthetic", "sampling": SAMPLING},
                "usage": {"prompt_tokens": 0, "completion_tokens": 0}, "error": None,
                "qa": {"flags": [], "tool_calls": []}}  # as validate leaves a kept record


def demo_tokenizer(workdir: Path):
    """The demo target's tokenizer, built from the shipped conversations (seconds, no model)."""
    from dflash.target.teach import build_tokenizer, load_conversations

    sources = [ROOT / s["path"] for s in load_config(ROOT / "config.yaml")["prompts"]["sources"]]
    tok = build_tokenizer(load_conversations(sources, split=None), 4096)
    tok.save_pretrained(workdir / "tokenizer")
    return tok, workdir / "tokenizer"


def with_ids(tok, rec: dict) -> dict:
    """The record with the ids the target would have produced (its own encoding)."""
    prompt = render_prompt(rec, tok)
    ids = tok(rec["text"], add_special_tokens=False)["input_ids"]
    end = [tok.convert_tokens_to_ids("<|im_end|>")] if rec["finish_reason"] == "stop" else []
    prompt_ids = tok(prompt, add_special_tokens=False)["input_ids"]
    return {**rec, "prompt_token_ids": prompt_ids, "output_token_ids": ids + end}


def conversation(rec: dict) -> dict:
    answer = {"role": "assistant", "reasoning_content": rec["reasoning"], "content": rec["content"]}
    return {"id": rec["id"], "messages": rec["messages"] + [answer], "tools": rec["tools"]}


def write_lines(path: Path, rows) -> Path:
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows), encoding="utf-8")
    return path


def run_specforge(python: Path, mode: str, path: Path, tokenizer_dir: Path, threads: int) -> tuple[int, float]:
    """(tokens, seconds) of one SpecForge call, timed by itself around its preprocessing."""
    out = subprocess.run([str(python), str(ROOT / "bench" / "specforge_preprocess.py"), f"--{mode}", str(path),
                          "--tokenizer", str(tokenizer_dir), "--max-length", str(1 << 20), "--num-proc", str(threads)],
                         capture_output=True, text=True, cwd=ROOT, env={**os.environ, "RAYON_NUM_THREADS": "1"})
    if out.returncode != 0:
        raise RuntimeError(f"SpecForge {mode} preprocessing failed:\n{out.stderr[-3000:]}")
    res = json.loads(out.stdout.strip().splitlines()[-1])
    return res["tokens"], res["seconds"]


def specforge_versions(python: Path) -> str:
    code = ("import importlib.metadata as m; print(', '.join(f'{p} {m.version(p)}' for p in "
            "('specforge', 'transformers', 'tokenizers', 'datasets', 'torch')))")
    return subprocess.run([str(python), "-c", code], capture_output=True, text=True, check=True).stdout.strip()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--records", type=int, default=1_000)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--tokenizer", type=Path, help="a tokenizer folder (default: build the demo one)")
    ap.add_argument("--specforge-python", type=Path, default=ROOT / ".venv-specforge" / "bin" / "python")
    ap.add_argument("--threads", type=int, default=1, help="cores for each method (default 1)")
    a = ap.parse_args()
    logging.getLogger("dflash").setLevel(logging.ERROR)  # per-record warnings: the counts are printed
    os.environ["RAYON_NUM_THREADS"] = str(a.threads)  # before the tokenizer's first batch encode
    # Every method gets the same cores, threads and child processes included.
    os.sched_setaffinity(0, sorted(os.sched_getaffinity(0))[:a.threads])
    specforge = a.specforge_python.exists()
    if not specforge:
        print(f"{a.specforge_python} not found (make specforge-venv): SpecForge is left out", file=sys.stderr)
    # Rows are not cut (every method counts the same tokens); the ids path checks its default sample.
    cfg = {**load_config(ROOT / "config.yaml")["tokenize"], "max_length": 1 << 30}
    print(f"python {platform.python_version()}, " + ", ".join(
        f"{p} {importlib.metadata.version(p)}" for p in ("tokenizers", "transformers", "torch")))
    if specforge:
        print(f"SpecForge venv: {specforge_versions(a.specforge_python)}")
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        if a.tokenizer:
            from transformers import AutoTokenizer

            tok, tok_dir = AutoTokenizer.from_pretrained(a.tokenizer), a.tokenizer
        else:
            tok, tok_dir = demo_tokenizer(tmp)
        t0 = time.perf_counter()
        rng = random.Random(0)
        corpus = Corpus(rng)
        recs = [with_ids(tok, corpus.record(rng, i)) for i in range(a.records)]
        ids_shard, text_shard = tmp / "ids.jsonl.zst", tmp / "text.jsonl.zst"
        write_jsonl_zst(ids_shard, recs)
        write_jsonl_zst(text_shard, [{**r, "prompt_token_ids": None, "output_token_ids": None} for r in recs])
        conversations = write_lines(tmp / "conv.jsonl", map(conversation, recs))
        pretokenized = write_lines(tmp / "rows.jsonl", (
            {"input_ids": r["prompt_token_ids"] + r["output_token_ids"],
             "loss_mask": [0] * len(r["prompt_token_ids"]) + [1] * len(r["output_token_ids"])} for r in recs))
        strings = [render_prompt(r, tok) for r in recs] + [r["text"] for r in recs]
        words = {w for r in recs for w in (r["messages"][0]["content"] + " " + r["text"]).split()}
        print(f"set: {len(recs)} records, mean text {sum(len(r['text']) for r in recs) / len(recs) / 1000:.1f} KB, "
              f"{len(words):,} distinct words, {len(corpus.languages)} languages, "
              f"tool prompts {sum(r['tools'] is not None for r in recs) / len(recs):.0%}, "
              f"ready in {time.perf_counter() - t0:.0f} s; threads per method: {a.threads}")
        del recs, words

        fast = tok.backend_tokenizer
        checks: dict[str, dict] = {}

        def floor() -> tuple[int, float]:
            t = time.perf_counter()
            encoded = fast.encode_batch_fast(strings, add_special_tokens=False)
            seconds = time.perf_counter() - t
            return sum(len(e.ids) for e in encoded), seconds

        def stage(shard: Path) -> tuple[int, float]:
            t = time.perf_counter()
            stats = tokenize_shard(shard, tmp / "t.safetensors", tmp / "t.json", tok, cfg)
            seconds = time.perf_counter() - t
            checks[shard.name] = {k: stats[k] for k in ("boundary_checked", "boundary_unstable", "retokenize_checked",
                                                        "retokenize_differs", "text_mismatch")}
            return stats["tokens"], seconds

        methods = {"floor": floor, "text": lambda: stage(text_shard), "ids": lambda: stage(ids_shard)}
        if specforge:
            methods["sf_text"] = lambda: run_specforge(a.specforge_python, "conversations", conversations, tok_dir,
                                                       a.threads)
            methods["sf_ids"] = lambda: run_specforge(a.specforge_python, "pretokenized", pretokenized, tok_dir,
                                                      a.threads)
        for run in methods.values():  # warm-up, not counted
            run()
        rates: dict[str, list[float]] = {k: [] for k in methods}
        tokens: dict[str, int] = {}
        for r in range(a.rounds):
            for k in (list(methods) if r % 2 == 0 else list(reversed(methods))):
                tokens[k], seconds = methods[k]()
                rates[k].append(tokens[k] / seconds)
            print(f"round {r + 1}: " + ", ".join(f"{k} {rates[k][-1]:,.0f}" for k in methods) + " tokens/s",
                  flush=True)
        names = {"floor": "floor: Rust encode_batch_fast", "text": "tokenize stage, rows from text",
                 "ids": "tokenize stage, rows from ids", "sf_text": "SpecForge 0.2.0, conversations",
                 "sf_ids": "SpecForge 0.2.0, pre-tokenized"}
        for k in methods:
            print(f"{names[k]:32s} {statistics.median(rates[k]):12,.0f} tokens/s  ({tokens[k]:,} tokens a round)")
        print(f"checks: {checks}")

        def ratio(x: str, y: str, label: str) -> None:
            per_round = [p / q for p, q in zip(rates[x], rates[y])]
            print(f"ratio {label}: {statistics.median(per_round):.2f} (median of {len(per_round)} rounds, "
                  f"range {min(per_round):.2f}-{max(per_round):.2f})")

        ratio("text", "floor", "text path / floor")
        ratio("ids", "floor", "ids path / floor")
        if specforge:
            ratio("text", "sf_text", "text path / SpecForge conversations")
            ratio("ids", "sf_ids", "ids path / SpecForge pre-tokenized")
            ratio("ids", "sf_text", "ids path / SpecForge conversations")


if __name__ == "__main__":
    main()
