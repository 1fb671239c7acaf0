"""The four algorithms side by side: the same model, task, seeds and completions per step, in one output folder with
markdown tables (table.md: quality, then speed) and a figure (figure.png). It runs the scripts as a user does and reads
back the arguments each run wrote (runs/{run_name}/args.json) and what it logged to TensorBoard beside them
(charts/time_*, charts/tokens_*, the rewards and losses); it re-implements nothing of them.

    python benchmark/benchmark.py                                   # CPU: SmolLM2-135M-Instruct, arithmetic, seed 1
    python benchmark/benchmark.py --preset gpu                      # Qwen2.5-0.5B-Instruct, 128 completions a step
    python benchmark/benchmark.py --seeds 1 2 3 --scripts grpo gspo   # any subset, any seeds
    python benchmark/benchmark.py --scripts grpo --dtypes bfloat16 float32  # each phase in bf16 against float32
    python benchmark/benchmark.py --samplers hf vllm                # model.generate against vLLM (docs/vllm.md)
    python benchmark/benchmark.py --report-only --out benchmark/cpu   # redraw the tables and figure from runs there

Floating-point work per step, from the logged token counts (each prompt counted once per group, no padding; the
work that is needed, whatever the script computes): 2 x N FLOPs per sampled token and per token of each forward-only
pass (old, reference, PPO's values), 6 x N per trained token, N the parameters that multiply (the LM head included,
the input embedding, a lookup, not), plus attention, 4 x layers x width x context per token forward (x3 trained),
at the mean context (prompt + half the completion). PPO's critic is counted as a copy of the policy, though it has no
LM head (28M of SmolLM2's 135M), so PPO's work is overstated by up to a tenth. The fraction of peak divides that work
by the time it took and by the peak measured here, before the runs, with a large matmul in the runs' dtype and threads.
"""

import glob
import json
import os
import re
import shlex
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Literal

import torch
import tyro

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPTS = ["grpo", "gspo", "dapo", "ppo"]
LONGEST_FIRST = ["ppo", "gspo", "dapo", "grpo"]  # the order runs start in, so that two at a time end together
PRESETS = {  # per preset: arguments for every script, for each script, runs at once, threads per run, matmul dtype
    "cpu": {"common": [], "own": {}, "parallel": 2, "threads": 1, "dtype": torch.float32},
    "gpu": {"common": ["--model", "Qwen/Qwen2.5-0.5B-Instruct", "--difficulty", "2", "--max-new-tokens", "128",
                       "--micro-batch-size", "32", "--eval-prompts", "256"],
            "own": {name: ["--num-prompts", "16", "--group-size", "8"] for name in ["grpo", "gspo", "dapo"]}
            | {"ppo": ["--num-prompts", "128"]}, "parallel": 1, "threads": 0, "dtype": torch.bfloat16},
}
PHASES = ["time_sample", "time_score", "time_logprobs", "time_train"]


@dataclass
class Args:
    preset: Literal["cpu", "gpu"] = "cpu"
    """cpu: SmolLM2-135M-Instruct with each script's defaults (16 completions a step), two runs at a time, one thread
    each; gpu: Qwen2.5-0.5B-Instruct, 128 completions of up to 128 tokens a step, one run at a time"""
    scripts: list[str] = field(default_factory=lambda: list(SCRIPTS))
    """which scripts to run"""
    seeds: list[int] = field(default_factory=lambda: [1])
    """seeds; every script runs once per seed"""
    dtypes: list[Literal["auto", "float32", "bfloat16"]] = field(default_factory=lambda: ["auto"])
    """the scripts' --dtype; every script runs once per seed and dtype, and with two or more the report compares
    each phase's time with float32's"""
    samplers: list[Literal["hf", "vllm"]] = field(default_factory=lambda: ["hf"])
    """the scripts' --sampler; every script runs once per seed, dtype and sampler, and with both the report compares
    their sampling speed"""
    out: str = ""
    """output folder (default benchmark/{preset}): one folder per run, table.md and figure.png"""
    extra: str = ""
    """more arguments for every script, in one string after an =, e.g. --extra='--steps 10 --eval-prompts 32'"""
    report_only: bool = False
    """do not run anything: write the table and figure from the runs already in --out"""


