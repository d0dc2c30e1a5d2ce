"""The training data, from the shards to a step's batch: the trainable rows (``ShardData``), the
order they are drawn in (``RowOrder``), each row's anchors, and the drafted blocks laid out as one
padded ``Batch``; ``prefetched`` builds the next batches while a step runs.

An anchor ``a`` is a position with ``loss_mask[a] and loss_mask[a + 1]``; its block is
``[input_ids[a], MASK x (B-1)]`` at positions ``a .. a+B-1``, reading the fused target features of
positions ``< a``.
"""
from __future__ import annotations

import hashlib
import json
import logging
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

import torch

from dflash.core.io import read_json
from dflash.core.tensors import load_safetensors, open_safetensors
from dflash.hidden.feature_guard import FeatureGuard, summary_from_metadata
from dflash.hidden.stage import cached_features, check_token_ids, features_and_greedy, forward_features, row_name
from dflash.train.objective import block_labels, supervision


@dataclass
class Row:
    shard: int
    start: int
    end: int
    input_ids: torch.Tensor  # int64 [T]
    loss_mask: torch.Tensor  # bool [T]


class NothingToTrain(ValueError):
    """No row of the shards can anchor a block."""


class ShardData:
    """Rows of the tokenized shards, with their hidden states (and, for ``greedy``, the target's
    greedy tokens) read lazily per row from the cache, or (``online``: the frozen target) computed
    per row when it is drawn."""

    def __init__(self, tokenized: list[Path], hidden: list[Path] | None, target_layer_ids: list[int],
                 hidden_size: int, target_name: str, log: logging.Logger, online: torch.nn.Module | None = None,
                 greedy: bool = False, feature_rms_range: float = 0):
        if hidden is None:
            hidden = [None] * len(tokenized)
        if len(tokenized) != len(hidden):
            raise ValueError(f"{len(tokenized)} tokenized shards but {len(hidden)} hidden shards")
        self.online, self.layer_ids, self.greedy = online, list(target_layer_ids), greedy
        self.guard = FeatureGuard(self.layer_ids, feature_rms_range)
        self._files = ExitStack()
        self.handles = []
        self.shard_paths: list[Path] = []
        self.shard_offsets: list[torch.Tensor] = []
        self.rows: list[Row] = []
        self.row_ids: dict[str, Path] = {}  # a row's id -> the index that lists it
        self.summary = {"shards": len(tokenized), "rows": 0, "tokens": 0,
                        "trainable_rows": 0, "trainable_tokens": 0, "supervised_tokens": 0}
        try:
            for shard, (tok_path, hid_path) in enumerate(zip(map(Path, tokenized), hidden)):
                self._add_shard(shard, tok_path, hid_path, target_layer_ids, hidden_size, target_name, log)
        except BaseException:
            self.close()
            raise
        if not self.rows:
            raise NothingToTrain("no trainable row has two consecutive supervised tokens: nothing to train on")

    def _add_shard(self, shard, tok_path, hid_path, target_layer_ids, hidden_size, target_name, log):
        tok = load_safetensors(tok_path, ("input_ids", "loss_mask", "offsets"), "a tokenized shard")
        meta_path = tok_path.with_suffix(".json")
        rows_meta = read_json(meta_path)["rows"]
        offsets = tok["offsets"].long()
        if len(rows_meta) != len(offsets) - 1:
            raise ValueError(f"{meta_path}: {len(rows_meta)} rows listed, {tok_path} has {len(offsets) - 1}")

        input_ids = tok["input_ids"].long()
        self.shard_paths.append(tok_path)
        self.shard_offsets.append(offsets)
        if self.online is not None:
            check_token_ids(tok_path, input_ids, offsets, self.online.get_input_embeddings().weight.shape[0])
        if hid_path is None:
            self.handles.append(None)
            self.guard.add_shard(str(tok_path), len(offsets) - 1, None)
        else:
            self.handles.append(self._open_cache(Path(hid_path), tok_path, offsets, input_ids, target_layer_ids,
                                                 hidden_size, target_name, log))
            self.guard.add_shard(str(hid_path), len(offsets) - 1, summary_from_metadata(self.handles[-1].metadata()))

        if again := next((m["id"] for m in rows_meta if m["id"] in self.row_ids), None):
            raise ValueError(f"{meta_path}: row {again} is a row of {self.row_ids[again]} too: a shard given twice "
                             f"(or a copy of one) would train its rows twice; give each shard once")
        self.row_ids.update((m["id"], meta_path) for m in rows_meta)
        loss_mask = tok["loss_mask"].bool()
        for r, row_meta in enumerate(rows_meta):
            start, end = int(offsets[r]), int(offsets[r + 1])
            row = Row(shard, start, end, input_ids[start:end], loss_mask[start:end])
            self.summary["rows"] += 1
            self.summary["tokens"] += end - start
            # "trainable" is the row's supervised-token count: 0 skips it.
            if row_meta.get("trainable", True) and len(anchor_candidates(row.loss_mask)) > 0:
                self.rows.append(row)
                self.summary["trainable_rows"] += 1
                self.summary["trainable_tokens"] += end - start
                self.summary["supervised_tokens"] += int(row.loss_mask.sum())

    def _open_cache(self, hid_path, tok_path, offsets, input_ids, target_layer_ids, hidden_size, target_name, log):
        f = self._files.enter_context(open_safetensors(hid_path, ("hidden_states", "input_ids", "offsets"),
                                                       "a hidden-state shard"))
        meta = f.metadata() or {}
        layer_ids = json.loads(meta.get("target_layer_ids", "null"))
        if layer_ids != list(target_layer_ids):
            raise ValueError(f"{hid_path}: hidden states of target layers {layer_ids}, "
                             f"the drafter config wants {list(target_layer_ids)}")
        if meta.get("model") not in (None, target_name):
            log.warning("%s: hidden states from model %r, training against %r", hid_path, meta["model"], target_name)
        shape = f.get_slice("hidden_states").get_shape()
        if shape[1:] != [len(target_layer_ids), hidden_size]:
            raise ValueError(f"{hid_path}: hidden_states shape {shape}, expected "
                             f"[T, {len(target_layer_ids)}, {hidden_size}] for this target and drafter")
        if not torch.equal(f.get_tensor("offsets").long(), offsets):
            raise ValueError(f"{hid_path}: row offsets differ from {tok_path}")
        if not torch.equal(f.get_tensor("input_ids").long(), input_ids) or shape[0] != len(input_ids):
            raise ValueError(f"{hid_path}: input_ids differ from {tok_path}")
        if self.greedy and "target_argmax" not in f.keys():
            raise ValueError(f"{hid_path}: a hidden-state cache without the target's greedy tokens (target_argmax), "
                             f"which train.loss.labels: target trains on: re-run the hidden stage with this version "
                             f"(`snakemake --forcerun hidden`), or set train.loss.labels: data")
        return f

    def target_outputs(self, row: Row) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(features [T, k, H], the target's greedy token after each position [T] or None)."""
        if self.online is not None:
            ids = row.input_ids[None].to(next(self.online.parameters()).device)
            if self.greedy:
                features, greedy = features_and_greedy(self.online, ids, self.layer_ids)
                greedy = greedy.cpu()  # laid out with the row's CPU positions
            else:
                features, greedy = forward_features(self.online, ids, self.layer_ids, logits=False)[1][0], None
        else:
            handle = self.handles[row.shard]
            greedy = handle.get_slice("target_argmax")[row.start:row.end] if self.greedy else None
            features = cached_features(handle, row.start, row.end)
        self.guard.add_row(row.shard, features, lambda: f"{self.guard.names[row.shard]}: {self._row_name(row)}")
        return features, greedy

    def _row_name(self, row: Row) -> str:
        path, offsets = self.shard_paths[row.shard], self.shard_offsets[row.shard]
        return row_name(path, int(torch.searchsorted(offsets, row.start)))

    def feature_summary(self) -> dict | None:
        """Per target layer, the features' statistics over the shards (``FeatureGuard.summary``)."""
        return self.guard.summary()

    def close(self) -> None:
        self._files.close()

    def __enter__(self) -> ShardData:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def anchor_candidates(loss_mask: torch.Tensor) -> torch.Tensor:
    """Positions whose next token is supervised too, so every block has a label."""
    return (loss_mask[:-1] & loss_mask[1:]).nonzero().squeeze(1)


def sample_anchors(loss_mask: torch.Tensor, num_anchors: int, generator: torch.Generator) -> torch.Tensor:
    candidates = anchor_candidates(loss_mask)
    pick = torch.randperm(len(candidates), generator=generator)[:num_anchors]
    return candidates[pick].sort().values


class RowOrder:
    """Row indices, epoch after epoch, each epoch in a fresh random order. Its position is part of
    a resume point, so a resumed run continues with exactly the rows it would have drawn."""

    def __init__(self, num_rows: int, generator: torch.Generator):
        self.num_rows, self.generator = num_rows, generator
        self.order: list[int] = []
        self.pos = 0

    def __next__(self) -> int:
        if self.pos == len(self.order):
            self.order, self.pos = torch.randperm(self.num_rows, generator=self.generator).tolist(), 0
        self.pos += 1
        return self.order[self.pos - 1]

    def state_dict(self) -> dict:
        # no copy: a new epoch replaces ``order`` and never changes it in place
        return {"order": self.order, "pos": self.pos}

    def load_state_dict(self, state: dict) -> None:
        self.order, self.pos = list(state["order"]), state["pos"]


@dataclass
class Batch:
    block_ids: torch.Tensor       # [R, N*B] anchor token then MASKs
    block_pos: torch.Tensor       # [R, N*B] absolute positions
    labels: torch.Tensor          # [R, N*B]
    supervised: torch.Tensor      # [R, N*B] bool: False for slot 0, padding, labels outside the completion
    context: torch.Tensor         # [R, T, k, H]
    context_pos: torch.Tensor     # [R, T]
    context_valid: torch.Tensor   # [R, T]

    def to(self, device: torch.device, non_blocking: bool = False) -> Batch:
        return Batch(**{k: v.to(device, non_blocking=non_blocking) for k, v in vars(self).items()})

    def pin_memory(self) -> Batch:
        return Batch(**{k: v.pin_memory() for k, v in vars(self).items()})


T = TypeVar("T")


def prefetched(build: Callable[[], T], count: int, ahead: int) -> Iterator[T]:
    """``count`` results of ``build()``, called in order by one background thread that stays up
    to ``ahead`` results ahead of the consumer (0: called in the consumer's thread). One thread
    keeps the calls, and so their random draws, in the order of a run without prefetch. A thread,
    not a process: building a batch is a few bulk copies (cache slices, the fp32 context, pinning)
    in torch and safetensors calls, not per-element Python, and a thread shares the open cache
    files and the generator (bench/train_input.py: no cost measured on CPU). Close it to stop the
    thread."""
    if ahead == 0:
        for _ in range(count):
            yield build()
        return
    pool = ThreadPoolExecutor(1, thread_name_prefix="dflash-prefetch")
    try:
        pending = deque(pool.submit(build) for _ in range(min(ahead, count)))
        submitted = len(pending)
        while pending:
            result = pending.popleft().result()
            if submitted < count:
                pending.append(pool.submit(build))
                submitted += 1
            yield result
    finally:
        pool.shutdown(cancel_futures=True)


def make_batch(rows: list[Row], features: list[torch.Tensor], anchors: list[torch.Tensor],
               block_size: int, mask_token_id: int, greedy: list[torch.Tensor] | None = None) -> Batch:
    """Lay out each row's blocks one after another and pad rows to a common shape; padded
    blocks keep well-formed positions but are not supervised. ``greedy``: per row, the target's
    greedy tokens to label with (``block_labels``); None: the data's tokens."""
    R, B = len(rows), block_size
    N = max(len(a) for a in anchors)
    T = max(len(r.input_ids) for r in rows)
    k = torch.arange(B)

    block_ids = torch.full((R, N, B), mask_token_id, dtype=torch.long)
    block_pos = k.repeat(R, N, 1)
    labels = torch.zeros((R, N, B), dtype=torch.long)
    supervised = torch.zeros((R, N, B), dtype=torch.bool)
    context = torch.zeros((R, T, *features[0].shape[1:]), dtype=torch.float32)
    context_valid = torch.zeros((R, T), dtype=torch.bool)
    for i, (row, feats, a) in enumerate(zip(rows, features, anchors)):
        n, length = len(a), len(row.input_ids)
        pos = a[:, None] + k                       # [n, B]
        block_ids[i, :n, 0] = row.input_ids[a]
        block_pos[i, :n] = pos
        labels[i, :n] = block_labels(row.input_ids, None if greedy is None else greedy[i], pos)
        supervised[i, :n] = supervision(row.loss_mask, pos)
        context[i, :length] = feats.float()
        context_valid[i, :length] = True
    return Batch(block_ids.flatten(1), block_pos.flatten(1), labels.flatten(1), supervised.flatten(1),
                 context, torch.arange(T).repeat(R, 1), context_valid)


def add_feature_noise(batch: Batch, scale: float, seed: int, step: int, first_row: int) -> None:
    """Add Gaussian noise to the target features the drafter reads, ``scale`` times each token's
    RMS in each layer: a regularizer for a drafter that sees its rows many times, which otherwise
    learns their exact features (bench/README.md, "the input layer off Muon, and feature noise").
    Each row's noise comes from its own seed (run seed, step, row of the global batch), drawn on
    the batch's device: a resumed run, a prefetching one and one split over ranks draw the same."""
    generator = torch.Generator(batch.context.device)
    for i, length in enumerate(batch.context_valid.sum(1).tolist()):
        key = hashlib.sha256(f"{seed}/{step}/{first_row + i}".encode()).digest()
        generator.manual_seed(int.from_bytes(key[:8], "little"))
        context = batch.context[i, :length]
        rms = context.pow(2).mean(-1, keepdim=True).sqrt()
        context.add_(scale * rms * torch.randn(context.shape, generator=generator, device=context.device))
