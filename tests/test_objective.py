"""The objective: D-PACE weights against the reference's worked example and the formula written out,
its normalization, and the target's greedy labels."""
from __future__ import annotations

import math

import pytest
import torch

from dflash.train.objective import block_labels, block_loss, decay_weights, dpace_weights, supervision
from dflash.target.head import head_argmax


def test_dpace_weights_give_the_worked_example():
    q = torch.tensor([1.0, 0.9, 0.5, 0.2])  # slot 0's value is never used: it is not supervised
    m = torch.tensor([False, True, True, True])
    w = dpace_weights(-q.log(), m, alpha=0.5)
    assert w.tolist() == pytest.approx([0, 2.09, 1.14, 0.4275])
    assert decay_weights(4, 7.0)[1:].tolist() == pytest.approx([1, 0.867, 0.751], abs=1e-3)


def _dpace_by_the_formula(q: list[float], m: list[bool], alpha: float) -> list[float]:
    s = [(1 - alpha) * qk + alpha if mk else 1.0 for qk, mk in zip(q, m)]
    p = [math.prod(s[:k + 1]) for k in range(len(s))]
    return [mk * sum(m[j] * p[j] for j in range(k, len(s))) for k, mk in enumerate(m)]


def test_dpace_weights_follow_the_formula_on_random_confidences():
    g = torch.Generator().manual_seed(0)
    ce = -torch.rand(64, 16, generator=g).clamp(min=1e-3).log()
    m = torch.rand(64, 16, generator=g) > 0.3
    m[:, 0] = False
    for alpha in (0.3, 0.5, 1.0):
        w = dpace_weights(ce, m, alpha)
        expected = [_dpace_by_the_formula(torch.exp(-c).tolist(), mk.tolist(), alpha) for c, mk in zip(ce, m)]
        torch.testing.assert_close(w, torch.tensor(expected), rtol=1e-5, atol=1e-6)
    # alpha 1 ignores the confidences: slot k weighs the supervised slots from k on
    assert dpace_weights(ce[:1, :4], torch.ones(1, 4, dtype=torch.bool), 1.0).tolist() == [[4, 3, 2, 1]]


def test_the_loss_is_divided_by_the_supervised_slots_not_by_the_weights():
    """Dividing by the sum of the weights would hand every step the same total weight, undoing
    D-PACE's choice of how much a step's blocks matter; world x share over the global count is
    what makes the ranks' averaged gradients one process's."""
    g = torch.Generator().manual_seed(0)
    H, V, B = 8, 50, 4
    hidden = torch.randn(2, 2 * B, H, generator=g, requires_grad=True)
    head = torch.randn(V, H, generator=g)
    labels = torch.randint(0, V, (2, 2 * B), generator=g)
    m = torch.tensor([[0, 1, 1, 0, 0, 1, 1, 1], [0, 1, 1, 1, 0, 0, 0, 0]], dtype=torch.bool)
    ce = torch.nn.functional.cross_entropy((hidden.detach() @ head.T).flatten(0, 1), labels.flatten(),
                                           reduction="none").view(2, 2 * B) * m
    w = dpace_weights(ce.view(-1, B), m.view(-1, B), 0.5).view(2, 2 * B)
    loss, parts = block_loss(hidden, head, labels, m, B, {"weights": "dpace", "dpace_alpha": 0.5}, supervised=20,
                             world=3)
    assert loss.item() == pytest.approx(3 * (w * ce).sum().item() / 20, rel=1e-5)
    assert parts.weighted_ce.item() == pytest.approx((w * ce).sum().item(), rel=1e-5)
    assert parts.count.tolist() == [0, 3, 3, 2] and parts.weight.sum().item() == pytest.approx(w.sum().item())
    loss.backward()  # the weights carry no gradient: d loss / d ce_k is w_k times the constant
    assert hidden.grad is not None


def test_target_labels_are_the_greedy_token_before_each_slot():
    ids = torch.arange(10, 20)
    greedy = torch.arange(50, 60, dtype=torch.int32)
    pos = torch.tensor([[0, 1, 2, 3], [7, 8, 9, 10]])
    assert block_labels(ids, greedy, pos)[0, 1:].tolist() == [50, 51, 52]
    assert block_labels(ids, greedy, pos)[1, 1:3].tolist() == [57, 58]
    assert block_labels(ids, None, pos)[0].tolist() == [10, 11, 12, 13]
    loss_mask = torch.tensor([0, 1, 1, 1, 1, 0, 1, 1, 1, 1], dtype=torch.bool)
    assert supervision(loss_mask, pos).tolist() == [[False, True, True, True], [False, True, True, False]]


def test_head_argmax_is_the_argmax_of_the_whole_logits_in_chunks():
    g = torch.Generator().manual_seed(0)
    hidden, head = torch.randn(300, 16, generator=g), torch.randn(1000, 16, generator=g)
    assert torch.equal(head_argmax(hidden, head, chunk=64).long(), (hidden @ head.T).argmax(-1))
