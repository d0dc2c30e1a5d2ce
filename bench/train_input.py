"""Drafter training with its input pipeline: batches prefetched by a background thread
(``train.prefetch``) against built in the loop (``prefetch: 0``).

Each side is a real ``dflash.train.stage.train`` run on the same data, in this process, one after the
other, the order alternating between rounds; a step's time includes drawing the rows and
anchors, reading their hidden states from the cache files, laying out the batch, and the
forward, backward and AdamW step. The first ``--log-every`` steps of each run (warm-up) and the
checkpoint writing at its end are left out: step time = the time between the first and the last
train_log line / the steps between them (taken from the trainer's own log records).

The data are files in the formats the pipeline's stages write: tokenized shards as the tokenize
stage writes them, hidden-state shards as the hidden stage's ``capture_shard`` writes them (same
tensors, dtype bf16 and metadata, the target's layers 1 and 3, hidden 128) but holding random
features and greedy tokens (running the demo target over 200k tokens takes an hour on a CPU: its linear-attention
layers fall back to transformers' reference kernel; the values do not change the reading), for
a randomly initialised target of the demo's shape (hidden 128, 4 layers, vocabulary 4096).
Training uses the demo's config (drafter 2 layers, block 8, batch 8 rows, 16 anchors per row)
on rows of --min-len to --max-len tokens (a prompt and a thinking trace). The files are read
through the page cache (warm after the first round), as a node that holds its shards in memory
reads them.

Prints: the versions, each round's step times and ratio (off / on: > 1 = prefetch is faster),
the median of the per-round ratios, and the time per step that building the batches alone takes.

Usage: python bench/train_input.py [--rounds 5] [--steps 30] [--rows 64] [--threads 1] [--prefetch 2]
"""
from __future__ import annotations

import argparse
import json
import logging
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

LAYER_IDS = [1, 3]
TRAIN = {"num_layers": 2, "block_size": 8, "mask_token_id": 4095, "target_layer_ids": LAYER_IDS,
         "batch_size": 8, "lr": 3e-3, "num_anchors": 16, "save_every": 0, "device": "cpu"}


def make_data(work: Path, rows: int, shards: int, min_len: int,
              max_len: int) -> tuple[Path, list[Path], list[Path], int]:
    """A demo-shaped target, its tokenized + hidden shards, and their token count."""
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM
    from transformers.models.qwen3_5.configuration_qwen3_5 import Qwen3_5TextConfig

    from dflash.core.shapes import HIDDEN_FORMAT
    from dflash.core.io import atomic_path

    torch.manual_seed(0)
    config = Qwen3_5TextConfig(
        vocab_size=4096, hidden_size=128, intermediate_size=384, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=32, layer_types=["linear_attention"] * 3 + ["full_attention"],
        rope_parameters={"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25,
                         "mrope_section": [1, 1, 0], "mrope_interleaved": True}, tie_word_embeddings=False)
    target = work / "target"
    AutoModelForCausalLM.from_config(config).save_pretrained(target)

    g = torch.Generator().manual_seed(0)
    tokenized, hidden, tokens = [], [], 0
    per_shard = -(-rows // shards)
    for shard in range(shards):
        lengths = torch.randint(min_len, max_len + 1, (min(per_shard, rows - shard * per_shard),), generator=g)
        ids = torch.randint(0, 4095, (int(lengths.sum()),), generator=g, dtype=torch.int32)
        mask = torch.ones(len(ids), dtype=torch.uint8)
        offsets = torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)])
        for start in offsets[:-1].tolist():
            mask[start:start + 100] = 0  # the prompt
        tok = work / "tokenized" / f"shard-{shard:05d}.safetensors"
        tok.parent.mkdir(parents=True, exist_ok=True)
        save_file({"input_ids": ids, "loss_mask": mask, "offsets": offsets}, tok,
                  metadata={"format": "dflash-tokenized-v1"})
        meta = [{"id": f"s{shard}r{r}", "category": "chat", "length": int(n), "trainable": int(n) - 100}
                for r, n in enumerate(lengths)]
        tok.with_suffix(".json").write_text(json.dumps({"rows": meta}))
        hid = work / "hidden" / tok.name
        hid.parent.mkdir(parents=True, exist_ok=True)
        feats = torch.randn(len(ids), len(LAYER_IDS), 128, generator=g).to(torch.bfloat16)
        greedy = torch.randint(0, 4095, (len(ids),), generator=g, dtype=torch.int32)  # random as the features
        with atomic_path(hid) as tmp:  # capture_shard's tensors and metadata
            save_file({"hidden_states": feats, "target_argmax": greedy, "input_ids": ids, "offsets": offsets},
                      str(tmp), metadata={"format": HIDDEN_FORMAT, "target_layer_ids": json.dumps(LAYER_IDS),
                                          "hidden_size": "128", "dtype": "bfloat16", "model": target.name})
        tokenized.append(tok)
        hidden.append(hid)
        tokens += len(ids)
    return target, tokenized, hidden, tokens


