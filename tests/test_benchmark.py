"""The comparison command: its floating-point accounting on hand-computed numbers, and one short run of two scripts
on the tiny model that writes the table and the figure."""

import os
import subprocess
import sys

from conftest import ROOT

sys.path.insert(0, os.path.join(ROOT, "benchmark"))
import benchmark  # noqa: E402


def test_step_work_counts_each_prompt_once_and_three_passes_for_training():
    """2 prompts x 4 completions of mean length 5; 60 sampled tokens = 2 prompts of 10 + 8 x 5. Forward FLOPs per token:
    2 N + 4 x layers x width x (10 + 5 / 2) = 200 + 4 x 2 x 8 x 12.5 = 1000."""
    run = {"args": {"num_prompts": "2", "group_size": "4"},
           "scalars": {"charts/completion_length_mean": [(1, 5.0, 0.0)], "charts/tokens_sampled": [(1, 60.0, 0.0)],
                       "charts/tokens_forward": [(1, 120.0, 0.0)], "charts/tokens_trained": [(1, 60.0, 0.0)]}}
    work = benchmark.step_work(run, n=100, layers=2, width=8)
    assert work == {"sampled": 60 * 1000, "forward": 120 * 1000, "trained": 3 * 60 * 1000}


def test_the_benchmark_runs_scripts_and_writes_a_table_and_a_figure(tiny_model, copy_task, tmp_path):
    extra = (f"--model {tiny_model} --task {copy_task} --steps 2 --eval-every 1 --eval-prompts 8 --num-prompts 4 "
             "--group-size 4 --max-new-tokens 4")
    out = tmp_path / "bench"
    result = subprocess.run([sys.executable, os.path.join(ROOT, "benchmark", "benchmark.py"), "--scripts", "grpo", "ppo",
                             "--out", str(out), f"--extra={extra}"], capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    lines = (out / "table.md").read_text().splitlines()
    rows = [line.split("|")[1:-1] for line in lines if line.startswith(("| grpo", "| ppo"))]
    rows, summary = [r for r in rows if len(r) == 12], [r for r in rows if len(r) == 6]  # per run; per script
    assert [row[0].strip() for row in rows] == ["grpo", "ppo"] and [row[0].strip() for row in summary] == ["grpo", "ppo"]
    for row in rows:
        assert row[3].strip() == "2"  # steps
        gflops = [float(x) for x in row[10].split("/")]  # sample / forward / train
        assert all(x >= 0 for x in gflops) and gflops[2] > 0
        assert row[11].strip().endswith("%")
    assert (out / "figure.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    report = subprocess.run([sys.executable, os.path.join(ROOT, "benchmark", "benchmark.py"), "--out", str(out),
                             "--report-only"], capture_output=True, text=True, timeout=600)
    assert report.returncode == 0 and "| grpo | 1 |" in report.stdout  # redrawn from the runs, nothing rerun


def test_the_ceiling_command_times_a_training_pass_and_a_decoding_step_of_the_model(tiny_model):
    result = subprocess.run([sys.executable, os.path.join(ROOT, "benchmark", "ceiling.py"), "--model", tiny_model,
                             "--tokens", "8", "16", "--rows", "2", "--repeats", "1"], capture_output=True, text=True,
                            timeout=600)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    rows = [line.split("|")[1:-1] for line in result.stdout.splitlines() if line.startswith(("| forward", "| decoding"))]
    assert [(r[0].strip(), r[1].strip()) for r in rows] == [
        ("forward + backward", "1 row x 8 tokens"), ("forward + backward", "1 row x 16 tokens"),
        ("decoding step", "2 rows, 50 cached")]
    assert all(float(r[3]) > 0 and r[4].strip().endswith("%") for r in rows)
