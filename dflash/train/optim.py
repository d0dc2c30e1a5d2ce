"""The optimizers and the learning-rate schedule: Muon for the drafter's hidden matrices, AdamW for
the rest (``make_optimizer``), stepped as one (``Optimizers``)."""
from __future__ import annotations

import math

import torch

from dflash.train.drafter import DFlashDraftModel

OPTIMIZERS = ("adamw", "muon")
SCHEDULES = ("cosine", "linear")


def lr_at(step: int, steps: int, lr: float, warmup_ratio: float, min_lr_ratio: float, schedule: str) -> float:
    """Linear warmup then a cosine or linear decay to ``min_lr_ratio * lr``; ``step`` counts from 0."""
    warmup = round(warmup_ratio * steps)
    if step < warmup:
        return lr * (step + 1) / warmup
    progress = (step - warmup) / max(1, steps - warmup)
    left = 0.5 * (1 + math.cos(math.pi * progress)) if schedule == "cosine" else 1 - progress
    return lr * (min_lr_ratio + (1 - min_lr_ratio) * left)


class Muon(torch.optim.Muon):
    """torch's Muon, with its Newton-Schulz orthogonalization in float32 off CUDA. torch runs it in
    bfloat16 on every device, which a CPU without bfloat16 matrix units (the demo's AVX2 machines)
    emulates: 60% of a demo training step went there, 2.4x the step. On CUDA it is torch's own
    step; elsewhere the same update (momentum, Nesterov, the quintic iteration, the lr adjustment,
    decoupled decay) on the same state, so a resume point carries over."""

    @torch.no_grad()
    def step(self, closure=None):
        if any(p.is_cuda for group in self.param_groups for p in group["params"]):
            return super().step(closure)
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            a, b, c = group["ns_coefficients"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                buf = self.state[p].setdefault("momentum_buffer", torch.zeros_like(p.grad))
                buf.lerp_(p.grad, 1 - group["momentum"])
                update = p.grad.lerp(buf, group["momentum"]) if group["nesterov"] else buf
                tall = update.size(0) > update.size(1)
                x = update.float().T if tall else update.float()
                x = x / x.norm().clamp(min=group["eps"])  # spectral norm at most 1
                for _ in range(group["ns_steps"]):
                    gram = x @ x.T
                    x = torch.addmm(x, torch.addmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
                rows, cols = p.shape[:2]
                adjust = {"match_rms_adamw": 0.2 * math.sqrt(max(rows, cols)),
                          "original": math.sqrt(max(1, rows / cols)), None: math.sqrt(max(1, rows / cols))}
                p.mul_(1 - group["lr"] * group["weight_decay"])
                p.add_((x.T if tall else x).to(p.dtype), alpha=-group["lr"] * adjust.get(group["adjust_lr_fn"], 1.0))
        return loss


class Optimizers:
    """Several optimizers stepped as one: Muon moves the hidden matrices, AdamW the rest."""

    def __init__(self, *optimizers: torch.optim.Optimizer):
        self.optimizers = optimizers

    @property
    def param_groups(self) -> list[dict]:
        return [g for o in self.optimizers for g in o.param_groups]

    def step(self) -> None:
        for o in self.optimizers:
            o.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        for o in self.optimizers:
            o.zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> dict:
        return {"optimizers": [o.state_dict() for o in self.optimizers]}

    def load_state_dict(self, state: dict) -> None:
        states = state.get("optimizers", [state])  # a lone AdamW's state: a resume point from before Muon
        for o, s in zip(self.optimizers, states, strict=True):
            o.load_state_dict(s)


def make_optimizer(model: DFlashDraftModel, lr: float, weight_decay: float, kind: str, muon_fc: bool) -> Optimizers:
    # nanoGPT convention: decay the matrices, not the norm gains.
    params = [p for p in model.parameters() if p.requires_grad]
    matrices, gains = [p for p in params if p.dim() >= 2], [p for p in params if p.dim() < 2]
    if kind == "muon":
        # fc, the input layer that reads the target's features, on Muon won where rows are seen once
        # or twice (bench/README.md, "the scale regime"); on AdamW (Keller Jordan's convention) where
        # they are seen ~40 times (the demo: "the input layer off Muon"). match_rms_adamw: one lr and
        # schedule suit both optimizers.
        groups = [{"params": gains, "weight_decay": 0.0}]
        hidden = matrices
        if not muon_fc:  # no empty fc group otherwise: torch's distributed state dict refuses one
            fc = getattr(model, "module", model).fc.weight  # DDP wraps the drafter; FSDP keeps it
            hidden = [p for p in matrices if p is not fc]
            groups.insert(0, {"params": [fc], "weight_decay": weight_decay})
        return Optimizers(Muon(hidden, lr=lr, weight_decay=weight_decay, adjust_lr_fn="match_rms_adamw"),
                          torch.optim.AdamW(groups, lr=lr))
    return Optimizers(torch.optim.AdamW([{"params": matrices, "weight_decay": weight_decay},
                                         {"params": gains, "weight_decay": 0.0}], lr=lr))
