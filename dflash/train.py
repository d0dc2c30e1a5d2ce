"""Train a DFlash drafter from tokenized shards and their cached target hidden states.

Each step, each row gets up to ``num_anchors`` random anchors ``a`` among the positions with
``loss_mask[a] and loss_mask[a + 1]``. The block at ``a`` is ``[input_ids[a], MASK x (B-1)]`` at
positions ``a .. a+B-1``; it sees the fused target features of positions ``< a`` and drafts the
tokens at ``a+1 .. a+B-1`` through the target's frozen lm_head. The objective (``dflash.objective``,
the math in its docstring): by default cross-entropy against the target's own greedy token at each
slot, D-PACE position weights (each slot weighted, without gradient, by the acceptance length it can
still add given the drafter's smoothed confidence up to it), summed and divided by the number of
supervised slots in the step's global batch.

``cfg``: the config's ``drafter`` and ``train`` sections merged (``mask_token`` resolved to
``mask_token_id``, ``gpus`` left to the launcher) and ``target.fast_kernels``; keys left out take
the schema's defaults (``dflash/schemas/config.schema.yaml`` documents each), unknown keys are errors.

Output directory (written under a temporary name, renamed when complete):
``config.json`` + ``model.safetensors`` (the drafter, reference layout), ``train_log.jsonl``
(``step, loss, acc, lr, position_acc, position_weight, expected_acceptance, tokens_per_s``, averaged since the previous line;
``position_acc[k-1]`` is the top-1 accuracy at block position k, null if none was supervised;
``position_weight[k-1]`` the mean loss weight there;
``tokens_per_s`` counts supervised block positions),
``trainer_state.json`` (``steps, first_loss, final_loss, seconds, cfg, data``).
"""
from __future__ import annotations

import contextlib
import json
import logging
import os
import subprocess
import sys
import tempfile
import time
from contextlib import ExitStack, closing, nullcontext
from pathlib import Path

import torch
from transformers import AutoConfig, Qwen3Config

from dflash.batches import Batch, RowOrder, ShardData, add_feature_noise, make_batch, prefetched, sample_anchors
from dflash.config import defaults
from dflash.drafter import DFlashDraftModel, TargetIO, make_draft_config, write_drafter_state
from dflash.errors import RANK_ERRORS, first_rank_error, rank_error_recorded
from dflash.io import atomic_dir, replace_problem
from dflash.models import check_fast_kernels, pick_device
from dflash.objective import LABELS, WEIGHTS, block_loss, supervision
from dflash.optim import OPTIMIZERS, lr_at, make_optimizer
from dflash.parallel import Distributed
from dflash.serving import serving_problems
from dflash.train_resume import newest_resume_point, resume_dir, run_fingerprint, save_resume_point
from dflash.workflow import CONSOLE_FD, drafter_train_cfg, job_console, progress

ARCH_KEYS = ("num_layers", "intermediate_size", "num_heads", "num_kv_heads", "head_dim", "block_size",
             "mask_token_id", "target_layer_ids", "layer_types", "sliding_window")
# Sizes that default to the target's own.
_FROM_TARGET = {"intermediate_size": "intermediate_size", "num_heads": "num_attention_heads",
                "num_kv_heads": "num_key_value_heads", "head_dim": "head_dim"}


def drafter_config(cfg: dict, target_config) -> Qwen3Config:
    """The config a drafter trained with ``cfg`` (the trainer's settings) on a target of
    ``target_config`` (its text config) gets: what its checkpoint carries, known before training."""
    arch = {k: cfg[k] for k in ARCH_KEYS}
    for key, target_key in _FROM_TARGET.items():
        if arch[key] is None:
            arch[key] = getattr(target_config, target_key)
    return make_draft_config(target_config, **arch)


