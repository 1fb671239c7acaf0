"""The relations between the algorithms, as tests: under stated conditions one script's loss and gradient (or
advantages) equal another's, and outside them they differ as the maths predicts. Each test calls the scripts' own
functions on one hand-made batch; docs/claims.md lists the relations next to these tests."""

from typing import NamedTuple

import pytest
import torch
from torch.testing import assert_close

import dapo
import grpo
import gspo
import ppo

CLIP = 0.2  # one symmetric clip range for every script in a comparison


class Batch(NamedTuple):
    logprobs: torch.Tensor  # (B, T) log pi_theta, 0 on padding as token_logprobs pads
    old: torch.Tensor  # (B, T) log pi_old
    ref: torch.Tensor  # (B, T) log pi_ref
    advantages: torch.Tensor  # (B,) one per completion, mixed signs
    mask: torch.Tensor  # (B, T) 1 on each completion's tokens, then 0


def make_batch(lengths, width=None, seed=0) -> Batch:
    """Completions of the given lengths, right-padded to `width` (default the longest); the old log-probs are 0.3
    (std) away from the current ones in log space, so that ratios leave [0.8, 1.2] on both sides."""
    gen = torch.Generator().manual_seed(seed)
    B, T = len(lengths), width or max(lengths)
    mask = (torch.arange(T)[None] < torch.tensor(lengths)[:, None]).long()
    logprobs = -3 * torch.rand(B, T, generator=gen) * mask
    old = (logprobs + 0.3 * torch.randn(B, T, generator=gen)) * mask
    ref = (logprobs + 0.3 * torch.randn(B, T, generator=gen)) * mask
    advantages = torch.tensor([1.0, -0.5, 0.75, -1.25, 0.4, -0.9])[:B]
    return Batch(logprobs, old, ref, advantages, mask)


def loss_and_grad(module, batch: Batch, on_policy=False, **args):
    """`module`'s compute_policy_loss on the batch with Args(**args): the loss, its gradient w.r.t. the log-probs,
    and the statistics. On-policy, the old log-probs are the current ones detached, as the scripts reuse them."""
    logprobs = batch.logprobs.clone().requires_grad_(True)
    old = logprobs.detach() if on_policy else batch.old
    loss, stats = module.compute_policy_loss(logprobs, old, batch.ref, old, batch.advantages, batch.mask,
                                             module.Args(**args))
    (grad,) = torch.autograd.grad(loss, logprobs)
    return loss.detach(), grad, stats


def assert_differ(actual, expected):
    """The negative controls: a difference 100 times assert_close's float32 tolerance (atol 1e-5) at least."""
    assert (actual - expected).abs().max() > 1e-3


def assert_clipping_exercised(stats):
    """An off-policy comparison means something only if some (not all) tokens fall outside the clip range."""
    assert 0 < stats["clip_fraction"] < 1


# ----------------------------------------------------------------------------- GSPO and GRPO
@pytest.mark.parametrize("token_level", [False, True], ids=["gspo", "gspo_token"])
@pytest.mark.parametrize("beta", [0.0, 0.04])
def test_gspo_equals_grpo_on_one_token_completions(beta, token_level):
    """|y_i| = 1: the geometric mean of one token ratio is that ratio, s_i = w_i1, and 1/|y_i| = 1, so GSPO's loss is
    GRPO's when the clip ranges are equal; the KL terms (k3 per token, averaged per completion) are the same in both
    at equal beta. Padding columns (T = 3) change nothing."""
    batch = make_batch([1, 1, 1, 1], width=3)
    grpo_loss, grpo_grad, stats = loss_and_grad(grpo, batch, clip_eps=CLIP, beta=beta)
    gspo_loss, gspo_grad, _ = loss_and_grad(gspo, batch, clip_eps_low=CLIP, clip_eps_high=CLIP, beta=beta,
                                            token_level=token_level)
    assert_clipping_exercised(stats)
    assert_close(gspo_loss, grpo_loss)
    assert_close(gspo_grad, grpo_grad)


