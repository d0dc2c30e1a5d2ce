"""The eval stage's decoder against the reference DFlash decoder, on a demo run's outputs.

Compared, in one process with the same torch threads, on the run's held-out prompts:

- ours:      ``dflash.eval.stage.speculative_generate`` (the eval job's decoder: the target's KV cache
             with linear-attention states rolled back on a rejection, the drafter's context
             keys and values cached);
- reference: ``dflash_generate`` of PyPI ``dflash`` 0.1.0 (z-lab), loaded by path from the
             unpacked wheel (its import name is ours), run as its benchmark.py runs it:
             ``return_stats=True`` (its CUDA-synchronising timer replaced by ``time.perf_counter``),
             target and drafter loaded with ``attn_implementation="sdpa"``.

Same inputs on both sides: the prompts rendered as the eval job renders them (``encode_prompts``),
the eval job's stop ids, max_new_tokens and block size (the drafter's unless --block-size), greedy.
The dtype is the target checkpoint's for both: the reference's benchmark.py loads bfloat16 on CUDA,
which on a float32 demo target would change the tokens. One warm-up prompt each is excluded.

Outputs are compared token for token, and both with plain greedy decoding (the reference's own
block size 1 path: no draft, nothing to roll back). On a hybrid target the reference crops keys,
values and convolution states after a rejected draft but not the linear-attention recurrent
state, which has absorbed the rejected tokens; from there its tokens are not the target's greedy
ones. The bench reports how many prompts that touches and at which token they first part.

Timing: --rounds rounds (>= 5), each decoding the same prompts (--prompts N: the first N, default
all) with both, the order alternating between rounds (the last round's outputs are the ones
checked; plain greedy is decoded once after the rounds); per round the ratio ours / reference,
the median of the ratios reported, in wall time and in CPU time of the process (steadier on a
shared machine). Where the outputs differ (the reference on a hybrid target) the two sides decode
different numbers of tokens, so a figure per generated token is printed too (per round, each
side's decode time over its tokens). A second figure adds model loading (target + drafter, from disk, as each side
loads them; timed in every round too) to each side's decode time.

--attention-only compares the two where the reference is correct too, like for like: instead of the
run's hybrid target and its drafter, a full-attention (``qwen3``) variant of the demo target, built
and taught as the run's config builds its own (``architecture: qwen3``), and a drafter trained on
its features of the run's tokenized shards with the run's drafter and train settings, as the
pipeline trains one (built once into --work, about 5 minutes on 2 cores, and reused).

Usage: python bench/eval_vs_reference.py [RESULTS_DIR] [--rounds 5] [--prompts N] [--threads N]
       [--reference PATH/TO/dflash/model.py] [--max-new-tokens 128] [--block-size B]
       [--attention-only [--work DIR]]
"""
from __future__ import annotations

import argparse
import importlib.util
import platform
import statistics
import sys
import time
from importlib.metadata import version
from pathlib import Path

import torch
import transformers
from transformers import AutoModelForCausalLM, AutoTokenizer

import dflash
from dflash.core.chat import stop_token_ids
from dflash.core.config import load_config
from dflash.train.drafter import TargetIO, load_drafter
from dflash.eval.stage import encode_prompts, load_target, settings, speculative_generate
from dflash.hidden.stage import capture_shard
from dflash.core.shapes import layer_selection
from dflash.core.shapes import HIDDEN_FORMAT
from dflash.core.io import read_jsonl
from dflash.target.stage import build_target
from dflash.train.stage import drafter_train_cfg, train
from dflash.core.workflow import demo_target_sources

ROOT = Path(__file__).resolve().parents[1]