def planned_drafter_config(drafter: dict, target_dir: str | Path) -> Qwen3Config:
    """:func:`drafter_config` from the pipeline config's ``drafter`` section alone (the train
    section shapes no weight matrix): the untrained baseline's, decoded before training ends."""
    cfg = resolve_cfg(drafter_train_cfg({"drafter": drafter, "train": {}}, target_dir))
    return drafter_config(cfg, AutoConfig.from_pretrained(target_dir).get_text_config())


def trainer_defaults() -> dict:
    """What the trainer takes, at the schema's defaults: the drafter and train sections as
    ``drafter_train_cfg`` merges them, and the target's ``fast_kernels``."""
    drafter = {k: v for k, v in defaults("drafter").items() if k != "mask_token"}
    train = {k: v for k, v in defaults("train").items() if k != "gpus"}
    return {**drafter, **train, "fast_kernels": defaults("target")["fast_kernels"]}


def resolve_cfg(cfg: dict) -> dict:
    known = trainer_defaults()
    unknown = sorted(set(cfg) - set(known))
    if unknown:
        raise ValueError(f"unknown drafter/train settings: {unknown}")
    merged = {**known, **cfg}
    merged["loss"] = {**known["loss"], **(cfg.get("loss") or {})}
    if unknown := sorted(set(merged["loss"]) - set(known["loss"])):
        raise ValueError(f"unknown train.loss settings: {unknown}")
    if merged["loss"]["weights"] not in WEIGHTS or merged["loss"]["labels"] not in LABELS:
        raise ValueError(f"train.loss.weights must be one of {WEIGHTS} and train.loss.labels one of {LABELS}")
    if merged["optimizer"] not in OPTIMIZERS:
        raise ValueError(f"train.optimizer must be one of {OPTIMIZERS}")
    if not 0 < merged["loss"]["dpace_alpha"] <= 1:
        raise ValueError("train.loss.dpace_alpha must be in (0, 1]")
    if merged["mask_token_id"] is None:  # the pipeline resolves drafter.mask_token to it (drafter_train_cfg)
        raise ValueError("missing required drafter/train settings: ['mask_token_id']")
    if min(merged[k] for k in ("steps", "batch_size", "num_anchors", "log_every", "loss_chunk_tokens")) < 1:
        raise ValueError("steps, batch_size, num_anchors, log_every and loss_chunk_tokens must be >= 1")
    if merged["prefetch"] < 0 or merged["feature_noise"] < 0:
        raise ValueError("prefetch and feature_noise must be >= 0")
    return merged


def draft_loss(model: torch.nn.Module, io: TargetIO, batch: Batch, B: int, loss: dict, supervised: int | torch.Tensor,
               world: int = 1, *, chunk_tokens: int):
    """The drafter's forward over a batch and its loss (``dflash.objective.block_loss``, whose
    arguments these are). ``model`` may be wrapped (DDP, FSDP); ``B`` is its block size."""
    hidden = model(io.embed(batch.block_ids), batch.block_pos, batch.context, batch.context_pos, batch.context_valid)
    return block_loss(hidden, io.head_weight, batch.labels, batch.supervised, B, loss, supervised, world, chunk_tokens)


