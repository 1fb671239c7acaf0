"""A learned reward model in place of the rule, on the CPU: does it teach as well, and does its score keep rising
after true accuracy stops (reward-model over-optimization, Gao et al. 2022)? One command, in stages; a stage whose
output exists is not redone, so a stopped command picks up where it was.

    python experiments/reward_model.py                 # pairs, the reward model, the runs, docs/reward_model.md
    python experiments/reward_model.py --report-only   # redraw from what is there

1. Pairs: the policy, SmolLM2-135M-Instruct, samples 8 completions of each of up to 400 training prompts (the
   built-in arithmetic task has 331) as the scripts sample (temperature 0.7, full softmax); the task's checker labels
   each. A prompt with a correct and a wrong completion gives up to 2 pairs (correct, wrong); the last 20% of prompts
   are held out.
2. The reward model: the same SmolLM2 with a scalar head (transformers' LlamaForSequenceClassification, the head
   new), trained on the pairs with the Bradley-Terry loss -log sigmoid(r_correct - r_wrong) in plain PyTorch: a loop
   of a dozen lines, which TRL's RewardTrainer would wrap in its own arguments and data collator. It reads each pair
   exactly as the scripts' --reward-model does (rewards.RewardModel: its own chat template). Its accuracy on the
   held-out pairs is reported.
3. Runs: grpo.py and ppo.py with `--reward-model` it and `--reward-weights.correctness 0 --reward-weights.format 0`
   (no rule reward; correctness still logged), each
   script's defaults, 3 seeds, two at a time with one thread each; against the same scripts, seeds and defaults
   with the rule reward, benchmark/benchmark.py's runs in benchmark/cpu (run here where they are missing).
4. docs/reward_model.png (the reward model's score and the checker's held-out accuracy, every evaluation, every
   seed) and the table in docs/reward_model.md between its markers.
"""

import glob
import json
import os
import random
import re
import shlex
import shutil
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
import tyro

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "benchmark"))
import benchmark  # noqa: E402  (runs logged as the benchmark logs them, and read back)
import grpo  # noqa: E402  (load_model: the default model resolves to its offline GGUF copy)
import rewards  # noqa: E402

OUT = os.path.join(ROOT, "experiments", "runs", "reward_model")
DOC = os.path.join(ROOT, "docs", "reward_model.md")
SCRIPTS = ["grpo", "ppo"]


@dataclass
class Args:
    seeds: list[int] = field(default_factory=lambda: [1, 2, 3])
    prompts: int = 400  # training prompts sampled for pairs (the last 20% held out)
    samples: int = 8  # completions per prompt
    epochs: int = 2  # over the training pairs
    learning_rate: float = 1e-5
    pairs_per_batch: int = 8
    checker_out: str = os.path.join(ROOT, "benchmark", "cpu")  # the rule-reward runs: {script}_s{seed}
    report_only: bool = False


def sample_pairs(args: Args, path: str) -> None:
    """Stage 1: {"prompt", "correct", "wrong", "held_out"} lines in `path`."""
    tokenizer, model = grpo.load_model(grpo.Args.model)
    model.eval()
    task = rewards.builtin_task("arithmetic", 1)
    records = task.train[: args.prompts]
    rewards.encode_prompts(tokenizer, records, 256)
    torch.manual_seed(0)
    pairs = []
    for start in range(0, len(records), 16):
        chunk = records[start : start + 16]
        inputs = tokenizer.pad({"input_ids": [r["prompt_ids"] for r in chunk]}, return_tensors="pt")
        with torch.no_grad():
            out = model.generate(**inputs, do_sample=True, temperature=0.7, top_k=0, top_p=1.0, max_new_tokens=48,
                                 num_return_sequences=args.samples, pad_token_id=tokenizer.pad_token_id)
        texts = tokenizer.batch_decode(out[:, inputs["input_ids"].shape[1]:], skip_special_tokens=True)
        for i, record in enumerate(chunk):
            group = texts[i * args.samples : (i + 1) * args.samples]
            correct = task.correctness(group, [record["answer"]] * len(group))
            right = list(dict.fromkeys(t for t, c in zip(group, correct) if c == 1))
            wrong = list(dict.fromkeys(t for t, c in zip(group, correct) if c == 0))
            held_out = start + i >= 0.8 * len(records)
            pairs += [{"prompt": record["prompt"], "correct": r, "wrong": w, "held_out": held_out}
                      for r, w in list(zip(right, wrong))[:2]]
        print(f"pairs: {start + len(chunk)} of {len(records)} prompts, {len(pairs)} pairs", flush=True)
    with open(path, "w") as f:
        f.writelines(json.dumps(pair) + "\n" for pair in pairs)


