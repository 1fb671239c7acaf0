"""Nothing lost in a sweep, on a damaged disk or with a hung process, in the code the four scripts share: runs started
in the same second get their own folders, a run is continued by one command at a time, a damaged checkpoint is
skipped (or named in one line), a full disk is said so and leaves the last checkpoint valid, and a hung process ends
the run in one line that says at which step."""

import errno
import fcntl
import glob
import json
import os
import subprocess
import sys

import pytest
import safetensors
import torch
import transformers
import tyro
from conftest import MODULES, OWN_ARGS, ROOT, ScriptedRewards, read_run
from test_distributed import batch

import grpo

CONTRAST = [[1, 0, 0, 1, 0, 1, 1, 0]]


def small_run(module, tiny_model, copy_task, *argv) -> list[str]:
    return ["--model", tiny_model, "--task", copy_task, "--num-prompts", "2", "--group-size", "4",
            "--max-new-tokens", "4", "--eval-every", "0", "--output-dir", "ckpt", *OWN_ARGS.get(module.__name__, []),
            *argv]


def train(module, cwd, argv, monkeypatch) -> None:
    monkeypatch.setattr(module.rewards, "score", ScriptedRewards(CONTRAST))
    monkeypatch.chdir(cwd)
    module.main(tyro.cli(module.Args, args=argv))


@pytest.mark.parametrize("module", MODULES)
def test_two_runs_started_in_the_same_second_get_their_own_folders(module, tiny_model, copy_task, tmp_path,
                                                                    monkeypatch):
    """The clock stubbed to stay in one second: two runs of the same seed with different learning rates, one after the
    other in one folder, each keep their own TensorBoard run, arguments and checkpoints."""
    ticks = iter(range(10**6))  # a microsecond a call: every run reads the same second
    monkeypatch.setattr(module.time, "time", lambda: 1_796_515_640.0 + next(ticks) * 1e-6)
    for rate in ["1e-5", "1e-3"]:
        train(module, tmp_path, small_run(module, tiny_model, copy_task, "--steps", "1", "--learning-rate", rate),
              monkeypatch)
    names = sorted(os.listdir(tmp_path / "runs"))
    base = f"copy__{module.__name__}__1__1796515640"
    assert names == [base, f"{base}_2"] and sorted(os.listdir(tmp_path / "ckpt")) == names
    for name, rate in zip(names, [1e-5, 1e-3]):
        with open(tmp_path / "runs" / name / "args.json") as f:
            assert json.load(f)["learning_rate"] == rate
        state = torch.load(tmp_path / "ckpt" / name / "step_1" / "training_state.pt", weights_only=True)
        assert state["args"]["learning_rate"] == rate and state["run_name"] == name


def test_a_run_is_continued_by_one_command_at_a_time_and_a_dead_holder_holds_nothing(tiny_model, copy_task,
                                                                                      tmp_path, monkeypatch):
    train(grpo, tmp_path, small_run(grpo, tiny_model, copy_task, "--steps", "2", "--save-every", "1",
                                    "--keep-checkpoints", "0"), monkeypatch)
    (run_dir,) = glob.glob(str(tmp_path / "ckpt" / "*"))
    resume = ["--resume", os.path.join(run_dir, "step_1")]
    with open(os.path.join(run_dir, ".lock"), "a+") as lock:  # another command holds the run
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        lock.truncate(0)
        lock.write("process 4242 on elsewhere")
        lock.flush()
        with pytest.raises(SystemExit, match="is in use by process 4242 on elsewhere: a run is continued by one"):
            grpo.main(tyro.cli(grpo.Args, args=resume))
    events = glob.glob(str(tmp_path / "runs" / "*" / "events.*"))
    assert len(events) == 1  # the refused command wrote nothing
    # a holder killed outright: the lock went with it
    holder = subprocess.Popen([sys.executable, "-c", "import fcntl, sys, time; f = open(sys.argv[1], 'a+'); "
                               "fcntl.flock(f, fcntl.LOCK_EX); print('held', flush=True); time.sleep(60)",
                               os.path.join(run_dir, ".lock")], stdout=subprocess.PIPE, text=True)
    assert holder.stdout.readline().strip() == "held"
    holder.kill()
    holder.wait()
    grpo.main(tyro.cli(grpo.Args, args=resume))  # goes on