def train(tokenized: list[Path], hidden: list[Path] | None, target_dir: Path, out_dir: Path, cfg: dict,
          log: logging.Logger | None = None) -> dict:
    """Train a drafter and write its checkpoint directory; returns a summary dict.

    Every ``save_every`` steps a resume point (weights, optimizer, RNG and data position) is
    written beside the output; a re-run with the same settings and data continues from the newest
    one and ends with the weights an uninterrupted run would have."""
    log = log or logging.getLogger(__name__)
    cfg = resolve_cfg(cfg)
    target_dir, out_dir = Path(target_dir), Path(out_dir)
    if problem := replace_problem(out_dir, "checkpoint"):  # now, not after the training
        raise FileExistsError(problem)
    dist = Distributed(pick_device(cfg["device"]))
    device, main = dist.device, dist.rank == 0
    torch.manual_seed(cfg["seed"])
    generator = torch.Generator().manual_seed(cfg["seed"])

    target_config = AutoConfig.from_pretrained(target_dir).get_text_config()
    if cfg["hidden_states"] == "online":  # the target runs here: stop now, not after minutes of loading
        check_fast_kernels(target_config, device, cfg["fast_kernels"], log)
    config = drafter_config(cfg, target_config)
    if main:  # before the hours of training, not after
        for problem in serving_problems(config.to_dict()):
            log.warning("serving: %s", problem)
    layer_ids = config.dflash_config["target_layer_ids"]
    model = DFlashDraftModel(config).to(device)
    io = TargetIO.from_pretrained(target_dir).to(device, torch.float32)
    B, steps = config.block_size, cfg["steps"]
    log.info("drafter: %d layers, %.2fM trainable params, target layers %s, block %d, %d process(es)",
             config.num_hidden_layers, sum(p.numel() for p in model.parameters()) / 1e6, layer_ids, B, dist.world)
    model = dist.wrap(model, cfg["parallel"])
    optimizer = make_optimizer(model, cfg["lr"], cfg["weight_decay"], cfg["optimizer"])
    # bf16 matmuls on GPU; the weights, optimizer and loss stay fp32
    autocast = torch.autocast("cuda", dtype=torch.bfloat16) if device.type == "cuda" else nullcontext()

    start = time.time()
    resume = resume_dir(out_dir)
    fingerprint = run_fingerprint(cfg, tokenized, target_dir)
    online = None
    if cfg["hidden_states"] == "online":  # the frozen target computes each drawn row's features
        from dflash.models import load_target

        online = load_target(target_dir, torch.bfloat16 if device.type == "cuda" else torch.float32)[0].to(device)
        online.requires_grad_(False)
        hidden = None
    greedy = cfg["loss"]["labels"] == "target"
    with ShardData(tokenized, hidden, layer_ids, target_config.hidden_size, target_dir.name, log, online,
                   greedy) as data, \
            ExitStack() as outputs:
        log.info("data: %s", data.summary)
        rows = RowOrder(len(data.rows), generator)
        first_loss = final_loss = float("nan")
        log_lines: list[str] = []
        window = new_window(B)
        step0 = 0
        state = newest_resume_point(resume, fingerprint, log) if resume.exists() else None
        if state:
            dist.load_full_state(model, optimizer, state["model"], state["optimizer"])
            generator.set_state(state["generator"])
            torch.set_rng_state(state["torch_rng"])
            rows.load_state_dict(state["rows"])
            step0, first_loss, final_loss = state["step"], state["first_loss"], state["final_loss"]
            log_lines, window = state["log_lines"], {**state["window"], "t0": time.time()}
        if main:
            tmp = outputs.enter_context(atomic_dir(out_dir, "checkpoint"))
            log_file = outputs.enter_context(open(tmp / "train_log.jsonl", "w"))
            log_file.writelines(log_lines)
        per_rank = cfg["batch_size"]
        mine = slice(dist.rank * per_rank, (dist.rank + 1) * per_rank)
        pin = device.type == "cuda"  # page-locked, so the copy to the GPU can run without blocking the loop
        pin_device = torch.cuda.current_device() if pin else None

        def next_batch() -> tuple[Batch, int, dict]:
            """The next step's batch, the supervised slots of the global batch (the loss's
            denominator on every rank), and the draw state a resume point after that step stores
            (the prefetch thread has drawn further by then)."""
            # all ranks draw the whole global batch, so their generators stay equal; each trains its slice
            batch_rows = [data.rows[next(rows)] for _ in range(per_rank * dist.world)]
            anchors = [sample_anchors(r.loss_mask, cfg["num_anchors"], generator) for r in batch_rows]
            draws = {"generator": generator.get_state(), "rows": rows.state_dict()}
            supervised = sum(int(supervision(r.loss_mask, a[:, None] + torch.arange(B)).sum())
                             for r, a in zip(batch_rows, anchors))
            outputs = [data.target_outputs(r) for r in batch_rows[mine]]
            batch = make_batch(batch_rows[mine], [f for f, _ in outputs], anchors[mine], B,
                               config.dflash_config["mask_token_id"], [g for _, g in outputs] if greedy else None)
            if pin:
                # a new thread's current device is GPU 0: pinning there would open a context on it from every rank
                torch.cuda.set_device(pin_device)
                batch = batch.pin_memory()
            return batch, supervised, draws

        # online features are the target's forward on this device: in a second thread it would only
        # queue behind the training step's kernels and contend for the GIL, so it runs in the loop
        ahead = cfg["prefetch"] if online is None else 0
        batches = outputs.enter_context(closing(prefetched(next_batch, steps - step0, ahead)))
        bar = progress(range(step0, steps), desc="train drafter", unit="step", initial=step0, total=steps,
                       disable=not main)  # one bar, one console story, for all ranks
        for step, (batch, supervised, draws) in zip(bar, batches):
            batch = batch.to(device, non_blocking=pin)
            if cfg["feature_noise"]:
                add_feature_noise(batch, cfg["feature_noise"], cfg["seed"], step, dist.rank * per_rank)
            lr = lr_at(step, steps, cfg["lr"], cfg["warmup_ratio"], cfg["min_lr_ratio"])
            for group in optimizer.param_groups:
                group["lr"] = lr

            with autocast:
                loss, parts = draft_loss(model, io, batch, B, cfg["loss"], supervised, dist.world,
                                         chunk_tokens=cfg["loss_chunk_tokens"])
            loss.backward()
            if cfg["grad_clip"]:
                torch.nn.utils.clip_grad_norm_(model.parameters(), cfg["grad_clip"])
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)

            weighted, correct, count, weight = dist.sum(parts.weighted_ce.float().reshape(1), parts.correct,
                                                        parts.count, parts.weight)
            step_loss = weighted.item() / supervised  # the global batch's loss, as one process has it
            if step == 0:
                first_loss = step_loss
            window["loss"] += step_loss
            window["steps"] += 1
            window["correct"] += correct.cpu()
            window["count"] += count.cpu()
            window["weight"] += weight.cpu()
            if (step + 1) % cfg["log_every"] == 0 or step + 1 == steps:
                final_loss = window["loss"] / window["steps"]
                record = log_record(step + 1, final_loss, lr, window)
                log_lines.append(json.dumps(record) + "\n")
                if main:
                    log_file.write(log_lines[-1])
                    log_file.flush()
                    log.info("step %d loss %.4f acc %.3f expected acceptance %.2f lr %.2e", step + 1, final_loss,
                             record["acc"], record["expected_acceptance"], lr)
                    bar.set_postfix(loss=f"{final_loss:.3f}", refresh=False)
                window = new_window(B)
            if cfg["save_every"] and (step + 1) % cfg["save_every"] == 0 and step + 1 < steps:
                model_state, optim_state = dist.full_state(model, optimizer)
                if main:
                    save_resume_point(resume, {
                        "fingerprint": fingerprint, "step": step + 1, "model": model_state, "optimizer": optim_state,
                        "generator": draws["generator"], "torch_rng": torch.get_rng_state(),
                        "rows": draws["rows"], "first_loss": first_loss, "final_loss": final_loss,
                        "log_lines": log_lines, "window": {k: v for k, v in window.items() if k != "t0"}})
                dist.barrier()

        model_state, _ = dist.full_state(model, optimizer)
        seconds = time.time() - start
        if main:
            write_drafter_state(model_state, config, tmp)
            state = {"steps": steps, "first_loss": first_loss, "final_loss": final_loss, "seconds": seconds,
                     "resumed_from_step": step0, "processes": dist.world, "cfg": cfg, "data": data.summary}
            (tmp / "trainer_state.json").write_text(json.dumps(state, indent=2) + "\n")
    if main and resume.exists():  # the checkpoint is in place: nothing left to resume
        for point in resume.glob("step-*.pt"):  # only what save_resume_point wrote
            point.unlink()
        with contextlib.suppress(OSError):  # a folder holding anything else is left as it is
            resume.rmdir()
    dist.barrier()
    dist.close()
    return {"steps": steps, "final_loss": final_loss, "first_loss": first_loss,
            "rows": data.summary["trainable_rows"], "tokens": data.summary["trainable_tokens"],
            "seconds": seconds, "resumed_from_step": step0}