def pair_scores(reward_model, pairs: list[dict]) -> tuple[torch.Tensor, torch.Tensor]:
    """The reward model's scores of each pair's correct and wrong completion, with gradients."""
    prompts = [p["prompt"] for p in pairs] * 2
    texts = reward_model.texts(prompts, [p["correct"] for p in pairs] + [p["wrong"] for p in pairs])
    inputs = reward_model.tokenizer(texts, padding=True, add_special_tokens=False, return_tensors="pt")
    scores = reward_model.model(**inputs).logits[:, 0]
    return scores[: len(pairs)], scores[len(pairs):]


def train_reward_model(args: Args, pairs_path: str, folder: str) -> None:
    """Stage 2: the policy with a new scalar head, trained with the Bradley-Terry loss; saved with save_pretrained,
    and its held-out pair accuracy in folder/accuracy.json."""
    from transformers import LlamaForSequenceClassification

    tokenizer, policy = grpo.load_model(grpo.Args.model)
    config = policy.config
    config.num_labels, config.pad_token_id, config.architectures = 1, tokenizer.pad_token_id, None
    torch.manual_seed(0)
    classifier = LlamaForSequenceClassification(config)
    missing, _ = classifier.load_state_dict(policy.state_dict(), strict=False)
    assert missing == ["score.weight"], missing  # everything but the new head is the policy's
    os.makedirs(folder + ".tmp", exist_ok=True)
    classifier.save_pretrained(folder + ".tmp")
    tokenizer.save_pretrained(folder + ".tmp")
    # the scorer the scripts build, trained in place, so that it reads the pairs exactly as they will
    reward_model = rewards.RewardModel(folder + ".tmp", torch.float32, torch.device("cpu"), 64)
    model = reward_model.model.train().requires_grad_(True)
    pairs = [json.loads(line) for line in open(pairs_path)]
    train = [p for p in pairs if not p["held_out"]]
    held_out = [p for p in pairs if p["held_out"]]
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.learning_rate)
    rng = random.Random(0)
    log = []
    for epoch in range(args.epochs):
        rng.shuffle(train)
        for start in range(0, len(train), args.pairs_per_batch):
            chosen, rejected = pair_scores(reward_model, train[start : start + args.pairs_per_batch])
            loss = -F.logsigmoid(chosen - rejected).mean()  # Bradley-Terry
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            log.append(loss.item())
        print(f"reward model: epoch {epoch + 1}, mean loss of its last 20 batches {statistics.mean(log[-20:]):.3f}",
              flush=True)
    model.eval()
    with torch.no_grad():
        margins = torch.cat([torch.sub(*pair_scores(reward_model, held_out[i : i + 16]))
                             for i in range(0, len(held_out), 16)])
    accuracy = (margins > 0).float().mean().item()
    print(f"reward model: held-out pair accuracy {accuracy:.3f} on {len(held_out)} pairs", flush=True)
    model.save_pretrained(folder + ".tmp")
    with open(os.path.join(folder + ".tmp", "accuracy.json"), "w") as f:
        json.dump({"held_out_pairs": len(held_out), "train_pairs": len(train), "held_out_accuracy": accuracy,
                   "loss": log}, f)
    os.rename(folder + ".tmp", folder)


def command(script: str, seed: int, reward_model: str | None) -> list[str]:
    extra = ["--reward-model", reward_model, "--reward-weights.correctness", "0", "--reward-weights.format", "0"]
    extra = extra if reward_model else []
    return [sys.executable, os.path.join(ROOT, f"{script}.py"), "--seed", str(seed), *extra]


