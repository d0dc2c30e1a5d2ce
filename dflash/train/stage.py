"""Train a DFlash drafter from tokenized shards and their cached target hidden states.

Each step, each row gets up to ``num_anchors`` random anchors ``a`` among the positions with
``loss_mask[a] and loss_mask[a + 1]``. The block at ``a`` is ``[input_ids[a], MASK x (B-1)]`` at
positions ``a .. a+B-1``; it sees the fused target features of positions ``< a`` and drafts the
tokens at ``a+1 .. a+B-1`` through the target's frozen lm_head. The objective (``dflash.train.objective``,
the math in its docstring): by default cross-entropy against the target's own greedy token at each
slot, D-PACE position weights (each slot weighted, without gradient, by the acceptance length it can
still add given the drafter's smoothed confidence up to it), summed and divided by the number of
supervised slots in the step's global batch.

``cfg``: the config's ``drafter`` and ``train`` sections merged (``mask_token`` resolved to
``mask_token_id``, ``gpus`` and ``nodes`` left to the launcher) and ``target.fast_kernels``; keys left out take
the schema's defaults (``dflash/schemas/config.schema.yaml`` documents each), unknown keys are errors.

Output directory (written under a temporary name, renamed when complete):
``config.json`` + ``model.safetensors`` (the drafter, reference layout), ``train_log.jsonl``
(``step, loss, acc, lr, grad_norm, position_acc, position_weight, expected_acceptance, tokens_per_s``, averaged since
the previous line; ``grad_norm`` before clipping;
``position_acc[k-1]`` is the top-1 accuracy at block position k, null if none was supervised;
``position_weight[k-1]`` the mean loss weight there;
``tokens_per_s`` counts supervised block positions),
``trainer_state.json`` (``steps, first_loss, final_loss, seconds, cfg, data``).

Here the run: set-up, the step loop, the checkpoint. The batches come from ``dflash.train.batches``, the
optimizers from ``dflash.train.optim``, resume points from ``dflash.train.resume``, the log's lines from
``dflash.train.log``, the processes from ``dflash.train.parallel``.
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import time
from collections.abc import Callable
from contextlib import AbstractContextManager, ExitStack, closing, nullcontext
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import AutoConfig, AutoTokenizer, PretrainedConfig, Qwen3Config

from dflash.core.config import completed, defaults
from dflash.core.curves import Curves, curve_spec, train_scalars
from dflash.core.errors import rank_error_recorded
from dflash.core.io import atomic_dir, json_text, replace_problem
from dflash.core.shapes import DRAFTER_FROM_TARGET, serving_problems
from dflash.core.workflow import notice, progress, setup_logging, sigterm_exits, stop_requested
from dflash.target.models import check_fast_kernels, load_target, pick_device
from dflash.train.batches import Batch, RowOrder, ShardData, add_feature_noise, make_batch, prefetched, sample_anchors
from dflash.train.drafter import DFlashDraftModel, TargetIO, make_draft_config, nonfinite_tensors, write_drafter_state
from dflash.train.launch import train_processes
from dflash.train.log import TrainLog
from dflash.train.objective import LABELS, WEIGHTS, block_loss, supervision
from dflash.train.optim import OPTIMIZERS, SCHEDULES, Optimizers, lr_at, make_optimizer
from dflash.train.parallel import Distributed
from dflash.train.resume import (held_resume_dir, newest_resume_point, remove_resume_points, resume_dir,
                                 run_fingerprint, save_resume_point)

LAUNCHER_KEYS = ("gpus", "nodes")  # how many processes, and where: the launcher's business, not the trainer's
ARCH_KEYS = ("num_layers", "intermediate_size", "num_heads", "num_kv_heads", "head_dim", "block_size",
             "mask_token_id", "target_layer_ids", "layer_types", "sliding_window")


def drafter_config(cfg: dict, target_config) -> Qwen3Config:
    """The config a drafter trained with ``cfg`` (the trainer's settings) on a target of
    ``target_config`` (its text config) gets: what its checkpoint carries, known before training."""
    arch = {k: cfg[k] for k in ARCH_KEYS}
    for key, target_key in DRAFTER_FROM_TARGET.items():
        if arch[key] is None:
            arch[key] = getattr(target_config, target_key)
    return make_draft_config(target_config, **arch)


def drafter_train_cfg(config: dict, target: str | Path) -> dict:
    """The trainer's settings: the ``drafter`` and ``train`` sections, with the mask token
    resolved to an id of the target's tokenizer when only its string is configured."""
    drafter = dict(config["drafter"])
    token = drafter.pop("mask_token")
    if drafter["mask_token_id"] is None:
        tokenizer = AutoTokenizer.from_pretrained(target)
        mask_id = tokenizer.convert_tokens_to_ids(token)
        if mask_id is None or mask_id == tokenizer.unk_token_id or tokenizer.convert_ids_to_tokens(mask_id) != token:
            raise ValueError(f"drafter.mask_token {token!r} is not a token of {target}; set drafter.mask_token_id")
        drafter["mask_token_id"] = mask_id
    train = {k: v for k, v in config["train"].items() if k not in LAUNCHER_KEYS}
    return {**drafter, **train}


def trainer_settings(config: dict, target: str | Path) -> dict:
    """What the trainer takes from a pipeline config: :func:`drafter_train_cfg`, and the target's
    ``fast_kernels`` policy (no rule param: it changes no result)."""
    return {**drafter_train_cfg(config, target), "fast_kernels": config["target"]["fast_kernels"]}


def train_job(config: dict, tokenized: list[Path], hidden: list[Path], target_dir: Path, out_dir: Path,
              run: str) -> None:
    """The train stage as its rule and ``dflash train`` run it: one process, or one per GPU
    (``train.gpus``) on this node or on each of the job's ``train.nodes`` nodes, data-parallel; its
    live curves go where the config's tracking says, under the run's name."""
    cfg, curves = trainer_settings(config, target_dir), curve_spec(config, run, "train")
    gpus, nodes = config["train"]["gpus"], config["train"]["nodes"]
    if gpus == nodes == 1:
        train(list(tokenized), list(hidden) or None, target_dir, out_dir, cfg, curves_spec=curves)
    else:
        train_processes(gpus, list(tokenized), list(hidden), target_dir, out_dir, cfg, curves, nodes)


def planned_drafter_config(drafter: dict, target_dir: str | Path) -> Qwen3Config:
    """:func:`drafter_config` from the pipeline config's ``drafter`` section alone (the train
    section shapes no weight matrix): the untrained baseline's, decoded before training ends."""
    cfg = resolve_cfg(drafter_train_cfg({"drafter": drafter, "train": {}}, target_dir))
    return drafter_config(cfg, AutoConfig.from_pretrained(target_dir).get_text_config())


def trainer_defaults() -> dict:
    """What the trainer takes, at the schema's defaults: the drafter and train sections as
    ``drafter_train_cfg`` merges them, and the target's ``fast_kernels``."""
    drafter = {k: v for k, v in defaults("drafter").items() if k != "mask_token"}
    train = {k: v for k, v in defaults("train").items() if k not in LAUNCHER_KEYS}
    return {**drafter, **train, "fast_kernels": defaults("target")["fast_kernels"]}


def resolve_cfg(cfg: dict) -> dict:
    known = trainer_defaults()
    unknown = sorted(set(cfg) - set(known))
    if unknown:
        raise ValueError(f"unknown drafter/train settings: {unknown}")
    # train.loss is the one nested setting: the schema's defaults complete it key by key (unpacked
    # first, so a loss that is no mapping fails here rather than pass as a set of keys)
    loss = completed({"loss": {**(cfg.get("loss") or {})}}, "train")["loss"]
    merged = {**known, **cfg, "loss": loss}
    if unknown := sorted(set(merged["loss"]) - set(known["loss"])):
        raise ValueError(f"unknown train.loss settings: {unknown}")
    if merged["loss"]["weights"] not in WEIGHTS or merged["loss"]["labels"] not in LABELS:
        raise ValueError(f"train.loss.weights must be one of {WEIGHTS} and train.loss.labels one of {LABELS}")
    if merged["optimizer"] not in OPTIMIZERS:
        raise ValueError(f"train.optimizer must be one of {OPTIMIZERS}")
    if merged["lr_schedule"] not in SCHEDULES:
        raise ValueError(f"train.lr_schedule must be one of {SCHEDULES}")
    if not 0 < merged["loss"]["dpace_alpha"] <= 1:
        raise ValueError("train.loss.dpace_alpha must be in (0, 1]")
    if merged["mask_token_id"] is None:  # the pipeline resolves drafter.mask_token to it (drafter_train_cfg)
        raise ValueError("missing required drafter/train settings: ['mask_token_id']")
    if min(merged[k] for k in ("steps", "batch_size", "num_anchors", "log_every", "loss_chunk_tokens")) < 1:
        raise ValueError("steps, batch_size, num_anchors, log_every and loss_chunk_tokens must be >= 1")
    if min(merged["prefetch"], merged["feature_noise"], merged["max_nonfinite_steps"]) < 0:
        raise ValueError("prefetch, feature_noise and max_nonfinite_steps must be >= 0")
    return merged


def draft_loss(model: torch.nn.Module, io: TargetIO, batch: Batch, B: int, loss: dict, supervised: int | torch.Tensor,
               world: int = 1, *, chunk_tokens: int):
    """The drafter's forward over a batch and its loss (``dflash.train.objective.block_loss``, whose
    arguments these are). ``model`` may be wrapped (DDP, FSDP); ``B`` is its block size."""
    hidden = model(io.embed(batch.block_ids), batch.block_pos, batch.context, batch.context_pos, batch.context_valid)
    return block_loss(hidden, io.head_weight, batch.labels, batch.supervised, B, loss, supervised, world, chunk_tokens)


def train(tokenized: list[Path], hidden: list[Path] | None, target_dir: Path, out_dir: Path, cfg: dict,
          log: logging.Logger | None = None, curves_spec: dict | None = None) -> dict:
    """Train a drafter and write its checkpoint directory; returns a summary dict. ``curves_spec``:
    where its live curves go (``dflash.core.curves.curve_spec``; None: nowhere but train_log.jsonl).

    Every ``save_every`` steps a resume point (weights, optimizer, RNG and data position) is
    written beside the output; a re-run with the same settings and data continues from the newest
    one and ends with the weights an uninterrupted run would have."""
    log = log or logging.getLogger(__name__)
    cfg = resolve_cfg(cfg)
    target_dir, out_dir = Path(target_dir), Path(out_dir)
    if problem := replace_problem(out_dir, "checkpoint"):  # now, not after the training
        raise FileExistsError(problem)
    dist = Distributed(pick_device(cfg["device"]))
    main, steps = dist.rank == 0, cfg["steps"]
    torch.manual_seed(cfg["seed"])
    generator = torch.Generator().manual_seed(cfg["seed"])
    run = _set_up(cfg, target_dir, dist, log)

    start = time.time()
    resume = resume_dir(out_dir)
    fingerprint = run_fingerprint(cfg, tokenized, target_dir)
    online = _online_target(target_dir, dist.device) if cfg["hidden_states"] == "online" else None
    # rank 0 holds the resume folder: the others only read the point it holds before any is written
    with sigterm_exits("training stopped; a re-run resumes from the newest resume point"), (held_resume_dir(resume, out_dir) if main else nullcontext()):
        with ShardData(tokenized, hidden if online is None else None, run.config.dflash_config["target_layer_ids"],
                       run.target_config.hidden_size, target_dir.name, log, online,
                       cfg["loss"]["labels"] == "target", cfg["feature_rms_range"]) as data, \
                ExitStack() as outputs:
            log.info("data: %s", data.summary)
            rows = RowOrder(len(data.rows), generator)
            train_log = TrainLog(run.config.block_size)
            state = newest_resume_point(resume, fingerprint, log) if resume.exists() else None
            step0 = _resumed(state, run, dist, generator, rows, train_log) if state else 0
            if main:
                tmp = outputs.enter_context(atomic_dir(out_dir, "checkpoint"))
                log_file = outputs.enter_context(open(tmp / "train_log.jsonl", "w"))
                log_file.writelines(train_log.lines)
                curves = outputs.enter_context(Curves(curves_spec, step0, cfg))
            # online features are the target's forward on this device: in a second thread it would only
            # queue behind the training step's kernels and contend for the GIL, so it runs in the loop
            ahead = cfg["prefetch"] if online is None else 0
            batches = outputs.enter_context(closing(prefetched(_batch_maker(data, rows, generator, run, cfg, dist),
                                                               steps - step0, ahead)))
            bar = progress(range(step0, steps), desc="train drafter", unit="step", initial=step0, total=steps,
                           disable=not main)  # one bar, one console story, for all ranks
            stop = outputs.enter_context(stop_requested())
            for step, (batch, supervised, draws) in zip(bar, batches):
                lr, step_loss, sums, grad_norm, stopping = _train_step(run, batch, supervised, step, cfg, dist,
                                                                       stop.signum is not None)
                if step_loss is None:
                    _skipped(step, train_log, cfg, out_dir, log)
                else:
                    train_log.add(step_loss, *sums, grad_norm)
                if (step + 1) % cfg["log_every"] == 0 or step + 1 == steps:
                    record = train_log.end_window(step + 1, lr)
                    if main:
                        log_file.write(train_log.lines[-1])
                        log_file.flush()
                        curves.log(step + 1, train_scalars(record))
                        if record["loss"] is not None:  # None: every step of the window was skipped
                            log.info("step %d loss %.4f acc %.3f expected acceptance %.2f lr %.2e", step + 1,
                                     record["loss"], record["acc"], record["expected_acceptance"], lr)
                            bar.set_postfix(loss=f"{record['loss']:.3f}", refresh=False)
                # preempted, a time limit near: a point of this step, not the last save's (at the last
                # step the checkpoint is as quick to write)
                stopping = stopping and step + 1 < steps
                if stopping or cfg["save_every"] and (step + 1) % cfg["save_every"] == 0 and step + 1 < steps:
                    _write_resume_point(resume, fingerprint, step + 1, run, dist, draws, train_log)
                if stopping:
                    _stopped(step + 1, stop.signum, resume, log)
            if train_log.first_loss is None:  # not one step applied: the weights are the random start
                _skipped(None, train_log, cfg, out_dir, log)

            model_state, _ = dist.full_state(run.model, run.optimizer)
            seconds = time.time() - start
            if main:
                _write_checkpoint(tmp, model_state, run.config, cfg, train_log, step0, seconds, dist.world,
                                  {**data.summary, "features": data.feature_summary()})
        if main and resume.exists():  # the checkpoint is in place: nothing left to resume
            remove_resume_points(resume)
    dist.barrier()
    dist.close()
    return {"steps": steps, "final_loss": train_log.final_loss, "first_loss": train_log.first_loss,
            "rows": data.summary["trainable_rows"], "tokens": data.summary["trainable_tokens"],
            "seconds": seconds, "resumed_from_step": step0}


def _stopped(step: int, signum: int | None, resume: Path, log: logging.Logger) -> None:
    """Stop after a stop signal (SLURM's warning before a time limit or a preemption): the resume
    point of ``step`` is written; the job exits as that signal's default would (143 for SIGTERM) so
    a requeued or retried job resumes from it. A rank that got none stops with the others."""
    signum = signum or signal.SIGTERM
    notice(log, f"{signal.Signals(signum).name}: training stopped after step {step}; its resume point is in "
                f"{resume}: the requeued job (or a re-run) resumes there, to the same weights")
    raise SystemExit(128 + signum)


def _skipped(step: int | None, train_log: TrainLog, cfg: dict, out_dir: Path, log: logging.Logger) -> None:
    """A step whose loss or gradient was not finite (``step``), not applied to the weights: counted,
    and the run stopped past ``train.max_nonfinite_steps`` of them or when none was applied (None).
    Every rank decides alike: the step's verdict is summed over them (``_train_step``)."""
    if step is not None:
        train_log.skipped += 1
        if train_log.skipped <= cfg["max_nonfinite_steps"]:
            log.warning("step %d: the loss or a gradient is not finite: skipped, not applied (%d of at most %d "
                        "such steps, train.max_nonfinite_steps)", step + 1, train_log.skipped,
                        cfg["max_nonfinite_steps"])
            return
    where = f"at step {step + 1}" if step is not None else "at every step"
    raise RuntimeError(f"{out_dir}: training diverged: the loss or a gradient was not finite {where} "
                       f"({train_log.skipped} such steps, train.max_nonfinite_steps is {cfg['max_nonfinite_steps']}); "
                       f"no checkpoint written: lower train.lr (now {cfg['lr']:g}) or check the data, and re-run")


@dataclass
class Run:
    """What set-up builds for the steps: the drafter (wrapped for the processes: DDP, FSDP), the
    target's frozen embedding and lm_head it drafts through, its optimizer, and the step's autocast."""
    target_config: PretrainedConfig
    config: Qwen3Config
    model: torch.nn.Module
    io: TargetIO
    optimizer: Optimizers
    autocast: AbstractContextManager


def _set_up(cfg: dict, target_dir: Path, dist: Distributed, log: logging.Logger) -> Run:
    target_config = AutoConfig.from_pretrained(target_dir).get_text_config()
    if cfg["hidden_states"] == "online":  # the target runs here: stop now, not after minutes of loading
        check_fast_kernels(target_config, dist.device, cfg["fast_kernels"], log)
    config = drafter_config(cfg, target_config)
    if dist.rank == 0:  # before the hours of training, not after
        for problem in serving_problems(config.to_dict()):
            log.warning("serving: %s", problem)
    model = DFlashDraftModel(config).to(dist.device)
    io = TargetIO.from_pretrained(target_dir).to(dist.device, torch.float32)
    log.info("drafter: %d layers, %.2fM trainable params, target layers %s, block %d, %d process(es)",
             config.num_hidden_layers, sum(p.numel() for p in model.parameters()) / 1e6,
             config.dflash_config["target_layer_ids"], config.block_size, dist.world)
    model = dist.wrap(model, cfg["parallel"])
    optimizer = make_optimizer(model, cfg["lr"], cfg["weight_decay"], cfg["optimizer"], cfg["muon_fc"])
    # bf16 matmuls on GPU; the weights, optimizer and loss stay fp32
    autocast = torch.autocast("cuda", dtype=torch.bfloat16) if dist.device.type == "cuda" else nullcontext()
    return Run(target_config, config, model, io, optimizer, autocast)


def _online_target(target_dir: Path, device: torch.device) -> torch.nn.Module:
    """The frozen target, to compute each drawn row's features (``hidden_states: online``)."""
    online = load_target(target_dir, torch.bfloat16 if device.type == "cuda" else torch.float32)[0].to(device)
    online.requires_grad_(False)
    return online


def _batch_maker(data: ShardData, rows: RowOrder, generator: torch.Generator, run: Run, cfg: dict,
                 dist: Distributed) -> Callable[[], tuple[Batch, int, dict]]:
    B, per_rank, greedy = run.config.block_size, cfg["batch_size"], cfg["loss"]["labels"] == "target"
    mine = slice(dist.rank * per_rank, (dist.rank + 1) * per_rank)
    pin = dist.device.type == "cuda"  # page-locked, so the copy to the GPU can run without blocking the loop
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
                           run.config.dflash_config["mask_token_id"], [g for _, g in outputs] if greedy else None)
        if pin:
            # a new thread's current device is GPU 0: pinning there would open a context on it from every rank
            torch.cuda.set_device(pin_device)
            batch = batch.pin_memory()
        return batch, supervised, draws

    return next_batch