class LogTimes(logging.Handler):
    """Arrival time of each train_log line (the trainer logs ``step N loss ...`` as it writes one)."""

    def __init__(self):
        super().__init__()
        self.times: list[tuple[int, float]] = []

    def emit(self, record: logging.LogRecord) -> None:
        if record.msg.startswith("step %d loss"):
            self.times.append((record.args[0], time.perf_counter()))


def step_seconds(target: Path, tokenized, hidden, out: Path, cfg: dict) -> float:
    from dflash.train.stage import train

    log = logging.getLogger(f"bench.train_input.{out.name}")
    log.propagate, log.level = False, logging.INFO
    times = LogTimes()
    log.handlers = [times]
    train(tokenized, hidden, target, out, cfg, log)
    (s0, t0), (s1, t1) = times.times[0], times.times[-1]
    return (t1 - t0) / (s1 - s0)


def build_seconds(target: Path, tokenized, hidden, cfg: dict, steps: int) -> float:
    """Building the batches alone (draws, cache reads, layout), as the loop does without prefetch."""
    import torch

    from dflash.train.batches import RowOrder, ShardData, make_batch, sample_anchors
    from dflash.train.stage import resolve_cfg

    cfg = resolve_cfg(cfg)
    generator = torch.Generator().manual_seed(0)
    # the greedy tokens are read with the features where the loss trains on them, as in train()
    with ShardData(tokenized, hidden, LAYER_IDS, 128, target.name, logging.getLogger("bench"),
                   greedy=cfg["loss"]["labels"] == "target") as data:
        order = RowOrder(len(data.rows), generator)
        t0 = time.perf_counter()
        for _ in range(steps):
            rows = [data.rows[next(order)] for _ in range(cfg["batch_size"])]
            anchors = [sample_anchors(r.loss_mask, cfg["num_anchors"], generator) for r in rows]
            make_batch(rows, [data.target_outputs(r)[0] for r in rows], anchors, cfg["block_size"],
                       cfg["mask_token_id"])
        return (time.perf_counter() - t0) / steps


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=30, help="steps per run (the first --log-every are warm-up)")
    ap.add_argument("--log-every", type=int, default=5)
    ap.add_argument("--rows", type=int, default=64)
    ap.add_argument("--shards", type=int, default=4)
    ap.add_argument("--min-len", type=int, default=512)
    ap.add_argument("--max-len", type=int, default=2048)
    ap.add_argument("--threads", type=int, default=1, help="torch intra-op threads, the same for both sides")
    ap.add_argument("--prefetch", type=int, default=2, help="train.prefetch of the prefetching side")
    a = ap.parse_args()

    import safetensors
    import torch
    import transformers

    torch.set_num_threads(a.threads)
    print(f"Python {platform.python_version()}, torch {torch.__version__}, safetensors {safetensors.__version__}, "
          f"transformers {transformers.__version__}; {a.threads} torch thread(s)")
    cfg = {**TRAIN, "steps": a.steps, "log_every": a.log_every}
    with tempfile.TemporaryDirectory(prefix="dflash-train-input-") as tmp:
        work = Path(tmp)
        t0 = time.perf_counter()
        target, tokenized, hidden, tokens = make_data(work, a.rows, a.shards, a.min_len, a.max_len)
        cache = sum(p.stat().st_size for p in hidden)
        print(f"data: {a.rows} rows of {a.min_len}-{a.max_len} tokens ({tokens:,} tokens) in {a.shards} shards, "
              f"hidden cache {cache / 1e6:.0f} MB (bf16, layers {LAYER_IDS}, hidden 128); "
              f"made in {time.perf_counter() - t0:.0f} s")
        print(f"compared: train.prefetch {a.prefetch} (background thread) vs 0 (in the loop); "
              f"batch 8 rows x 16 anchors, block 8, drafter 2 layers; steps {a.log_every + 1}-{a.steps} timed")
        step_seconds(target, tokenized, hidden, work / "warm", {**cfg, "steps": a.log_every * 2, "prefetch": 0})
        off_times, on_times, ratios = [], [], []
        for r in range(a.rounds):
            sides = [0, a.prefetch] if r % 2 == 0 else [a.prefetch, 0]
            got = {p: step_seconds(target, tokenized, hidden, work / f"r{r}-p{p}", {**cfg, "prefetch": p})
                   for p in sides}
            off_times.append(got[0])
            on_times.append(got[a.prefetch])
            ratios.append(got[0] / got[a.prefetch])
            print(f"round {r + 1} ({'off first' if sides[0] == 0 else 'on first'}): off {got[0] * 1e3:.1f} ms/step, "
                  f"on {got[a.prefetch] * 1e3:.1f} ms/step, off / on {ratios[-1]:.3f}", flush=True)
        build = build_seconds(target, tokenized, hidden, cfg, a.steps)
    off, on = statistics.median(off_times), statistics.median(on_times)
    print(f"median step: off {off * 1e3:.1f} ms, on {on * 1e3:.1f} ms; building a batch alone {build * 1e3:.1f} ms")
    print(f"off / on, median of {a.rounds} per-round ratios: {statistics.median(ratios):.3f} "
          f"(rounds {min(ratios):.3f} to {max(ratios):.3f}; > 1 = prefetch faster)")


if __name__ == "__main__":
    main()
