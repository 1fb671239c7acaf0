"""docs/fork.md's three forks, built from its diffs applied to today's grpo.py (so the guide cannot go stale), then
checked as the shared tests check the scripts: hand-computed advantages and loss, micro-batch invariance, exact
ratios and KL before any update in bf16, and a two-step run through the command line."""

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

GUIDE = os.path.join(ROOT, "docs", "fork.md")


@pytest.fixture(scope="module", params=["drgrpo", "rloo", "cispo"])
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
    """The plumbing is grpo.py's, and the diff is a few lines (a token-level loss changes a few more in main)."""
    with open(os.path.join(ROOT, "grpo.py")) as f:
        grpo = f.read()
    with open(fork.__file__) as f:
        source = f.read()
    marker = re.compile(r"^# -+ plumbing", re.M)
    assert source[marker.search(source).start():] == grpo[marker.search(grpo).start():]
    changed = subprocess.run(["diff", os.path.join(ROOT, "grpo.py"), fork.__file__], capture_output=True, text=True)
    limit = {"drgrpo": 16, "rloo": 16, "cispo": 45}[fork.__name__]
    assert 0 < len([line for line in changed.stdout.splitlines() if line[:1] in "<>"]) <= limit


def test_hand_computed_advantages_and_loss(fork):
    """Rewards [1, 0, 0, 1]: Dr. GRPO's advantages [0.5, -0.5, -0.5, 0.5]; RLOO's [2/3, -2/3, -2/3, 2/3] (1 minus
    the mean of the other three, 1/3); CISPO's GRPO's, 0.5 / (std + 1e-4), the sample std sqrt(1/3). On-policy,
    completions of 1 and 3 tokens with advantages 1 and -1, L_max 4: Dr. GRPO's loss (-1 * 1 + 1 * 3) / 2 / 4 = 0.25,
    RLOO's GRPO's per-completion mean, (-1 + 1) / 2 = 0, CISPO's -(log 0.5 - log 0.4 - log 0.3 - log 0.2) / 4, every
    weight 1 and every token weighing 1/4."""
    advantages = fork.compute_advantages(torch.tensor([1.0, 0.0, 0.0, 1.0]), 4)
    grpo = 0.5 / (math.sqrt(1 / 3) + 1e-4)
    expected = {"drgrpo": [0.5, -0.5, -0.5, 0.5], "rloo": [2 / 3, -2 / 3, -2 / 3, 2 / 3],
                "cispo": [grpo, -grpo, -grpo, grpo]}[fork.__name__]
    assert torch.allclose(advantages, torch.tensor(expected))
    logprobs = torch.log(torch.tensor([[0.5, 0.0, 0.0], [0.4, 0.3, 0.2]]).clamp(min=1e-9))
    mask = torch.tensor([[1, 0, 0], [1, 1, 1]])
    args = fork.Args(beta=0.0, max_new_tokens=4)
    loss, _ = fork.compute_policy_loss(logprobs, logprobs.detach(), logprobs.detach(), logprobs.detach(),
                                       torch.tensor([1.0, -1.0]), mask, args)
    cispo = -(math.log(0.5) - math.log(0.4) - math.log(0.3) - math.log(0.2)) / 4
    assert loss.item() == pytest.approx({"drgrpo": 0.25, "rloo": 0.0, "cispo": cispo}[fork.__name__])


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
