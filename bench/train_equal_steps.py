"""Drafter quality at equal steps: our trainer against speculators 0.9.0's DFlash trainer on the
same rows, both drafters evaluated by the same evaluator (acceptance length per category).

A faster trainer that makes a worse drafter is no win, so this trains both to the same number of
steps on the same data and compares what they make:

- data: a finished demo run's results (`make demo`; `--results`): its target, its tokenized rows
  (with their categories) and its hidden-state cache, and its held-out prompts for the eval;
- drafter: the run's drafter config (`drafter` section: layers, block size, target layers, mask
  token), built by make_draft_config for both, so both have the same shape and RoPE;
- training: the run's `train` section for steps, peak lr, rows per step and anchors per row;
  each trainer otherwise runs its own recipe: ours dflash.train.train (CE on the data's next
  tokens, weights exp(-(k-1)/gamma), warmup + cosine, its AdamW); speculators its DFlash defaults
  (`bench/speculators_train_rows.py`: CE against the verifier's argmax with D-PACE weights,
  linear schedule, AdamW wd 0.01, rows packed into one sequence). fp32, one thread each, CPU;
- the weights map one to one: speculators' DFlashDraftModel has our parameter names (fc,
  hidden_norm, layers.N.{input_layernorm, self_attn.{q,k,v,o}_proj, q_norm, k_norm,
  post_attention_layernorm, mlp.{gate,up,down}_proj}, norm); its frozen embed_tokens / lm_head /
  verifier_* copies of the target are dropped (ours reads them from the target). The conversion
  is checked: on one row with speculators' anchors, our DFlashDraftModel with the converted
  weights must give speculators' draft hidden states (max abs difference printed);
- eval: dflash.eval.evaluate on the run's held-out prompts (greedy speculative decoding with the
  target, its `eval` settings), the same target and prompts for both.

Prints training wall time (the training loop) and acceptance length overall and per category.
One run of each: a quality comparison, not a timing ratio (see train_vs_speculators.py for that).

Usage: .venv/bin/python bench/train_equal_steps.py [--results results] [--config config.yaml]
    [--steps N] [--speculators-python .venv-speculators/bin/python]
(the demo's 1,000 steps: about 7 minutes on 2 cores, 30 on a heavily loaded machine)
"""
from __future__ import annotations

import argparse
import itertools
import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
DROPPED = ("embed_tokens.", "lm_head.", "verifier_lm_head.", "verifier_norm.", "t2d", "d2t")
ENV = {"OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin"}


def speculators_data(results: Path, drafter_dir: Path, out: Path) -> None:
    """The rows, features and target head speculators' trainer reads (see its helper's docstring),
    with the drafter config our trainer built (``drafter_dir``: its checkpoint)."""
    from safetensors import safe_open
    from safetensors.torch import load_file, save_file
    from transformers import Qwen3Config

    from dflash.drafter import TargetIO
    from dflash.hidden import cached_features, forward_features
    from dflash.target import load_target
    from dflash.train import anchor_candidates

    target_dir = results / "target"
    config = Qwen3Config.from_pretrained(drafter_dir)
    config.save_pretrained(out)
    layer_ids = config.dflash_config["target_layer_ids"]
    io = TargetIO.from_pretrained(target_dir)
    save_file({"embed": io.embed_weight.float().contiguous(), "head": io.head_weight.float().contiguous()},
              out / "io.safetensors")
    target, _ = load_target(target_dir)
    last = config.num_target_layers - 1
    ids, mask, aux, final, offsets = [], [], [], [], [0]
    for tok_path in sorted((results / "tokenized").glob("shard-*.safetensors")):
        tok = load_file(tok_path)
        rows_meta = json.loads(tok_path.with_suffix(".json").read_text())["rows"]
        with safe_open(results / "hidden" / tok_path.name, framework="pt") as handle:
            meta = json.loads((handle.metadata() or {}).get("target_layer_ids", "null"))
            if meta != layer_ids:
                sys.exit(f"{results / 'hidden' / tok_path.name}: features of layers {meta}, the drafter wants {layer_ids}")
            bounds = tok["offsets"].long().tolist()
            for r, (s, e) in enumerate(itertools.pairwise(bounds)):
                row_mask = tok["loss_mask"][s:e].bool()
                if not rows_meta[r].get("trainable", True) or not len(anchor_candidates(row_mask)):
                    continue  # rows our trainer skips too
                row_ids = tok["input_ids"][s:e].long()
                ids.append(row_ids)
                mask.append(row_mask.long())
                aux.append(cached_features(handle, s, e).float().flatten(1))
                with torch.no_grad():
                    final.append(forward_features(target, row_ids[None], [last], logits=False)[1][0, :, 0].float())
                offsets.append(offsets[-1] + e - s)
    save_file({"offsets": torch.tensor(offsets), "input_ids": torch.cat(ids), "loss_mask": torch.cat(mask),
               "aux": torch.cat(aux).contiguous(), "last": torch.cat(final).contiguous()}, out / "rows.safetensors")


