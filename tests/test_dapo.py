"""DAPO maths on hand-computed numbers (token-level loss, clip-higher, overlong shaping), micro-batch gradient
equivalence, and dynamic sampling run through main() with a scripted reward."""

import glob
import math

import pytest
import torch
import tyro
from conftest import ScriptedRewards, read_run
from transformers import AutoModelForCausalLM

import dapo


def loss_of(logprobs, old, advantages, mask, sampler=None, **overrides):
    """The loss; given the sampler's log-probs, as vLLM's (--sampler vllm: truncated importance sampling)."""
    args = dapo.Args(**{"sampler": "hf" if sampler is None else "vllm", **overrides})
    sampler = old if sampler is None else sampler
    return dapo.compute_policy_loss(logprobs, old, torch.zeros_like(logprobs), sampler, advantages, mask, args)


def test_every_token_of_200_and_10_token_completions_weighs_1_over_210():
    """The seed's example: GRPO gives the 10-token completion's tokens 20 times the weight; DAPO weighs all 210
    alike."""
    mask = torch.zeros(2, 200)
    mask[0, :200], mask[1, :10] = 1, 1
    logprobs = torch.full((2, 200), -1.0, requires_grad=True)
    loss, _ = loss_of(logprobs, logprobs.detach(), torch.tensor([1.0, 1.0]), mask)
    loss.backward()
    assert torch.allclose(logprobs.grad[mask.bool()], torch.full((210,), -1 / 210))
    assert (logprobs.grad[1, 10:] == 0).all()  # padding gets no gradient
    assert loss.item() == pytest.approx(-1.0)


@pytest.mark.parametrize("clip_eps_high, clipped", [(0.28, False), (0.2, True)])
def test_clip_higher_lets_a_rare_token_rise_from_0_2_to_0_25(clip_eps_high, clipped):
    """The seed's example: pi_old = 0.2, pi_theta = 0.25, A > 0. The ratio 1.25 is inside 1 + 0.28, outside 1 + 0.2."""
    logprobs = torch.log(torch.tensor([[0.25]])).requires_grad_(True)
    old = torch.log(torch.tensor([[0.2]]))
    loss, stats = loss_of(logprobs, old, torch.tensor([1.0]), torch.ones(1, 1), clip_eps_high=clip_eps_high)
    loss.backward()
    if clipped:  # -clip(1.25, 0.8, 1.2) * A: a constant, so no gradient
        assert loss.item() == pytest.approx(-1.2) and logprobs.grad.item() == 0.0
        assert stats["clip_fraction_high"] == 1.0
    else:  # -w A with d w / d logp = w
        assert loss.item() == pytest.approx(-1.25) and logprobs.grad.item() == pytest.approx(-1.25)
        assert stats["clip_fraction_high"] == 0.0
    assert stats["clip_fraction_low"] == 0.0


def test_low_and_high_clip_fractions_are_counted_apart():
    ratios = torch.tensor([[0.7, 0.9, 1.25, 1.3], [0.7, 0.9, 1.25, 1.3]])  # the first row has A > 0, the second A < 0
    _, stats = loss_of(ratios.log(), torch.zeros(2, 4), torch.tensor([1.0, -1.0]), torch.ones(2, 4))
    # A > 0: only 1.3 > 1.28 is clipped; A < 0: only 0.7 < 0.8 is clipped
    assert stats["clip_fraction_high"] == pytest.approx(1 / 8) and stats["clip_fraction_low"] == pytest.approx(1 / 8)
    assert stats["clip_fraction"] == pytest.approx(2 / 8)


def test_overlong_penalty_at_inside_and_beyond_the_buffer():
    # L_max = 20, L_cache = 4: no penalty up to 16 tokens, then -1/4 per token, -1 at 20 and beyond
    lengths = torch.tensor([1, 16, 17, 18, 19, 20, 21, 50])
    expected = [0.0, 0.0, -0.25, -0.5, -0.75, -1.0, -1.0, -1.0]
    assert dapo.overlong_penalty(lengths, 20, 4).tolist() == expected
    assert dapo.overlong_penalty(lengths, 20, 0).tolist() == [0.0] * 6 + [-1.0, -1.0]  # no buffer: only beyond L_max