def finished(folder: str) -> bool:
    log = os.path.join(folder, "log.txt")
    return os.path.isfile(log) and "held-out greedy accuracy:" in open(log).read()


def run_all(args: Args, reward_model: str) -> None:
    """Every run not yet finished, two at a time, one thread each; checkpoints are not kept."""
    jobs = [(os.path.join(OUT, f"{script}_rm_s{seed}"), command(script, seed, reward_model))
            for script in SCRIPTS for seed in args.seeds]
    jobs += [(os.path.join(args.checker_out, f"{script}_s{seed}"), command(script, seed, None))
             for script in SCRIPTS for seed in args.seeds]

    def run(job):
        folder, argv = job
        if not finished(folder) and benchmark.run_logged(argv, folder, 1) != 0:
            return
        # a checker run's last policy, scored by the reward model too (an evaluation alone, --steps 0)
        final = os.path.join(folder, "checkpoints", "*", "step_20")
        if "--reward-model" not in argv and not os.path.isdir(os.path.join(folder, "rm_eval", "runs")):
            (checkpoint,) = glob.glob(final)
            argv = [*argv[:2], "--model", checkpoint, "--steps", "0", "--reward-model", reward_model]
            benchmark.run_logged(argv, os.path.join(folder, "rm_eval"), 1)
        shutil.rmtree(os.path.join(folder, "checkpoints"), ignore_errors=True)

    with ThreadPoolExecutor(2) as pool:
        list(pool.map(run, jobs))


