"""docs/fork.md's five forks, built from its diffs applied to today's grpo.py (so the guide cannot go stale), then
checked as the shared tests check the scripts (the clamp at log-ratios of +-100, micro-batch invariance, exact ratios
and KL before any update in bf16, a two-step run through the command line) and on hand-computed numbers: advantages,
the loss on-policy, the loss and its gradient off-policy, and vLLM's samples weighed per token or per sequence."""

import importlib.util
import math
import os
import re
import shutil
import subprocess
import sys

import pytest
import torch
from conftest import ROOT, read_run, run_script
from test_precision import exact, first_step
from test_runs import TINY, check_micro_batch_invariance
from test_shared import check_log_ratios_past_20_are_clamped, shared_text

import grpo

GUIDE = os.path.join(ROOT, "docs", "fork.md")


@pytest.fixture(scope="module", params=["drgrpo", "rloo", "cispo", "gmpo", "sapo"])
def fork(request, tmp_path_factory):
    """The fork's module: grpo.py copied to NAME.py, the guide's diff for it applied with `git apply`."""
    name = request.param
    with open(GUIDE) as f:
        (patch,) = [block for block in re.findall(r"```diff\n(.*?)```", f.read(), re.S)
                    if block.startswith(f"--- a/{name}.py\n")]
    folder = tmp_path_factory.mktemp(name)
    shutil.copy(os.path.join(ROOT, "grpo.py"), folder / f"{name}.py")
    shutil.copy(os.path.join(ROOT, "rewards.py"), folder)  # beside it, as for a user's fork
    (folder / f"{name}.patch").write_text(patch)
    applied = subprocess.run(["git", "apply", f"{name}.patch"], cwd=folder, capture_output=True, text=True)
    assert applied.returncode == 0, f"docs/fork.md's {name} diff no longer applies to grpo.py: {applied.stderr}"
    spec = importlib.util.spec_from_file_location(name, folder / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    previous = sys.modules.get(name)  # a script of the same name at the root, tested as the scripts are
    sys.modules[name] = module  # (a script run in-process looks itself up by name, as `import` would)
    spec.loader.exec_module(module)
    yield module
    del sys.modules[name]
    if previous is not None:
        sys.modules[name] = previous


def test_the_fork_changes_only_the_algorithm(fork):
    """The plumbing and the step's shared functions are grpo.py's, and the diff is the guide's size for each fork: the
    lines `diff` marks < or > (a token-level loss changes a few more in main)."""
    assert shared_text(fork) == shared_text(grpo)
    changed = subprocess.run(["diff", os.path.join(ROOT, "grpo.py"), fork.__file__], capture_output=True, text=True)
    limit = {"drgrpo": 15, "rloo": 11, "cispo": 42, "gmpo": 33, "sapo": 28}[fork.__name__]
    assert 0 < len([line for line in changed.stdout.splitlines() if line[:1] in "<>"]) <= limit


def test_hand_computed_advantages_and_loss(fork):
    """Rewards [1, 0, 0, 1]: Dr. GRPO's advantages [0.5, -0.5, -0.5, 0.5]; RLOO's [2/3, -2/3, -2/3, 2/3] (1 minus
    the mean of the other three, 1/3); CISPO's, GMPO's and SAPO's GRPO's, 0.5 / (std + 1e-4), the sample std
    sqrt(1/3). On-policy, completions of 1 and 3 tokens with advantages 1 and -1, L_max 4: Dr. GRPO's loss
    (-1 * 1 + 1 * 3) / 2 / 4 = 0.25, RLOO's GRPO's per-completion mean, (-1 + 1) / 2 = 0, CISPO's
    -(log 0.5 - log 0.4 - log 0.3 - log 0.2) / 4, every weight 1 and every token weighing 1/4, GMPO's
    (-1 + 1) / 2 = 0 (s_i = 1), SAPO's (-2 / 1 + 2 / 1.05) / 2, its gate f(1) = 2 / tau (tau 1 where A > 0, 1.05
    else)."""
    advantages = fork.compute_advantages(torch.tensor([1.0, 0.0, 0.0, 1.0]), 4)
    grpo = 0.5 / (math.sqrt(1 / 3) + 1e-4)
    expected = {"drgrpo": [0.5, -0.5, -0.5, 0.5], "rloo": [2 / 3, -2 / 3, -2 / 3, 2 / 3],
                "cispo": [grpo, -grpo, -grpo, grpo], "gmpo": [grpo, -grpo, -grpo, grpo],
                "sapo": [grpo, -grpo, -grpo, grpo]}[fork.__name__]
    assert torch.allclose(advantages, torch.tensor(expected))
    logprobs = torch.log(torch.tensor([[0.5, 0.0, 0.0], [0.4, 0.3, 0.2]]).clamp(min=1e-9))
    mask = torch.tensor([[1, 0, 0], [1, 1, 1]])
    args = fork.Args(beta=0.0, max_new_tokens=4)
    loss, _ = fork.compute_policy_loss(logprobs, logprobs.detach(), logprobs.detach(), logprobs.detach(),
                                       torch.tensor([1.0, -1.0]), mask, args)
    cispo = -(math.log(0.5) - math.log(0.4) - math.log(0.3) - math.log(0.2)) / 4
    sapo = (-2 / 1 + 2 / 1.05) / 2
    assert loss.item() == pytest.approx({"drgrpo": 0.25, "rloo": 0.0, "cispo": cispo, "gmpo": 0.0,
                                         "sapo": sapo}[fork.__name__])


def test_off_policy_loss_and_gradient_hand_computed(fork):
    """The check the learning test cannot make (it trains on-policy, where every ratio is 1 and GMPO's and SAPO's
    gradients are GRPO's): ratios w = 1.5 and 0.6 on a completion with A = 1, 1.6, 0.5 and 1.1 on one with A = -1,
    beta 0, the loss and its gradient in log pi worked out here in float64. GRPO's clip, [0.8, 1.2] (Dr. GRPO, RLOO),
    holds 1.5 at 1.2 and 0.5 at 0.8 (A < 0), with no gradient, and leaves 0.6 (A > 0) and 1.6 (A < 0) alone; CISPO
    caps the weights 1.5 and 1.6 at 1.2 and keeps every gradient; GMPO clips log 1.5 and log 0.5 to +-0.4 (no
    gradient), not log 0.6 nor log 1.6 (the side that does not matter), and weighs each completion by s_i, the
    geometric mean of its clipped ratios, each other token's gradient s_i A_i / |o_i| / G; SAPO's gate
    f(w) = sigmoid(tau (w - 1)) 4 / tau (tau 1, then 1.05) clips nothing: each token's gradient is
    f'(w) w A_i / |o_i| / G, f'(w) = 4 sigmoid (1 - sigmoid)."""
    p = [[0.6, 0.3, 1.0], [0.8, 0.25, 0.55]]  # pi_theta; the first completion's third token is padding
    w = [[1.5, 0.6, 1.0], [1.6, 0.5, 1.1]]  # pi_theta / pi_old
    logprobs = torch.tensor(p).log().requires_grad_(True)
    old = (torch.tensor(p) / torch.tensor(w)).log()
    mask = torch.tensor([[1, 1, 0], [1, 1, 1]])
    loss, _ = fork.compute_policy_loss(logprobs, old, old, old, torch.tensor([1.0, -1.0]), mask,
                                       fork.Args(beta=0.0, max_new_tokens=4))
    (grad,) = torch.autograd.grad(loss, logprobs)
    # per token, -min(w A, clip(w) A): -1.2 and -0.6, then 1.6, 0.8 and 1.1; the gradient -w A where not clipped
    drgrpo = ((-1.2 - 0.6) + (1.6 + 0.8 + 1.1)) / 2 / 4, [[0, -0.6 / 8, 0], [1.6 / 8, 0, 1.1 / 8]]
    rloo = ((-1.2 - 0.6) / 2 + (1.6 + 0.8 + 1.1) / 3) / 2, [[0, -0.6 / 4, 0], [1.6 / 6, 0, 1.1 / 6]]
    # per token, -sg(min(w, 1.2)) A log pi, over the 5 tokens
    weighed = 1.2 * math.log(0.6) + 0.6 * math.log(0.3) - 1.2 * math.log(0.8) - 0.5 * math.log(0.25)
    cispo = -(weighed - 1.1 * math.log(0.55)) / 5, [[-1.2 / 5, -0.6 / 5, 0], [1.2 / 5, 0.5 / 5, 1.1 / 5]]
    # A = 1: min(log w, clip(log w)); A = -1: max(log w, clip(log w))
    s1 = math.exp((min(math.log(1.5), 0.4) + min(math.log(0.6), -0.4)) / 2)
    s2 = math.exp((max(math.log(1.6), 0.4) + max(math.log(0.5), -0.4) + math.log(1.1)) / 3)
    gmpo = (-s1 + s2) / 2, [[0, -s1 / 2 / 2, 0], [s2 / 3 / 2, 0, s2 / 3 / 2]]

    def gate(w, tau):  # f(w), and f'(w) w: the gradient's weight in log pi
        sigmoid = 1 / (1 + math.exp(-tau * (w - 1)))
        return sigmoid * 4 / tau, 4 * sigmoid * (1 - sigmoid) * w

    first = [gate(x, 1.0) for x in w[0][:2]]
    second = [gate(x, 1.05) for x in w[1]]
    sapo_loss = (-sum(f for f, _ in first) / 2 + sum(f for f, _ in second) / 3) / 2
    sapo = sapo_loss, [[-first[0][1] / 4, -first[1][1] / 4, 0], [g / 6 for _, g in second]]
    cases = {"drgrpo": drgrpo, "rloo": rloo, "cispo": cispo, "gmpo": gmpo, "sapo": sapo}
    expected, expected_grad = cases[fork.__name__]
    assert loss.item() == pytest.approx(expected, rel=1e-5)
    assert grad.tolist() == [pytest.approx(row, rel=1e-5, abs=1e-7) for row in expected_grad]


def test_vllm_samples_are_weighed_per_token_or_per_sequence_as_the_loss(fork):
    """--sampler vllm with the sampler's log-probs given (compute_policy_loss called directly: no vLLM needed):
    pi_old / pi_sampler = 0.5 and 3 on one completion's two tokens, on-policy, A = 1, --tis-cap 2. A loss with a term
    per token weighs each by its own truncated weight, 0.5 and min(3, 2) = 2, half the tokens truncated (Dr. GRPO's
    sum over L_max 4, RLOO's mean, CISPO's -w log pi, SAPO's gate f(1) = 2); GMPO's one term per sequence is weighed
    once, by the geometric mean sqrt(0.5 x 3) = 1.22 (as gspo.py weighs), below the cap: nothing truncated."""
    old = torch.tensor([[0.5, 0.6]]).log()
    sampler = torch.tensor([[1.0, 0.2]]).log()
    args = fork.Args(beta=0.0, max_new_tokens=4, sampler="vllm", tis_cap=2.0)
    loss, stats = fork.compute_policy_loss(old.clone(), old, old, sampler, torch.tensor([1.0]), torch.ones(1, 2), args)
    cispo = -(0.5 * math.log(0.5) + 2 * math.log(0.6)) / 2
    expected = {"drgrpo": (-(0.5 + 2) / 4, 0.5), "rloo": (-(0.5 + 2) / 2, 0.5), "cispo": (cispo, 0.5),
                "gmpo": (-math.sqrt(1.5), 0.0), "sapo": (-(0.5 * 2 + 2 * 2) / 2, 0.5)}[fork.__name__]
    assert (loss.item(), stats["tis_truncated_fraction"]) == pytest.approx(expected)


def test_log_ratios_past_20_are_clamped_before_exp_so_the_loss_stays_finite(fork):
    check_log_ratios_past_20_are_clamped(fork)


def test_micro_batching_changes_neither_the_update_nor_the_logged_statistics(fork, tiny_model, copy_task, tmp_path,
                                                                             monkeypatch):
    check_micro_batch_invariance(fork, tiny_model, copy_task, tmp_path, monkeypatch)


def test_before_any_update_every_ratio_is_1_and_the_kl_is_0(fork, tiny_model, copy_task, tmp_path, monkeypatch):
    scalars, _ = first_step(fork, tiny_model, copy_task, tmp_path, monkeypatch, "--dtype", "bfloat16",
                            "--learning-rate", "1e-30")
    assert {tag: scalars[tag] for tag in exact(fork)} == exact(fork)


def test_two_steps_from_the_command_line(fork, tiny_model, copy_task, tmp_path):
    result = run_script(fork, "--model", tiny_model, "--task", copy_task, "--steps", "2", "--eval-every", "2",
                        "--output-dir", "ckpt", *TINY, cwd=str(tmp_path))
    assert result.returncode == 0
    assert "held-out greedy accuracy:" in result.stdout
    assert [step for step, _ in read_run(str(tmp_path))[0]["charts/reward_mean"]] == [1, 2]
    assert os.listdir(tmp_path / "ckpt")[0].startswith(f"copy__{fork.__name__}__1__")