def test_token_weighted_micro_batches_give_the_gradient_of_the_whole_batch():
    """The classic bug: averaging micro-batch token means with equal (or per-sample) weights is not the token mean
    of the batch. Weighting each micro-batch's loss by its share of the tokens is."""
    torch.manual_seed(0)
    lengths = [9, 1, 2, 7, 3]
    mask = (torch.arange(9)[None] < torch.tensor(lengths)[:, None]).float()  # (5, 9)
    old = torch.randn(5, 9) * 0.1 - 1
    new = (old + torch.randn(5, 9) * 0.2).requires_grad_(True)
    advantages = torch.tensor([1.0, -1.0, 0.5, -0.5, 2.0])

    def gradient(micro_batches, weigh):
        new.grad = None
        for mb in micro_batches:
            loss, _ = loss_of(new[mb], old[mb], advantages[mb], mask[mb])
            (loss * weigh(mb)).backward()
        return new.grad.clone()

    whole = gradient([torch.arange(5)], lambda mb: 1.0)
    micro = [torch.tensor([0, 1]), torch.tensor([2, 3]), torch.tensor([4])]
    by_tokens = gradient(micro, lambda mb: mask[mb].sum() / mask.sum())  # what dapo.main does
    by_samples = gradient(micro, lambda mb: len(mb) / 5)  # what is right for GRPO's per-sequence mean
    assert torch.allclose(by_tokens, whole, atol=1e-7)
    assert not torch.allclose(by_samples, whole, atol=1e-3)


def run_main(tmp_path, monkeypatch, tiny_model, copy_task, rewards, *argv, formats=None):
    """dapo.main with a scripted reward, 2 prompts x 4 completions; returns its scalars, the advantages it trained
    on and the final weights."""
    monkeypatch.setattr(dapo.rewards, "score", ScriptedRewards(rewards, formats))
    trained, compute_policy_loss = [], dapo.compute_policy_loss

    def recording_policy_loss(logprobs, old_logprobs, ref_logprobs, sampler_logprobs, advantages, mask, args):
        trained.append(advantages)  # notes the advantages
        return compute_policy_loss(logprobs, old_logprobs, ref_logprobs, sampler_logprobs, advantages, mask, args)

    monkeypatch.setattr(dapo, "compute_policy_loss", recording_policy_loss)
    monkeypatch.chdir(tmp_path)
    args = ["--model", tiny_model, "--task", copy_task, "--eval-every", "0", "--num-prompts", "2", "--group-size", "4",
            "--max-new-tokens", "4", "--overlong-buffer", "0", "--num-minibatches", "1", "--output-dir", "ckpt", *argv]
    dapo.main(tyro.cli(dapo.Args, args=args))
    scalars, _ = read_run(str(tmp_path))
    (last,) = glob.glob("ckpt/*/step_*")
    return scalars, torch.cat(trained) if trained else torch.zeros(0), AutoModelForCausalLM.from_pretrained(last)


def test_dynamic_sampling_fills_the_batch_with_groups_that_have_contrast(tmp_path, monkeypatch, tiny_model, copy_task):
    rounds = [[1, 1, 1, 1, 0, 1, 0, 0],  # round 1: the first group is all correct (dropped), the second is kept
              [0, 0, 0, 0, 0, 0, 0, 0],  # round 2: nothing to learn from
              [1, 0, 1, 0, 1, 1, 0, 0]]  # round 3: two groups with contrast; the batch needs only one more
    scalars, trained, _ = run_main(tmp_path, monkeypatch, tiny_model, copy_task, rounds, "--steps", "1")
    assert scalars["charts/sampling_rounds"] == [(1, 3.0)]
    assert scalars["charts/kept_groups"] == [(1, 2.0)]
    assert scalars["charts/filtered_fraction"][0][1] == pytest.approx(1 - 2 / 6)
    assert scalars["charts/zero_std_fraction"][0][1] == pytest.approx(3 / 6)  # of everything sampled
    assert scalars["charts/reward_mean"][0][1] == pytest.approx(9 / 24)  # of everything sampled, too
    kept = dapo.compute_advantages(torch.tensor([0.0, 1, 0, 0, 1, 0, 1, 0]), 4)  # the two kept groups
    assert sorted(trained.tolist()) == pytest.approx(sorted(kept.tolist()))


