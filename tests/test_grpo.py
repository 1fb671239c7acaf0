"""GRPO maths on hand-computed numbers, and one gradient step of its loss on a tiny model."""

import math

import pytest
import torch
from transformers import AutoModelForCausalLM

import grpo


def loss_of(logprobs, old, advantages, mask, ref=None, sampler=None, **overrides):
    """The loss; given the sampler's log-probs, as vLLM's (--sampler vllm: truncated importance sampling)."""
    args = grpo.Args(**{"beta": 0.0, "sampler": "hf" if sampler is None else "vllm", **overrides})
    ref = torch.zeros_like(logprobs) if ref is None else ref
    sampler = old if sampler is None else sampler
    return grpo.compute_policy_loss(logprobs, old, ref, sampler, advantages, mask, args)


def test_advantages_hand_computed():
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 2.0, 2.0, 2.0, 2.0])
    adv = grpo.compute_advantages(rewards, group_size=4)
    # group 1: mean 0.5, sample std sqrt((4 * 0.25) / 3) = 0.57735; group 2: all equal
    expected = 0.5 / (math.sqrt(1 / 3) + 1e-4)
    assert torch.allclose(adv, torch.tensor([expected, -expected, -expected, expected, 0, 0, 0, 0]))
    assert torch.isfinite(adv).all() and (adv[4:] == 0).all()


def test_advantages_groups_are_contiguous():
    adv = grpo.compute_advantages(torch.tensor([0.0, 1.0, 5.0, 5.0, 3.0, 9.0]), group_size=2)
    assert adv[0] < 0 < adv[1] and adv[2] == adv[3] == 0 and adv[4] < 0 < adv[5]


def test_short_completion_tokens_weigh_20_times_more():
    """The seed's example: completions of 200 and 10 tokens; GRPO weighs each token by 1/(G |o_i|)."""
    mask = torch.zeros(2, 200)
    mask[0, :200], mask[1, :10] = 1, 1
    logprobs = torch.full((2, 200), -1.0, requires_grad=True)
    loss, _ = loss_of(logprobs, logprobs.detach(), torch.tensor([1.0, 1.0]), mask)
    loss.backward()
    grad = logprobs.grad
    assert torch.allclose(grad[0, :200], torch.full((200,), -1 / 400))  # (1/200) * (1/2)
    assert torch.allclose(grad[1, :10], torch.full((10,), -1 / 20))  # (1/10) * (1/2)
    assert (grad[1, 10:] == 0).all()  # padding gets no gradient
    assert torch.isclose(grad[1, 0] / grad[0, 0], torch.tensor(20.0))


@pytest.mark.parametrize("advantage, clipped_index", [(1.0, 3), (-1.0, 0)])
def test_clipping_only_outside_the_range_on_the_side_that_matters(advantage, clipped_index):
    ratios = torch.tensor([[0.7, 0.9, 1.1, 1.3]])
    old = torch.zeros(1, 4)
    logprobs = ratios.log().requires_grad_(True)
    loss, stats = loss_of(logprobs, old, torch.tensor([advantage]), torch.ones(1, 4), clip_eps=0.2)
    loss.backward()
    # per token: -min(w A, clip(w, 0.8, 1.2) A), averaged over the 4 tokens
    clipped = ratios.clamp(0.8, 1.2)
    expected = -torch.minimum(ratios * advantage, clipped * advantage).mean()
    assert torch.isclose(loss, expected)
    grad = logprobs.grad[0]
    for i in range(4):  # d/dlogp of -w A / 4 = -w A / 4 unless clipped, then exactly 0
        want = 0.0 if i == clipped_index else -ratios[0, i].item() * advantage / 4
        assert grad[i].item() == pytest.approx(want, abs=1e-7)
    assert stats["clip_fraction"] == pytest.approx(0.25)
    assert stats["ratio_mean"] == pytest.approx((0.7 + 0.9 + 1.1 + 1.3) / 4)


def test_k3_kl_zero_at_reference_and_hand_computed():
    logprobs = torch.log(torch.tensor([[0.4, 0.5]]))
    mask, adv = torch.ones(1, 2), torch.zeros(1)
    loss, stats = loss_of(logprobs, logprobs, adv, mask, ref=logprobs.clone(), beta=0.1)
    assert loss.item() == 0.0 and stats["kl"] == 0.0
    ref = torch.log(torch.tensor([[0.2, 0.5]]))  # delta = ref - logp = log(0.5), then 0
    loss, stats = loss_of(logprobs, logprobs, adv, mask, ref=ref, beta=0.1)
    d = math.log(0.5)
    kl = math.exp(d) - d - 1  # 0.193147
    assert stats["kl"] == pytest.approx(kl / 2)
    assert loss.item() == pytest.approx(0.1 * kl / 2)


