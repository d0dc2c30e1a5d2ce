"""Drafter quality at equal steps: our trainer against speculators 0.9.0's DFlash trainer on the
same rows, both drafters evaluated by the same evaluator (acceptance length per category).

A faster trainer that makes a worse drafter is no win, so this trains both to the same number of
steps on the same data and compares what they make:

- data: a finished demo run's results (`make demo`; `--results`): its target, its tokenized rows
  (with their categories) and its hidden-state cache, and its held-out prompts for the eval;
  `--attention-only`: the full-attention (`qwen3`) variant of the demo target instead, built and
  taught as the run's config builds its own, with its own cache of the run's rows
  (`eval_vs_reference.attention_only_target`, built once into `--work`), so that a win is not one
  model's accident;
- drafter: the run's drafter config (`drafter` section: layers, block size, target layers, mask
  token), built by make_draft_config for both, so both have the same shape and RoPE;
- training: the run's `train` section for steps, peak lr, rows per step and anchors per row;
  each trainer otherwise runs its own recipe: ours dflash.train.stage.train with the config's
  `train.loss` (`--ablation`: each of {decay, dpace} weights x {data, target} labels), warmup +
  cosine, its AdamW (`--set KEY=VALUE` overrides one of our train settings); speculators the
  defaults of `speculators train --speculator-type dflash` (`bench/speculators_train_rows.py`: CE
  against the verifier's argmax with D-PACE weights, linear schedule, Muon for the matrices and
  AdamW for the rest, rows packed into one sequence; `--speculators-optimizer adamw`: AdamW for
  all, the default of its TrainerConfig class, which its CLI overrides). `--lr` sets both
  trainers' peak lr. fp32, one thread each, CPU, `--jobs` trainings at a time;
- seeds (`--seeds 0,1,2`): each trainer once per seed (model init, row order, anchors), so the
  spread of a single run's figures is printed beside them;
- the weights map one to one: speculators' DFlashDraftModel has our parameter names (fc,
  hidden_norm, layers.N.{input_layernorm, self_attn.{q,k,v,o}_proj, q_norm, k_norm,
  post_attention_layernorm, mlp.{gate,up,down}_proj}, norm); its frozen embed_tokens / lm_head /
  verifier_* copies of the target are dropped (ours reads them from the target). The conversion
  is checked: on one row with speculators' anchors, our DFlashDraftModel with the converted
  weights must give speculators' draft hidden states (max abs difference printed);
- eval: dflash.eval.stage.evaluate on the run's held-out prompts (greedy speculative decoding with the
  target, its `eval` settings), the same target and prompts for all, `--jobs` drafters at a time;
- the scale regime (bench/scale_data.py's data set: `--results .cache/scale/results --config
  .cache/scale/config.yaml`, whose target is the demo's by path): `--rows N` trains on the fewest
  leading shards holding N trainable rows (a point of the data curve), `--epochs E` sets the steps
  to rows x E / rows per step, `--batch-size` and `--anchors` set rows per step and anchors per
  row for both trainers, `--speculators-optimizer muon,adamw` runs both of its optimizers (`none`:
  ours only), `--variant LABEL:KEY=VALUE,...` (repeatable) trains ours once more per variant with
  those settings, side by side with the plain one (a sweep of candidate defaults), and
  `--json-out` writes every run's figures for bench/scale_curve.py (the table and the curve), with
  a digest of the rows and held-out prompts (`data`: points of two builds are not mixed) and the
  target by what it learnt from (`target_label`: hybrid, qwen3 on the hybrid's completions, or
  qwen3-own for a data set that scale_data.py --target built with the full-attention variant).

Prints training wall time (the training loop) and acceptance length overall and per category.
A quality comparison, not a timing ratio (see train_vs_speculators.py for that).

Usage: .venv/bin/python bench/train_equal_steps.py [--results results] [--config config.yaml]
    [--steps N] [--lr LR] [--ablation] [--attention-only [--work DIR]] [--seeds 0,1,2] [--jobs 2]
    [--set KEY=VALUE ...] [--speculators-optimizer muon,adamw] [--rows N] [--epochs E] [--batch-size N]
    [--anchors N] [--variant LABEL:KEY=VALUE,...] [--json-out FILE]
    [--speculators-python .venv-speculators/bin/python]
(the demo's 1,000 steps, --ablation: about 20 minutes on 2 cores; each seed or target as much again)
"""
from __future__ import annotations

import argparse
import hashlib
import itertools
import json
import multiprocessing
import shutil
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import torch

