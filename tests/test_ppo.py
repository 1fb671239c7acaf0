"""PPO maths: GAE against a plain loop, the per-token reward, value-loss clipping and explained variance on
hand-computed numbers, whitening, the per-token clipped surrogate, and the critic on a tiny model."""

import math
import inspect

import pytest
import torch
from transformers import AutoModelForCausalLM

import ppo


def gae_reference(rewards: list[float], values: list[float], gamma: float, lam: float) -> list[float]:
    """GAE of one completion of len(rewards) real tokens, written as a plain loop over time steps."""
    advantages, running = [0.0] * len(rewards), 0.0
    for t in reversed(range(len(rewards))):
        next_value = values[t + 1] if t + 1 < len(rewards) else 0.0  # the episode ends with the completion
        delta = rewards[t] + gamma * next_value - values[t]
        running = delta + gamma * lam * running
        advantages[t] = running
    return advantages


@pytest.mark.parametrize("gamma, lam", [(1.0, 0.95), (0.9, 0.8), (1.0, 1.0), (0.99, 0.0)])
def test_gae_matches_a_plain_loop_on_ragged_masks(gamma, lam):
    torch.manual_seed(0)
    lengths = [7, 1, 4, 7, 2]
    mask = (torch.arange(7)[None] < torch.tensor(lengths)[:, None]).long()  # (5, 7)
    rewards, values = torch.randn(5, 7), torch.randn(5, 7)  # padding holds noise: it must not leak in
    advantages, returns = ppo.compute_gae(rewards, values, mask, gamma, lam)
    for i, n in enumerate(lengths):
        expected = gae_reference(rewards[i, :n].tolist(), values[i, :n].tolist(), gamma, lam)
        assert advantages[i, :n].tolist() == pytest.approx(expected, abs=1e-5)
        expected_returns = [a + v for a, v in zip(expected, values[i, :n].tolist())]
        assert returns[i, :n].tolist() == pytest.approx(expected_returns, abs=1e-5)
        assert (advantages[i, n:] == 0).all() and (returns[i, n:] == 0).all()


def test_gae_with_gamma_and_lambda_one_is_reward_to_go_minus_value():
    rewards = torch.tensor([[0.1, -0.2, 1.0, 0.0]])
    values = torch.tensor([[0.5, 0.4, 0.3, 9.0]])
    advantages, returns = ppo.compute_gae(rewards, values, torch.tensor([[1, 1, 1, 0]]), 1.0, 1.0)
    assert advantages[0].tolist() == pytest.approx([0.9 - 0.5, 0.8 - 0.4, 1.0 - 0.3, 0.0])
    assert returns[0].tolist() == pytest.approx([0.9, 0.8, 1.0, 0.0])


def test_kl_penalty_on_every_real_token_and_score_on_the_last_one_only():
    logprobs = torch.tensor([[-1.0, -2.0, -0.5, -3.0], [-1.0, -1.0, -9.0, -9.0]])
    ref = torch.tensor([[-1.5, -2.0, -1.0, -0.1], [-0.5, -1.0, -0.1, -0.1]])
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0]])
    rewards, non_score = ppo.compute_rewards(torch.tensor([1.0, 0.5]), logprobs, ref, mask, beta=0.1)
    # -beta (logp - ref) = -0.1 * [0.5, 0, 0.5] and -0.1 * [-0.5, 0]; the scores 1.0 and 0.5 on tokens 3 and 2
    assert rewards[0].tolist() == pytest.approx([-0.05, 0.0, -0.05 + 1.0, 0.0])
    assert rewards[1].tolist() == pytest.approx([0.05, 0.0 + 0.5, 0.0, 0.0])
    assert non_score.sum(1).tolist() == pytest.approx([-0.1, 0.05])
    no_kl, _ = ppo.compute_rewards(torch.tensor([1.0, 0.5]), logprobs, ref, mask, beta=0.0)
    assert no_kl.tolist() == [[0.0, 0.0, 1.0, 0.0], [0.0, 0.5, 0.0, 0.0]]