DAMAGE = {
    "truncated training state": lambda c: truncate(os.path.join(c, "training_state.pt")),
    "random training state": lambda c: open(os.path.join(c, "training_state.pt"), "wb").write(os.urandom(1000)),
    "empty training state": lambda c: open(os.path.join(c, "training_state.pt"), "wb").close(),
    "truncated weights": lambda c: truncate(os.path.join(c, "model.safetensors")),
}


def truncate(path: str) -> None:
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) // 2)


@pytest.mark.parametrize("damage", DAMAGE)
def test_a_damaged_checkpoint_is_skipped_for_the_one_before_it_or_named_in_one_line(damage, tiny_model, copy_task,
                                                                                    tmp_path, monkeypatch):
    train(grpo, tmp_path, small_run(grpo, tiny_model, copy_task, "--steps", "2", "--save-every", "1",
                                    "--keep-checkpoints", "0"), monkeypatch)
    (run_dir,) = glob.glob(str(tmp_path / "ckpt" / "*"))
    DAMAGE[damage](os.path.join(run_dir, "step_2"))
    # named itself: one line, before anything loads
    named = r"error: --resume .*step_2: no whole checkpoint to continue from: .*step_2 \("
    with pytest.raises(SystemExit, match=named):
        grpo.resume(grpo.Args(resume=os.path.join(run_dir, "step_2")))
    # latest names it: the one before, said so
    args, state = grpo.resume(grpo.Args(resume=os.path.join(run_dir, "latest")))
    assert args.resume == os.path.join(run_dir, "step_1") and state["step"] == 1
    # nothing before it (as with the default --keep-checkpoints 1): one line
    truncate(os.path.join(run_dir, "step_1", "model.safetensors"))
    with pytest.raises(SystemExit, match="no whole checkpoint to continue from: .*step_2 .*; .*step_1 "
                                         r"\(model.safetensors has \d+ bytes, \d+ were saved\)"):
        grpo.resume(grpo.Args(resume=os.path.join(run_dir, "latest")))


def test_latest_never_falls_back_to_a_later_checkpoint_and_a_folder_named_latest_is_one_line(tiny_model, copy_task,
                                                                                            tmp_path, monkeypatch):
    train(grpo, tmp_path, small_run(grpo, tiny_model, copy_task, "--steps", "2", "--save-every", "1",
                                    "--keep-checkpoints", "0"), monkeypatch)
    (run_dir,) = glob.glob(str(tmp_path / "ckpt" / "*"))
    grpo.set_latest(os.path.join(run_dir, "step_1"))  # resumed from step 1 once: step_2 is an abandoned branch
    truncate(os.path.join(run_dir, "step_1", "training_state.pt"))
    with pytest.raises(SystemExit, match="no whole checkpoint to continue from: .*step_1 "):
        grpo.resume(grpo.Args(resume=os.path.join(run_dir, "latest")))
    os.remove(os.path.join(run_dir, "latest"))
    os.mkdir(os.path.join(run_dir, "latest"))
    with pytest.raises(SystemExit, match="latest: a folder, not the file that names the latest checkpoint"):
        grpo.resume(grpo.Args(resume=os.path.join(run_dir, "latest")))


@pytest.mark.parametrize("writer", ["torch.save", "safetensors"])
def test_a_full_disk_is_said_leaves_no_partial_checkpoint_and_latest_valid(writer, tiny_model, copy_task, tmp_path,
                                                                          monkeypatch, capsys):
    """The second save fails as a full disk fails (torch.save: a write that raises ENOSPC; the weights:
    safetensors' own error, as it was seen): one line that says so, no .tmp-step_2, latest still naming step_1,
    which is whole, and the printed command resumes from it."""
    if writer == "torch.save":
        module, name = grpo.torch, "save"
        error = OSError(errno.ENOSPC, "No space left on device")
    else:
        module, name = transformers.modeling_utils, "safe_save_file"
        error = safetensors.SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")
    write, calls = getattr(module, name), []

    def failing_write(obj, path, *rest, **options):
        calls.append(path)
        if len(calls) == 2:
            raise error
        return write(obj, path, *rest, **options)

    monkeypatch.setattr(module, name, failing_write)
    with pytest.raises(SystemExit, match=r"error: step 2: cannot save .*step_2: the disk is full \(\d+ MB free\); "
                                         "nothing of it was kept, latest still names step_1; resume with: python"):
        train(grpo, tmp_path, small_run(grpo, tiny_model, copy_task, "--steps", "3", "--save-every", "1",
                                        "--keep-checkpoints", "0"), monkeypatch)
    (run_dir,) = glob.glob(str(tmp_path / "ckpt" / "*"))
    assert sorted(os.listdir(run_dir)) == [".lock", "latest", "step_1"]
    assert open(os.path.join(run_dir, "latest")).read() == "step_1"
    assert grpo.damage(os.path.join(run_dir, "step_1")) is None


