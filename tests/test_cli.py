"""Each script's command line, through its real entry point as a user runs it: --help, and bad input that fails in
one `error:` line before a model is loaded."""

import glob
import json
import os
import re
import shlex
import shutil

import pytest
import tyro
from conftest import FIRST_FAST, MODULES, run_script

import dapo
import grpo
import gspo
import ppo
import rewards


@pytest.mark.parametrize("module", FIRST_FAST)
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
    (["--model", "no-such-org/no-such-model"], "couldn't connect to 'https://huggingface.co'"),
    (["--resume", "nowhere"], "not a checkpoint"), (["--learning-rate", "-1"], "--learning-rate"),
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
# Each run costs about 4 s, nearly all of it importing torch and transformers: the default run sends every bad input
# to `main` in-process, the slow run sends each to every script's command line, as a user would. A Hub id that
# cannot be fetched fails as load_model tries it, offline at once only where HF_HUB_OFFLINE is set before the
# import: the default run sends it to grpo.py's command line.
HUB = (["--model", "no-such-org/no-such-model"], "couldn't connect to 'https://huggingface.co'")
BAD_INPUTS = [pytest.param(m, a, text, marks=() if (m, (a, text)) == (grpo, HUB) else pytest.mark.slow)
              for m in MODULES for a, text in SHARED_BAD_INPUTS] + [
              pytest.param(*bad, marks=pytest.mark.slow) for bad in OWN_BAD_INPUTS]
IN_PROCESS = [(grpo, a, text) for a, text in SHARED_BAD_INPUTS if (a, text) != HUB] + OWN_BAD_INPUTS


def write_bad_files(folder) -> None:
    for name, content in {**BAD_FILES, **MORE_BAD_FILES}.items():
        (folder / name).parent.mkdir(exist_ok=True)
        (folder / name).write_bytes(content.encode() if isinstance(content, str) else content)


@pytest.mark.parametrize("module, argv, message", BAD_INPUTS)
def test_bad_input_fails_in_one_line_before_loading_a_model(module, argv, message, tmp_path, monkeypatch):
    write_bad_files(tmp_path)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # no network here either way; offline mode fails without retrying
    result = run_script(module, *argv, cwd=str(tmp_path))
    assert result.returncode != 0 and "error: " in result.stderr and message in result.stderr
    assert "Traceback" not in result.stderr and len(result.stderr.strip().splitlines()) == 1
    assert "Loading weights" not in result.stderr and not os.path.exists(tmp_path / "runs")


MORE_BAD_INPUTS = [
    (["--temperature", "inf"], "--temperature must be in [0.01, inf)"),
    (["--temperature", "1e-8"], "--temperature must be in [0.01, inf)"),
    (["--reward-weights.correctness", "nan"], "--reward-weights must be >= 0 and finite"),
    (["--reward-weights.correctness", "inf"], "--reward-weights must be >= 0 and finite"),
    (["--reward-weights.format", "-1"], "--reward-weights must be >= 0 and finite"),
    (["--reward-weights.correctness", "0", "--reward-weights.format", "0"], "and not all 0"),
    (["--beta", "inf"], "--beta must be finite"), (["--lora-alpha", "inf"], "--lora-alpha must be > 0 and finite"),
    (["--timeout-minutes", "0"], "--timeout-minutes must be > 0"),
    (["--model", "./no_tokenizer"], "no tokenizer in the folder (none of tokenizer.json"),
    (["--task", "empty_prompt.jsonl"], "empty_prompt.jsonl: line 2: the prompt ('prompt') is \"\": it must be"),
    (["--task", "null_answer.jsonl"], "null_answer.jsonl: line 1: the answer ('answer') is null: it must be text"),
    (["--task", "list_answer.jsonl"], "list_answer.jsonl: line 1: the answer ('answer') is [1, 2]: it must be"),
    (["--task", "latin1.jsonl"], "latin1.jsonl: line 2 is not UTF-8 text (byte 16: b'\\xe9')"),
    (["--task", "task.json"], "task.json: a .json file; tasks are read from .jsonl files"),
    (["--output-dir", "task.json"], "task.json is a file"),
    (["--task", "chat_no_role.jsonl"], "chat_no_role.jsonl: line 2: message 1 of the prompt ('prompt') has no 'role'"),
    (["--task", "chat_no_content.jsonl"], "line 1: message 2 of the prompt ('prompt') has no 'content' (it has ["),
    (["--task", "chat_text.jsonl"], "line 1: message 1 of the prompt ('prompt') is a str, not an object with a role")]
