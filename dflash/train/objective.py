"""The drafter's training objective: labels, position weights, the loss and its normalization.

One anchor block sits at row positions ``a .. a+B-1``: slot 0 holds the given token
``input_ids[a]``, slots ``k = 1 .. B-1`` are drafted. Slot k is supervised (``m_k = 1``) when
``k >= 1``, ``a + k`` is inside the row and ``loss_mask[a + k]`` (a completion token).

Labels ``y_k`` (``loss.labels``):
  ``target``  the target's greedy next token at position ``a + k - 1`` given the data prefix
              (its final hidden state through its final norm and lm_head, argmax). Greedy
              verification accepts a drafted token iff it equals exactly this, so these labels
              train what serving rewards (speculators' choice).
  ``data``    the data's token ``input_ids[a + k]``: a sample of the target's distribution, so a
              noisier version of the same (SpecForge's and the DFlash paper's choice).

Per-slot cross-entropy ``l_k = -log softmax(h_k @ W.T)[y_k]`` through the target's frozen lm_head
``W``, ``chunk`` supervised slots at a time (:class:`HeadCE`): the logits of a real vocabulary
(248k for Qwen3.6) are never whole.

Position weights ``w_k`` (``loss.weights``), never trained through:
  ``decay``  ``w_k = m_k exp(-(k - 1) / gamma)``: a fixed guess that later slots matter less.
  ``dpace``  (D-PACE) from the draft's own confidence ``q_k = exp(-l_k)``::

                 s_k = (1 - alpha) q_k + alpha   where m_k = 1, else 1
                 P_k = s_0 s_1 ... s_k
                 w_k = m_k (m_k P_k + m_{k+1} P_{k+1} + ... + m_{B-1} P_{B-1})

             With greedy verification the expected accepted length of a block is
             ``sum_j q_1 ... q_j``, and ``sum_{j>=k} q_1 ... q_j`` is its derivative with respect to
             ``log q_k``: the weighted CE climbs expected acceptance, putting its effort where a
             slot's error still cuts off the most accepted tokens. ``alpha`` smooths q so that an
             early slot's low confidence does not zero everything after it (0.5; stable 0.3-0.7).
             Worked example (B 4, alpha 0.5, m [0,1,1,1], q [-, .9, .5, .2]): s [1, .95, .75, .6],
             P [1, .95, .7125, .4275], w [0, 2.09, 1.14, .4275].

The loss is ``sum_k w_k l_k / S`` with ``S`` the number of supervised slots in the step's whole
batch, on every rank. Not ``/ sum w``: that would cancel the weighting (it rescales each step back
to a plain average; SpecForge issue #828). Not a per-rank count either: DDP and FSDP average the
ranks' gradients, so each rank returns ``world x`` its share of the numerator over the global
``S``, and the update is the one a single process makes on the global batch, however the rows fall
on the ranks.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from dflash.target.head import logit_chunks

WEIGHTS = ("dpace", "decay")
LABELS = ("target", "data")


def supervision(loss_mask: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    """``m`` [n, B] for blocks at positions ``pos`` [n, B] of a row with this ``loss_mask``."""
    inside = pos < len(loss_mask)
    m = loss_mask[pos.clamp(max=len(loss_mask) - 1)] & inside
    m[:, 0] = False  # slot 0 is the given anchor token, not a prediction
    return m


def block_labels(input_ids: torch.Tensor, target_ids: torch.Tensor | None, pos: torch.Tensor) -> torch.Tensor:
    """``y`` [n, B]: the target's greedy token predicted at ``pos - 1`` (``target_ids[t]`` is its
    argmax after reading positions ``<= t``), or with ``target_ids=None`` the data's token at
    ``pos``. Slots outside the row get some in-row label; their ``m`` is 0."""
    last = len(input_ids) - 1
    if target_ids is None:
        return input_ids[pos.clamp(max=last)]
    return target_ids[(pos - 1).clamp(min=0, max=last)].long()


def decay_weights(block_size: int, gamma: float | None) -> torch.Tensor:
    """``exp(-(k - 1) / gamma)`` per slot (slot 0 too, though it is never supervised); ``gamma``
    None: all 1."""
    k = torch.arange(block_size)
    return torch.exp(-(k - 1).clamp(min=0) / gamma) if gamma else torch.ones(block_size)


def dpace_weights(ce: torch.Tensor, m: torch.Tensor, alpha: float) -> torch.Tensor:
    """D-PACE ``w`` [..., B] from per-slot CE and supervision ``m`` [..., B] (the module docstring)."""
    q = torch.exp(-ce.detach().float())
    s = torch.where(m, (1 - alpha) * q + alpha, torch.ones_like(q))
    p = torch.cumprod(s, dim=-1) * m
    return m * p.flip(-1).cumsum(-1).flip(-1)


class HeadCE(torch.autograd.Function):
    """``(CE(hidden @ head.T, labels) per row, top-1 hit per row)`` through the frozen head,
    ``chunk`` rows of logits at a time. Backward recomputes each chunk's logits instead of keeping
    them: neither pass holds more than one chunk of fp32 logits (with bf16 autocast, their bf16
    matmul output and, in backward, a bf16 copy of their gradient besides: two chunks' worth),
    where the whole fp32 logits at 30k supervised positions x 248k vocabulary would be 30 GB, with
    as much again for their gradient. The per-row CE is what D-PACE weights need first; it is one
    float per row, not a chunk's logits."""

    @staticmethod
    def forward(ctx, hidden: torch.Tensor, head: torch.Tensor, labels: torch.Tensor,
                chunk: int) -> tuple[torch.Tensor, torch.Tensor]:
        # Under autocast the head is cast once here, not once per chunk; the logits are the same
        # bf16 matmul the unchunked lm_head gave, upcast to fp32 for the loss.
        device = hidden.device.type
        dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else head.dtype
        weight = head.to(dtype)
        lse = torch.empty(len(labels), device=hidden.device)
        ce = torch.empty(len(labels), device=hidden.device)
        hit = torch.empty(len(labels), dtype=torch.bool, device=hidden.device)
        for s, e, logits in logit_chunks(hidden, weight, chunk):
            top, arg = logits.max(-1)
            hit[s:e] = arg == labels[s:e]
            picked = logits.gather(1, labels[s:e, None]).squeeze(1)
            lse[s:e] = logits.sub_(top[:, None]).exp_().sum(-1).log_() + top  # in place: no second buffer
            ce[s:e] = lse[s:e] - picked
        ctx.save_for_backward(hidden, head, labels, lse)
        ctx.chunk, ctx.dtype = chunk, dtype
        ctx.mark_non_differentiable(hit)
        return ce, hit

    @staticmethod
    def backward(ctx, grad_ce: torch.Tensor, _grad_hit) -> tuple:
        hidden, head, labels, lse = ctx.saved_tensors
        weight = head.to(ctx.dtype)
        grad = torch.empty_like(hidden)
        for s, e, probs in logit_chunks(hidden, weight, ctx.chunk):
            probs.sub_(lse[s:e, None]).exp_()  # softmax, from the forward's log-sum-exp
            probs[torch.arange(e - s, device=probs.device), labels[s:e]] -= 1  # d CE / d logits = softmax - onehot
            probs.mul_(grad_ce[s:e, None])
            grad[s:e] = probs.to(ctx.dtype) @ weight
        return grad, None, None, None  # the head and labels are not trained


@dataclass
class LossParts:
    """What a step's loss is made of, for the train log; every tensor is this rank's share."""
    weighted_ce: torch.Tensor  # sum of w * l (detached)
    correct: torch.Tensor      # top-1 hits per slot [B]
    count: torch.Tensor        # supervised slots per slot [B]
    weight: torch.Tensor       # sum of w per slot [B]


def block_loss(hidden: torch.Tensor, head: torch.Tensor, labels: torch.Tensor, m: torch.Tensor, block_size: int,
               loss: dict, supervised: int | torch.Tensor, world: int = 1,
               chunk_tokens: int = 2048) -> tuple[torch.Tensor, LossParts]:
    """This rank's loss ``world * sum(w * l) / supervised`` for draft hidden states [R, N*B, H]
    of blocks with ``labels`` and ``m`` [R, N*B], ``supervised`` counting the supervised slots of
    every rank's blocks; and its parts. ``loss``: the ``train.loss`` settings (weights,
    dpace_alpha, decay_gamma)."""
    R, L = m.shape
    flat = m.flatten()  # unsupervised slots (anchors, padding) never reach the lm_head
    ce, hit = HeadCE.apply(hidden.flatten(0, 1)[flat], head, labels.flatten()[flat], chunk_tokens)
    slot = (torch.arange(L, device=m.device) % block_size).repeat(R)[flat]
    if loss["weights"] == "dpace":  # needs every slot's CE of a block first: one float each, no logits
        grid = torch.zeros(R * L, device=ce.device)
        grid[flat] = ce.detach()
        w = dpace_weights(grid.view(-1, block_size), flat.view(-1, block_size), loss["dpace_alpha"]).flatten()[flat]
    else:
        w = decay_weights(block_size, loss["decay_gamma"]).to(ce.device)[slot]
    weighted = (w * ce).sum()
    parts = LossParts(weighted.detach(), torch.bincount(slot[hit], minlength=block_size),
                      torch.bincount(slot, minlength=block_size),
                      torch.bincount(slot, weights=w.detach().float(), minlength=block_size))
    return weighted * (world / supervised), parts
