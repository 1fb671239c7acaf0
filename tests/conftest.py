"""Shared fixtures: a tiny randomly initialised Llama and a character tokenizer, saved with
save_pretrained and loaded back through `--model` exactly like a user's model; the list of scripts; and the `slow`
mark: tests marked slow (long end-to-end, distributed and real-model runs) run only with RUN_SLOW=1, as in
transformers. `python -m pytest -q` runs the rest; `RUN_SLOW=1 python -m pytest -q -m slow` runs the slow ones."""

import importlib
import json
import os
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest
import torch
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SPECIALS = ["<pad>", "<s>", "</s>", "<unk>"]
CHARS = list("0123456789+-=?ab ")
# the algorithm scripts: every script at the root that defines compute_policy_loss, grpo.py first; a new one (a
# fork, docs/fork.md) is tested as they are, with nothing to register
SCRIPTS = sorted((path.name for path in Path(ROOT).glob("*.py") if "\ndef compute_policy_loss(" in path.read_text()),
                 key=lambda name: (name != "grpo.py", name))
MODULES = [importlib.import_module(script.removesuffix(".py")) for script in SCRIPTS]
# DAPO's overlong buffer (12 tokens by default) must be shorter than --max-new-tokens; the tests generate 2 to 8
# tokens, too few to shape by length, so it is off in them (tests/test_dapo.py checks the penalty itself)
OWN_ARGS = {"dapo": ["--overlong-buffer", "0"]}
# a check of code that is the same text in every script, run as a subprocess (4 s of start-up each): the default run
# checks grpo.py, the slow run the others
FIRST_FAST = [pytest.param(m, marks=[] if m is MODULES[0] else [pytest.mark.slow]) for m in MODULES]
# One thread for the runs in this process: the tiny model gains nothing from two, and on a 2-core machine that other
# work shares, two threads wait on each other (micro-batch invariance and a resumed run, 8 runs: 93 s with two threads,
# 11 s with one, both under that load). The scripts run as subprocesses keep their default.
torch.set_num_threads(1)


def pytest_collection_modifyitems(config, items):
    if os.environ.get("RUN_SLOW", "").lower() in ("1", "true", "yes"):
        return
    skip = pytest.mark.skip(reason="slow: runs with RUN_SLOW=1 (.ci/run runs it)")
    for item in items:
        if "slow" in item.keywords:
            item.add_marker(skip)


def pytest_make_parametrize_id(config, val, argname):
    """A script's module is named by its name in test ids: test_help[grpo]."""
    return val.__name__ if isinstance(val, ModuleType) else None


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> str:
    return save_tiny_model(str(tmp_path_factory.mktemp("tiny_model")))


def save_tiny_model(path: str, hidden_size: int = 64, tied: bool = False) -> str:
    """The tiny Llama (4 heads of hidden_size / 4; its LM head the embedding's weight if tied) and its character
    tokenizer, saved in path."""
    vocab = {token: i for i, token in enumerate(SPECIALS + CHARS)}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Split(Regex("."), "isolated")  # one token per character
    backend.decoder = decoders.Fuse()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="<pad>", bos_token="<s>",
                                        eos_token="</s>", unk_token="<unk>")
    config = LlamaConfig(vocab_size=len(vocab), hidden_size=hidden_size, intermediate_size=2 * hidden_size,
                         num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=64,
                         pad_token_id=0, bos_token_id=1, eos_token_id=2, tie_word_embeddings=tied)
    torch.manual_seed(0)  # the same tiny model in every session
    LlamaForCausalLM(config).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def copy_task(tmp_path_factory) -> str:
    """Toy task: the prompt is a digit, the correct answer is the same digit."""
    path = str(tmp_path_factory.mktemp("data") / "copy.jsonl")
    with open(path, "w") as f:
        for i in range(200):
            f.write(json.dumps({"prompt": f"{i % 10}", "answer": f"{i % 10}"}) + "\n")
    return path


def loss_statistics(module: ModuleType) -> list[str]:
    """The names of the statistics that a script's compute_policy_loss returns (main logs each as losses/NAME), from
    one token on-policy: every loss's (tests/test_runs.py's LOSS_STATISTICS) and its own, such as the clip_fraction of
    a loss that clips. (A (1,) advantage is one completion's, or PPO's one token's.)"""
    one = torch.zeros(1, 1)
    _, stats = module.compute_policy_loss(one, one, one, one, torch.ones(1), torch.ones(1, 1), module.Args())
    return list(stats)


def run_script(module: ModuleType, *argv: str, cwd: str = ROOT, timeout: float = 600,
               env: dict | None = None) -> subprocess.CompletedProcess:
    """Run `python grpo.py argv...` (the script of `module`) in `cwd` (where runs/ is written), as a user would."""
    result = subprocess.run([sys.executable, module.__file__, *argv], capture_output=True, text=True, timeout=timeout,
                            cwd=cwd, env=env)
    if result.returncode != 0:
        print(result.stdout[-3000:], result.stderr[-3000:])
    return result


def read_run(cwd: str) -> tuple[dict[str, list[tuple[int, float]]], dict[str, list[str]]]:
    """The (step, value) scalars and the text summaries of the one TensorBoard run under cwd/runs."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    (run,) = os.listdir(os.path.join(cwd, "runs"))
    events = EventAccumulator(os.path.join(cwd, "runs", run))
    events.Reload()
    scalars = {tag: [(e.step, e.value) for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]}
    texts = {tag: [e.tensor_proto.string_val[0].decode() for e in events.Tensors(tag)]
             for tag in events.Tags()["tensors"]}
    return scalars, texts


class ScriptedRewards:
    """Stands in for a script's `score`: the n-th call returns the n-th list of correctness scores (plus 0.2 times the
    n-th list of format scores, when given), then repeats the last one."""

    def __init__(self, correct: list[list[float]], formats: list[list[float]] | None = None):
        self.correct, self.formats, self.calls = correct, formats, 0

    def __call__(self, completions, answers, task, weights, prompts=None):
        pick = min(self.calls, len(self.correct) - 1)
        parts = {"correctness": torch.tensor(self.correct[pick], dtype=torch.float)}
        if self.formats is not None:
            parts["format"] = torch.tensor(self.formats[pick], dtype=torch.float)
        assert all(len(part) == len(completions) for part in parts.values())
        self.calls += 1
        return parts["correctness"] + 0.2 * parts.get("format", 0.0), parts
