"""Train speculators 0.9.0's DFlash drafter on given rows for a fixed number of steps, on CPU.

Runs inside the speculators venv (`make speculators-venv`), started by train_equal_steps.py:
.venv-speculators/bin/python bench/speculators_train_rows.py DATA OUT --steps N --lr LR --batch R
    --anchors-per-row A [--seed 0] [--threads 1]

DATA (written by train_equal_steps.py) holds config.json (our drafter config: a Qwen3Config,
used as speculators' transformer_layer_config so both drafters have the same shape and RoPE),
io.safetensors (the target's embedding and lm_head) and rows.safetensors (offsets, input_ids,
loss_mask, aux [T, k*H]: the target layers' features from the pipeline's hidden cache, last
[T, H]: the target's last hidden state after its final norm).

Its own recipe, as `speculators train --speculator-type dflash` sets it (train/config/schema.py
defaults, the best-practices example): loss "ce" (hard CE against the verifier's argmax) with
D-PACE per-position weights (alpha 0.5), its CLI's optimizer (`--optimizer muon` by default:
torch's Muon for the 2-D weights, lr = --lr, match_rms_adamw, momentum 0.95, weight decay 0.1;
AdamW with weight decay 0.01 for the rest; `--optimizer adamw`: AdamW, decay 0.01, for all, the
default of its TrainerConfig class, which the CLI overrides), a linear schedule with 1% warmup,
clip 1.0; each step packs its rows into one sequence (its CollateFn) with
max_anchors = rows x anchors per row; sdpa attention and the eager loss (its CPU path). The
verifier's final norm is already applied to `last`: verifier_norm gets weight 1, which rescales
each position's logits by a positive factor and leaves the argmax targets as they were.

OUT gets model.safetensors (its state dict), probe.safetensors (one row's anchors and draft
hidden states, to check the converted weights give the same forward) and summary.json.
"""
import argparse
import itertools
import json
import time
import warnings
from pathlib import Path

import torch

warnings.filterwarnings("ignore")

from safetensors.torch import load_file, save_file
from speculators.config import SpeculatorsConfig, VerifierConfig
from speculators.models.dflash import DFlashDraftModel, DFlashSpeculatorConfig
from speculators.proposals.greedy import GreedyTokenProposalConfig
from speculators.train.config.schema import OptimizerArgs
from speculators.train.optimizers import build_optimizers
from speculators.train.trainer import TrainerConfig
from transformers import Qwen3Config, get_linear_schedule_with_warmup

ap = argparse.ArgumentParser()
ap.add_argument("data", type=Path)
ap.add_argument("out", type=Path)
ap.add_argument("--steps", type=int, required=True)
ap.add_argument("--lr", type=float, required=True)
ap.add_argument("--batch", type=int, required=True, help="rows per step")
ap.add_argument("--anchors-per-row", type=int, required=True)
ap.add_argument("--seed", type=int, default=0)
ap.add_argument("--threads", type=int, default=1)
ap.add_argument("--loss-weight", choices=["dpace", "fixed-exp-decay"], default="dpace",
                help="its --per-position-loss-weight (fixed-exp-decay: with --gamma)")
ap.add_argument("--gamma", type=float, default=4.0, help="its --dflash-decay-gamma")
ap.add_argument("--optimizer", choices=["muon", "adamw"], default=OptimizerArgs().optimizer,
                help="its --optimizer (default: its CLI's)")
a = ap.parse_args()
torch.set_num_threads(a.threads)
torch.manual_seed(a.seed)

tl_config = Qwen3Config.from_pretrained(a.data)
tl_config._attn_implementation = "sdpa"  # --draft-attn-impl sdpa: flex has no CPU backward
dflash = tl_config.dflash_config
B = tl_config.block_size
config = DFlashSpeculatorConfig(
    transformer_layer_config=tl_config,
    draft_vocab_size=tl_config.vocab_size,
    block_size=B,
    aux_hidden_state_layer_ids=dflash["target_layer_ids"],
    mask_token_id=dflash["mask_token_id"],
    sample_from_anchor=False,
    speculators_config=SpeculatorsConfig(
        algorithm="dflash",
        proposal_methods=[GreedyTokenProposalConfig(speculative_tokens=B - 1)],
        default_proposal_method="greedy",
        verifier=VerifierConfig(name_or_path=None, architectures=["Qwen3ForCausalLM"]),
    ),
)
model = DFlashDraftModel(config)
io = load_file(a.data / "io.safetensors")
with torch.no_grad():  # what load_verifier_weights() copies from the verifier
    model.embed_tokens.weight.copy_(io["embed"])
    model.verifier_lm_head.weight.copy_(io["head"])
    model.lm_head.weight.copy_(io["head"])
    model.verifier_norm.weight.fill_(1.0)