def _train_step(run: Run, batch: Batch, supervised: int, step: int, cfg: dict, dist: Distributed,
                stop: bool) -> tuple[float, float, list[torch.Tensor], float, bool]:
    """One optimizer step on this rank's slice of the global batch: its lr, the global batch's loss
    (None when the loss or the gradient of any rank is not finite: the step is not applied), the
    global batch's per-position sums (correct, count, weight), the gradient's norm before clipping,
    and whether any rank was asked to stop (``stop``: this one was), so that all stop after it."""
    batch = batch.to(dist.device, non_blocking=dist.device.type == "cuda")
    if cfg["feature_noise"]:
        add_feature_noise(batch, cfg["feature_noise"], cfg["seed"], step, dist.rank * cfg["batch_size"])
    lr = lr_at(step, cfg["steps"], cfg["lr"], cfg["warmup_ratio"], cfg["min_lr_ratio"], cfg["lr_schedule"])
    for group in run.optimizer.param_groups:
        group["lr"] = lr

    with run.autocast:
        loss, parts = draft_loss(run.model, run.io, batch, run.config.block_size, cfg["loss"], supervised,
                                 dist.world, chunk_tokens=cfg["loss_chunk_tokens"])
    loss.backward()
    # clip_grad_norm_'s two halves: the norm tells a non-finite gradient whether clipped or not
    params = [p for p in run.model.parameters() if p.grad is not None]
    norm = torch.nn.utils.get_total_norm([p.grad for p in params])
    if cfg["grad_clip"]:
        torch.nn.utils.clip_grads_with_norm_(params, cfg["grad_clip"], norm)
    norm = norm.full_tensor() if hasattr(norm, "full_tensor") else norm  # a DTensor under FSDP
    weighted = parts.weighted_ce.float().reshape(1)
    bad = (~torch.isfinite(norm) | ~torch.isfinite(weighted)).float().reshape(1)
    stopping = torch.tensor([float(stop)], device=bad.device)
    # summed with the step's sums, before the step: every rank skips the same steps, or none, and
    # stops after the same step
    weighted, bad, stopping, *sums = dist.sum(weighted, bad, stopping, parts.correct, parts.count, parts.weight)
    applied = not bad.item()
    if applied:
        run.optimizer.step()
    run.optimizer.zero_grad(set_to_none=True)
    # the global batch's loss, as one process has it; None for a step not applied
    return lr, weighted.item() / supervised if applied else None, sums, norm.item(), bool(stopping.item())