def test_an_output_dir_that_cannot_hold_checkpoints_fails_before_the_model_loads(tiny_model, copy_task, tmp_path,
                                                                                 monkeypatch):
    (tmp_path / "a_file").write_text("")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(grpo, "load_model", lambda *args: pytest.fail("the model loaded"))
    for output_dir in ["a_file", "a_file/below"]:
        with pytest.raises(SystemExit, match=f"error: --output-dir {output_dir}: .*a_file is a file"):
            grpo.main(tyro.cli(grpo.Args, args=small_run(grpo, tiny_model, copy_task, "--output-dir", output_dir)))
    assert sorted(os.listdir(tmp_path)) == ["a_file"]


@pytest.mark.slow
@pytest.mark.parametrize("module", [grpo])
def test_a_hung_process_ends_the_run_in_one_line_that_says_at_which_step(module, tiny_model, copy_task, tmp_path):
    """Two processes, rank 1 hung in its third step's sampling (tests/fixed_rollouts.py with HANG_AT_STEP): rank 0
    stops waiting after --timeout-minutes and says at which step, and how to resume (from step 2)."""
    argv = [os.path.join(ROOT, "tests", "fixed_rollouts.py"), module.__name__, "--model", tiny_model, "--task",
            copy_task, "--steps", "5", "--eval-every", "0", "--output-dir", "ckpt", "--save-every", "1",
            "--timeout-minutes", "0.1", *batch(module)]
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", *argv]
    result = subprocess.run(torchrun, cwd=tmp_path, capture_output=True, text=True, timeout=300,
                            env={**os.environ, "OMP_NUM_THREADS": "1", "HANG_AT_STEP": "3"})
    assert result.returncode != 0
    assert "error: step 3: the processes stopped waiting for each other after --timeout-minutes 0.1 (one hung or " \
           "died); resume with: torchrun --nproc_per_node=2" in result.stdout + result.stderr
    assert read_run(str(tmp_path))[0]["charts/reward_mean"][-1][0] == 2


def test_a_run_folder_without_a_checkpoint_or_named_itself_is_one_line(tmp_path):
    """A run stopped before its first save leaves a folder with no checkpoint: `--resume {it}/latest` says so in one
    line; `--resume {run folder}` (a folder, not a checkpoint) points at `latest`."""
    empty = tmp_path / "ckpt" / "run"
    empty.mkdir(parents=True)
    (empty / ".lock").write_text("")
    with pytest.raises(SystemExit, match=r"run/latest: no whole checkpoint to continue from: none there$"):
        grpo.resume(grpo.Args(resume=str(empty / "latest")))
    (empty / "latest").write_text("step_1")
    with pytest.raises(SystemExit, match=r"a run's folder: --resume .*run/latest continues it\)$"):
        grpo.resume(grpo.Args(resume=str(empty)))


def test_a_run_resumed_from_another_folder_goes_on_beside_its_checkpoints(tiny_model, copy_task, tmp_path,
                                                                         monkeypatch):
    """Resumed from elsewhere by its absolute path, a run saves and holds its lock in its own folder, not in a new
    ./ckpt of the directory it was started from (where a second resume would not see the first's lock)."""
    first, elsewhere = tmp_path / "first", tmp_path / "elsewhere"
    first.mkdir()
    elsewhere.mkdir()
    train(grpo, first, small_run(grpo, tiny_model, copy_task, "--steps", "2", "--save-every", "1",
                                 "--keep-checkpoints", "0"), monkeypatch)
    (run_dir,) = glob.glob(str(first / "ckpt" / "*"))
    os.remove(os.path.join(run_dir, "step_2", "contents.json"))
    os.rename(os.path.join(run_dir, "step_2"), os.path.join(run_dir, "abandoned"))
    grpo.set_latest(os.path.join(run_dir, "step_1"))
    train(grpo, elsewhere, ["--resume", os.path.join(run_dir, "latest")], monkeypatch)
    assert os.path.isfile(os.path.join(run_dir, "step_2", "contents.json"))
    assert not os.path.exists(elsewhere / "ckpt")