def new_window(block_size: int) -> dict:
    """Running sums between two train_log lines."""
    return {"loss": 0.0, "steps": 0, "correct": torch.zeros(block_size), "count": torch.zeros(block_size),
            "weight": torch.zeros(block_size), "t0": time.time()}


def expected_acceptance(position_acc: list[float | None]) -> float:
    """Tokens per target forward if the block positions were accepted independently with these
    accuracies: 1 (the target's own token) + sum over k of acc_1 x ... x acc_k."""
    total, run = 1.0, 1.0
    for acc in position_acc:
        run *= acc or 0.0
        total += run
    return total


def log_record(step: int, loss: float, lr: float, window: dict) -> dict:
    correct, count = window["correct"][1:], window["count"][1:]
    position_acc = [(c / n).item() if n > 0 else None for c, n in zip(correct, count)]
    position_weight = [(w / n).item() if n > 0 else None for w, n in zip(window["weight"][1:], count)]
    return {
        "step": step,
        "loss": loss,
        "acc": (correct.sum() / count.sum().clamp(min=1)).item(),
        "lr": lr,
        "position_acc": position_acc,
        "position_weight": position_weight,
        "expected_acceptance": expected_acceptance(position_acc),
        "tokens_per_s": count.sum().item() / max(time.time() - window["t0"], 1e-9),
    }


