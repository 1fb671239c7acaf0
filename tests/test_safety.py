"""Nothing lost, in each script: a resumed run ends where an uninterrupted one does, checkpoints are written whole
and rotated, SIGINT and SIGTERM stop cleanly, non-finite updates are skipped, a reward function that raises costs
one completion its score, and a cut prompt is reported."""

import glob
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time

import pytest
import rewards
import torch
import tyro
from conftest import MODULES, OWN_ARGS, ScriptedRewards, read_run
from safetensors.torch import load_file

import grpo

CONTRAST = [[1, 0, 0, 1, 0, 1, 1, 0]]  # scripted correctness: both groups of 4 have contrast (DAPO keeps them)


def small_run(module, tiny_model, copy_task, *argv) -> list[str]:
    """Arguments of a short run of `module` on the toy task: 2 prompts x 4 completions of at most 4 tokens."""
    return ["--model", tiny_model, "--task", copy_task, "--num-prompts", "2", "--group-size", "4", "--max-new-tokens",
            "4", "--eval-prompts", "4", "--output-dir", "ckpt", *OWN_ARGS.get(module.__name__, []), *argv]


def train(module, cwd, argv, monkeypatch) -> None:
    """module.main in `cwd`, with scripted rewards (the same every step, so a resumed run sees what a whole one
    does)."""
    monkeypatch.setattr(module.rewards, "score", ScriptedRewards(CONTRAST))
    monkeypatch.chdir(cwd)
    module.main(tyro.cli(module.Args, args=argv))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("lora", [[], ["--lora-rank", "2", "--beta", "0.1"]], ids=["full", "lora"])
@pytest.mark.parametrize("module", MODULES)
def test_a_resumed_run_ends_with_the_weights_of_an_uninterrupted_one(module, lora, dtype, tiny_model, copy_task,
                                                                      tmp_path, monkeypatch):
    """4 steps in one go, against 2 steps resumed from the step-2 checkpoint: weights (with LoRA: the adapter, and the
    merged model the last checkpoint holds), optimizer state (and PPO's critic) bit-identical on CPU, and TensorBoard
    holds each step once, with the same values; in float32 and in bf16 compute."""
    whole, resumed = tmp_path / "whole", tmp_path / "resumed"
    whole.mkdir()
    argv = small_run(module, tiny_model, copy_task, "--steps", "4", "--save-every", "2", "--keep-checkpoints", "0",
                     "--learning-rate", "1e-3", "--eval-every", "2", "--dtype", dtype, *lora)
    train(module, whole, argv, monkeypatch)
    (run_dir,) = glob.glob(str(whole / "ckpt" / "*"))
    shutil.copytree(whole, resumed)
    shutil.rmtree(resumed / "ckpt" / os.path.basename(run_dir) / "step_4")  # as if stopped after step 2
    (resumed / "ckpt" / os.path.basename(run_dir) / "latest").write_text("step_2")
    # TensorBoard reads a run's event files in the order of their names, which begin with the second each was
    # opened in and end with a counter: a tiny run resumed within the same second could sort before the first
    time.sleep(1)
    train(module, resumed, ["--resume", os.path.join("ckpt", os.path.basename(run_dir), "latest")], monkeypatch)

    checkpoints = [os.path.join(root, "ckpt", os.path.basename(run_dir), "step_4") for root in (whole, resumed)]
    if lora:
        adapters = [load_file(os.path.join(c, "adapter_model.safetensors")) for c in checkpoints]
        assert len(adapters[0]) > 0 and all(torch.equal(adapters[0][k], adapters[1][k]) for k in adapters[0])
    weights = [load_file(os.path.join(c, *(["merged"] if lora else []), "model.safetensors")) for c in checkpoints]
    initial = load_file(os.path.join(tiny_model, "model.safetensors"))
    assert any(not torch.equal(weights[0][k], initial[k]) for k in initial)  # it trained
    assert all(torch.equal(weights[0][k], weights[1][k]) for k in initial)
    states = [torch.load(os.path.join(c, "training_state.pt"), weights_only=True) for c in checkpoints]
    moments = [[t for s in state["optimizer"]["state"].values() for t in s.values()] for state in states]
    assert len(moments[0]) > 0 and all(torch.equal(a, b) for a, b in zip(*moments))
    if module.__name__ == "ppo":
        assert all(torch.equal(states[0]["critic"][k], v) for k, v in states[1]["critic"].items())
    assert states[1]["prompts_taken"] == states[0]["prompts_taken"] == 4 * 2 and states[1]["step"] == 4
    whole_scalars, resumed_scalars = read_run(str(whole))[0], read_run(str(resumed))[0]
    assert [s for s, _ in resumed_scalars["charts/reward_mean"]] == [1, 2, 3, 4]
    assert resumed_scalars["charts/eval_accuracy"] == whole_scalars["charts/eval_accuracy"]
    assert resumed_scalars["losses/policy_loss"] == whole_scalars["losses/policy_loss"]

    latest = os.path.join(run_dir, "latest")  # a run resumes with its own arguments, and only in its own script
    with pytest.raises(SystemExit, match="give no others"):
        module.main(tyro.cli(module.Args, args=["--resume", latest, "--steps", "8"]))
    other = MODULES[(MODULES.index(module) + 1) % len(MODULES)]
    with pytest.raises(SystemExit, match=f"a checkpoint of {module.__name__}.py, not of this script"):
        other.main(tyro.cli(other.Args, args=["--resume", latest]))