def _resumed(state: dict, run: Run, dist: Distributed, generator: torch.Generator, rows: RowOrder,
             train_log: TrainLog) -> int:
    """Continue from a resume point: the step it was written after."""
    dist.load_full_state(run.model, run.optimizer, state["model"], state["optimizer"])
    generator.set_state(state["generator"])
    torch.set_rng_state(state["torch_rng"])
    rows.load_state_dict(state["rows"])
    train_log.load_state_dict(state)
    return state["step"]


def _write_resume_point(resume: Path, fingerprint: str, step: int, run: Run, dist: Distributed, draws: dict,
                        train_log: TrainLog) -> None:
    """Rank 0's, which serves every rank: they all draw the same rows and anchors."""
    model_state, optim_state = dist.full_state(run.model, run.optimizer)
    if dist.rank == 0:
        _refuse_nonfinite(model_state, resume)
        save_resume_point(resume, {
            "fingerprint": fingerprint, "step": step, "model": model_state, "optimizer": optim_state,
            "generator": draws["generator"], "torch_rng": torch.get_rng_state(), "rows": draws["rows"],
            **train_log.state_dict()})
    dist.barrier()


def _write_checkpoint(tmp: Path, model_state: dict, config: Qwen3Config, cfg: dict, train_log: TrainLog,
                      step0: int, seconds: float, processes: int, data: dict) -> None:
    _refuse_nonfinite(model_state, tmp)
    write_drafter_state(model_state, config, tmp)
    state = {"steps": cfg["steps"], "first_loss": train_log.first_loss, "final_loss": train_log.final_loss,
             "skipped_steps": train_log.skipped, "seconds": seconds, "resumed_from_step": step0,
             "processes": processes, "cfg": cfg, "data": data}
    (tmp / "trainer_state.json").write_text(json_text(state, tmp / "trainer_state.json"))


