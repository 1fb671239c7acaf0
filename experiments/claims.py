"""The article's claims about training, measured: one command per claim. Each runs the scripts as a user does (several
seeds, two runs at a time on a CPU), then writes a figure, docs/claims/{claim}.png, and a table into docs/claims.md
between that claim's markers, with the date, the machine, the commands and the seeds.

    python experiments/claims.py clip-higher        # 1. DAPO's clip-higher against a symmetric clip: entropy, clipping
    python experiments/claims.py token-level-loss   # 2. GRPO's per-completion average against DAPO's token mean
    python experiments/claims.py dynamic-sampling   # 3. DAPO with and without dynamic sampling: flat groups, cost
    python experiments/claims.py moe                # 4. GRPO against GSPO, on a sparse-upcycled MoE and dense
    python experiments/claims.py critic             # 5. PPO against GRPO: memory, time, accuracy (benchmark's report)
    python experiments/claims.py moe --seeds 1 --report-only   # redraw from the runs already in experiments/runs

A run that finished (its log ends with the held-out summary) is not run again, so a variant shared by two claims runs
once. Runs go through experiments/track.py (the script unchanged) where a claim needs what the logs do not hold.
"""

import glob
import json
import os
import re
import shlex
import shutil
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Literal

import tyro

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "benchmark"))
import benchmark  # noqa: E402  (benchmark/benchmark.py: runs logged as it logs them, the peak FLOP/s)

DOCS = os.path.join(ROOT, "docs")  # claims.md and the figures in claims/
MOE = "{moe}"  # the preset's model, sparse-upcycled by experiments/moe.py into this folder under experiments/models
SHORT = ["--steps", "10"]  # claims 1-4 on the CPU: 10 steps (evaluations at 0, 5 and 10); claim 5 the default 20
# label: (script, its arguments, through track.py); the rest of each script's arguments are its defaults
VARIANTS = {
    "dapo": ("dapo", SHORT, False),
    "dapo-symmetric": ("dapo", [*SHORT, "--clip-eps-high", "0.2"], False),
    "dapo-no-dynamic-sampling": ("dapo", [*SHORT, "--no-dynamic-sampling"], False),
    # GRPO's loss and DAPO's differ, with these arguments, only in the averaging (tests/test_relations.py)
    "grpo-beta0": ("grpo", [*SHORT, "--beta", "0"], True),
    "dapo-as-grpo": ("dapo", [*SHORT, "--clip-eps-high", "0.2", "--no-dynamic-sampling", "--overlong-penalty", "0"],
                     True),
    "gspo": ("gspo", [*SHORT, "--num-prompts", "4"], True),  # 16 completions a step, as GRPO's
    "moe-grpo-beta0": ("grpo", [*SHORT, "--beta", "0", "--model", MOE], True),
    "moe-gspo": ("gspo", [*SHORT, "--num-prompts", "4", "--model", MOE], True),
    "grpo": ("grpo", [], False),
    "ppo": ("ppo", [], False),
}
# claim: (its variants, its panels: (metric, title); track.py's metrics have no "/")
CLAIMS = {
    "clip-higher": (["dapo", "dapo-symmetric"], [
        ("losses/entropy", "entropy (nats per token)"), ("losses/clip_fraction_high", "clipped above 1 + eps_high"),
        ("losses/clip_fraction_low", "clipped below 1 - eps_low"), ("charts/eval_accuracy", "held-out accuracy")]),
    "token-level-loss": (["grpo-beta0", "dapo-as-grpo"], [
        ("length_correct", "length of correct completions"), ("length_wrong", "length of wrong completions"),
        ("charts/truncated_fraction", "truncated fraction"), ("charts/eval_accuracy", "held-out accuracy")]),
    "dynamic-sampling": (["dapo", "dapo-no-dynamic-sampling"], [
        ("charts/zero_std_fraction", "sampled groups with zero reward spread"),
        ("informative_groups", "groups with reward spread trained on"), ("charts/sampling_rounds", "sampling rounds"),
        ("charts/time_sample", "sampling seconds"), ("charts/eval_accuracy", "held-out accuracy")]),
    "moe": (["moe-grpo-beta0", "moe-gspo", "grpo-beta0", "gspo"], [
        ("experts_changed", "tokens whose experts changed in a step"),
        ("losses/token_log_ratio_std", "token log-ratio std"), ("losses/seq_log_ratio_std", "sequence log-ratio std"),
        ("losses/clip_fraction", "clip fraction"), ("charts/eval_accuracy", "held-out accuracy")]),
    "critic": (["grpo", "ppo"], []),  # the table is benchmark/benchmark.py's, on these runs
}
PRESETS = {"cpu": [], "gpu": ["--model", "HuggingFaceTB/SmolLM2-1.7B-Instruct", "--difficulty", "2", "--max-new-tokens",
                              "128", "--eval-prompts", "256", "--micro-batch-size", "16"]}