def start(argv: list[str], cwd, ready: str) -> subprocess.Popen:
    """Start a script and return once it has printed a line containing `ready`."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
    process = subprocess.Popen([sys.executable, *argv], cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                               text=True, env=env)
    for line in process.stdout:
        if ready in line:
            return process
    raise AssertionError(f"{ready!r} never printed; exit code {process.wait()}")


def stop(process: subprocess.Popen, signum: int) -> tuple[str, int]:
    """Send `signum` once the run is in its training loop; its output and the step it says it stopped after."""
    try:
        process.communicate(timeout=2)  # let it take a few steps (it cannot finish 10000 of them)
    except subprocess.TimeoutExpired:
        pass
    process.send_signal(signum)
    output, _ = process.communicate(timeout=300)
    assert process.returncode == 0, output[-2000:]
    return output, int(re.search(r"stopped after step (\d+)", output).group(1))


@pytest.mark.slow  # two processes per test, each run for seconds
@pytest.mark.parametrize("module, signum", [(m, signal.SIGTERM) for m in MODULES] + [(grpo, signal.SIGINT)],
                         ids=lambda value: getattr(value, "name", None))  # test_...[grpo-SIGINT]
def test_a_signal_stops_after_the_step_saves_and_exits_0_and_the_run_resumes(module, signum, tiny_model, copy_task,
                                                                              tmp_path):
    """SIGTERM (a scheduler's pre-emption) or SIGINT (Ctrl-C): the step finishes, a checkpoint is saved, the command
    that resumes it is printed, exit code 0. That command continues the run, which a second signal stops again."""
    argv = small_run(module, tiny_model, copy_task, "--steps", "10000", "--eval-every", "0", "--save-every", "0")
    output, first = stop(start([module.__file__, *argv], tmp_path, "TensorBoard"), signum)
    (run_dir,) = glob.glob(str(tmp_path / "ckpt" / "*"))
    # nothing else: no temporary folder left
    assert sorted(os.listdir(run_dir)) == ["latest", f"step_{first}"]
    checkpoint = os.path.join(run_dir, f"step_{first}")
    assert os.path.isfile(os.path.join(checkpoint, "training_state.pt"))
    command = shlex.split(re.search(r"resume with: (.*)", output).group(1))
    assert command[0] == "python" and command[2:] == ["--resume", os.path.relpath(checkpoint, tmp_path)]
    output, second = stop(start(command[1:], tmp_path, f"after step {first}"), signal.SIGTERM)
    assert second > first
    steps = [s for s, _ in read_run(str(tmp_path))[0]["charts/reward_mean"]]
    assert steps == list(range(1, second + 1))  # one TensorBoard run, each step once


@pytest.mark.parametrize("module", MODULES)
def test_non_finite_updates_are_skipped_counted_and_stop_the_run_when_they_persist(module, tiny_model, copy_task,
                                                                                  tmp_path, monkeypatch):
    compute_policy_loss = module.compute_policy_loss

    def nan_loss(*args):
        loss, stats = compute_policy_loss(*args)
        return loss * float("nan"), stats

    monkeypatch.setattr(module, "compute_policy_loss", nan_loss)
    (tmp_path / "skipped").mkdir()
    argv = small_run(module, tiny_model, copy_task, "--steps", "2", "--eval-every", "0", "--max-skipped-updates", "100")
    train(module, tmp_path / "skipped", argv, monkeypatch)
    skipped = read_run(str(tmp_path / "skipped"))[0]["charts/skipped_updates"]
    updates_per_step = module.Args().num_minibatches * module.Args().num_iterations
    assert skipped == [(1, updates_per_step), (2, 2 * updates_per_step)]
    (last,) = glob.glob(str(tmp_path / "skipped" / "ckpt" / "*" / "step_2"))
    trained = load_file(os.path.join(last, "model.safetensors"))
    initial = load_file(os.path.join(tiny_model, "model.safetensors"))
    assert all(torch.equal(trained[k], initial[k]) for k in initial)  # no NaN reached the weights

    (tmp_path / "stopped").mkdir()
    argv = small_run(module, tiny_model, copy_task, "--steps", "6", "--eval-every", "0", "--save-every", "1",
                     "--keep-checkpoints", "0")
    with pytest.raises(SystemExit, match=r"error: step (\d+): 3 updates in a row had a non-finite") as stopped:
        train(module, tmp_path / "stopped", argv, monkeypatch)
    failed_step = int(re.search(r"step (\d+)", str(stopped.value)).group(1))
    saved = sorted(int(p.rsplit("_", 1)[1]) for p in glob.glob(str(tmp_path / "stopped" / "ckpt" / "*" / "step_*")))
    assert saved == list(range(1, failed_step))  # the step that failed saved nothing; the earlier ones stay


def test_a_reward_function_that_raises_scores_0_only_where_it_fails():
    def fragile(completions, answers):
        if any("boom" in c for c in completions):
            raise ValueError("boom")
        return [1.0] * len(completions)

    task = rewards.Task(train=[], test=[], correctness=fragile)
    weights = {"correctness": 1.0, "format": 0.5}
    total, parts = rewards.score(["ok", "boom", "\\boxed{3}"], ["1", "1", "3"], task, weights)
    assert parts["correctness"].tolist() == [1.0, 0.0, 1.0]
    assert parts["errors"].tolist() == [0.0, 1.0, 0.0]
    assert total.tolist() == [1.0, 0.0, 1.5]


@pytest.mark.parametrize("module", MODULES)
def test_prompts_longer_than_max_prompt_tokens_are_reported(module, tiny_model, tmp_path, monkeypatch, capsys):
    """10 prompts of one digit and 5 of nine digits; at most 6 tokens per prompt cuts exactly the 5 long ones."""
    data = tmp_path / "long.jsonl"
    data.write_text("".join(f'{{"prompt": "{p}", "answer": "1"}}\n' for p in ["7"] * 10 + ["123456789"] * 5))
    argv = small_run(module, tiny_model, str(data), "--steps", "1", "--eval-every", "0", "--max-prompt-tokens", "6")
    train(module, tmp_path, argv, monkeypatch)
    assert "warning: 5 of 15 prompts are longer than --max-prompt-tokens 6" in capsys.readouterr().out


@pytest.mark.parametrize("module", MODULES)
def test_a_crash_while_saving_leaves_no_checkpoint_that_looks_complete(module, tiny_model, tmp_path, monkeypatch):
    """`save_checkpoint` writes into .tmp-step_N and renames it into place, then points `latest` at it: a crash while
    writing the training state (the process killed: nothing cleans up) leaves the earlier checkpoint the one
    --resume .../latest continues from; the next save of that step starts afresh."""
    tokenizer, model = module.load_model(tiny_model)
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    args = module.Args(keep_checkpoints=1)
    module.save_checkpoint(str(run_dir), model, tokenizer, {"step": 2}, args)

    def crash(*args, **kwargs):  # the process dies in the middle of the write (a failed write is handled)
        raise KeyboardInterrupt("killed")

    save = torch.save
    monkeypatch.setattr(torch, "save", crash)
    with pytest.raises(KeyboardInterrupt, match="killed"):
        module.save_checkpoint(str(run_dir), model, tokenizer, {"step": 4}, args)
    assert sorted(os.listdir(run_dir)) == [".tmp-step_4", "latest", "step_2"]
    (run_dir / "step_6").mkdir()  # a folder without training_state.pt (copied by hand, say) is not complete either
    resumed, loaded = module.resume(module.Args(resume=str(run_dir / "latest")))
    assert resumed.resume == str(run_dir / "step_2") and loaded["step"] == 2
    with pytest.raises(SystemExit, match=r"step_6: not a checkpoint \(no training_state.pt in "):
        module.resume(module.Args(resume=str(run_dir / "step_6")))
    monkeypatch.setattr(torch, "save", save)
    module.save_checkpoint(str(run_dir), model, tokenizer, {"step": 4}, args)
    assert sorted(os.listdir(run_dir)) == ["latest", "step_4", "step_6"]


def test_a_run_resumed_off_the_evaluation_schedule_keeps_to_it(tiny_model, copy_task, tmp_path, monkeypatch):
    """Resumed from step 1 (--eval-every 2: no evaluation there), a run evaluates at steps 2 and 3 (the last) only,
    as the uninterrupted run did; and a checkpoint saved before the data position was a plain count (its `cursor`)
    resumes at the same position."""
    train(grpo, tmp_path, small_run(grpo, tiny_model, copy_task, "--steps", "3", "--eval-every", "2",
                                    "--save-every", "1", "--keep-checkpoints", "0"), monkeypatch)
    (run_dir,) = glob.glob(str(tmp_path / "ckpt" / "*"))
    whole = read_run(str(tmp_path))[0]["charts/eval_accuracy"]
    time.sleep(1)  # (TensorBoard orders a run's event files by the second they were opened in)
    train(grpo, tmp_path, ["--resume", os.path.join(run_dir, "step_1")], monkeypatch)
    assert [s for s, _ in read_run(str(tmp_path))[0]["charts/eval_accuracy"]] == [s for s, _ in whole] == [0, 2, 3]
    state_file = os.path.join(run_dir, "step_1", "training_state.pt")
    state = torch.load(state_file, weights_only=True)
    state["cursor"] = {"prompts_taken": state.pop("prompts_taken")}  # as saved before 2026-12-07
    torch.save(state, state_file)
    assert grpo.resume(grpo.Args(resume=os.path.join(run_dir, "step_1")))[1]["prompts_taken"] == 2


@pytest.mark.parametrize("module", MODULES)
def test_latest_never_names_a_checkpoint_of_an_abandoned_branch(module, tiny_model, copy_task, tmp_path, monkeypatch,
                                                               capsys):
    """4 steps saved, then resumed from step 2 and crashed in step 3: `latest` names step_2, not the old step_4."""
    train(module, tmp_path, small_run(module, tiny_model, copy_task, "--steps", "4", "--eval-every", "0",
                                      "--save-every", "1", "--keep-checkpoints", "0"), monkeypatch)
    (run_dir,) = glob.glob(str(tmp_path / "ckpt" / "*"))

    def crash(*args):
        raise RuntimeError("a crash in step 3")

    monkeypatch.setattr(module.rewards, "score", crash)
    with pytest.raises(RuntimeError, match="a crash in step 3"):
        module.main(tyro.cli(module.Args, args=["--resume", os.path.join(run_dir, "step_2")]))
    latest = os.path.join(run_dir, "latest")
    command = f"python {sys.argv[0]} --resume {os.path.join('ckpt', os.path.basename(run_dir), 'latest')}"
    assert f"crashed; resume with: {command}" in capsys.readouterr().out
    assert os.path.isdir(os.path.join(run_dir, "step_4"))  # still there, but not what --resume .../latest takes
    assert module.resume(module.Args(resume=latest))[0].resume == os.path.join(run_dir, "step_2")


def test_a_run_under_torchrun_prints_the_torchrun_command_that_resumes_it(monkeypatch):
    monkeypatch.setattr(sys, "argv", ["grpo.py"])
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    expected = "torchrun --nproc_per_node=2 --nnodes=1 grpo.py --resume ckpt/step_3"
    assert MODULES[0].resume_command("ckpt/step_3") == expected
    monkeypatch.setenv("WORLD_SIZE", "16")  # two nodes of 8
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    assert MODULES[0].resume_command("x") == "torchrun --nproc_per_node=8 --nnodes=2 grpo.py --resume x"
    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    assert MODULES[0].resume_command("x") == "python grpo.py --resume x"
