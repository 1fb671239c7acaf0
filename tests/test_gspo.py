"""GSPO maths on hand-computed numbers: the sequence ratio, sequence-level clipping, GSPO-token."""

import math

import pytest
import torch

import gspo


def loss_of(logprobs, old, advantages, mask, sampler=None, **overrides):
    """The loss; given the sampler's log-probs, as vLLM's (--sampler vllm: truncated importance sampling)."""
    args = gspo.Args(**{"sampler": "hf" if sampler is None else "vllm", **overrides})
    sampler = old if sampler is None else sampler
    return gspo.compute_policy_loss(logprobs, old, torch.zeros_like(logprobs), sampler, advantages, mask, args)


def test_sequence_ratio_is_the_geometric_mean_of_token_ratios():
    token_ratios = torch.tensor([[1.2, 0.9, 1.05, 1.0]])  # last token is padding
    mask = torch.tensor([[1, 1, 1, 0]])
    _, stats = loss_of(token_ratios.log(), torch.zeros(1, 4), torch.tensor([1.0]), mask, clip_eps_high=1.0)
    geometric_mean = (1.2 * 0.9 * 1.05) ** (1 / 3)  # 1.04323
    assert stats["ratio_mean"] == pytest.approx(geometric_mean, rel=1e-6)


def test_sequence_ratio_stays_finite_for_long_sequences():
    """1,000 tokens, each 10% more (or less) likely: the product of the token ratios, 1.1**1000 ~ 2.5e41,
    overflows float32 (and 1.1**-1000 underflows to 0); computed in log space s_i is simply 1.1."""
    assert torch.tensor(1.1).pow(1000).isinf()
    for sign in (1, -1):
        logprobs = torch.full((2, 1000), sign * math.log(1.1), requires_grad=True)
        loss, stats = loss_of(logprobs, torch.zeros(2, 1000), torch.tensor([1.0, -1.0]), torch.ones(2, 1000),
                              clip_eps_low=0.2, clip_eps_high=0.2)
        loss.backward()
        assert math.isfinite(loss.item()) and torch.isfinite(logprobs.grad).all()
        assert stats["ratio_mean"] == pytest.approx(1.1**sign, rel=1e-5)


def test_clipping_is_per_sequence_not_per_token():
    """One token's ratio is 3 but the sequence's geometric mean is inside the range: nothing clipped.
    A second sequence whose geometric mean leaves the range is clipped as a whole: no gradient at all."""
    inside = torch.log(torch.tensor([3.0, 1 / 3, 1.0]))  # geometric mean exactly 1
    outside = torch.full((3,), math.log(1.001))  # s = 1.001 > 1 + 4e-4
    logprobs = torch.stack([inside, outside]).requires_grad_(True)
    loss, stats = loss_of(logprobs, torch.zeros(2, 3), torch.tensor([1.0, 1.0]), torch.ones(2, 3))
    loss.backward()
    assert stats["clip_fraction"] == 0.5  # of the sequences, as the loss averages them
    assert (logprobs.grad[1] == 0).all()
    # sequence 1: d/dlogp_t of -(1/2) s A with s = exp(mean_t logp_t) = 1: -(1/2) * (1/3) for every token
    assert torch.allclose(logprobs.grad[0], torch.full((3,), -1 / 6))
    assert loss.item() == pytest.approx(-(1.0 + (1 + 4e-4)) / 2)


@pytest.mark.parametrize("advantage, clipped", [(1.0, [False, False, True]), (-1.0, [True, False, False])])
def test_asymmetric_clip_range_on_the_side_that_matters(advantage, clipped):
    s = torch.tensor([1 - 5e-4, 1.0, 1 + 5e-4])  # below 1 - 3e-4, inside, above 1 + 4e-4
    logprobs = s.log()[:, None].repeat(1, 2)
    _, stats = loss_of(logprobs, torch.zeros(3, 2), torch.full((3,), advantage), torch.ones(3, 2))
    assert stats["clip_fraction"] == pytest.approx(sum(clipped) / 3)