def load_reference(path: Path):
    """The wheel's model.py as a module of its own name (its package is never imported)."""
    spec = importlib.util.spec_from_file_location("dflash_reference_model", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    module._cuda_time = time.perf_counter  # its stats timer syncs CUDA
    return module


def cache_format(path: Path) -> str | None:
    from safetensors import safe_open

    with safe_open(path, framework="pt") as f:
        return (f.metadata() or {}).get("format")


def attention_only_target(results: Path, config: dict, work: Path, taught: tuple[dict, Path] | None = None,
                          tokenized: list[Path] | None = None) -> tuple[Path, list[Path]]:
    """(target folder, its hidden-state shards of the run's tokenized shards) of the full-attention
    variant (see the module docstring), built into ``work`` unless already there. ``taught``: the
    config (and the folder its paths are relative to) whose target the variant copies, for a run
    that names its target by path (the demo's, for bench/scale_data.py's run); default the run's.
    ``tokenized``: only these of the run's shards (a point of a data curve; default all)."""
    target_dir = work / "target"
    taught_config, root = taught or (config, results.resolve().parent)  # paths relative to the run's folder
    if not target_dir.exists():
        sources = [root / p for p in demo_target_sources(taught_config)]
        build_target(sources, target_dir, {**taught_config["target"]["build"], "architecture": "qwen3"})
    run_target = Path(config["target"]["path"]) if config["target"]["path"] else results / "target"
    if (target_dir / "tokenizer.json").read_bytes() != (run_target / "tokenizer.json").read_bytes():
        sys.exit(f"{target_dir}: its tokenizer is not the run's ({run_target}), so the run's tokenized "
                 "shards do not fit it")
    (work / "hidden").mkdir(parents=True, exist_ok=True)
    hidden = []
    for t in tokenized or sorted((results / "tokenized").glob("shard-*.safetensors")):
        hidden.append(work / "hidden" / t.name)
        if not hidden[-1].exists() or cache_format(hidden[-1]) != HIDDEN_FORMAT:  # older caches lack greedy tokens
            capture_shard(t, hidden[-1], target_dir, layer_selection(config["drafter"]), config["hidden"]["dtype"])
    return target_dir, hidden


def attention_only_models(results: Path, config: dict, work: Path) -> tuple[Path, Path]:
    """(target, drafter) folders of the full-attention variant, built into ``work`` unless already
    there: the drafter trained on the variant's features of the run's tokenized shards."""
    target_dir, hidden = attention_only_target(results, config, work)
    drafter_dir = work / "drafter"
    if not drafter_dir.exists():
        tokenized = sorted((results / "tokenized").glob("shard-*.safetensors"))
        train(tokenized, hidden, target_dir, drafter_dir, drafter_train_cfg(config, target_dir))
    return target_dir, drafter_dir


def load_ours(target_dir: Path, drafter_dir: Path):
    """As ``dflash.eval.stage.evaluate`` loads them."""
    target = load_target(target_dir, settings({"device": "cpu"}))  # the eval settings, completed as evaluate's
    drafter = load_drafter(drafter_dir)[0].to(target.device, target.dtype).eval()
    return target, drafter


def load_theirs(reference, target_dir: Path, drafter_dir: Path, dtype: torch.dtype):
    """As the reference's benchmark.py ``load_transformers_models`` loads them, in ``dtype``."""
    target = AutoModelForCausalLM.from_pretrained(target_dir, attn_implementation="sdpa", dtype=dtype).eval()
    drafter = reference.DFlashDraftModel.from_pretrained(drafter_dir, attn_implementation="sdpa", dtype=dtype).eval()
    return target, drafter


def decode_ours(models, prompts, max_new_tokens, stop_ids, block_size):
    """(new tokens, target forwards) per prompt, as ``decode_theirs``."""
    target, drafter = models
    io = TargetIO.from_model(target)
    return [speculative_generate(target, drafter, io, ids, max_new_tokens, stop_ids, block_size)[:2] for ids in prompts]


def decode_theirs(reference, models, prompts, max_new_tokens, stop_ids, block_size):
    """As its benchmark.py calls it (``return_stats=True``): (new tokens, target forwards) per prompt."""
    target, drafter = models
    out = []
    for ids in prompts:
        r = reference.dflash_generate(drafter, target, torch.tensor([ids]), max_new_tokens, sorted(stop_ids),
                                      block_size=block_size, return_stats=True)
        out.append((r.output_ids[0, len(ids):].tolist(), len(r.acceptance_lengths) + 1))
    return out


def first_difference(a: list[int], b: list[int]) -> int | None:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None if len(a) == len(b) else min(len(a), len(b)))


