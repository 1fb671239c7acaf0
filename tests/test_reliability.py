"""Nothing lost in a sweep or on a full disk, in the code the four scripts share: runs started in the same second get
their own folders, a failed save leaves the last checkpoint the one to resume from, and an output folder that cannot
hold checkpoints fails before the model loads."""

import errno
import glob
import json
import os
import sys

import pytest
import safetensors
import torch
import transformers
import tyro
from conftest import MODULES, OWN_ARGS, ScriptedRewards

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


@pytest.mark.parametrize("writer", ["torch.save", "safetensors"])
def test_a_failed_save_leaves_no_partial_checkpoint_and_latest_unchanged(writer, tiny_model, copy_task, tmp_path,
                                                                        monkeypatch, capsys):
    """The second save fails as a full disk fails (torch.save: a write that raises ENOSPC; the weights:
    safetensors' own error, as it was seen): the run stops with the system's error, no .tmp-step_2 is left, latest
    still names step_1, which is whole and resumes, and the printed command does so."""
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
    with pytest.raises(type(error), match="No space left on device"):
        train(grpo, tmp_path, small_run(grpo, tiny_model, copy_task, "--steps", "3", "--save-every", "1",
                                        "--keep-checkpoints", "0"), monkeypatch)
    (run_dir,) = glob.glob(str(tmp_path / "ckpt" / "*"))
    assert sorted(os.listdir(run_dir)) == ["latest", "step_1"]
    assert open(os.path.join(run_dir, "latest")).read() == "step_1"
    latest = os.path.join("ckpt", os.path.basename(run_dir), "latest")
    assert f"crashed; resume with: python {sys.argv[0]} --resume {latest}" in capsys.readouterr().out
    args, state = grpo.resume(grpo.Args(resume=os.path.join(run_dir, "latest")))
    assert args.resume == os.path.join(run_dir, "step_1") and state["step"] == 1


def test_an_output_dir_that_cannot_hold_checkpoints_fails_before_the_model_loads(tiny_model, copy_task, tmp_path,
                                                                                 monkeypatch):
    (tmp_path / "a_file").write_text("")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(grpo, "load_model", lambda *args: pytest.fail("the model loaded"))
    for output_dir in ["a_file", "a_file/below"]:
        with pytest.raises(SystemExit, match=f"error: --output-dir {output_dir}: .*a_file is a file"):
            grpo.main(tyro.cli(grpo.Args, args=small_run(grpo, tiny_model, copy_task, "--output-dir", output_dir)))
    assert sorted(os.listdir(tmp_path)) == ["a_file"]


def test_a_run_folder_without_a_checkpoint_or_named_itself_is_one_line(tmp_path):
    """A run stopped before its first save leaves a folder with no checkpoint: `--resume {it}/latest` says so in one
    line, and so does `--resume {run folder}` (a folder, not a checkpoint)."""
    empty = tmp_path / "ckpt" / "run"
    empty.mkdir(parents=True)
    for path in [empty / "latest", empty]:
        with pytest.raises(SystemExit, match=rf"error: --resume {path}: not a checkpoint \(no training_state.pt in "):
            grpo.resume(grpo.Args(resume=str(path)))


def test_a_run_resumed_from_another_folder_goes_on_beside_its_checkpoints(tiny_model, copy_task, tmp_path,
                                                                         monkeypatch):
    """Resumed from elsewhere by its absolute path, a run saves in its own folder, not in a new ./ckpt of the
    directory it was started from."""
    first, elsewhere = tmp_path / "first", tmp_path / "elsewhere"
    first.mkdir()
    elsewhere.mkdir()
    train(grpo, first, small_run(grpo, tiny_model, copy_task, "--steps", "2", "--save-every", "1",
                                 "--keep-checkpoints", "0"), monkeypatch)
    (run_dir,) = glob.glob(str(first / "ckpt" / "*"))
    os.rename(os.path.join(run_dir, "step_2"), os.path.join(run_dir, "abandoned"))
    grpo.set_latest(os.path.join(run_dir, "step_1"))
    train(grpo, elsewhere, ["--resume", os.path.join(run_dir, "latest")], monkeypatch)
    assert os.path.isfile(os.path.join(run_dir, "step_2", "training_state.pt"))
    assert not os.path.exists(elsewhere / "ckpt")
