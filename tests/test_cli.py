"""Each script's command line, through its real entry point as a user runs it: --help, and bad input that fails in
one `error:` line before a model is loaded."""

import os

import pytest
from conftest import MODULES, run_script

import dapo
import grpo
import gspo
import ppo


@pytest.mark.parametrize("module", MODULES)
def test_help(module):
    result = run_script(module, "--help")
    assert result.returncode == 0
    for name in ["--model", "--task", "--num-prompts", "--group-size", "--micro-batch-size", "--num-iterations"]:
        assert name in result.stdout


SHARED_BAD_INPUTS = [
    (["--num-minibatches", "3"], "--num-minibatches must divide"), (["--task", "nonsense"], "not one of"),
    (["--model", "./no/such/model"], "no such file"), (["--task", "missing.jsonl"], "no such file"),
    (["--temperature", "0"], "--temperature"), (["--save-every", "-1"], "--save-every"),
    (["--max-skipped-updates", "0"], "--max-skipped-updates"),
    (["--task", "empty.jsonl"], "found 0 (the file is empty)"),
    (["--task", "broken.jsonl"], "broken.jsonl: line 2 is not valid JSON"),
    (["--task", "no_answer.jsonl"], "no_answer.jsonl: line 3 has no field 'answer'"),
    (["--model", "no-such-org/no-such-model"], "Hugging Face Hub cannot be reached (offline?)"),
    (["--resume", "nowhere"], "no complete checkpoint"), (["--learning-rate", "-1"], "--learning-rate"),
    (["--max-grad-norm", "0"], "--max-grad-norm"), (["--top-p", "1.5"], "--top-p"),
    (["--model", "./adapter"], "a LoRA adapter; continue it with --resume, or train merged/")]
BAD_FILES = {"empty.jsonl": "", "broken.jsonl": '{"prompt": "1", "answer": "1"}\n{"prompt": "2", "answer"\n',
             "no_answer.jsonl": '{"prompt": "1", "answer": "1"}\n\n{"prompt": "2"}\n',
             "adapter/adapter_config.json": "{}"}
OWN_BAD_INPUTS = [
    (grpo, ["--group-size", "1"], "--group-size"), (gspo, ["--group-size", "1"], "--group-size"),
    (dapo, ["--group-size", "1"], "--group-size"), (ppo, ["--group-size", "0"], "--group-size"),
    (dapo, ["--overlong-buffer", "48"], "--overlong-buffer"), (dapo, ["--max-sampling-rounds", "0"], "rounds"),
    (ppo, ["--lam", "1.5"], "--lam"), (ppo, ["--vf-coef", "-1"], "coefficients"),
    (ppo, ["--critic-learning-rate", "-1"], "--critic-learning-rate"), (grpo, ["--clip-eps", "-0.2"], "--clip-eps"),
    (gspo, ["--clip-eps-high", "0"], "clip ranges"), (dapo, ["--clip-eps-low", "-1"], "clip ranges"),
    (grpo, ["--beta", "-1"], "--beta"), (dapo, ["--overlong-penalty", "-1"], "--overlong-penalty")]
# Each run costs about 4 s, nearly all of it importing torch and transformers. The default run sends every bad input
# once: the shared ones to grpo.py, whose checks the other scripts copy line for line; the slow run sends them to
# the other three scripts too.
BAD_INPUTS = [pytest.param(m, a, text, marks=() if m is grpo else pytest.mark.slow)
              for m in MODULES for a, text in SHARED_BAD_INPUTS] + OWN_BAD_INPUTS


@pytest.mark.parametrize("module, argv, message", BAD_INPUTS)
def test_bad_input_fails_in_one_line_before_loading_a_model(module, argv, message, tmp_path, monkeypatch):
    for name, text in BAD_FILES.items():
        (tmp_path / name).parent.mkdir(exist_ok=True)
        (tmp_path / name).write_text(text)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # no network here either way; offline mode fails without retrying
    result = run_script(module, *argv, cwd=str(tmp_path))
    assert result.returncode != 0 and "error: " in result.stderr and message in result.stderr
    assert "Traceback" not in result.stderr and len(result.stderr.strip().splitlines()) == 1
    assert "Loading weights" not in result.stderr and not os.path.exists(tmp_path / "runs")