def test_dynamic_sampling_stops_at_its_cap_and_trains_on_nothing_without_contrast(tmp_path, monkeypatch, tiny_model,
                                                                                    copy_task):
    scalars, trained, model = run_main(tmp_path, monkeypatch, tiny_model, copy_task, [[1.0] * 8], "--steps", "2",
                                       "--max-sampling-rounds", "3")
    assert [v for _, v in scalars["charts/sampling_rounds"]] == [3.0, 3.0]
    assert [v for _, v in scalars["charts/kept_groups"]] == [0.0, 0.0]
    assert len(trained) == 0 and "losses/policy_loss" not in scalars
    initial = AutoModelForCausalLM.from_pretrained(tiny_model).state_dict()
    assert all(torch.equal(initial[k], v) for k, v in model.state_dict().items())  # no optimizer step at all


def test_without_dynamic_sampling_every_group_is_trained_on(tmp_path, monkeypatch, tiny_model, copy_task):
    rounds = [[1, 1, 1, 1, 0, 1, 0, 0]]
    scalars, trained, _ = run_main(tmp_path, monkeypatch, tiny_model, copy_task, rounds, "--steps", "1",
                                   "--no-dynamic-sampling")
    assert scalars["charts/sampling_rounds"] == [(1, 1.0)] and scalars["charts/kept_groups"] == [(1, 2.0)]
    assert scalars["charts/filtered_fraction"] == [(1, 0.0)]
    assert len(trained) == 8 and (trained == 0).sum() == 4  # the all-correct group is in the batch, with A = 0


def test_dynamic_sampling_filters_on_correctness_not_on_the_total_reward(tmp_path, monkeypatch, tiny_model, copy_task):
    """DAPO keeps a group when 0 < #correct < G. A format bonus that differs inside an all-correct (or all-wrong)
    group makes the total reward vary, but the group still teaches nothing about correctness."""
    correct = [[1, 1, 1, 1, 0, 0, 0, 0],  # round 1: all correct, then all wrong
               [1, 0, 0, 0, 0, 1, 1, 0]]  # round 2: two groups with contrast
    formats = [[1, 1, 1, 0, 1, 0, 1, 0],  # round 1: the total reward varies inside both groups
               [1, 1, 1, 1, 1, 1, 1, 1]]
    scalars, trained, _ = run_main(tmp_path, monkeypatch, tiny_model, copy_task, correct, "--steps", "1",
                                   formats=formats)
    assert scalars["charts/sampling_rounds"] == [(1, 2.0)] and scalars["charts/kept_groups"] == [(1, 2.0)]
    kept = dapo.compute_advantages(torch.tensor(correct[1], dtype=torch.float) + 0.2, 4)  # round 2's groups only
    assert sorted(trained.tolist()) == pytest.approx(sorted(kept.tolist()))


def test_has_contrast_counts_correct_completions():
    correctness = torch.tensor([1.0, 1, 1, 1, 0, 0, 0, 0, 1, 0, 0, 0, 0, 1, 1, 1])
    assert dapo.has_contrast(correctness, 4).tolist() == [False, False, True, True]


def test_has_contrast_keeps_a_spread_of_partial_credit():
    """A task that gives partial credit: a group with scores 0.5 and 0 teaches something though none is fully
    correct; one whose completions all scored 0.5 does not."""
    correctness = torch.tensor([0.5, 0, 0, 0.5, 0.5, 0.5, 0.5, 0.5, 0.25, 0.75, 1, 1])
    assert dapo.has_contrast(correctness, 4).tolist() == [True, False, True]


