"""The target's frozen lm_head applied chunk by chunk: its logits for a real vocabulary (248k for
Qwen3.6) are never whole. The hidden stage takes the target's greedy tokens with it, training its
loss through the head."""
from __future__ import annotations

from collections.abc import Iterator

import torch


def logit_chunks(hidden: torch.Tensor, weight: torch.Tensor, chunk: int) -> Iterator[tuple[int, int, torch.Tensor]]:
    """``(start, end, fp32 logits of rows start:end)``, chunk after chunk, all in the same buffers:
    one chunk of logits is alive at a time, and CPU runs do not fault in fresh pages per chunk.
    Each chunk's logits are overwritten by the next, so callers may change them in place."""
    rows = min(chunk, len(hidden))
    raw = torch.empty(rows, len(weight), dtype=weight.dtype, device=hidden.device)
    logits = raw if raw.dtype == torch.float32 else torch.empty(rows, len(weight), device=hidden.device)
    for s in range(0, len(hidden), chunk):
        e = min(s + chunk, len(hidden))
        torch.mm(hidden[s:e].to(weight.dtype), weight.T, out=raw[:e - s])
        if logits is not raw:
            logits[:e - s].copy_(raw[:e - s])
        yield s, e, logits[:e - s]


@torch.no_grad()
def head_argmax(hidden: torch.Tensor, head: torch.Tensor, chunk: int = 1024) -> torch.Tensor:
    """argmax of ``hidden @ head.T`` per row (int32), ``chunk`` rows of logits at a time: the
    target's greedy tokens from its final normed hidden states without its whole logits."""
    ids = torch.empty(len(hidden), dtype=torch.int32, device=hidden.device)
    for s, e, logits in logit_chunks(hidden, head, chunk):
        ids[s:e] = logits.argmax(-1)
    return ids