def matmul_peak(dtype: torch.dtype, threads: int) -> float:
    """FLOP/s of a large square matmul in `dtype` with `threads` threads (all when 0): the machine's usable peak."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if threads:
        torch.set_num_threads(threads)
    n = 8192 if device == "cuda" else 2048
    a, b = torch.randn(n, n, device=device, dtype=dtype), torch.randn(n, n, device=device, dtype=dtype)
    best = float("inf")
    for _ in range(20):  # the best of many: a single product is easily slowed by anything else on the machine
        start = time.perf_counter()
        a @ b
        if device == "cuda":
            torch.cuda.synchronize()
        best = min(best, time.perf_counter() - start)
    return 2 * n**3 / best


def run_logged(argv: list[str], folder: str, threads: int) -> int:
    """Run `argv` in `folder` with `threads` threads (all when 0); folder/log.txt holds the command (paths from the
    repository root), then its output. Returns the exit code."""
    os.makedirs(folder, exist_ok=True)
    env = {**os.environ, **({"OMP_NUM_THREADS": str(threads)} if threads else {})}
    start = time.time()
    with open(os.path.join(folder, "log.txt"), "w") as log:
        log.write(shlex.join(argv[1:]).replace(ROOT + "/", "") + "\n")  # the exact command, above its output
        log.flush()
        code = subprocess.run(argv, cwd=folder, env=env, stdout=log, stderr=subprocess.STDOUT).returncode
    print(f"{os.path.basename(folder)}: exit {code} after {(time.time() - start) / 60:.1f} min", flush=True)
    return code


def run_all(args: Args, preset: dict) -> None:
    """Every (script, seed) in its own folder under --out (runs/, checkpoints/, log.txt), `parallel` at a time."""
    def run(job):
        name, dtype, sampler, seed = job
        argv = [sys.executable, os.path.join(ROOT, f"{name}.py"), "--seed", str(seed), "--dtype", dtype,
                "--sampler", sampler, *preset["common"], *preset["own"].get(name, []), *shlex.split(args.extra)]
        variant = ("" if dtype == "auto" else f"-{dtype}") + ("" if sampler == "hf" else f"-{sampler}")
        run_logged(argv, os.path.join(args.out, f"{name}{variant}_s{seed}"), preset["threads"])

    with ThreadPoolExecutor(preset["parallel"]) as pool:
        jobs = [(name, dtype, sampler, seed) for name in args.scripts for dtype in args.dtypes
                for sampler in args.samplers for seed in args.seeds]
        list(pool.map(run, sorted(jobs, key=lambda job: LONGEST_FIRST.index(job[0]))))


def matmul_parameters(model: str) -> tuple[int, int, int]:
    """N (parameters that multiply: the LM head in, the input embedding out), layers and width of `model`."""
    sys.path.insert(0, ROOT)
    from grpo import load_model  # as the scripts load it: the default model resolves to its offline GGUF copy

    _, net = load_model(model)
    config = net.config
    total = sum(p.numel() for p in net.parameters())
    embedding = net.get_input_embeddings().weight
    tied = net.get_output_embeddings().weight is embedding
    return total - (0 if tied else embedding.numel()), config.num_hidden_layers, config.hidden_size


def read_runs(out: str) -> list[dict]:
    """Each run in `out`: its script and seed (from its folder's name), its arguments (the args.json it wrote beside
    its TensorBoard events), the compute precision its log's first line names (else its --dtype), its scalars as
    (step, value, wall time), and when it started: the first TensorBoard event, written when the script opened its
    writer, after loading the model and just before evaluation 0."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    runs = []
    for folder in sorted(glob.glob(os.path.join(out, "*_s*"))):
        logs = glob.glob(os.path.join(folder, "runs", "*"))
        if not logs:
            continue
        args_file = os.path.join(logs[0], "args.json")
        if not os.path.isfile(args_file):
            raise SystemExit(f"error: {args_file}: no such file (the run's arguments, which the scripts write)")
        with open(args_file) as f:
            args = json.load(f)
        events = EventAccumulator(logs[0], size_guidance={"scalars": 0, "tensors": 0})
        events.Reload()
        scalars = {tag: [(e.step, e.value, e.wall_time) for e in events.Scalars(tag)]
                   for tag in events.Tags()["scalars"]}
        name, seed = os.path.basename(folder).rsplit("_s", 1)
        log_file, precision = os.path.join(folder, "log.txt"), args["dtype"]
        if os.path.isfile(log_file):
            with open(log_file) as f:
                said = re.search(r"^precision: (\w+) compute", f.read(), re.M)
            precision = said.group(1) if said else precision
        runs.append({"script": name.split("-")[0], "precision": precision, "seed": int(seed), "scalars": scalars,
                     "args": args, "start": events.FirstEventTimestamp(), "sampler": args.get("sampler", "hf")})
    return sorted(runs, key=lambda r: (SCRIPTS.index(r["script"]), r["precision"], r["sampler"], r["seed"]))