def test_value_loss_is_clipped_around_the_old_values():
    args = ppo.Args(cliprange_value=0.2)
    old = torch.tensor([[0.0, 0.0, 0.0, 0.0]])
    values = torch.tensor([[0.5, 0.5, -0.1, 0.3]], requires_grad=True)
    returns = torch.tensor([[1.0, -1.0, 0.0, 0.0]])
    mask = torch.tensor([[1, 1, 1, 0]])
    loss, stats = ppo.compute_value_loss(values, old, returns, mask, args)
    loss.backward()
    # token 1: V = 0.5, clipped to 0.2: max((0.5-1)^2, (0.2-1)^2) = 0.64, the clipped term: no gradient
    # token 2: max((0.5+1)^2, (0.2+1)^2) = 2.25, unclipped; token 3: inside the range, 0.01; token 4: padding
    assert loss.item() == pytest.approx(0.5 * (0.64 + 2.25 + 0.01) / 3)
    assert values.grad[0].tolist() == pytest.approx([0.0, (0.5 + 1) / 3, -0.1 / 3, 0.0])
    assert stats["value_clip_fraction"] == pytest.approx(1 / 3)


def test_explained_variance():
    returns = torch.tensor([[1.0, 2.0, 3.0, 99.0]])
    mask = torch.tensor([[1, 1, 1, 0]])
    assert ppo.explained_variance(returns.clone(), returns, mask) == pytest.approx(1.0)
    assert ppo.explained_variance(torch.full((1, 4), 2.0), returns, mask) == pytest.approx(0.0)
    # values [0, 2, 4] leave residuals [1, 0, -1]: variance 1, as much as the returns' own
    assert ppo.explained_variance(torch.tensor([[0.0, 2.0, 4.0, 0.0]]), returns, mask) == pytest.approx(0.0)
    assert ppo.explained_variance(torch.tensor([[1.5, 2.0, 2.5, 0.0]]), returns, mask) == pytest.approx(0.75)


def test_whiten_over_real_tokens_only():
    x = torch.tensor([[1.0, 2.0, 50.0], [3.0, -7.0, -7.0]])
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    white = ppo.whiten(x, mask)
    real = white[mask.bool()]
    assert real.tolist() == pytest.approx([-1 / math.sqrt(2 / 3), 0.0, 1 / math.sqrt(2 / 3)], abs=1e-4)
    assert white[~mask.bool()].tolist() == [0.0, 0.0, 0.0]


def test_policy_loss_uses_each_tokens_own_advantage_and_token_mean():
    ratios = torch.tensor([[1.0, 1.3, 0.7], [1.0, 1.0, 1.0]])
    logprobs = ratios.log().requires_grad_(True)
    advantages = torch.tensor([[1.0, 1.0, -1.0], [-2.0, 0.5, 0.0]])
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    loss, stats = ppo.compute_policy_loss(logprobs, torch.zeros(2, 3), torch.zeros(2, 3), torch.zeros(2, 3),
                                          advantages, mask, ppo.Args(beta=0.0))
    loss.backward()
    # -min(w A, clip(w) A) per token: -1, -1.2 (clipped), +0.8 (clipped), +2, -0.5; the mean of 5 real tokens
    assert loss.item() == pytest.approx((-1 - 1.2 + 0.8 + 2 - 0.5) / 5)
    assert torch.allclose(logprobs.grad, torch.tensor([[-1 / 5, 0.0, 0.0], [2 / 5, -0.5 / 5, 0.0]]))
    assert stats["clip_fraction"] == pytest.approx(2 / 5)