data = load_file(a.data / "rows.safetensors")
offsets = data["offsets"].tolist()
rows = [slice(s, e) for s, e in itertools.pairwise(offsets)]


def packed(picked: list[slice]) -> dict:
    """The rows as speculators' CollateFn lays them out: one [1, total] sequence."""
    return {
        "input_ids": torch.cat([data["input_ids"][r] for r in picked])[None],
        "loss_mask": torch.cat([data["loss_mask"][r] for r in picked])[None],
        "hidden_states": torch.cat([data["aux"][r] for r in picked])[None],
        "verifier_last_hidden_states": torch.cat([data["last"][r] for r in picked])[None],
        "position_ids": torch.cat([torch.arange(r.stop - r.start) for r in picked])[None],
        "document_ids": torch.cat([torch.full((r.stop - r.start,), i) for i, r in enumerate(picked)])[None],
    }


train_kwargs, _ = DFlashDraftModel.get_trainer_kwargs(
    loss_fn="ce", loss_implementation="eager", max_anchors=a.anchors_per_row * a.batch,
    per_position_loss_weight=a.loss_weight, dflash_decay_gamma=a.gamma, dpace_alpha=0.5)
cli = OptimizerArgs(optimizer=a.optimizer, lr=a.lr)  # the CLI's defaults for everything else
optimizers = build_optimizers(model, TrainerConfig(
    lr=a.lr, num_epochs=1, save_path=str(a.out), optimizer=cli.optimizer, weight_decay=cli.weight_decay,
    muon_lr=a.lr if cli.muon_lr is None else cli.muon_lr, muon_momentum=cli.muon_momentum,
    muon_weight_decay=cli.muon_weight_decay, muon_ns_steps=cli.muon_ns_steps, muon_adjust_lr_fn=cli.muon_adjust_lr_fn))
schedulers = [get_linear_schedule_with_warmup(o, a.steps // 100, a.steps) for o in optimizers]
generator = torch.Generator().manual_seed(a.seed)
order: list[int] = []
losses = []
model.train()
t0 = time.perf_counter()
for step in range(a.steps):
    picked = []
    while len(picked) < a.batch:
        if not order:
            order = torch.randperm(len(rows), generator=generator).tolist()
        picked.append(rows[order.pop()])
    _, loss, _ = model(**packed(picked), **train_kwargs)
    for o in optimizers:
        o.zero_grad()
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    for o in optimizers:
        o.step()
    for s in schedulers:
        s.step()
    losses.append(loss.item())
seconds = time.perf_counter() - t0

a.out.mkdir(parents=True, exist_ok=True)
save_file({k: v.contiguous() for k, v in model.state_dict().items()}, a.out / "model.safetensors")
model.eval()
with torch.no_grad():
    torch.manual_seed(a.seed + 1)
    probe_row = max(rows, key=lambda r: r.stop - r.start)
    hidden, _, _, _, idx = model._backbone_forward(**packed([probe_row]), max_anchors=a.anchors_per_row)
save_file({"hidden": hidden[0].contiguous(), "block_positions": idx.contiguous(),
           "row": torch.tensor([probe_row.start, probe_row.stop])}, a.out / "probe.safetensors")
(a.out / "summary.json").write_text(json.dumps({
    "seconds": seconds, "steps": a.steps, "first_loss": losses[0], "final_loss": sum(losses[-10:]) / 10,
    "recipe": f"ce + {a.loss_weight} ({'alpha 0.5' if a.loss_weight == 'dpace' else f'gamma {a.gamma}'}), "
              + ("Muon (2-D, wd 0.1) + AdamW (wd 0.01), " if a.optimizer == "muon" else "AdamW wd 0.01, ")
              + "linear schedule 1% warmup, clip 1.0, packed rows, sdpa"}))