from dflash.core.io import write_json

ROOT = Path(__file__).resolve().parents[1]
DROPPED = ("embed_tokens.", "lm_head.", "verifier_lm_head.", "verifier_norm.", "t2d", "d2t")
ENV = {"OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin"}


def speculators_data(tokenized: list[Path], target_dir: Path, hidden: list[Path], drafter_dir: Path, out: Path) -> None:
    """The rows, features and target head speculators' trainer reads (see its helper's docstring),
    with the drafter config our trainer built (``drafter_dir``: its checkpoint)."""
    from safetensors import safe_open
    from safetensors.torch import load_file, save_file
    from transformers import Qwen3Config

    from dflash.train.drafter import TargetIO
    from dflash.hidden.stage import cached_features, forward_features
    from dflash.target.models import load_target
    from dflash.train.batches import anchor_candidates

    config = Qwen3Config.from_pretrained(drafter_dir)
    config.save_pretrained(out)
    layer_ids = config.dflash_config["target_layer_ids"]
    io = TargetIO.from_pretrained(target_dir)
    save_file({"embed": io.embed_weight.float().contiguous(), "head": io.head_weight.float().contiguous()},
              out / "io.safetensors")
    target, _ = load_target(target_dir)
    last = config.num_target_layers - 1
    ids, mask, aux, final, offsets = [], [], [], [], [0]
    for tok_path, hid_path in zip(tokenized, hidden, strict=True):
        tok = load_file(tok_path)
        rows_meta = json.loads(tok_path.with_suffix(".json").read_text())["rows"]
        with safe_open(hid_path, framework="pt") as handle:
            meta = json.loads((handle.metadata() or {}).get("target_layer_ids", "null"))
            if meta != layer_ids:
                sys.exit(f"{hid_path}: features of layers {meta}, the drafter wants {layer_ids}")
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

    from dflash.train.drafter import (
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


OURS = {f"ours ({weights}, {labels})": {"loss": {"weights": weights, "labels": labels}}
        for weights in ("decay", "dpace") for labels in ("data", "target")}


def start_ours(tokenized: list[Path], hidden: list[Path], target_dir: Path, out: Path, cfg: dict) -> subprocess.Popen:
    code = ("import json, sys, time, torch; torch.set_num_threads(1); from pathlib import Path; "
            "from dflash.train.stage import train; t0 = time.perf_counter(); "
            f"train([Path(p) for p in {list(map(str, tokenized))!r}], [Path(p) for p in {list(map(str, hidden))!r}], "
            f"Path({str(target_dir)!r}), Path({str(out)!r}), json.loads({json.dumps(cfg)!r})); "
            "print(json.dumps({'seconds': time.perf_counter() - t0}))")
    return subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            cwd=ROOT, env=ENV)


def start_speculators(python: Path, data: Path, out: Path, cfg: dict, loss_weight: str,
                      optimizer: str) -> subprocess.Popen:
    return subprocess.Popen([str(python), str(ROOT / "bench" / "speculators_train_rows.py"), str(data), str(out),
                             "--steps", str(cfg["steps"]), "--lr", str(cfg["lr"]), "--batch", str(cfg["batch_size"]),
                             "--anchors-per-row", str(cfg["num_anchors"]), "--seed", str(cfg["seed"]),
                             "--loss-weight", loss_weight, "--gamma", str(cfg["loss"]["decay_gamma"]),
                             "--optimizer", optimizer],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT, env=ENV)


def leading_shards(tokenized: list[Path], rows: int | None) -> tuple[list[Path], int]:
    """The fewest leading shards that hold ``rows`` trainable rows (None: all), and how many they hold."""
    chosen, held = [], 0
    for path in tokenized:
        if rows is not None and held >= rows:
            break
        chosen.append(path)
        # an index row's "trainable" counts its supervised tokens: rows with none are skipped in training
        held += sum(1 for r in json.loads(path.with_suffix(".json").read_text())["rows"] if r.get("trainable", True))
    if rows is not None and held < rows:
        sys.exit(f"--rows {rows}: the run's {len(tokenized)} tokenized shards hold only {held} trainable rows")
    return chosen, held


def data_digest(files: list[Path]) -> str:
    """sha256 over the files' bytes: two points (or two builds of a data set) trained and were
    evaluated on the same data only if this matches."""
    h = hashlib.sha256()
    for path in files:
        h.update(path.read_bytes())
    return h.hexdigest()[:16]