def series(run: dict, tag: str) -> list[float]:
    return [v for _, v, _ in run["scalars"].get(tag, [])]


def mean(run: dict, tag: str) -> float:
    return statistics.mean(series(run, tag))


def forward_flops(n: int, layers: int, width: int, context: float) -> float:
    """FLOPs of a forward pass per token: 2 x N for the weights, 4 x layers x width x context for attention (the scores
    and the weighted sum of the values over `context` tokens)."""
    return 2 * n + 4 * layers * width * context


def step_work(run: dict, n: int, layers: int, width: int) -> dict[str, float]:
    """Mean FLOPs per step of each phase (sample, forward, train), from the logged token counts."""
    s, args = run["scalars"], run["args"]
    completions = args["num_prompts"] * args["group_size"]
    rounds = statistics.mean(series(run, "charts/sampling_rounds") or [1])  # DAPO samples several rounds
    completion = statistics.mean(series(run, "charts/completion_length_mean"))
    sampled = statistics.mean(series(run, "charts/tokens_sampled")) / (completions * rounds)  # per completion
    prompt = (sampled - completion) * args["group_size"]  # each prompt counted once per group
    per_token = forward_flops(n, layers, width, prompt + completion / 2)  # at the mean context
    return {phase: factor * per_token * statistics.mean(series(run, f"charts/tokens_{phase}"))
            for phase, factor in [("sampled", 1), ("forward", 1), ("trained", 3)] if s.get(f"charts/tokens_{phase}")}