@pytest.mark.parametrize("lengths, gspo_args", [
    ([2, 3, 1, 2], dict(clip_eps_low=CLIP, clip_eps_high=CLIP)),  # longer completions: s_i is no token's ratio
    ([1, 1, 1, 1], {}),  # one token each, but GSPO's default clip range, [1 - 3e-4, 1 + 4e-4]
], ids=["longer_completions", "gspo_default_clip_range"])
def test_gspo_differs_from_grpo_off_policy_outside_those_conditions(lengths, gspo_args):
    batch = make_batch(lengths)
    grpo_loss, grpo_grad, _ = loss_and_grad(grpo, batch, clip_eps=CLIP, beta=0.0)
    gspo_loss, gspo_grad, _ = loss_and_grad(gspo, batch, beta=0.0, **gspo_args)
    assert_differ(gspo_loss, grpo_loss)
    assert_differ(gspo_grad, grpo_grad)


@pytest.mark.parametrize("token_level", [False, True], ids=["gspo", "gspo_token"])
@pytest.mark.parametrize("beta", [0.0, 0.04])
def test_gspo_equals_grpo_on_policy_for_any_lengths(beta, token_level):
    """pi_old = pi_theta (detached): every ratio is 1, inside any clip range (GSPO's default one here). GRPO's
    gradient on token t of o_i is -A_i / (G |o_i|); GSPO's is -A_i s_i d(mean_t log w_it)/d log p_it, the same
    -A_i / (G |o_i|): the sequence-level averaging gives exactly GRPO's per-completion 1/|o_i|. The losses are both
    -mean_i A_i (+ the same KL term)."""
    batch = make_batch([3, 1, 5, 2], width=6)
    grpo_loss, grpo_grad, _ = loss_and_grad(grpo, batch, on_policy=True, clip_eps=CLIP, beta=beta)
    gspo_loss, gspo_grad, _ = loss_and_grad(gspo, batch, on_policy=True, beta=beta, token_level=token_level)
    assert_close(gspo_loss, grpo_loss)
    assert_close(gspo_grad, grpo_grad)


# ----------------------------------------------------------------------------- DAPO and GRPO
def dapo_args(beta: float) -> dict:
    """DAPO's loss with GRPO's symmetric clip range. Dynamic sampling (which groups are trained on) and the overlong
    penalty (a reward) act outside compute_policy_loss; they are switched off only to state the condition."""
    return dict(clip_eps_low=CLIP, clip_eps_high=CLIP, beta=beta, dynamic_sampling=False, overlong_penalty=0.0)


@pytest.mark.parametrize("beta", [0.0, 0.04])
def test_dapo_equals_grpo_when_completions_have_equal_lengths(beta):
    """|o_i| = L for every i: DAPO's 1/sum_i |o_i| = 1/(G L) is GRPO's 1/G * 1/|o_i|, so the token-level and the
    per-completion averages coincide, clipped ratios and the KL term (equal beta) included."""
    batch = make_batch([3, 3, 3, 3], width=5)
    grpo_loss, grpo_grad, stats = loss_and_grad(grpo, batch, clip_eps=CLIP, beta=beta)
    dapo_loss, dapo_grad, _ = loss_and_grad(dapo, batch, **dapo_args(beta))
    assert_clipping_exercised(stats)
    assert_close(dapo_loss, grpo_loss)
    assert_close(dapo_grad, grpo_grad)


@pytest.mark.parametrize("lengths", [(200, 10), (3, 1, 5, 2)], ids=["article_200_and_10", "four_lengths"])
def test_dapo_weighs_every_token_equally_grpo_every_completion(lengths):
    """The article's example: completions of 200 and 10 tokens. On-policy (every ratio 1, nothing clipped) and
    beta = 0, d loss / d log p_it = -A_i x (the token's weight): GRPO 1/(G |o_i|), 1/400 and 1/20, the short
    completion's tokens 20 times heavier; DAPO 1/sum_j |o_j|, 1/210 for every token. So DAPO's gradient on each token
    is GRPO's times G |o_i| / sum_j |o_j|, and the losses differ: -mean_i A_i against -sum_i |o_i| A_i / sum_j |o_j|."""
    batch = make_batch(lengths)
    A, mask, length = batch.advantages, batch.mask.float(), torch.tensor(lengths, dtype=torch.float)
    G, total = len(lengths), sum(lengths)
    grpo_loss, grpo_grad, _ = loss_and_grad(grpo, batch, on_policy=True, clip_eps=CLIP, beta=0.0)
    dapo_loss, dapo_grad, _ = loss_and_grad(dapo, batch, on_policy=True, **dapo_args(0.0))
    grpo_weight, dapo_weight = 1 / (G * length), torch.full((G,), 1 / total)
    assert_close(grpo_grad, -A[:, None] * grpo_weight[:, None] * mask)
    assert_close(dapo_grad, -A[:, None] * dapo_weight[:, None] * mask)
    real = mask.bool()
    factor = (G * length / total)[:, None].expand_as(mask)  # DAPO's per-token gradient / GRPO's
    assert_close((dapo_grad / grpo_grad)[real], factor[real])
    assert_close(grpo_loss, -A.mean())
    assert_close(dapo_loss, -(A * length).sum() / total)
    assert_differ(dapo_loss, grpo_loss)
    if lengths == (200, 10):
        assert_close(grpo_weight, torch.tensor([1 / 400, 1 / 20]))
        assert_close(dapo_weight, torch.tensor([1 / 210, 1 / 210]))
        assert_close(grpo_weight[1] / grpo_weight[0], torch.tensor(20.0))


