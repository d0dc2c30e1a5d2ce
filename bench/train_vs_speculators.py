"""Drafter training throughput: our trainer's step against speculators 0.9.0's DFlash trainer.

Same model sizes (hidden 128, 2 draft layers, 4 heads / 2 kv heads, head dim 32, MLP 384, vocab
4096, block 8, 2 target layers captured), same data shape (8 rows x 300 tokens per step, loss on
all but the first 40 tokens, about 16 anchors per row), fp32 on CPU, one thread each, AdamW with
gradient clipping. Each side runs in its own process (speculators pins its own torch/transformers
range and lives in `.venv-speculators`, made by `make speculators-venv`), alternately, for
--rounds rounds; the best round of each is compared.

What one step is:
- ours: anchors sampled per row (two consecutive supervised tokens), blocks laid out, drafter
  forward over the blocks with the cached target features, CE on block positions 1..7 weighted
  exp(-(k-1)/7) against the next tokens, backward, clip, AdamW (dflash.train's loop body,
  batch assembly included);
- speculators: DFlashDraftModel.forward on the packed batch (its CollateFn layout; 128 anchors
  over the batch, sdpa attention: flex attention has no CPU backward), CE against the argmax of
  its verifier head, backward, clip, AdamW (its Trainer.train_epoch body).

Usage: python bench/train_vs_speculators.py [--steps 30] [--rounds 3] [--speculators-python PATH]
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
HIDDEN, LAYERS, HEADS, KV_HEADS, HEAD_DIM, INTER = 128, 2, 4, 2, 32, 384
VOCAB, BLOCK, N_TARGET_LAYERS = 4096, 8, 2
ROWS, ROW_LEN, PROMPT, ANCHORS = 8, 300, 40, 16


def ours(steps: int) -> dict:
    """Our trainer's step on the same shapes (run in a child process, one thread)."""
    import torch
    from transformers.models.qwen3.configuration_qwen3 import Qwen3Config

    from dflash.drafter import DFlashDraftModel, TargetIO, make_draft_config
    from dflash.train import Row, block_loss, make_batch, make_optimizer, sample_anchors

    torch.set_num_threads(1)
    torch.manual_seed(0)
    target = Qwen3Config(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=INTER, num_hidden_layers=4,
                         num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, head_dim=HEAD_DIM)
    config = make_draft_config(target, num_layers=LAYERS, intermediate_size=INTER, num_heads=HEADS,
                               num_kv_heads=KV_HEADS, head_dim=HEAD_DIM, block_size=BLOCK, mask_token_id=VOCAB - 1,
                               target_layer_ids=[1, 2])
    model = DFlashDraftModel(config).train()
    io = TargetIO(torch.randn(VOCAB, HIDDEN) * 0.02, torch.randn(VOCAB, HIDDEN) * 0.02)
    optimizer = make_optimizer(model, 1e-3, 0.01)
    generator = torch.Generator().manual_seed(0)
    mask = torch.ones(ROW_LEN, dtype=torch.bool)
    mask[:PROMPT] = False
    rows = [Row(0, 0, ROW_LEN, torch.randint(0, VOCAB - 1, (ROW_LEN,)), mask) for _ in range(ROWS)]
    feats = [torch.randn(ROW_LEN, N_TARGET_LAYERS, HIDDEN) for _ in range(ROWS)]

    def step() -> int:
        anchors = [sample_anchors(r.loss_mask, ANCHORS, generator) for r in rows]
        batch = make_batch(rows, feats, anchors, BLOCK, VOCAB - 1, 7.0)
        loss, _, count = block_loss(model, io, batch, BLOCK)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        return int(count.sum())

    for _ in range(5):
        step()
    supervised = 0
    t0 = time.perf_counter()
    for _ in range(steps):
        supervised += step()
    dt = time.perf_counter() - t0
    return {"steps_per_s": round(steps / dt, 3), "tokens_per_s": round(supervised / dt, 1),
            "supervised_per_step": round(supervised / steps, 1)}


def run_ours(steps: int) -> dict:
    code = f"import json, sys; sys.path.insert(0, {str(ROOT)!r}); sys.path.insert(0, {str(ROOT / 'bench')!r}); " \
           f"from train_vs_speculators import ours; print(json.dumps(ours({steps})))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT,
                         env={"OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin"})
    return json.loads(out.stdout.strip().splitlines()[-1])


def run_speculators(python: Path, steps: int) -> dict:
    out = subprocess.run([str(python), str(ROOT / "bench" / "speculators_dflash_step.py"), "1", str(steps),
                          str(ANCHORS)], capture_output=True, text=True, cwd=ROOT,
                         env={"OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin"})
    if out.returncode:
        sys.exit(f"speculators step failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--speculators-python", type=Path, default=ROOT / ".venv-speculators" / "bin" / "python")
    a = ap.parse_args()
    if not a.speculators_python.exists():
        sys.exit(f"{a.speculators_python} not found: run `make speculators-venv` first")
    best = {"dflash-pipeline": None, "speculators 0.9.0": None}
    for r in range(1, a.rounds + 1):
        results = {"dflash-pipeline": run_ours(a.steps), "speculators 0.9.0": run_speculators(a.speculators_python,
                                                                                              a.steps)}
        for name, res in results.items():
            if best[name] is None or res["steps_per_s"] > best[name]["steps_per_s"]:
                best[name] = res
        print(f"round {r}: " + "  ".join(f"{n}: {x['steps_per_s']:.2f} steps/s {x['tokens_per_s']:.0f} tok/s"
                                        for n, x in results.items()), flush=True)
    o, s = best["dflash-pipeline"], best["speculators 0.9.0"]
    print(f"best: dflash-pipeline {o['steps_per_s']:.2f} steps/s, {o['tokens_per_s']:.0f} supervised tokens/s "
          f"({o['supervised_per_step']:.0f} per step); speculators 0.9.0 {s['steps_per_s']:.2f} steps/s, "
          f"{s['tokens_per_s']:.0f} supervised tokens/s ({s['supervised_per_step']:.0f} per step)")
    print(f"ratio steps/s {o['steps_per_s'] / s['steps_per_s']:.2f}, tokens/s {o['tokens_per_s'] / s['tokens_per_s']:.2f}"
          " (target >= 1.0)")
    print(f"compared: {s['what']}")


if __name__ == "__main__":
    main()