def timed(fn):
    """(fn(), (wall seconds, CPU seconds))."""
    wall, cpu = time.perf_counter(), time.process_time()
    result = fn()
    return result, (time.perf_counter() - wall, time.process_time() - cpu)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("results", nargs="?", type=Path, default=ROOT / "results")
    ap.add_argument("--run", default=None, help="checkpoints/<run> (default: the config's run)")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--prompts", type=int, default=None, help="the first N held-out prompts (default all)")
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--max-new-tokens", type=int, default=None, help="default: the config's eval.max_new_tokens")
    ap.add_argument("--block-size", type=int, default=None, help="default: the drafter's")
    ap.add_argument("--reference", type=Path, default=ROOT / ".cache/dflash-reference/dflash/model.py")
    ap.add_argument("--attention-only", action="store_true",
                    help="a full-attention variant of the run's target and a drafter trained for it")
    ap.add_argument("--work", type=Path, default=ROOT / ".cache/bench-eval-attention-only",
                    help="where --attention-only builds its target and drafter (reused)")
    args = ap.parse_args()
    if args.rounds < 5:
        ap.error("--rounds must be >= 5")
    if not args.reference.exists():
        sys.exit(f"{args.reference}: the reference wheel is not unpacked "
                 "(make .cache/dflash-reference/dflash/model.py)")
    torch.set_num_threads(args.threads)

    config_path = args.results.resolve().parent / "config.yaml"
    config = load_config(config_path if config_path.exists() else ROOT / "config.yaml")
    run = args.run or config["run"]
    target_dir, drafter_dir = args.results / "target", args.results / "checkpoints" / run
    heldout = next(args.results.glob("prompts/heldout.jsonl*"), None)
    if heldout is None or not drafter_dir.exists() or not (target_dir / "config.json").exists():
        sys.exit(f"{args.results}: no target/, checkpoints/{run}/ or prompts/heldout.jsonl.zst (run `make demo` first)")
    max_new_tokens = args.max_new_tokens or config["eval"]["max_new_tokens"]
    if args.attention_only:
        target_dir, drafter_dir = attention_only_models(args.results, config, args.work)
    reference = load_reference(args.reference)

    tokenizer = AutoTokenizer.from_pretrained(target_dir)
    records = read_jsonl(heldout)[:args.prompts]
    prompts = encode_prompts(records, tokenizer)
    ours = load_ours(target_dir, drafter_dir)
    theirs = load_theirs(reference, target_dir, drafter_dir, ours[0].dtype)
    stop_ids = stop_token_ids(tokenizer, ours[0].generation_config)
    block_size = args.block_size or ours[1].block_size

    print(f"python {platform.python_version()}, torch {torch.__version__}, transformers {transformers.__version__}, "
          f"reference dflash 0.1.0 ({args.reference}), ours dflash-pipeline {version('dflash-pipeline')} "
          f"({Path(dflash.__file__).parent})")
    print(f"{torch.get_num_threads()} torch threads, target {target_dir} ({ours[0].dtype}, "
          f"{ours[0].config.get_text_config().model_type}), drafter {drafter_dir}, {len(prompts)} prompts from "
          f"{heldout}, "
          f"max_new_tokens {max_new_tokens}, block size {block_size}, greedy, stop ids {sorted(stop_ids)}")

    # Warm-up, excluded: one prompt each.
    decode_ours(ours, prompts[:1], max_new_tokens, stop_ids, block_size)
    decode_theirs(reference, theirs, prompts[:1], max_new_tokens, stop_ids, block_size)

    sides = {
        "ours": (lambda: load_ours(target_dir, drafter_dir),
                 lambda: decode_ours(ours, prompts, max_new_tokens, stop_ids, block_size)),
        "reference": (lambda: load_theirs(reference, target_dir, drafter_dir, ours[0].dtype),
                      lambda: decode_theirs(reference, theirs, prompts, max_new_tokens, stop_ids, block_size)),
    }
    rows, outputs = [], {}
    for round_ in range(args.rounds):
        times = {}
        for side in (("ours", "reference") if round_ % 2 == 0 else ("reference", "ours")):
            load, decode = sides[side]
            _, load_s = timed(load)
            outputs[side], decode_s = timed(decode)
            times[side] = {"load": load_s, "decode": decode_s, "tokens": sum(len(out) for out, _ in outputs[side])}
        rows.append(times)
        print(f"round {round_ + 1} ({' then '.join(times)}): decode ours {times['ours']['decode'][0]:.2f} s "
              f"(CPU {times['ours']['decode'][1]:.2f}), reference {times['reference']['decode'][0]:.2f} s "
              f"(CPU {times['reference']['decode'][1]:.2f}); loading ours {times['ours']['load'][0]:.2f} s, "
              f"reference {times['reference']['load'][0]:.2f} s", flush=True)

    # The last round's outputs, against each other and plain greedy (the reference without drafts).
    mine, ref = outputs["ours"], outputs["reference"]
    greedy = [out for out, _ in decode_theirs(reference, theirs, prompts, max_new_tokens, stop_ids, 1)]
    ours_exact = sum(m[0] == g for m, g in zip(mine, greedy))
    ref_exact = sum(r[0] == g for r, g in zip(ref, greedy))
    same = sum(m[0] == r[0] for m, r in zip(mine, ref))
    print(f"\noutputs: ours = plain greedy on {ours_exact}/{len(prompts)} prompts, reference = plain greedy on "
          f"{ref_exact}/{len(prompts)}, ours = reference on {same}/{len(prompts)}")
    for record, (m, mf), (r, rf), g in zip(records, mine, ref, greedy):
        if m != r:
            print(f"  prompt {record['id']}: ours and the reference part at token {first_difference(m, r)} "
                  f"(ours vs greedy: {first_difference(m, g)}, reference vs greedy: {first_difference(r, g)}); "
                  f"target forwards ours {mf}, reference {rf}")
        elif mf != rf:
            print(f"  prompt {record['id']}: same tokens, target forwards ours {mf}, reference {rf}")
    tokens = sum(len(m[0]) for m in mine)
    print(f"acceptance (tokens per target forward, prefill included): ours {tokens / sum(f for _, f in mine):.3f}, "
          f"reference {sum(len(r[0]) for r in ref) / sum(f for _, f in ref):.3f}")

    def median(side: str, parts: tuple[str, ...], clock: int) -> float:
        return statistics.median(sum(r[side][p][clock] for p in parts) for r in rows)

    def ratio(parts: tuple[str, ...], clock: int) -> float:
        return statistics.median(sum(r["ours"][p][clock] for p in parts) / sum(r["reference"][p][clock] for p in parts)
                                 for r in rows)

    def per_token(clock: int) -> float:
        return statistics.median(r["ours"]["decode"][clock] / r["ours"]["tokens"]
                                 / (r["reference"]["decode"][clock] / r["reference"]["tokens"]) for r in rows)

    print(f"\n{len(prompts)} prompts, {tokens} tokens per decode (ours), "
          f"{sum(len(r[0]) for r in ref)} (reference), {args.rounds} rounds, "
          f"median of per-round ratios ours / reference (below 1: ours faster):")
    for clock, c in (("wall", 0), ("CPU", 1)):
        print(f"  decode, {clock:4}            {ratio(('decode',), c):.3f}  (medians: ours "
              f"{median('ours', ('decode',), c):.2f} s, reference {median('reference', ('decode',), c):.2f} s)")
        print(f"  decode per token, {clock:4}  {per_token(c):.3f}  (each side's decode time over the tokens it "
              f"generated: they differ where the outputs do)")
        print(f"  loading + decode, {clock:4}  {ratio(('load', 'decode'), c):.3f}  (median loading: ours "
              f"{median('ours', ('load',), c):.2f} s, reference {median('reference', ('load',), c):.2f} s)")


if __name__ == "__main__":
    main()