def evaluate_one(target_dir: Path, drafter: Path, heldout: Path, eval_cfg: dict) -> dict:
    """One drafter through the evaluator, in a process of its own (one thread)."""
    torch.set_num_threads(1)
    from transformers import AutoTokenizer

    from dflash.eval.stage import evaluate
    from dflash.core.io import read_jsonl

    return evaluate(target_dir, drafter, read_jsonl(heldout), eval_cfg, AutoTokenizer.from_pretrained(target_dir))


def finish(name: str, run: subprocess.Popen) -> str:
    out, err = run.communicate()
    if run.returncode:
        sys.exit(f"{name}: training failed:\n{err[-3000:]}")
    return out


def target_label(target_dir: Path, attention_only: bool) -> str:
    """The target a point names: ``hybrid`` (the demo's), ``qwen3`` (its full-attention variant,
    trained on the run's completions: the demo target's) or ``qwen3-own`` (a run whose own target
    is full-attention, bench/scale_data.py --target: trained on that target's own completions)."""
    if attention_only:
        return "qwen3"
    layer_types = json.loads((target_dir / "config.json").read_text()).get("layer_types") or []
    return "hybrid" if "linear_attention" in layer_types else "qwen3-own"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--results", type=Path, default=ROOT / "results", help="a finished demo run's results folder")
    ap.add_argument("--config", type=Path, default=ROOT / "config.yaml", help="that run's config")
    ap.add_argument("--steps", type=int, help="default: the config's train.steps")
    ap.add_argument("--lr", type=float, help="peak learning rate of both trainers (default: the config's train.lr)")
    ap.add_argument("--ablation", action="store_true",
                    help="ours with each of {decay, dpace} x {data, target} (train.loss weights x labels), not only "
                         "the config's")
    ap.add_argument("--attention-only", action="store_true",
                    help="the full-attention (qwen3) variant of the demo target, as eval_vs_reference.py builds it "
                         "(into --work, reused), instead of the run's hybrid target")
    ap.add_argument("--work", type=Path, default=ROOT / ".cache/bench-eval-attention-only")
    ap.add_argument("--jobs", type=int, default=2, help="trainings at a time (one thread each)")
    ap.add_argument("--seeds", type=lambda text: [int(x) for x in text.split(",")], default=None,
                    help="comma-separated seeds, each trainer trained once per seed (default: the config's "
                         "train.seed): the spread across seeds is the noise a single run's figures carry")
    ap.add_argument("--speculators-loss-weight", choices=["dpace", "fixed-exp-decay"], default="dpace",
                    help="speculators' per-position loss weights (dpace: its default for dflash; fixed-exp-decay "
                         "uses our train.loss.decay_gamma)")
    ap.add_argument("--speculators-optimizer", type=lambda text: text.split(","), default=["muon"],
                    help="speculators' --optimizer, comma-separated for several runs (muon: its CLI's default; "
                         "adamw: its TrainerConfig's; none: ours only)")
    ap.add_argument("--rows", type=int, help="train on the fewest leading tokenized shards holding this many "
                                             "trainable rows (default: all): a point of the data curve")
    ap.add_argument("--epochs", type=float, help="steps = rows x epochs / rows per step (instead of --steps)")
    ap.add_argument("--batch-size", type=int, help="rows per step, both trainers (default: the config's)")
    ap.add_argument("--anchors", type=int, help="anchors per row, both trainers (default: the config's)")
    ap.add_argument("--json-out", type=Path, help="also write every run's figures here (bench/scale_curve.py reads them)")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="override one of our train settings (VALUE is YAML: --set optimizer=muon, "
                         "--set min_lr_ratio=0); repeatable")
    ap.add_argument("--variant", action="append", default=[], metavar="LABEL:KEY=VALUE[,KEY=VALUE...]",
                    help="also train ours with these settings on top of --set, under this label (a sweep of "
                         "candidate defaults, side by side with the plain one); repeatable")
    ap.add_argument("--speculators-python", type=Path, default=ROOT / ".venv-speculators" / "bin" / "python")
    a = ap.parse_args()
    import yaml

    def settings_of(items: list[str], flag: str) -> dict:
        if bad := [item for item in items if "=" not in item]:
            ap.error(f"{flag} {bad[0]!r}: expected KEY=VALUE")
        return {k: yaml.safe_load(v) for k, v in (item.split("=", 1) for item in items)}

    if bad := [v for v in a.variant if ":" not in v]:
        ap.error(f"--variant {bad[0]!r}: expected LABEL:KEY=VALUE[,KEY=VALUE...]")
    ours_set = settings_of(a.set, "--set")
    variants = {f"ours ({label})": settings_of(items.split(","), "--variant")
                for label, items in (v.split(":", 1) for v in a.variant)}
    # Without its venv our trainer still runs and is evaluated (its figures alone), so that the
    # bench keeps working where only our venv is built (CI: tests/test_bench.py).
    speculators = a.speculators_python.exists() and a.speculators_optimizer != ["none"]
    if not a.speculators_python.exists():
        print(f"{a.speculators_python} not found (make speculators-venv): speculators is left out, only our trainer "
              f"runs", file=sys.stderr)
    from dflash.core.config import load_config
    from dflash.eval.stage import settings
    from dflash.train.stage import drafter_train_cfg

    config = load_config(a.config)
    # a run that names its target by path (bench/scale_data.py's: the demo's) has none in its results
    run_target = Path(config["target"]["path"]) if config["target"]["path"] else a.results / "target"
    for path in (run_target, *(a.results / p for p in ("tokenized", "hidden", "prompts/heldout.jsonl.zst"))):
        if not path.exists():
            sys.exit(f"{path} not found: run the demo (`make demo`) first, or pass --results")
    torch.set_num_threads(1)

    tokenized, rows = leading_shards(sorted((a.results / "tokenized").glob("shard-*.safetensors")), a.rows)
    if a.attention_only:
        sys.path.insert(0, str(ROOT / "bench"))
        from eval_vs_reference import attention_only_target

        # the variant of the demo target for a run that uses the demo's by path
        taught = (load_config(ROOT / "config.yaml"), ROOT) if config["target"]["path"] else None
        target_dir, hidden = attention_only_target(a.results, config, a.work, taught, tokenized)
    else:
        target_dir, hidden = run_target, [a.results / "hidden" / p.name for p in tokenized]
    cfg = drafter_train_cfg(config, target_dir)
    cfg.update({k: v for k, v in (("lr", a.lr), ("batch_size", a.batch_size), ("num_anchors", a.anchors)) if v})
    if a.steps:
        cfg["steps"] = a.steps
    elif a.epochs:
        cfg["steps"] = -(-int(rows * a.epochs) // cfg["batch_size"])
    cfg.update(device="cpu", hidden_states="offline")
    ours_cfg = {**cfg, **ours_set}
    a.seeds = a.seeds or [cfg["seed"]]
    work = Path(tempfile.mkdtemp(prefix="bench-equal-steps-"))
    combos = {**(OURS if a.ablation else {"dflash-pipeline": {}}), **variants}
    which = "the full-attention variant" if a.attention_only else "the run's"
    print(f"data: {a.results}, {len(tokenized)} shards, {rows} trainable rows "
          f"({cfg['steps'] * cfg['batch_size'] / rows:.2f} epochs); target {target_dir} ({which}); "
          f"drafter {cfg['num_layers']} layers, block {cfg['block_size']}, target layers {cfg['target_layer_ids']}; "
          f"{cfg['steps']} steps, lr {cfg['lr']}, {cfg['batch_size']} rows per step, {cfg['num_anchors']} anchors "
          f"per row; fp32, 1 thread each, {a.jobs} at a time", flush=True)

    if speculators:  # its rows need our drafter config (the trainer writes it; one step is enough)
        shape = work / "shape"
        finish("ours (config)", start_ours(tokenized, hidden, target_dir, shape, {**cfg, "steps": 1, "save_every": 0}))
        speculators_data(tokenized, target_dir, hidden, shape, work / "data")
    spec_names = {f"speculators 0.9.0 ({a.speculators_loss_weight}, {opt})": opt for opt in a.speculators_optimizer}
    runs = {}  # (trainer, seed) -> (output folder, start)
    lrs = {**{name: {**ours_cfg, **overrides}["lr"] for name, overrides in combos.items()},
           **{name: cfg["lr"] for name in spec_names}}  # each trainer's peak lr (a variant may set its own)
    for seed in a.seeds:
        for name, overrides in combos.items():
            out = work / f"ours-{len(runs)}"
            run_cfg = {**ours_cfg, **overrides, "seed": seed,
                       "loss": {**ours_cfg["loss"], **overrides.get("loss", {})}}
            runs[name, seed] = (out, lambda out=out, run_cfg=run_cfg: start_ours(tokenized, hidden, target_dir, out,
                                                                                  run_cfg))
        for spec_name, optimizer in spec_names.items() if speculators else ():
            out = work / f"spec-{optimizer}-{seed}"
            runs[spec_name, seed] = (out, lambda out=out, seed=seed, optimizer=optimizer: start_speculators(
                a.speculators_python, work / "data", out, {**cfg, "seed": seed}, a.speculators_loss_weight, optimizer))

    t0, seconds, pending, running = time.perf_counter(), {}, list(runs), []
    while pending or running:
        while pending and len(running) < a.jobs:
            running.append((pending[0], runs[pending[0]][1]()))
            pending.pop(0)
        time.sleep(1)
        for key, run in [(k, r) for k, r in running if r.poll() is not None]:
            running.remove((key, run))
            out = finish(f"{key[0]} seed {key[1]}", run)
            seconds[key] = (json.loads((runs[key][0] / "summary.json").read_text())["seconds"] if key[0] in spec_names
                            else json.loads(out.strip().splitlines()[-1])["seconds"])
            print(f"{key[0]} (seed {key[1]}) trained in {seconds[key]:.1f} s ({time.perf_counter() - t0:.0f} s so far)",
                  flush=True)
    drafters = {}
    for key, (out, _) in runs.items():
        if key[0] in spec_names:
            spec_summary = json.loads((out / "summary.json").read_text())
            diff, scale = convert(out, work / "data", out.with_name(out.name + "-drafter"))
            print(f"speculators (seed {key[1]}): loss {spec_summary['first_loss']:.3f} -> "
                  f"{spec_summary['final_loss']:.3f} (its own loss); converted to our format, our forward on its "
                  f"probe row: max abs difference {diff:.2e} (its hidden states reach {scale:.2f})", flush=True)
            out = out.with_name(out.name + "-drafter")
        drafters[key] = out

    eval_cfg = settings({**config["eval"], "device": "cpu"})
    heldout = a.results / "prompts" / "heldout.jsonl.zst"
    # the drafters side by side, a process each ("spawn": no torch threads inherited)
    with ProcessPoolExecutor(a.jobs, mp_context=multiprocessing.get_context("spawn")) as pool:
        futures = {key: pool.submit(evaluate_one, target_dir, d, heldout, eval_cfg) for key, d in drafters.items()}
        results = {key: future.result() for key, future in futures.items()}
    prompts = results[next(iter(results))]["samples"]
    outputs = [[s["output_ids"] for s in r["samples"]] for r in results.values()]
    same = all(o == outputs[0] for o in outputs)
    categories = sorted(next(iter(results.values()))["per_category"])
    print(f"\nacceptance length on {len(prompts)} held-out prompts (max_new_tokens {eval_cfg['max_new_tokens']}, "
          f"greedy; outputs identical: {same}):")
    print(f"| trainer | seed | overall | {' | '.join(categories)} | training s |")
    print("| --- " * (len(categories) + 4) + "|")

    def row(label: str, seed: str, rs: list[dict], secs: list[float]) -> str:
        def mean(values):
            return sum(values) / len(values)
        return (f"| {label} | {seed} | {mean([r['overall']['acceptance_length'] for r in rs]):.3f} | "
                + " | ".join(f"{mean([r['per_category'][c]['acceptance_length'] for r in rs]):.3f}"
                             for c in categories) + f" | {mean(secs):.0f} |")

    for name in [*combos, *(spec_names if speculators else [])]:
        keys = [(name, seed) for seed in a.seeds]
        for key in keys:
            print(row(name, str(key[1]), [results[key]], [seconds[key]]))
        if len(keys) > 1:
            print(row(name, "mean", [results[k] for k in keys], [seconds[k] for k in keys]))
    recipe = [f"speculators recipe: {spec_summary['recipe']}"] if speculators else []
    if recipe or a.set:
        print("; ".join(recipe + ([f"ours with {' '.join(a.set)}"] if a.set else [])))
    if a.json_out:
        write_json(a.json_out, {
            "target": target_label(target_dir, a.attention_only), "rows": rows, "shards": len(tokenized),
            "steps": cfg["steps"], "rows_per_step": cfg["batch_size"], "anchors_per_row": cfg["num_anchors"],
            "lr": cfg["lr"], "ours_set": a.set, "variants": variants, "heldout": len(prompts),
            "outputs_identical": same, "data": data_digest([*tokenized, heldout]),
            "runs": [{"trainer": name, "seed": seed, "lr": lrs[name], "seconds": seconds[name, seed],
                      "overall": r["overall"], "per_category": r["per_category"]} for (name, seed), r in results.items()]})
    shutil.rmtree(work)


if __name__ == "__main__":
    main()