def convert(spec_out: Path, config_dir: Path, drafter_dir: Path) -> tuple[float, float]:
    """speculators' state dict as our drafter checkpoint; returns the probe's max abs difference
    and the largest probe value (for scale)."""
    from safetensors.torch import load_file
    from transformers import Qwen3Config

    from dflash.drafter import (
        DFlashDraftModel,
        TargetIO,
        load_drafter,
        write_drafter_state,
    )

    state = {k: v for k, v in load_file(spec_out / "model.safetensors").items() if not k.startswith(DROPPED)}
    drafter_dir.mkdir(parents=True)
    write_drafter_state(state, Qwen3Config.from_pretrained(config_dir), drafter_dir)
    model, config = load_drafter(drafter_dir)  # strict: every one of our parameters came from speculators
    assert isinstance(model, DFlashDraftModel)
    probe = load_file(spec_out / "probe.safetensors")
    rows = load_file(config_dir / "rows.safetensors")
    io = load_file(config_dir / "io.safetensors")
    start, stop = probe["row"].tolist()
    positions = probe["block_positions"].long()
    B = config.block_size
    block_ids = torch.full_like(positions, config.dflash_config["mask_token_id"])
    block_ids[::B] = rows["input_ids"][start:stop][positions[::B]]
    features = rows["aux"][start:stop].view(stop - start, len(config.dflash_config["target_layer_ids"]), -1)
    with torch.no_grad():
        hidden = model.eval()(TargetIO(io["embed"], io["head"]).embed(block_ids)[None], positions[None],
                              features[None], torch.arange(stop - start)[None])
    return float((hidden[0] - probe["hidden"]).abs().max()), float(probe["hidden"].abs().max())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--results", type=Path, default=ROOT / "results", help="a finished demo run's results folder")
    ap.add_argument("--config", type=Path, default=ROOT / "config.yaml", help="that run's config")
    ap.add_argument("--steps", type=int, help="default: the config's train.steps")
    ap.add_argument("--speculators-loss-weight", choices=["dpace", "fixed-exp-decay"], default="dpace",
                    help="speculators' per-position loss weights (dpace: its default for dflash; fixed-exp-decay "
                         "uses our loss_decay_gamma)")
    ap.add_argument("--speculators-python", type=Path, default=ROOT / ".venv-speculators" / "bin" / "python")
    a = ap.parse_args()
    if not a.speculators_python.exists():
        sys.exit(f"{a.speculators_python} not found: run `make speculators-venv` first")
    for part in ("target", "tokenized", "hidden", "prompts/heldout.jsonl.zst"):
        if not (a.results / part).exists():
            sys.exit(f"{a.results / part} not found: run the demo (`make demo`) first, or pass --results")
    torch.set_num_threads(1)

    from transformers import AutoTokenizer

    from dflash.config import load_config
    from dflash.eval import encode_prompts, evaluate, load_target, settings
    from dflash.io import read_jsonl
    from dflash.workflow import drafter_train_cfg

    config = load_config(a.config)
    target_dir = a.results / "target"
    cfg = drafter_train_cfg(config, target_dir)
    if a.steps:
        cfg["steps"] = a.steps
    cfg.update(device="cpu", hidden_states="offline")
    work = Path(tempfile.mkdtemp(prefix="bench-equal-steps-"))
    print(f"data: {a.results}; drafter {cfg['num_layers']} layers, block {cfg['block_size']}, target layers "
          f"{cfg['target_layer_ids']}; {cfg['steps']} steps, lr {cfg['lr']}, {cfg['batch_size']} rows per step, "
          f"{cfg['num_anchors']} anchors per row; fp32, 1 thread each", flush=True)

    tokenized = sorted(str(p) for p in (a.results / "tokenized").glob("shard-*.safetensors"))
    hidden = [str(a.results / "hidden" / Path(p).name) for p in tokenized]
    ours_code = ("import json, sys, time, torch; torch.set_num_threads(1); from pathlib import Path; "
                 "from dflash.train import train; t0 = time.perf_counter(); "
                 f"train([Path(p) for p in {tokenized!r}], [Path(p) for p in {hidden!r}], Path({str(target_dir)!r}), "
                 f"Path({str(work / 'ours')!r}), json.loads({json.dumps(cfg)!r})); "
                 "print(json.dumps({'seconds': time.perf_counter() - t0}))")
    t0 = time.perf_counter()
    ours = subprocess.run([sys.executable, "-c", ours_code], check=False, capture_output=True, text=True, cwd=ROOT,
                          env=ENV)
    if ours.returncode:
        sys.exit(f"our trainer failed:\n{ours.stderr[-3000:]}")
    ours_s = json.loads(ours.stdout.strip().splitlines()[-1])["seconds"]
    print(f"ours trained in {ours_s:.1f} s ({time.perf_counter() - t0:.1f} s with the process start)", flush=True)
    speculators_data(a.results, work / "ours", work / "data")
    spec = subprocess.run([str(a.speculators_python), str(ROOT / "bench" / "speculators_train_rows.py"),
                           str(work / "data"), str(work / "spec"), "--steps", str(cfg["steps"]), "--lr", str(cfg["lr"]),
                           "--batch", str(cfg["batch_size"]), "--anchors-per-row", str(cfg["num_anchors"]),
                           "--seed", str(cfg["seed"]), "--loss-weight", a.speculators_loss_weight,
                           "--gamma", str(cfg["loss_decay_gamma"])], check=False, capture_output=True, text=True, cwd=ROOT,
                           env=ENV)
    if spec.returncode:
        sys.exit(f"speculators' trainer failed:\n{spec.stderr[-3000:]}")
    spec_summary = json.loads((work / "spec" / "summary.json").read_text())
    print(f"speculators trained in {spec_summary['seconds']:.1f} s (loss {spec_summary['first_loss']:.3f} -> "
          f"{spec_summary['final_loss']:.3f}, its own loss)", flush=True)
    diff, scale = convert(work / "spec", work / "data", work / "spec-drafter")
    print(f"converted speculators' weights to our format; our forward on its probe row: max abs difference "
          f"{diff:.2e} (its hidden states reach {scale:.2f})", flush=True)

    eval_cfg = settings({**config["eval"], "device": "cpu"})
    prompts = read_jsonl(a.results / "prompts" / "heldout.jsonl.zst")
    tokenizer = AutoTokenizer.from_pretrained(target_dir)
    loaded = {"target": load_target(target_dir, eval_cfg), "prompt_ids": encode_prompts(prompts, tokenizer)}
    results = {name: evaluate(target_dir, d, prompts, eval_cfg, tokenizer, **loaded)
               for name, d in (("dflash-pipeline", work / "ours"), ("speculators 0.9.0", work / "spec-drafter"))}
    same = [s["output_ids"] for s in results["dflash-pipeline"]["samples"]] == \
        [s["output_ids"] for s in results["speculators 0.9.0"]["samples"]]
    categories = sorted(results["dflash-pipeline"]["per_category"])
    print(f"\nacceptance length on {len(prompts)} held-out prompts (max_new_tokens {eval_cfg['max_new_tokens']}, "
          f"greedy; outputs identical: {same}):")
    print(f"{'':20} {'overall':>8} " + " ".join(f"{c:>9}" for c in categories) + "  train s")
    for (name, r), secs in zip(results.items(), (ours_s, spec_summary["seconds"])):
        print(f"{name:20} {r['overall']['acceptance_length']:8.3f} "
              + " ".join(f"{r['per_category'][c]['acceptance_length']:9.3f}" for c in categories) + f"  {secs:7.1f}")
    print(f"speculators recipe: {spec_summary['recipe']}")
    shutil.rmtree(work)


if __name__ == "__main__":
    main()