def curves(folder: str) -> dict[str, dict[int, float]]:
    """A run's evaluations by step: eval_accuracy and, where it had a reward model, eval_reward_model."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    (log,) = glob.glob(os.path.join(folder, "runs", "*"))
    events = EventAccumulator(log, size_guidance={"scalars": 0})
    events.Reload()
    tags = events.Tags()["scalars"]
    return {tag: {e.step: e.value for e in events.Scalars(f"charts/{tag}")} if f"charts/{tag}" in tags else {}
            for tag in ["eval_accuracy", "eval_reward_model"]}


def report(args: Args, reward_model: str) -> str:
    stats = json.load(open(os.path.join(reward_model, "accuracy.json")))
    runs = {(script, arm, seed): curves(os.path.join(OUT if arm == "rm" else args.checker_out,
                                                     f"{script}_{'rm_' if arm == 'rm' else ''}s{seed}"))
            for script in SCRIPTS for arm in ["rm", "checker"] for seed in args.seeds}
    # a checker run's reward-model score: its last policy's, evaluated apart (rm_eval), and at step 0 the same policy's
    for script in SCRIPTS:
        for seed in args.seeds:
            checker = runs[(script, "checker", seed)]
            rm_eval = curves(os.path.join(args.checker_out, f"{script}_s{seed}", "rm_eval"))
            (score,) = rm_eval["eval_reward_model"].values()
            checker["eval_reward_model"] = {0: runs[(script, "rm", seed)]["eval_reward_model"][0],
                                            max(checker["eval_accuracy"]): score}
    figure(runs, args.seeds, os.path.join(ROOT, "docs", "reward_model.png"))
    dates = sorted({time.strftime("%Y-%m-%d", time.gmtime(os.path.getmtime(os.path.join(OUT, name, "log.txt"))))
                    for name in os.listdir(OUT) if finished(os.path.join(OUT, name))})
    lines = [f"The reward model: {stats['train_pairs']} training pairs, {args.epochs} epochs; held-out pair accuracy "
             f"**{stats['held_out_accuracy']:.3f}** on {stats['held_out_pairs']} pairs.", "",
             f"Runs finished {', '.join(dates)} on a {os.cpu_count()}-core CPU, two at a time, one thread each, "
             f"seeds {' '.join(map(str, args.seeds))}:", ""]
    for script in SCRIPTS:
        for arm, path in [("reward model", reward_model), ("checker", None)]:
            argv = shlex.join(command(script, 1, path)[1:]).replace(ROOT + "/", "")
            argv = argv.replace("--seed 1", "--seed N")
            lines.append(f"- {script}, {arm}: `python {argv}`")
    lines += ["", "| script | reward | seed | held-out accuracy, step 0 -> best -> last | reward-model score, step 0 "
              "-> best -> last | step of best accuracy, of best score |", "|---|---|---|---|---|---|"]
    for (script, arm, seed), curve in runs.items():
        cells = []
        for tag in ["eval_accuracy", "eval_reward_model"]:
            c = curve[tag]
            cells.append(f"{c[0]:.3f} -> {max(c.values()):.3f} -> {c[max(c)]:.3f}" if c else "-")
        best = [str(max(curve[tag], key=curve[tag].get)) if curve[tag] else "-"
                for tag in ["eval_accuracy", "eval_reward_model"]]
        reward = "reward model" if arm == "rm" else "checker"
        lines.append(f"| {script} | {reward} | {seed} | {cells[0]} | {cells[1]} | {', '.join(best)} |")
    lines += ["", "| script | reward | held-out accuracy, step 0 -> last, mean (range) over seeds |", "|---|---|---|"]
    for script in SCRIPTS:
        for arm in ["rm", "checker"]:
            last = [runs[(script, arm, s)]["eval_accuracy"] for s in args.seeds]
            last = [c[max(c)] for c in last]
            first = runs[(script, arm, args.seeds[0])]["eval_accuracy"][0]
            lines.append(f"| {script} | {'reward model' if arm == 'rm' else 'checker'} | {first:.3f} -> "
                         f"{statistics.mean(last):.3f} ({min(last):.3f}-{max(last):.3f}) |")
    lines += ["", "![reward model](reward_model.png)"]
    return "\n".join(lines)


def figure(runs: dict, seeds: list[int], path: str) -> None:
    """Per script: the reward model's score (left axis) and the checker's held-out accuracy (right), every seed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2 * len(SCRIPTS), figsize=(16, 3.4))
    for column, script in enumerate(SCRIPTS):
        score_ax, accuracy_ax = axes[2 * column], axes[2 * column + 1]
        for i, seed in enumerate(seeds):
            for arm, style in [("rm", "-"), ("checker", "--")]:
                curve = runs[(script, arm, seed)]
                label = f"seed {seed}, {'reward model' if arm == 'rm' else 'checker'}"
                for ax, tag in [(score_ax, "eval_reward_model"), (accuracy_ax, "eval_accuracy")]:
                    c = curve[tag]
                    if c:
                        ax.plot(sorted(c), [c[s] for s in sorted(c)], style, color=f"C{i}", marker=".", label=label)
        score_ax.set_title(f"{script}: reward-model score, held out", fontsize=10)
        accuracy_ax.set_title(f"{script}: true accuracy, held out", fontsize=10)
        for ax in (score_ax, accuracy_ax):
            ax.set_xlabel("step")
    axes[1].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=70)
    plt.close(fig)


def main(args: Args) -> None:
    os.makedirs(OUT, exist_ok=True)
    pairs_path = os.path.join(OUT, "pairs.jsonl")
    reward_model = os.path.join(OUT, "reward_model")
    if not args.report_only:
        if not os.path.isfile(pairs_path):
            sample_pairs(args, pairs_path + ".tmp")
            os.rename(pairs_path + ".tmp", pairs_path)
        if not os.path.isdir(reward_model):
            train_reward_model(args, pairs_path, reward_model)
        run_all(args, reward_model)
    begin, end = "<!-- written by experiments/reward_model.py -->", "<!-- end -->"
    doc = open(DOC).read()
    text = report(args, reward_model)
    doc = re.sub(re.escape(begin) + ".*?" + re.escape(end), lambda _: f"{begin}\n{text}\n{end}", doc, flags=re.S)
    with open(DOC, "w") as f:
        f.write(doc)
    print("docs/reward_model.md written")


if __name__ == "__main__":
    main(tyro.cli(Args))