def test_gspo_token_equals_gspo_in_value_and_gradient():
    torch.manual_seed(0)
    old = torch.randn(4, 6) * 0.1 - 2
    new = old + torch.randn(4, 6) * 1e-3
    mask = torch.tensor([[1] * 6, [1] * 4 + [0] * 2, [1] * 2 + [0] * 4, [1] * 5 + [0]])
    advantages = torch.tensor([1.0, -0.5, 0.3, -1.2])
    results = []
    for token_level in (False, True):
        logprobs = new.clone().requires_grad_(True)
        loss, stats = loss_of(logprobs, old, advantages, mask, token_level=token_level)
        loss.backward()
        results.append((loss.item(), logprobs.grad, stats["clip_fraction"]))
    assert results[0][0] == pytest.approx(results[1][0], abs=1e-7)
    assert torch.allclose(results[0][1], results[1][1], atol=1e-7)
    assert results[0][2] == results[1][2] and 0 < results[0][2] < 1  # some sequences clipped, equally


def test_on_policy_ratio_is_one_and_gradient_is_the_policy_gradient():
    """One update per batch: s_i = 1, and the gradient is -1/G sum_i A_i 1/|y_i| sum_t grad logp_it."""
    logprobs = torch.tensor([[-1.0, -2.0, -0.5], [-0.3, -0.7, 0.0]], requires_grad=True)
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    advantages = torch.tensor([0.8, -0.8])
    loss, stats = loss_of(logprobs, logprobs.detach(), advantages, mask)
    loss.backward()
    assert stats["ratio_mean"] == 1.0 and stats["clip_fraction"] == 0.0
    expected = torch.tensor([[-0.8 / 2 / 3] * 3, [0.8 / 2 / 2] * 2 + [0.0]])
    assert torch.allclose(logprobs.grad, expected)


def test_truncated_importance_sampling_is_per_sequence_hand_computed():
    """pi_old / pi_sampler = 0.5 and 3 on the two tokens of one sequence (A = 1, on-policy so s = 1): GSPO weighs the
    sequence by their geometric mean, sqrt(1.5) = 1.2247 (below --tis-cap 2: loss -1.2247); at --tis-cap 1.1 by 1.1,
    and the whole sequence counts as truncated."""
    old = torch.tensor([[0.5, 0.6]]).log()
    sampler = torch.tensor([[1.0, 0.2]]).log()
    mask = torch.ones(1, 2)
    logprobs = old.clone().requires_grad_(True)
    loss, stats = loss_of(logprobs, old, torch.tensor([1.0]), mask, sampler=sampler, tis_cap=2.0)
    assert loss.item() == pytest.approx(-(1.5**0.5)) and stats["tis_truncated_fraction"] == 0.0
    loss, stats = loss_of(logprobs, old, torch.tensor([1.0]), mask, sampler=sampler, tis_cap=1.1)
    (grad,) = torch.autograd.grad(loss, logprobs)
    assert loss.item() == pytest.approx(-1.1) and stats["tis_truncated_fraction"] == 1.0
    assert torch.allclose(grad, torch.tensor([[-0.55, -0.55]]))  # d(-1.1 s)/d logp_t = -1.1 / |y|


@pytest.mark.parametrize("log_ratio", [100.0, -100.0])
def test_a_log_ratio_of_100_gives_the_clamped_loss_e20_or_1_minus_eps_and_no_gradient(log_ratio):
    """One token, A = -1, old and reference log-probs 0, beta 0.1: s = exp(clamp(log s, -20, 20)) (one token: s is its
    ratio) and the k3 KL's exp is clamped too, so the loss is e^20 (unclipped, since A < 0 and s > 1 + eps_high) or
    1 - eps_low (clipped at the bottom), plus beta k3, finite where exp(100) would be inf in float32; past the clamp no
    gradient flows. (tests/test_shared.py checks the clamp on every script, without these numbers.)"""
    logprobs = torch.tensor([[log_ratio]], requires_grad=True)
    loss, stats = loss_of(logprobs, torch.zeros(1, 1), torch.tensor([-1.0]), torch.ones(1, 1), beta=0.1)
    (grad,) = torch.autograd.grad(loss, logprobs)
    delta = -20.0 if log_ratio > 0 else 20.0  # log pi_ref - log pi, clamped
    kl = math.exp(delta) - delta - 1
    policy = math.exp(20) if log_ratio > 0 else 1 - gspo.Args().clip_eps_low  # -min(s A, clip(s) A) with A = -1
    assert math.isfinite(loss.item()) and loss.item() == pytest.approx(policy + 0.1 * kl, rel=1e-6)
    assert stats["kl"] == pytest.approx(kl, rel=1e-6)
    assert grad.item() == 0.0