def train_processes(processes: int, tokenized: list[Path], hidden: list[Path], target_dir: Path, out_dir: Path,
                    cfg: dict) -> None:
    """``train`` in data-parallel processes, one per GPU (torchrun): their output goes to this
    process's stderr (a job's log), rank 0's progress lines to its job's console, and a failure
    is one error naming the rank that failed first and its reason."""
    console = job_console()
    with tempfile.TemporaryDirectory(prefix="dflash-ranks-") as errors:
        # the ranks' stderr is the log from the start: their stdout is the console
        env = {**os.environ, RANK_ERRORS: errors, **({CONSOLE_FD: "1"} if console else {})}
        ranks = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                                f"--nproc_per_node={processes}", "-m", "dflash.train", "--cfg", json.dumps(cfg),
                                "--tokenized", *map(str, tokenized), "--hidden", *map(str, hidden or []),
                                "--target", str(target_dir), "--out", str(out_dir)],
                               stdout=console or sys.stderr, stderr=sys.stderr, env=env)
        if ranks.returncode:
            first = first_rank_error(errors) or (f"torchrun exited with {ranks.returncode} and no rank raised an "
                                                 f"error (killed or crashed: out of memory?)")
            raise RuntimeError(f"training in {processes} processes failed: {first}\n(every rank's output is in the "
                               f"log; a re-run resumes from the last resume point)")


def main(argv: list[str] | None = None) -> None:
    """Entry point of each torchrun process (``train_processes`` starts them)."""
    import argparse

    from dflash.workflow import setup_logging

    ap = argparse.ArgumentParser(description="one process of a multi-GPU drafter training (torchrun)")
    ap.add_argument("--cfg", required=True, help="the trainer's settings as JSON")
    ap.add_argument("--tokenized", nargs="+", type=Path, required=True)
    ap.add_argument("--hidden", nargs="*", type=Path, help="hidden-state shards (none with hidden_states: online)")
    ap.add_argument("--target", type=Path, required=True)
    ap.add_argument("--out", type=Path, required=True)
    a = ap.parse_args(argv)
    setup_logging()
    with rank_error_recorded():
        train(a.tokenized, a.hidden, a.target, a.out, json.loads(a.cfg), logging.getLogger("dflash.train"))


if __name__ == "__main__":
    main()