def test_the_logged_clip_fraction_is_that_of_the_mini_batchs_tokens():
    """8 completions of 4 tokens, all clipped, and 8 of 40, none clipped, in two micro-batches sorted by length: the
    mini-batch's clip fraction is 32 / 352 = 0.091 of its tokens (a plain mean of the two micro-batches' gave 0.5)."""
    entries = []
    for length, ratio in ((4, 1.5), (40, 1.0)):  # 1.5 > 1 + clip_eps_high with A > 0: clipped
        mask = torch.zeros(8, 40)
        mask[:, :length] = 1
        _, stats = loss_of(torch.full((8, 40), ratio).log(), torch.zeros(8, 40), torch.ones(8), mask)
        entries.append((mask.sum().item(), stats))  # weighted as main weighs DAPO's micro-batches: by their tokens
    assert [s["clip_fraction"] for _, s in entries] == [1.0, 0.0]
    assert dapo.weighted_means(entries)["clip_fraction"] == pytest.approx(32 / 352)


def test_truncated_importance_sampling_hand_computed():
    """pi_old / pi_sampler = 0.5 and 3 on one completion's two tokens and 1 on another's one (A = 1, on-policy): the
    token-level mean of 0.5, min(3, 2) = 2 and 1 is -(0.5 + 2 + 1) / 3; one token of three truncated."""
    old = torch.tensor([[0.5, 0.6], [0.4, 0.0]]).log().nan_to_num(neginf=0.0)
    sampler = torch.tensor([[1.0, 0.2], [0.4, 1.0]]).log()
    mask = torch.tensor([[1, 1], [1, 0]])
    loss, stats = loss_of(old.clone(), old, torch.tensor([1.0, 1.0]), mask, sampler=sampler, tis_cap=2.0)
    assert loss.item() == pytest.approx(-3.5 / 3)
    assert stats["tis_truncated_fraction"] == pytest.approx(1 / 3)


@pytest.mark.parametrize("log_ratio", [100.0, -100.0])
def test_a_log_ratio_of_100_gives_the_clamped_loss_e20_or_1_minus_eps_and_no_gradient(log_ratio):
    """One token, A = -1, old and reference log-probs 0, beta 0.1: the ratio is exp(clamp(log w, -20, 20)) and the k3
    KL's exp is clamped too, so the loss is e^20 (unclipped, since A < 0 and w > 1 + eps_high) or 1 - eps_low (clipped
    at the bottom), plus beta k3, finite where exp(100) would be inf in float32; past the clamp no gradient flows.
    (tests/test_shared.py checks the clamp on every script, without these numbers.)"""
    logprobs = torch.tensor([[log_ratio]], requires_grad=True)
    loss, stats = loss_of(logprobs, torch.zeros(1, 1), torch.tensor([-1.0]), torch.ones(1, 1), beta=0.1)
    (grad,) = torch.autograd.grad(loss, logprobs)
    delta = -20.0 if log_ratio > 0 else 20.0  # log pi_ref - log pi, clamped
    kl = math.exp(delta) - delta - 1
    policy = math.exp(20) if log_ratio > 0 else 1 - dapo.Args().clip_eps_low  # -min(w A, clip(w) A) with A = -1
    assert math.isfinite(loss.item()) and loss.item() == pytest.approx(policy + 0.1 * kl, rel=1e-6)
    assert stats["kl"] == pytest.approx(kl, rel=1e-6)
    assert grad.item() == 0.0


def test_dynamic_sampling_filters_on_a_reward_that_weighs():
    """Groups are kept on correctness where it weighs, else on --reward-model's score where that weighs; with
    neither (a format reward alone), check_args refuses dynamic sampling."""
    def passes(weights: dict, reward_model: str | None = None) -> bool:
        return all(ok for ok, _ in dapo.check_args(dapo.Args(reward_weights=weights, reward_model=reward_model)))

    assert passes({"correctness": 1.0, "format": 0.2})
    assert passes({"correctness": 0.0, "format": 0.0, "reward_model": 1.0}, "rm")
    assert not passes({"correctness": 0.0, "format": 1.0, "reward_model": 0.0}, "rm")
    assert not passes({"correctness": 0.0, "format": 1.0})