MOE_FOLDERS = {"cpu": "smollm2-moe", "gpu": "smollm2-1.7b-moe"}


@dataclass
class Args:
    claim: tyro.conf.Positional[Literal["clip-higher", "token-level-loss", "dynamic-sampling", "moe", "critic", "all"]]
    seeds: list[int] = field(default_factory=lambda: [1, 2, 3])
    preset: Literal["cpu", "gpu"] = "cpu"  # gpu: SmolLM2-1.7B-Instruct, harder sums, longer completions, one at a time
    out: str = ""  # one folder per run, {out}/{label}_s{seed}; default experiments/runs/{preset}
    report_only: bool = False  # run nothing: write the figures and tables from the runs in --out


def command(label: str, seed: int, preset: str) -> list[str]:
    script, extra, tracked = VARIANTS[label]
    entry = [os.path.join(ROOT, "experiments", "track.py"), script] if tracked else [os.path.join(ROOT, f"{script}.py")]
    moe = os.path.join(ROOT, "experiments", "models", MOE_FOLDERS[preset])
    return [sys.executable, *entry, "--seed", str(seed), *PRESETS[preset], *[moe if a == MOE else a for a in extra]]


def finished(folder: str) -> bool:
    """The run ended at its last step (a stopped run prints its summary too, after "stopped after step")."""
    if not os.path.isfile(os.path.join(folder, "log.txt")):
        return False
    with open(os.path.join(folder, "log.txt")) as f:
        log = f.read()
    return "held-out greedy accuracy:" in log and "stopped after step" not in log


def run_all(labels: list[str], args: Args) -> None:
    """Every (variant, seed) not yet finished in its own folder (log.txt: the command, then its output)."""
    preset = benchmark.PRESETS[args.preset]  # the benchmark's runs at once, threads per run, matmul dtype

    def run(job):
        label, seed = job
        folder = os.path.join(args.out, f"{label}_s{seed}")
        for stale in ["runs", "checkpoints", "track.jsonl"]:  # of an unfinished earlier attempt
            shutil.rmtree(os.path.join(folder, stale), ignore_errors=True)
            if os.path.isfile(os.path.join(folder, stale)):
                os.remove(os.path.join(folder, stale))
        if benchmark.run_logged(command(label, seed, args.preset), folder, preset["threads"]) == 0:
            shutil.rmtree(os.path.join(folder, "checkpoints"), ignore_errors=True)  # the report reads only runs/

    moe = os.path.join(ROOT, "experiments", "models", MOE_FOLDERS[args.preset])
    if any(MOE in VARIANTS[label][1] for label in labels) and not os.path.isfile(f"{moe}/tokenizer_config.json"):
        subprocess.run([sys.executable, os.path.join(ROOT, "experiments", "moe.py"), "--out", moe,
                        *PRESETS[args.preset][:2]], check=True)
    if "ppo" in labels and not os.path.isfile(os.path.join(args.out, "critic", "peak.json")):  # before the runs
        os.makedirs(os.path.join(args.out, "critic"), exist_ok=True)
        with open(os.path.join(args.out, "critic", "peak.json"), "w") as f:
            json.dump({"flops": benchmark.matmul_peak(preset["dtype"], preset["threads"])}, f)
    jobs = [(label, seed) for seed in args.seeds for label in labels
            if not finished(os.path.join(args.out, f"{label}_s{seed}"))]
    with ThreadPoolExecutor(preset["parallel"]) as pool:
        list(pool.map(run, jobs))