def test_log_ratio_diagnostics():
    logprobs = torch.tensor([[0.1, 0.3, 0.0], [-0.2, 0.0, 0.0]])
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    _, stats = loss_of(logprobs, torch.zeros(2, 3), torch.ones(2), mask)
    assert stats["token_log_ratio_std"] == pytest.approx(torch.tensor([0.1, 0.3, -0.2]).std().item())
    assert stats["seq_log_ratio_std"] == pytest.approx(torch.tensor([0.2, -0.2]).std().item())


def test_positive_advantage_raises_probability_of_sampled_tokens(tiny_model):
    model = AutoModelForCausalLM.from_pretrained(tiny_model)
    ids = torch.tensor([[5, 6, 7, 8, 9]])
    attention, mask = torch.ones(1, 5, dtype=torch.long), torch.ones(1, 3)
    before, _ = grpo.token_logprobs(model, ids, attention, 3, 1.0)
    loss, _ = loss_of(before, before.detach(), torch.tensor([1.0]), mask)
    loss.backward()
    with torch.no_grad():
        for p in model.parameters():
            p -= 0.01 * p.grad
    after, _ = grpo.token_logprobs(model, ids, attention, 3, 1.0)
    assert after.sum() > before.sum()


def test_truncated_importance_sampling_hand_computed():
    """pi_old / pi_sampler = 0.5 and 3 on the two tokens of one completion (A = 1, on-policy so w = 1): the tokens
    weigh min(0.5, 2) = 0.5 and min(3, 2) = 2 (--tis-cap 2), loss -(0.5 + 2) / 2 = -1.25, gradient -tis / 2; half
    the tokens truncated. --tis-cap 0: every weight 1."""
    old = torch.tensor([[0.5, 0.6]]).log()
    sampler = torch.tensor([[1.0, 0.2]]).log()
    mask = torch.ones(1, 2)
    logprobs = old.clone().requires_grad_(True)
    loss, stats = loss_of(logprobs, old, torch.tensor([1.0]), mask, sampler=sampler, tis_cap=2.0)
    (grad,) = torch.autograd.grad(loss, logprobs)
    assert loss.item() == pytest.approx(-1.25)
    assert torch.allclose(grad, torch.tensor([[-0.25, -1.0]]))
    assert stats["tis_truncated_fraction"] == pytest.approx(0.5)
    off, stats = loss_of(logprobs, old, torch.tensor([1.0]), mask, sampler=sampler, tis_cap=0.0)
    assert off.item() == pytest.approx(-1.0) and stats["tis_truncated_fraction"] == 0.0
    # --sampler hf: `generate` drew with the trainer's own model; its log-probs weigh nothing
    hf, stats = grpo.compute_policy_loss(logprobs, old, torch.zeros(1, 2), sampler, torch.tensor([1.0]), mask,
                                         grpo.Args(beta=0.0))
    assert hf.item() == pytest.approx(-1.0) and stats["tis_truncated_fraction"] == 0.0


@pytest.mark.parametrize("log_ratio", [100.0, -100.0])
def test_a_log_ratio_of_100_gives_the_clamped_loss_e20_or_1_minus_eps_and_no_gradient(log_ratio):
    """One token, A = -1, old and reference log-probs 0, beta 0.1: the ratio is exp(clamp(log w, -20, 20)) and the k3
    KL's exp is clamped too, so the loss is e^20 (unclipped, since A < 0 and w > 1 + eps) or 1 - eps (clipped at the
    bottom), plus beta k3, finite where exp(100) would be inf in float32; past the clamp no gradient flows.
    (tests/test_shared.py checks the clamp on every script, without these numbers.)"""
    logprobs = torch.tensor([[log_ratio]], requires_grad=True)
    loss, stats = loss_of(logprobs, torch.zeros(1, 1), torch.tensor([-1.0]), torch.ones(1, 1), beta=0.1)
    (grad,) = torch.autograd.grad(loss, logprobs)
    delta = -20.0 if log_ratio > 0 else 20.0  # log pi_ref - log pi, clamped
    kl = math.exp(delta) - delta - 1
    policy = math.exp(20) if log_ratio > 0 else 1 - grpo.Args().clip_eps  # -min(w A, clip(w) A) with A = -1
    assert math.isfinite(loss.item()) and loss.item() == pytest.approx(policy + 0.1 * kl, rel=1e-6)
    assert stats["kl"] == pytest.approx(kl, rel=1e-6)
    assert grad.item() == 0.0
