"""A run you can follow, in each script: a line per step with where the run is and when it ends (the one progress
display), no interleaved bars of transformers', a summary at the end, --steps 0 to evaluate alone, a
completions table with prompts and references, --track, and the system prompt reaching the prompts."""

import fcntl
import glob
import os
import pty
import re
import struct
import subprocess
import sys
import termios

import pytest
import rewards
import tyro
from conftest import FIRST_FAST, MODULES, OWN_ARGS, ScriptedRewards, read_run, run_script
from test_runs import TINY

import grpo


def tiny_run(module, tiny_model, copy_task, *argv) -> list[str]:
    return ["--model", tiny_model, "--task", copy_task, *TINY, "--output-dir", "ckpt",
            *OWN_ARGS.get(module.__name__, []), *argv]


@pytest.mark.parametrize("module", FIRST_FAST)
def test_each_step_says_where_the_run_is_what_it_learns_and_when_it_ends(module, tiny_model, copy_task, tmp_path):
    result = run_script(module, *tiny_run(module, tiny_model, copy_task, "--steps", "2", "--eval-every", "2"),
                        cwd=str(tmp_path))
    assert result.returncode == 0
    lines = result.stdout.splitlines()
    assert re.search(r"^step 0/2: held-out greedy accuracy \d\.\d{3} on 8 prompts$", result.stdout, re.M)
    first = next(line for line in lines if line.startswith("step 1/2: "))
    assert re.fullmatch(r"step 1/2: reward \d\.\d{3}(, policy loss -?\d\.\d{4})?(, kl \S+)?, \d+\.\d s, ETA \d+ s",
                        first), first
    last = next(line for line in lines if line.startswith("step 2/2: "))
    assert re.search(r"reward \d\.\d{3}, held-out accuracy \d\.\d{3}", last) and "ETA" not in last
    # the summary: steps and time, reward first -> last, accuracy before -> after, the checkpoint
    (run_dir,) = glob.glob(str(tmp_path / "ckpt" / "*"))
    summary = result.stdout[result.stdout.index("finished step 2: 2 steps in "):]
    assert re.search(r"reward \(sampled\): \d\.\d{3} at step 1 -> \d\.\d{3} at step 2", summary)
    assert "held-out greedy accuracy: " in summary and "before training -> " in summary
    assert f"checkpoint: ckpt/{os.path.basename(run_dir)}/step_2" in summary


def test_a_finished_run_resumed_has_nothing_left_to_do(tiny_model, copy_task, tmp_path):
    run_script(grpo, *tiny_run(grpo, tiny_model, copy_task, "--steps", "1", "--eval-every", "0"), cwd=str(tmp_path))
    (run_dir,) = glob.glob(str(tmp_path / "ckpt" / "*"))
    result = run_script(grpo, "--resume", os.path.join(run_dir, "latest"), cwd=str(tmp_path))
    assert result.returncode == 0
    assert "nothing left to do: the run finished its 1 steps" in result.stdout
    assert "saved" not in result.stdout and "finished step" not in result.stdout


def run_in_terminal(argv: list[str], cwd) -> str:
    """The script's output through a pseudo-terminal of 24 x 100 characters, as a user at a terminal sees it."""
    leader, follower = pty.openpty()
    fcntl.ioctl(follower, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 100, 0, 0))  # rows, columns
    process = subprocess.Popen([sys.executable, *argv], cwd=cwd, stdin=follower, stdout=follower, stderr=follower)
    os.close(follower)
    output = b""
    while True:
        try:
            chunk = os.read(leader, 65536)
        except OSError:  # the other end closed: the process is done
            break
        if not chunk:
            break
        output += chunk
    process.wait()
    os.close(leader)
    assert process.returncode == 0, output.decode(errors="replace")[-2000:]
    return output.decode(errors="replace")


def test_plain_lines_at_a_terminal_and_in_a_file(tiny_model, copy_task, tmp_path):
    """The step lines are the progress display, at a terminal as in a file or a pipe: no bar redrawn in place, and
    transformers' own bars (loading weights, writing the checkpoint's shards) never break into the run's lines."""
    argv = [grpo.__file__, *tiny_run(grpo, tiny_model, copy_task, "--steps", "2", "--eval-every", "2",
                                     "--save-every", "1")]
    terminal = run_in_terminal(argv, tmp_path)
    piped = subprocess.run([sys.executable, *argv], cwd=tmp_path, capture_output=True, text=True)
    assert piped.returncode == 0
    for output in (terminal, piped.stdout + piped.stderr):
        assert "Writing model shards" not in output and "Loading weights" not in output
        assert "\r" not in output.replace("\r\n", "\n") and re.search(r"^step 2/2: reward", output, re.M)


@pytest.mark.parametrize("module", FIRST_FAST)
def test_steps_0_evaluates_the_model_and_exits(module, tiny_model, copy_task, tmp_path):
    result = run_script(module, *tiny_run(module, tiny_model, copy_task, "--steps", "0"), cwd=str(tmp_path))
    assert result.returncode == 0
    assert re.search(r"evaluation only \(--steps 0\): held-out greedy accuracy \d\.\d{3}", result.stdout)
    assert [step for step, _ in read_run(str(tmp_path))[0]["charts/eval_accuracy"]] == [0]
    assert not os.path.exists(tmp_path / "ckpt")  # nothing trained, nothing saved
    nothing = run_script(module, *tiny_run(module, tiny_model, copy_task, "--steps", "0", "--eval-every", "0"),
                         cwd=str(tmp_path))
    assert nothing.returncode != 0 and "error: --steps 0 only evaluates the model" in nothing.stderr


