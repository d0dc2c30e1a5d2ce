"""What ``train_log.jsonl`` holds: a line every ``train.log_every`` steps, the sums of the steps
since the last one (the window), and the run's first and last loss; a resume point carries it."""
from __future__ import annotations

import time

import torch

from dflash.core.io import json_text


class TrainLog:
    """What train_log.jsonl holds of a run so far, and what its next line sums: the steps since the
    last line (the window)."""

    def __init__(self, block_size: int):
        self.block_size = block_size
        # None until a step is applied: JSON holds no NaN (a window of skipped steps has no loss)
        self.first_loss: float | None = None
        self.final_loss: float | None = None
        self.skipped = 0  # steps not applied: their loss or gradient was not finite
        self.lines: list[str] = []
        self.window = new_window(block_size)

    def add(self, loss: float, correct: torch.Tensor, count: torch.Tensor, weight: torch.Tensor,
            grad_norm: float) -> None:
        """An applied step's loss, per-position sums and gradient norm."""
        if self.first_loss is None:
            self.first_loss = loss
        self.window["loss"] += loss
        self.window["grad_norm"] += grad_norm
        self.window["steps"] += 1
        self.window["correct"] += correct.cpu()
        self.window["count"] += count.cpu()
        self.window["weight"] += weight.cpu()

    def end_window(self, step: int, lr: float) -> dict:
        """The line for the window that ends after ``step`` steps (appended to ``lines``)."""
        loss = self.window["loss"] / self.window["steps"] if self.window["steps"] else None
        self.final_loss = self.final_loss if loss is None else loss
        record = log_record(step, loss, lr, self.window)
        self.lines.append(json_text(record, "train_log.jsonl", indent=None))
        self.window = new_window(self.block_size)
        return record

    def state_dict(self) -> dict:
        return {"first_loss": self.first_loss, "final_loss": self.final_loss, "skipped_steps": self.skipped,
                "log_lines": self.lines, "window": {k: v for k, v in self.window.items() if k != "t0"}}

    def load_state_dict(self, state: dict) -> None:
        self.first_loss, self.final_loss = state["first_loss"], state["final_loss"]
        self.skipped = state.get("skipped_steps", 0)  # a point from before steps were skipped
        # a point written before grad_norm was logged: the window's sum starts at 0
        self.lines, self.window = state["log_lines"], {"grad_norm": 0.0, **state["window"], "t0": time.time()}


def new_window(block_size: int) -> dict:
    """Running sums between two train_log lines."""
    return {"loss": 0.0, "grad_norm": 0.0, "steps": 0, "correct": torch.zeros(block_size),
            "count": torch.zeros(block_size), "weight": torch.zeros(block_size), "t0": time.time()}


def expected_acceptance(position_acc: list[float | None]) -> float:
    """Tokens per target forward if the block positions were accepted independently with these
    accuracies: 1 (the target's own token) + sum over k of acc_1 x ... x acc_k."""
    total, run = 1.0, 1.0
    for acc in position_acc:
        run *= acc or 0.0
        total += run
    return total


def log_record(step: int, loss: float | None, lr: float, window: dict) -> dict:
    correct, count = window["correct"][1:], window["count"][1:]
    position_acc = [(c / n).item() if n > 0 else None for c, n in zip(correct, count)]
    position_weight = [(w / n).item() if n > 0 else None for w, n in zip(window["weight"][1:], count)]
    seconds = max(time.time() - window["t0"], 1e-9)
    return {
        "step": step,
        "loss": loss,
        "acc": (correct.sum() / count.sum().clamp(min=1)).item(),
        "lr": lr,
        "grad_norm": window["grad_norm"] / window["steps"] if window["steps"] else None,
        "position_acc": position_acc,
        "position_weight": position_weight,
        "expected_acceptance": expected_acceptance(position_acc),
        "tokens_per_s": count.sum().item() / seconds,
        "seconds": round(seconds, 3),  # the window's wall time: the pilot's burst reads its step rate from it
    }