MORE_BAD_FILES = {"no_tokenizer/config.json": b"{}",
                  "empty_prompt.jsonl": b'{"prompt": "1", "answer": "1"}\n{"prompt": "", "answer": "2"}\n',
                  "null_answer.jsonl": b'{"prompt": "1", "answer": null}\n{"prompt": "2", "answer": "2"}\n',
                  "list_answer.jsonl": b'{"prompt": "1", "answer": [1, 2]}\n{"prompt": "2", "answer": "2"}\n',
                  "latin1.jsonl": b'{"prompt": "1", "answer": "1"}\n{"prompt": "caf\xe9", "answer": "2"}\n',
                  "task.json": b'[{"prompt": "1", "answer": "1"}]',
                  "chat_no_role.jsonl": b'{"prompt": [{"role": "user", "content": "1"}], "answer": "1"}\n'
                                        b'{"prompt": [{"content": "2"}], "answer": "2"}\n',
                  "chat_no_content.jsonl": b'{"prompt": [{"role": "system", "content": "Add."}, {"role": "user", '
                                           b'"text": "1"}], "answer": "1"}\n{"prompt": "2", "answer": "2"}\n',
                  "chat_text.jsonl": b'{"prompt": ["1"], "answer": "1"}\n{"prompt": "2", "answer": "2"}\n'}


@pytest.mark.parametrize("module, argv, message", IN_PROCESS + [(grpo, a, text) for a, text in MORE_BAD_INPUTS])
def test_bad_input_stops_main_in_one_line_before_a_model_loads_and_writes_nothing(module, argv, message, tmp_path,
                                                                                   monkeypatch):
    """In-process (each costs no start-up): `main` stops with one `error:` line before it loads a model, and the
    folder holds only the input files."""
    write_bad_files(tmp_path)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(module, "load_model", lambda *args: pytest.fail("the model loaded"))
    with pytest.raises(SystemExit) as stopped:
        module.main(tyro.cli(module.Args, args=argv))
    assert str(stopped.value).startswith("error: ") and message in str(stopped.value)
    assert "\n" not in str(stopped.value)
    assert sorted(os.listdir(tmp_path)) == sorted({name.split("/")[0] for name in {**BAD_FILES, **MORE_BAD_FILES}})


# A model that cannot take the run, or prompts it cannot take: found from its config and tokenizer (read before its
# weights), or from the folder. conftest's tiny model has 64 positions and no chat template; the copy task's prompts
# are one token each, long.jsonl's 30.
MODEL_BAD_INPUTS = [
    (["--max-new-tokens", "100000"], "the longest prompt plus --max-new-tokens (1 + 100000 tokens) passes the 64 "
                                     "positions of --model ./model: lower --max-new-tokens or --max-prompt-tokens"),
    (["--task", "long.jsonl", "--max-new-tokens", "40"], "the longest prompt plus --max-new-tokens (30 + 40 tokens)"),
    (["--model", "./no_weights"], "--model ./no_weights: no weights in the folder (none of model.safetensors, "),
    (["--model", "./unknown_type"], "--model ./unknown_type: The checkpoint you are trying to load has model type "
                                    "`no_such_type` but Transformers does not recognize this architecture."),
    (["--task", "chat.jsonl"], "prompts given as chat messages need a --model whose tokenizer has a chat template")]


def copy_tiny_model(tiny_model, folder) -> None:
    """conftest's tiny model in folder/model, and two copies a user might have made: without its weights
    (folder/no_weights) and with a model type that transformers does not know (folder/unknown_type)."""
    shutil.copytree(tiny_model, folder / "model")
    shutil.copytree(tiny_model, folder / "no_weights", ignore=shutil.ignore_patterns("*.safetensors"))
    shutil.copytree(tiny_model, folder / "unknown_type")
    config = json.loads((folder / "unknown_type" / "config.json").read_text())
    (folder / "unknown_type" / "config.json").write_text(json.dumps({**config, "model_type": "no_such_type"}))


@pytest.mark.parametrize("argv, message", MODEL_BAD_INPUTS)
def test_a_model_that_cannot_take_the_run_stops_main_in_one_line_before_its_weights_load(argv, message, tiny_model,
                                                                                        tmp_path, monkeypatch):
    copy_tiny_model(tiny_model, tmp_path)
    records = {"copy.jsonl": [("1", "1")] * 20, "long.jsonl": [("1" * 30, "1")] * 20,
               "chat.jsonl": [([{"role": "user", "content": "1"}], "1")] * 20}
    for name, rows in records.items():
        (tmp_path / name).write_text("".join(json.dumps({"prompt": p, "answer": a}) + "\n" for p, a in rows))
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(grpo, "load_model", lambda *args: pytest.fail("the model loaded"))
    with pytest.raises(SystemExit) as stopped:
        grpo.main(tyro.cli(grpo.Args, args=["--model", "./model", "--task", "copy.jsonl", *argv]))
    assert str(stopped.value).startswith("error: ") and message in str(stopped.value)
    assert "\n" not in str(stopped.value) and not os.path.exists(tmp_path / "runs")


class Loading(Exception):
    """Raised in place of loading the model: the run got that far."""


def loading(*args, **kwargs):
    raise Loading