def test_critic_starts_at_zero_and_ignores_left_padding(tiny_model):
    policy = AutoModelForCausalLM.from_pretrained(tiny_model)
    critic = ppo.Critic(policy)
    assert critic.backbone is not policy.base_model and not hasattr(critic.backbone, "lm_head")
    ids = torch.tensor([[5, 6, 7, 8, 9, 10], [0, 0, 0, 11, 12, 13]])
    attention = torch.tensor([[1] * 6, [0, 0, 0, 1, 1, 1]])
    assert critic(ids, attention, 2).tolist() == [[0.0, 0.0], [0.0, 0.0]]  # a zero head: V = 0 everywhere
    torch.nn.init.normal_(critic.head.weight)
    values = critic(ids, attention, 2)  # (2, 2): the states before each of the last 2 tokens
    unpadded = critic(torch.tensor([[11, 12, 13]]), torch.ones(1, 3, dtype=torch.long), 2)
    assert torch.allclose(values[1], unpadded[0], atol=1e-5)
    # position t of the output is the state before completion token t: the hidden state of the token before it, also
    # for a row that shares its prompt (computed once) with another
    shared = critic(torch.cat([ids, torch.tensor([[5, 6, 7, 8, 14, 15]])]),
                    torch.cat([attention, torch.ones(1, 6).long()]), 2)
    for i, row in [(0, [5, 6, 7, 8, 9, 10]), (2, [5, 6, 7, 8, 14, 15])]:
        hidden = policy.base_model(input_ids=torch.tensor([row])).last_hidden_state
        assert torch.allclose(shared[i], critic.head(hidden[0, -3:-1]).squeeze(-1), atol=1e-5)
    assert all(torch.equal(a, b) for a, b in zip(critic.backbone.parameters(), policy.base_model.parameters()))


def test_truncated_importance_sampling_weighs_the_policy_loss_hand_computed():
    """pi_old / pi_sampler = 0.5 and 3 on two tokens with advantages 1 and -1 (on-policy, w = 1): the token mean of
    -0.5 x 1 and -min(3, 2) x (-1) is (-0.5 + 2) / 2 = 0.75; the value loss has no such weight."""
    old = torch.tensor([[0.5, 0.6]]).log()
    sampler = torch.tensor([[1.0, 0.2]]).log()
    loss, stats = ppo.compute_policy_loss(old.clone(), old, torch.zeros(1, 2), sampler, torch.tensor([[1.0, -1.0]]),
                                          torch.ones(1, 2), ppo.Args(beta=0.0, sampler="vllm", tis_cap=2.0))
    assert loss.item() == pytest.approx(0.75) and stats["tis_truncated_fraction"] == pytest.approx(0.5)
    assert "sampler_logprobs" not in inspect.signature(ppo.compute_value_loss).parameters


@pytest.mark.parametrize("log_ratio", [100.0, -100.0])
def test_a_log_ratio_of_100_gives_the_clamped_loss_e20_or_1_minus_eps_and_no_gradient(log_ratio):
    """One token, A = -1, old and reference log-probs 0, beta 0.1: the ratio is exp(clamp(log w, -20, 20)) and the k3
    KL's exp is clamped too, so the loss is e^20 (unclipped, since A < 0 and w > 1 + eps) or 1 - eps (clipped at the
    bottom), finite where exp(100) would be inf in float32, and the logged KL is k3 of the clamped log-ratio (PPO's KL
    is in its reward); past the clamp no gradient flows. (tests/test_shared.py checks the clamp on every script,
    without these numbers.)"""
    logprobs = torch.tensor([[log_ratio]], requires_grad=True)
    zeros = torch.zeros(1, 1)
    loss, stats = ppo.compute_policy_loss(logprobs, zeros, zeros, zeros, torch.tensor([[-1.0]]), torch.ones(1, 1),
                                          ppo.Args(beta=0.1))
    (grad,) = torch.autograd.grad(loss, logprobs)
    delta = -20.0 if log_ratio > 0 else 20.0  # log pi_ref - log pi, clamped
    kl = math.exp(delta) - delta - 1
    policy = math.exp(20) if log_ratio > 0 else 1 - ppo.Args().clip_eps  # -min(w A, clip(w) A) with A = -1
    assert math.isfinite(loss.item()) and loss.item() == pytest.approx(policy, rel=1e-6)
    assert stats["kl"] == pytest.approx(kl, rel=1e-6)
    assert grad.item() == 0.0
