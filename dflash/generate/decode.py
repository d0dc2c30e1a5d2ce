"""Batched sampling from an in-process causal LM: the generation loop of the CPU backend.

transformers' ``generate()`` samples a whole batch from torch's one global generator, so a prompt's
tokens would depend on which prompts share its batch; and on a tiny model its per-step overhead
costs as much as the model. Here each row draws from its own generator, seeded per sample, so a
row at batch size 1 draws what ``generate()`` draws after ``torch.manual_seed(seed)``; rows are
left-padded, and a finished row leaves the batch (its cache rows dropped). Batched rows can still
differ from a lone row in float rounding, as on any batching server.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch


@dataclass
class Decoded:
    ids: list[int]  # the output ids, the stop token included when the row stopped on one
    finish: str  # "stop", "length" or "loop_abort" (``watch`` said so)


def warp(logits: torch.Tensor, sampling: dict) -> torch.Tensor:
    """Temperature, then top-k, then top-p on a (rows, vocab) float tensor, in transformers'
    order and with its rules (ties at the k-th score kept; at least one token kept by top-p)."""
    logits = logits / sampling["temperature"]
    top_k = sampling.get("top_k") or 0
    if 0 < top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    top_p = sampling.get("top_p")
    if top_p is not None and top_p < 1.0:
        ordered, order = torch.sort(logits, descending=False)
        dropped = ordered.softmax(-1).cumsum(-1) <= 1 - top_p
        dropped[..., -1] = False
        logits = logits.masked_fill(dropped.scatter(-1, order, dropped), float("-inf"))
    return logits


@torch.no_grad()
def sample_batch(model, prompts: list[list[int]], seeds: list[int], sampling: dict, stop: set[int], pad_id: int,
                 watches: list[Callable[[int], bool]] | None = None, repetition_penalty: float = 1.0) -> list[Decoded]:
    """Decode ``prompts`` (token id lists) together, up to ``sampling["max_tokens"]`` new tokens
    each; temperature 0 is greedy. ``watches[i](token)`` is told each new token of row i and ends
    the row (``loop_abort``) when it returns True. ``repetition_penalty`` (the model's
    generation_config, as ``generate()`` applies it): the scores of tokens already in the row,
    prompt included, divided by it (multiplied where negative) before sampling."""
    greedy = sampling["temperature"] == 0
    generators = [torch.Generator().manual_seed(s) for s in seeds]
    width = max(map(len, prompts))
    ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    seen = None
    if repetition_penalty != 1.0:
        seen = torch.zeros(len(prompts), model.config.get_text_config().vocab_size, dtype=torch.bool)
        for row, prompt in enumerate(prompts):
            seen[row, prompt] = True
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    rows = list(range(len(prompts)))  # the prompt index of each live row of the batch
    out: list[list[int]] = [[] for _ in prompts]
    finish: list[str] = ["length"] * len(prompts)
    cache = None
    for _ in range(sampling["max_tokens"]):
        step = model(input_ids=ids, attention_mask=mask, position_ids=positions, past_key_values=cache,
                     use_cache=True, logits_to_keep=1)
        cache, logits = step.past_key_values, step.logits[:, -1].float()
        if seen is not None:
            penalized = torch.where(logits < 0, logits * repetition_penalty, logits / repetition_penalty)
            logits = torch.where(seen[:, :logits.shape[-1]], penalized, logits)
        if greedy:
            tokens = logits.argmax(-1).tolist()
        else:
            probs = warp(logits, sampling).softmax(-1)
            tokens = [int(torch.multinomial(probs[i], 1, generator=generators[r])) for i, r in enumerate(rows)]
        live = []
        for i, (r, token) in enumerate(zip(rows, tokens)):
            out[r].append(token)
            if token in stop:
                finish[r] = "stop"
            elif watches and watches[r](token):
                finish[r] = "loop_abort"
            else:
                live.append(i)
        if not live:
            break
        if len(live) < len(rows):
            keep = torch.tensor(live)
            cache.reorder_cache(keep)
            mask, positions = mask[keep], positions[keep]
            seen = seen[keep] if seen is not None else None
            rows = [rows[i] for i in live]
            tokens = [tokens[i] for i in live]
        ids = torch.tensor(tokens).unsqueeze(-1)
        if seen is not None:
            seen.scatter_(1, ids, True)
        mask = torch.cat([mask, mask.new_ones(len(rows), 1)], dim=-1)
        positions = positions[:, -1:] + 1
    return [Decoded(o, f) for o, f in zip(out, finish)]