def report(args: Args, peak: float) -> str:
    """Two tables: quality (held-out accuracy per run, then per script over its seeds) and speed (time, throughput,
    memory and floating-point work per run); with runs in several precisions, each labelled with its precision, and
    a third table: each phase's time against float32's."""
    runs = read_runs(args.out)
    if not runs:
        raise SystemExit(f"error: no runs in {args.out}")
    several = len({r["precision"] for r in runs}) > 1
    samplers = len({r["sampler"] for r in runs}) > 1
    for run in runs:
        run["label"] = " ".join([run["script"], *([run["precision"]] if several else []),
                                 *([run["sampler"]] if samplers else [])])
    n, layers, width = matmul_parameters(runs[0]["args"]["model"])
    preset = PRESETS[args.preset]
    quality = ["## Quality", "", "| script | seed | steps | held-out accuracy, first -> last eval |", "|" + "---|" * 4]
    speed = ["## Speed", "", f"Peak: {peak / 1e9:.1f} GFLOP/s (a {str(preset['dtype'])[6:]} matmul, "
             f"{preset['threads'] or 'all'} thread(s)); N = {n / 1e6:.1f}M parameters that multiply.", "",
             "| script | seed | wall min | s/step | sample / score / logprobs / train s | sampled tok/s "
             "| trained tok/s | peak GB | GFLOP/step sample / forward / train | % peak: step, train |",
             "|" + "---|" * 10]
    for run in runs:
        accuracy, steps = series(run, "charts/eval_accuracy"), series(run, "charts/step_seconds")
        quality.append(f"| {run['label']} | {run['seed']} | {len(steps)} | {accuracy[0]:.3f} -> {accuracy[-1]:.3f} |")
        work = step_work(run, n, layers, width)
        wall = max(w for values in run["scalars"].values() for _, _, w in values) - run["start"]  # loading not counted
        phases = " / ".join(f"{mean(run, 'charts/' + p):.1f}" for p in PHASES)
        memory = max(series(run, "charts/peak_memory_gb"))
        gflops = " / ".join(f"{work.get(k, 0) / 1e9:.3g}" for k in ["sampled", "forward", "trained"])
        step_peak = sum(work.values()) / statistics.mean(steps) / peak
        train_peak = work["trained"] / mean(run, "charts/time_train") / peak
        speed.append(f"| {run['label']} | {run['seed']} | {wall / 60:.1f} | {statistics.mean(steps):.1f} | {phases} "
                     f"| {mean(run, 'charts/sample_tokens_per_second'):.0f} "
                     f"| {mean(run, 'charts/train_tokens_per_second'):.0f} "
                     f"| {memory:.1f} | {gflops} | {step_peak:.0%}, {train_peak:.0%} |")
    quality += ["", "| script | seeds | held-out accuracy before | after, mean (range) | change, mean (range) "
                "| seeds with +0.2 or more |", "|" + "---|" * 6]
    for name in dict.fromkeys(r["label"] for r in runs):
        curves = [series(r, "charts/eval_accuracy") for r in runs if r["label"] == name]
        before, after = [c[0] for c in curves], [c[-1] for c in curves]
        change = [b - a for a, b in zip(before, after)]
        quality.append(f"| {name} | {len(curves)} | {statistics.mean(before):.3f} | {statistics.mean(after):.3f} "
                       f"({min(after):.3f}-{max(after):.3f}) | {statistics.mean(change):+.3f} ({min(change):+.3f} to "
                       f"{max(change):+.3f}) | {sum(c >= 0.2 - 1e-9 for c in change)} of {len(curves)} |")
    figure(runs, os.path.join(args.out, "figure.png"))
    return "\n".join(quality + [""] + speed + ([""] + precisions(runs) if several else [])
                     + ([""] + sampling(runs) if samplers else [])) + "\n"


def precisions(runs: list[dict]) -> list[str]:
    """Each script's seconds a step, and per phase, in each precision over float32's (medians over its steps and
    seeds, so that one slow step, a first one or a loaded moment, does not decide); and per sampled token (the median
    step over the median tokens sampled), since the precisions sample different completions."""
    table = ["## Precision", "", "| script | precision | s/step | sample / score / logprobs / train s "
             "| ms per sampled token | over float32: step, per sampled token | sample / score / logprobs / train |",
             "|" + "---|" * 7]
    for name in dict.fromkeys(r["script"] for r in runs):
        seconds = {}  # precision: [step, per sampled token, *phases]
        for precision in dict.fromkeys(r["precision"] for r in runs if r["script"] == name):
            group = [r for r in runs if r["script"] == name and r["precision"] == precision]
            step = statistics.median(v for r in group for v in series(r, "charts/step_seconds"))
            tokens = statistics.median(v for r in group for v in series(r, "charts/tokens_sampled"))
            phases = [statistics.median(v for r in group for v in series(r, f"charts/{p}")) for p in PHASES]
            seconds[precision] = [step, step / tokens, *phases]
        for precision, values in seconds.items():
            base = seconds.get("float32")
            ratios = [f"{v / b:.2f}x" if base and b > 0 else "-" for v, b in zip(values, base or values)]
            table.append(f"| {name} | {precision} | {values[0]:.2f} | {' / '.join(f'{v:.2f}' for v in values[2:])} "
                         f"| {1000 * values[1]:.1f} | {ratios[0]}, {ratios[1]} | {' / '.join(ratios[2:])} |")
    return table