def read(folder: str) -> dict[str, dict[int, float]]:
    """A run's metrics by step: its TensorBoard scalars, track.py's records (lists averaged; a record per sampled
    batch, one per step where nothing is resampled) and the groups with reward spread it trained on."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    logs = glob.glob(os.path.join(folder, "runs", "*"))
    if len(logs) != 1 or not finished(folder):
        raise SystemExit(f"error: {folder}: not one finished run (run the claim's command without --report-only)")
    log = logs[0]
    events = EventAccumulator(log, size_guidance={"scalars": 0})
    events.Reload()
    metrics = {tag: {e.step: e.value for e in events.Scalars(tag)} for tag in events.Tags()["scalars"]}
    with open(os.path.join(log, "args.json")) as f:
        run_args = json.load(f)
    spread = {s: run_args["num_prompts"] * (1 - v) for s, v in metrics["charts/zero_std_fraction"].items()}
    dynamic = run_args.get("dynamic_sampling")  # DAPO's kept groups all have spread
    metrics["informative_groups"] = metrics["charts/kept_groups"] if dynamic else spread
    track = os.path.join(folder, "track.jsonl")
    for record in map(json.loads, open(track).readlines() if os.path.isfile(track) else []):
        for key, value in record.items():
            if key != "batch" and not key.endswith("per_layer") and (value or value == 0):
                mean = statistics.mean(value) if isinstance(value, list) else value
                metrics.setdefault(key, {})[record["batch"]] = mean
    return metrics


def window(metric: dict[int, float], first: bool, n: int = 3) -> float | None:
    steps = sorted(s for s in metric if s > 0)
    picked = steps[:n] if first else steps[-n:]
    return statistics.mean(metric[s] for s in picked) if picked else None


def commands(labels: list[str], args: Args) -> list[str]:
    """When (the dates the runs' logs were last written), where and how the runs were made, and their commands."""
    logs = [os.path.join(args.out, f"{label}_s{seed}", "log.txt") for label in labels for seed in args.seeds]
    dates = sorted({time.strftime("%Y-%m-%d", time.gmtime(os.path.getmtime(log))) for log in logs})
    how = f"a {os.cpu_count()}-core CPU, two runs at a time, one thread each" if args.preset == "cpu" else "one GPU"
    seeds = " ".join(map(str, args.seeds))
    lines = [f"Runs finished {', '.join(dates)} on {how} ({args.preset} preset), seeds {seeds}:", ""]
    return lines + [f"- `{label}`: `python {shlex.join(command(label, 1, args.preset)[1:]).replace(ROOT + '/', '')}`"
                    .replace("--seed 1", "--seed N") for label in labels]


def report(claim: str, args: Args) -> str:
    labels, panels = CLAIMS[claim]
    runs = {label: {seed: read(os.path.join(args.out, f"{label}_s{seed}")) for seed in args.seeds} for label in labels}
    lines = commands(labels, args)
    shown = [(metric, title) for metric, title in panels if metric != "charts/eval_accuracy"]  # (accuracy: its own)
    header = " | ".join(f"{title}: first 3 -> last 3 steps" for _, title in shown)
    lines += ["", f"| variant | held-out accuracy: step 0 -> last, per seed | mean change | {header} |",
              "|" + "---|" * (3 + len(shown))]
    for label in labels:
        accuracy = [runs[label][seed]["charts/eval_accuracy"] for seed in args.seeds]
        per_seed = ", ".join(f"{a[0]:.3f} -> {a[max(a)]:.3f}" for a in accuracy)
        change = statistics.mean(a[max(a)] - a[0] for a in accuracy)
        cells = []
        for metric, _ in shown:
            curves = [runs[label][seed].get(metric, {}) for seed in args.seeds]
            ends = [[window(curve, first) for curve in curves] for first in (True, False)]
            cells.append(" -> ".join("-" if None in e else f"{statistics.mean(e):.3g}" for e in ends))
        lines.append(f"| `{label}` | {per_seed} | {change:+.3f} | {' | '.join(cells)} |")
    figure(runs, panels, os.path.join(DOCS, "claims", f"{claim}.png"))
    lines += ["", f"Means over the seeds. ![{claim}](claims/{claim}.png)"]
    return "\n".join(lines)


def figure(runs: dict, panels: list, path: str) -> None:
    """One panel per metric, step on x; a thin line per seed and a thick line for the mean over seeds."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(panels), figsize=(4.2 * len(panels), 3.4), squeeze=False)
    for ax, (metric, title) in zip(axes[0], panels):
        for i, (label, seeds) in enumerate(runs.items()):
            curves = [seeds[s].get(metric, {}) for s in seeds]
            for curve in curves:
                ax.plot(sorted(curve), [curve[s] for s in sorted(curve)], color=f"C{i}", alpha=0.3, linewidth=0.8)
            steps = sorted(set.intersection(*(set(c) for c in curves))) if all(curves) else []
            ax.plot(steps, [statistics.mean(c[s] for c in curves) for s in steps], color=f"C{i}", linewidth=2,
                    label=label, marker="." if "eval" in metric else None)
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("step")
    axes[0][0].legend(fontsize=8)
    fig.tight_layout()
    os.makedirs(os.path.dirname(path), exist_ok=True)
    fig.savefig(path, dpi=70)
    plt.close(fig)


def write_section(claim: str, text: str) -> None:
    """Replace the text between the claim's markers in docs/claims.md (appended there at the first report)."""
    path = os.path.join(DOCS, "claims.md")
    doc = open(path).read()
    begin, end = f"<!-- {claim}: written by experiments/claims.py -->", f"<!-- end {claim} -->"
    if begin not in doc:
        doc = doc.rstrip("\n") + f"\n\n{begin}\n{end}\n"
    doc = re.sub(re.escape(begin) + ".*?" + re.escape(end), lambda _: f"{begin}\n{text}\n{end}", doc, flags=re.S)
    with open(path, "w") as f:
        f.write(doc)


def main(args: Args) -> None:
    claims = list(CLAIMS) if args.claim == "all" else [args.claim]
    args.out = args.out or os.path.join(ROOT, "experiments", "runs", args.preset)
    if not args.report_only:
        run_all(list(dict.fromkeys(label for claim in claims for label in CLAIMS[claim][0])), args)
    for claim in claims:
        if claim == "critic":  # benchmark/benchmark.py's quality and speed tables, on the grpo and ppo runs
            out = os.path.join(args.out, "critic")  # the benchmark reads {script}_s{seed} folders: links to the runs
            os.makedirs(out, exist_ok=True)
            for link in glob.glob(os.path.join(out, "*_s*")):
                os.remove(link)
            for label in CLAIMS[claim][0]:
                for seed in args.seeds:
                    os.symlink(os.path.abspath(os.path.join(args.out, f"{label}_s{seed}")), f"{out}/{label}_s{seed}")
            subprocess.run([sys.executable, os.path.join(ROOT, "benchmark", "benchmark.py"), "--report-only",
                            "--out", out, "--preset", args.preset], check=True, stdout=subprocess.DEVNULL)
            table = open(os.path.join(out, "table.md")).read().split("\n", 2)[2].replace("## ", "#### ")
            os.makedirs(os.path.join(DOCS, "claims"), exist_ok=True)
            shutil.copy(os.path.join(out, "figure.png"), os.path.join(DOCS, "claims", "critic.png"))
            text = "\n".join(commands(CLAIMS[claim][0], args)) + "\n\n" + table + "\n![critic](claims/critic.png)"
        else:
            text = report(claim, args)
        write_section(claim, text)
        print(f"docs/claims.md: {claim} written")


if __name__ == "__main__":
    main(tyro.cli(Args))