def test_steps_0_evaluates_a_checkpoint_and_a_lora_runs_merged_model(tiny_model, copy_task, tmp_path):
    run_script(grpo, *tiny_run(grpo, tiny_model, copy_task, "--steps", "1", "--eval-every", "1", "--lora-rank", "2"),
               cwd=str(tmp_path))
    (checkpoint,) = glob.glob(str(tmp_path / "ckpt" / "*" / "step_1"))
    (tmp_path / "again").mkdir()
    trained = run_script(grpo, "--model", os.path.join(checkpoint, "merged"), "--task", copy_task, "--steps", "0",
                         "--eval-prompts", "8", "--max-new-tokens", "4", cwd=str(tmp_path / "again"))
    assert trained.returncode == 0 and "evaluation only (--steps 0)" in trained.stdout


@pytest.mark.parametrize("module", MODULES)
def test_the_completions_table_shows_prompt_reference_completion_and_reward_of_several_groups(
        module, tiny_model, copy_task, tmp_path, monkeypatch):
    """A task of 90 distinct prompts (10 to 99, each its own answer): the four rows hold four prompts."""
    task = tmp_path / "distinct.jsonl"
    task.write_text("".join(f'{{"prompt": "{n}", "answer": "{n}"}}\n' for n in range(10, 100)))
    monkeypatch.setattr(module.rewards, "score", ScriptedRewards([[1, 0, 0, 1] * 4]))
    monkeypatch.chdir(tmp_path)
    module.main(tyro.cli(module.Args, args=tiny_run(module, tiny_model, str(task), "--steps", "1", "--eval-every",
                                                       "0", "--log-completions-every", "1")))
    (table,) = read_run(str(tmp_path))[1]["completions/text_summary"]
    header, _, *rows = table.splitlines()
    assert header == "|prompt|answer|completion|reward|" and len(rows) == 4
    cells = [row.split("|")[1:-1] for row in rows]
    assert len({cell[0] for cell in cells}) == 4  # each row another group's
    assert all(cell[1] == cell[0] for cell in cells)  # each prompt beside its own reference answer
    assert all(re.fullmatch(r"\d\.\d\d", cell[3]) for cell in cells)


def test_track_without_wandb_is_one_line_before_the_model_loads(tiny_model, copy_task, monkeypatch):
    find_spec = grpo.importlib.util.find_spec
    monkeypatch.setattr(grpo.importlib.util, "find_spec", lambda name: None if name == "wandb" else find_spec(name))
    monkeypatch.setattr(grpo, "load_model", lambda *args: pytest.fail("the model loaded"))
    with pytest.raises(SystemExit, match="error: --track logs to Weights & Biases: pip install wandb"):
        grpo.main(tyro.cli(grpo.Args, args=tiny_run(grpo, tiny_model, copy_task, "--track")))


@pytest.mark.slow
def test_track_logs_the_scalars_tensorboard_logs(tiny_model, copy_task, tmp_path):
    """W&B offline (no account): its run holds the TensorBoard run's scalars, every one of them."""
    pytest.importorskip("wandb")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    argv = [grpo.__file__, *tiny_run(grpo, tiny_model, copy_task, "--steps", "2", "--eval-every", "1", "--track")]
    env = {**os.environ, "WANDB_MODE": "offline", "WANDB_DIR": str(tmp_path), "WANDB_SILENT": "true"}
    result = subprocess.run([sys.executable, *argv], cwd=tmp_path, capture_output=True, text=True, env=env,
                            timeout=600)
    assert result.returncode == 0, result.stderr[-2000:]
    (mirrored,) = glob.glob(str(tmp_path / "wandb" / "offline-run-*" / "files" / "runs" / "*"))
    scalars = []
    for folder in (glob.glob(str(tmp_path / "runs" / "*"))[0], mirrored):
        events = EventAccumulator(folder)
        events.Reload()
        scalars.append({tag: [(e.step, e.value) for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]})
    assert len(scalars[0]) > 20 and scalars[1] == scalars[0]


def test_the_system_prompt_reaches_every_prompt(tiny_model, copy_task, tmp_path, monkeypatch):
    """--system-prompt TEXT is put before every prompt (the tiny tokenizer has no chat template: as text); auto gives
    none for a file task, and reasoning-gym's default for its tasks."""
    encode, seen = rewards.encode_prompts, []

    def recording_encode(tokenizer, records, max_tokens, system_prompt=None):
        seen.append(system_prompt)
        return encode(tokenizer, records, max_tokens, system_prompt)

    monkeypatch.setattr(grpo.rewards, "encode_prompts", recording_encode)
    monkeypatch.chdir(tmp_path)
    for value in ["auto", "0 0"]:  # (the tiny tokenizer knows only digits, + - = ? a b and the space)
        grpo.main(tyro.cli(grpo.Args, args=tiny_run(grpo, tiny_model, copy_task, "--steps", "1", "--eval-every", "0",
                                                     "--system-prompt", value, "--output-dir", f"ckpt{len(seen)}")))
    assert seen == [None, "0 0"]
    pytest.importorskip("reasoning_gym")  # an optional extra (requirements.txt): its prompts only with it
    reasoning_gym = rewards.resolve_system_prompt("auto", "reasoning_gym:chain_sum")
    assert "<answer>" in reasoning_gym and reasoning_gym == rewards.resolve_system_prompt("default", "arithmetic")