def _refuse_nonfinite(model_state: dict, where: Path) -> None:
    """Skipped steps keep the weights finite; this makes sure no checkpoint or resume point of
    NaN weights is ever written, whatever else went wrong."""
    if bad := nonfinite_tensors(model_state):
        raise RuntimeError(f"{where}: not written: the drafter's weights {bad} are not finite (NaN or infinite): "
                           f"lower train.lr and re-run")


def main(argv: list[str] | None = None) -> None:
    """Entry point of each torchrun process (``train_processes`` starts them)."""
    ap = argparse.ArgumentParser(description="one process of a multi-GPU drafter training (torchrun)")
    ap.add_argument("--cfg", required=True, help="the trainer's settings as JSON")
    ap.add_argument("--tokenized", nargs="+", type=Path, required=True)
    ap.add_argument("--hidden", nargs="*", type=Path, help="hidden-state shards (none with hidden_states: online)")
    ap.add_argument("--target", type=Path, required=True)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--curves", default="null", help="where rank 0 writes the live curves (JSON; null: nowhere)")
    a = ap.parse_args(argv)
    setup_logging()
    log = logging.getLogger("dflash.train.stage")
    if node := os.environ.get("SLURMD_NODENAME"):  # under SLURM: which rank ran where (several nodes)
        log.info("rank %s of %s on node %s", os.environ.get("RANK"), os.environ.get("WORLD_SIZE"), node)
    with rank_error_recorded():
        train(a.tokenized, a.hidden, a.target, a.out, json.loads(a.cfg), log, json.loads(a.curves))


if __name__ == "__main__":
    main()