def sampling(runs: list[dict]) -> list[str]:
    """Each script's sampling speed with each sampler (means over steps and seeds, by precision), and over hf's."""
    table = ["## Sampler", "", "| script | precision | sampler | sampled tok/s | sample s/step | s/step "
             "| over hf: tok/s, sample s, step s |", "|" + "---|" * 7]
    for name in dict.fromkeys(r["script"] for r in runs):
        for precision in dict.fromkeys(r["precision"] for r in runs if r["script"] == name):
            values = {}  # sampler: [tok/s, sample s, step s]
            for sampler in ["hf", "vllm"]:
                group = [r for r in runs if (r["script"], r["precision"], r["sampler"]) == (name, precision, sampler)]
                if group:
                    values[sampler] = [statistics.mean(v for r in group for v in series(r, f"charts/{tag}"))
                                       for tag in ["sample_tokens_per_second", "time_sample", "step_seconds"]]
            for sampler, (rate, sample, step) in values.items():
                base = values.get("hf")
                ratios = ", ".join(f"{v / b:.2f}x" for v, b in zip(values[sampler], base)) if base else "-"
                table.append(f"| {name} | {precision} | {sampler} | {rate:.0f} | {sample:.2f} | {step:.2f} "
                             f"| {ratios} |")
    return table


def seed_band(runs: list[dict], tag: str) -> tuple[list[int], list[float], list[float], list[float]]:
    """The steps every run logged `tag` at, and at each the mean, lowest and highest value over the runs (seeds)."""
    values = [dict((s, v) for s, v, _ in run["scalars"].get(tag, [])) for run in runs]
    steps = sorted(set.intersection(*(set(v) for v in values))) if values else []
    at = [[v[s] for v in values] for s in steps]
    return steps, [statistics.mean(x) for x in at], [min(x) for x in at], [max(x) for x in at]


def plot_bands(ax, runs: list[dict], tag: str, colors: dict, linestyle: str = "-", legend: bool = True) -> None:
    """One line a label (script, and precision or sampler where they differ): the mean over its seeds, shaded from
    the lowest to the highest seed."""
    for label in dict.fromkeys(r["label"] for r in runs):
        group = [r for r in runs if r["label"] == label]
        steps, middle, low, high = seed_band(group, tag)
        if not steps:
            continue
        color = colors.get(group[0]["script"])
        alpha = 0.5 if group[0]["precision"] == "float32" and len({r["precision"] for r in runs}) > 1 else 1.0
        seeds = f" ({len(group)} seeds)" if len(group) > 1 else ""
        ax.plot(steps, middle, color=color, linestyle=linestyle, alpha=alpha,
                marker="." if "eval" in tag else None, label=label + seeds if legend else None)
        if len(group) > 1:
            ax.fill_between(steps, low, high, color=color, alpha=0.15 * alpha, linewidth=0)