# ----------------------------------------------------------------------------- PPO
def ppo_advantages(scores, lengths, lam: float):
    """ppo.py's own step 5 without whitening: per-token rewards with beta = 0 (no KL), GAE with gamma = 1 and
    `lam` on a critic that outputs 0 everywhere. The log-probs are random and still add nothing at beta = 0."""
    batch = make_batch(lengths, width=max(lengths) + 1)
    rewards, non_score = ppo.compute_rewards(scores, batch.logprobs, batch.ref, batch.mask, beta=0.0)
    assert (non_score == 0).all()
    values = torch.zeros_like(rewards)
    advantages, returns = ppo.compute_gae(rewards, values, batch.mask, gamma=1.0, lam=lam)
    assert_close(returns, advantages)  # R_t = A_t + V_t, V = 0
    return advantages, batch


@pytest.mark.parametrize("lam", [1.0, 0.95])
def test_ppo_gae_with_gamma_and_lam_1_zero_critic_no_kl_gives_every_token_the_score(lam):
    """The only reward is the score on the last token and V = 0, so delta_t = r_t and A_t = sum_k (gamma lam)^k
    r_t+k = lam^(|o_i| - 1 - t) x score_i: with lam = 1 every token of o_i gets score_i, as GRPO gives every token
    A_i; with PPO's default lam = 0.95 the earlier tokens get less (the negative control)."""
    scores, lengths = torch.tensor([1.0, 0.0, 1.2, -0.4]), [3, 1, 4, 2]
    advantages, batch = ppo_advantages(scores, lengths, lam)
    steps_to_end = (torch.tensor(lengths)[:, None] - 1 - torch.arange(batch.mask.shape[1])).clamp(min=0)
    assert_close(advantages, scores[:, None] * lam**steps_to_end * batch.mask)
    if lam == 1.0:
        assert_close(advantages, scores[:, None] * batch.mask)
    else:
        assert_differ(advantages, scores[:, None] * batch.mask)


def test_ppo_whitened_advantages_stay_per_completion_and_its_loss_is_dapos():
    """ppo.py always whitens the advantages (no flag): with the conditions above, (score_i - mu) / sigma, mu and
    sigma over the batch's tokens (a completion counts |o_i| times), still one advantage per completion. PPO's
    policy loss is a token mean like DAPO's, so with equal symmetric clip ranges it is DAPO's loss (beta = 0)
    with A_i = that whitened score: GRPO-style sequence advantages, but a token-weighted batch baseline instead of
    the group mean and std."""
    scores, lengths = torch.tensor([1.0, 0.0, 1.2, -0.4]), [3, 1, 4, 2]
    advantages, batch = ppo_advantages(scores, lengths, 1.0)
    whitened = ppo.whiten(advantages, batch.mask)
    length = torch.tensor(lengths, dtype=torch.float)
    mu = (scores * length).sum() / length.sum()
    sigma = ((scores - mu) ** 2 * length).sum().div(length.sum()).sqrt()
    per_completion = (scores - mu) / sigma
    assert_close(whitened, per_completion[:, None] * batch.mask)
    ppo_loss, ppo_grad, stats = loss_and_grad(ppo, batch._replace(advantages=whitened), clip_eps=CLIP, beta=0.0)
    dapo_loss, dapo_grad, _ = loss_and_grad(dapo, batch._replace(advantages=per_completion), **dapo_args(0.0))
    assert_clipping_exercised(stats)
    assert_close(ppo_loss, dapo_loss)
    assert_close(ppo_grad, dapo_grad)