def test_more_prompts_a_step_than_the_task_has_is_one_warning_before_the_model_loads(tiny_model, copy_task, tmp_path,
                                                                                    monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(grpo, "load_model", loading)
    with pytest.raises(Loading):
        grpo.main(tyro.cli(grpo.Args, args=["--model", tiny_model, "--task", copy_task, "--num-prompts", "500"]))
    warnings = [line for line in capsys.readouterr().out.splitlines() if line.startswith("warning: ")]
    assert warnings == [f"warning: --num-prompts 500 is more than the 180 training prompts of --task {copy_task}: "
                        "each step takes each of them about 2.8 times"]


def test_a_long_held_out_prompt_that_is_never_evaluated_does_not_stop_the_run(tiny_model, tmp_path, monkeypatch):
    """The positions check counts the training prompts and the held-out prompts evaluated (the first --eval-prompts),
    none other: the last of 200 prompts, a held-out one of 30 tokens, with 40 new tokens passes the tiny model's 64
    positions only where it is evaluated."""
    rows = [("1", "1")] * 199 + [("1" * 30, "1")]
    (tmp_path / "task.jsonl").write_text("".join(json.dumps({"prompt": p, "answer": a}) + "\n" for p, a in rows))
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(grpo, "load_model", loading)
    argv = ["--model", tiny_model, "--task", "task.jsonl", "--max-new-tokens", "40"]
    for more in (["--eval-every", "0"], ["--eval-prompts", "4"]):
        with pytest.raises(Loading):
            grpo.main(tyro.cli(grpo.Args, args=[*argv, *more]))
    with pytest.raises(SystemExit, match=r"^error: the longest prompt plus --max-new-tokens \(30 \+ 40 tokens\)"):
        grpo.main(tyro.cli(grpo.Args, args=argv))


# the defaults under torchrun: --num-prompts counts the prompts of all processes (as verl's train_batch_size), and by
# default grows with them (each process as many as one process alone, as TRL's per-device sizes)
ONE_PROCESS_PROMPTS = {"grpo": 4, "gspo": 8, "dapo": 4, "ppo": 16}


@pytest.fixture(scope="module")
def arithmetic():
    """The default task, built once (1.5 s each time)."""
    return rewards.load_task("arithmetic")


@pytest.mark.parametrize("module", MODULES)
@pytest.mark.parametrize("world", [1, 2, 4, 8])
def test_torchrun_with_only_a_model_passes_the_argument_checks(module, world, tiny_model, arithmetic, tmp_path,
                                                               monkeypatch):
    """`torchrun --nproc_per_node N script.py --model M`: each process reads WORLD_SIZE as validate does."""
    monkeypatch.setattr(rewards, "load_task", lambda *args: arithmetic)  # the default task, no --task
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("WORLD_SIZE", str(world))
    monkeypatch.setenv("RANK", "0")
    args, _, _ = module.validate(tyro.cli(module.Args, args=["--model", tiny_model]))
    assert args.num_prompts == ONE_PROCESS_PROMPTS[module.__name__] * world


def documented_torchrun_commands() -> list[tuple[str, int, str, list[str]]]:
    """Every `torchrun ... SCRIPT.py ...` command of the README, docs/ and the scripts' docstrings: where it is
    written, its --nnodes, its script and the script's arguments."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    paths = ["README.md", *sorted(glob.glob("docs/*.md", root_dir=root)), *(m.__name__ + ".py" for m in MODULES)]
    commands = []
    for path in paths:
        text = open(os.path.join(root, path)).read().replace("\\\n", " ")
        for launcher, script, argv in re.findall(r"torchrun ([^`\n]*?)\b(\w+)\.py([^`\n]*)", text):
            nodes = re.search(r"--nnodes[ =](\d+)", launcher)
            commands.append((path, int(nodes.group(1)) if nodes else 1, script, shlex.split(argv)))
    return commands


@pytest.mark.parametrize("processes", [2, 4, 8])
def test_the_documented_torchrun_commands_pass_the_argument_checks(processes, arithmetic, tmp_path, monkeypatch):
    """As written, on 2, 4 and 8 processes a node; their Hub task, Hub reward model and prompts.jsonl are not
    fetched here (a built-in task stands in, the reward model is not read)."""
    monkeypatch.setattr(rewards, "load_task", lambda *args: arithmetic)
    monkeypatch.setattr(rewards, "check_reward_model", lambda name: None)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("RANK", "0")
    commands = documented_torchrun_commands()
    assert len(commands) >= 8 and {script for _, _, script, _ in commands} == set(ONE_PROCESS_PROMPTS)
    for path, nodes, script, argv in commands:
        module = {m.__name__: m for m in MODULES}[script]
        monkeypatch.setenv("WORLD_SIZE", str(nodes * processes))
        try:
            module.validate(tyro.cli(module.Args, args=argv))
        except SystemExit as stopped:
            pytest.fail(f"{path}: {script}.py {shlex.join(argv)} on {nodes} x {processes} processes: {stopped}")