def figure(runs: list[dict], path: str) -> None:
    """figure.png: the runs' curves (mean over seeds, shaded from the lowest to the highest) and phase times; and
    beside it accuracy.png, the held-out accuracy panel alone, small enough for the README."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colors = {name: f"C{i}" for i, name in enumerate(SCRIPTS)}
    panels = [("charts/reward_mean", "reward (sampled)", False),
              ("charts/eval_accuracy", "held-out greedy accuracy", False),
              ("charts/eval_accuracy", "held-out accuracy vs wall-clock s (each run)", True),
              ("charts/completion_length_mean", "completion length (tokens)", False),
              ("losses/clip_fraction", "clip fraction", False),
              ("losses/token_log_ratio_std", "log-ratio std: token (solid), sequence (dashed)", False)]
    fig, axes = plt.subplots(2, 4, figsize=(20, 8.5))
    for ax, (tag, title, wall) in zip(axes.flat, panels):
        if wall:  # runs take different times: one line each
            for run in runs:
                points = run["scalars"].get(tag, [])
                ax.plot([w - run["start"] for _, _, w in points], [v for _, v, _ in points],
                        color=colors.get(run["script"]), marker=".", alpha=0.6)
        else:
            plot_bands(ax, runs, tag, colors)
        if tag == "losses/token_log_ratio_std":
            plot_bands(ax, runs, "losses/seq_log_ratio_std", colors, linestyle="--", legend=False)
        ax.set_title(title)
        ax.set_xlabel("seconds" if wall else "step")
    axes.flat[0].legend()
    scripts = list(dict.fromkeys(r["label"] for r in runs))
    ax = axes.flat[6]  # the time of a step, split into its phases (mean over steps and seeds)
    bottom = [0.0] * len(scripts)
    for i, phase in enumerate(PHASES):
        heights = [statistics.mean(v for r in runs if r["label"] == s for v in series(r, f"charts/{phase}"))
                   for s in scripts]
        ax.bar(scripts, heights, bottom=bottom, label=phase[5:], color=f"C{4 + i}")  # not the scripts' colours
        bottom = [b + h for b, h in zip(bottom, heights)]
    ax.set_title("seconds per step, by phase")
    ax.legend()
    ax = axes.flat[7]
    rates = [("charts/sample_tokens_per_second", "sampled"), ("charts/train_tokens_per_second", "trained")]
    for i, (tag, label) in enumerate(rates):
        values = [statistics.mean(v for r in runs if r["label"] == s for v in series(r, tag)) for s in scripts]
        ax.bar([j + 0.4 * i for j in range(len(scripts))], values, width=0.4, label=label, color=f"C{8 + i}")
    ax.set_xticks([j + 0.2 for j in range(len(scripts))], scripts)
    ax.set_title("tokens per second")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)
    fig, ax = plt.subplots(figsize=(8, 3.6))
    plot_bands(ax, runs, "charts/eval_accuracy", colors)
    ax.set_xlabel("step")
    ax.set_ylabel("held-out greedy accuracy")
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right")
    fig.tight_layout()
    fig.savefig(os.path.join(os.path.dirname(path), "accuracy.png"), dpi=80)
    plt.close(fig)


def main(args: Args) -> None:
    if not set(args.scripts) <= set(SCRIPTS) or not args.seeds:
        raise SystemExit(f"error: --scripts must be among {' '.join(SCRIPTS)}, with at least one --seeds")
    args.out = args.out or os.path.join(ROOT, "benchmark", args.preset)
    preset = PRESETS[args.preset]
    os.makedirs(args.out, exist_ok=True)
    peak_file = os.path.join(args.out, "peak.json")
    if not args.report_only:
        with open(peak_file, "w") as f:  # measured before the runs, on the idle machine
            json.dump({"flops": matmul_peak(preset["dtype"], preset["threads"])}, f)
        run_all(args, preset)
    if os.path.exists(peak_file):
        with open(peak_file) as f:
            peak = json.load(f)["flops"]
    else:
        peak = matmul_peak(preset["dtype"], preset["threads"])
    table = report(args, peak)
    machine = torch.cuda.get_device_name() if torch.cuda.is_available() else f"{os.cpu_count()}-core CPU"
    with open(os.path.join(args.out, "table.md"), "w") as f:
        f.write(f"{time.strftime('%Y-%m-%d')}, {machine}\n\n" + table)
    print(table)


if __name__ == "__main__":
    main(tyro.cli(Args))
