"""grpo.py against TRL's GRPOTrainer on the same work, on this machine: the same model and prompts, 16 completions a
step (4 prompts x 4) of exactly 48 tokens (see --fixed-length) at temperature 0.7, fp32, a reference model (beta
0.04), one optimizer update per batch in micro-batches of 8, the same rewards (rewards.py's correctness + 0.2 x
format). It prints and writes (to {out}/table.md) the seconds per step of each, the median over the steps after the
first. With --repeats K it runs the two K times, alternately, so that a slow spell of the machine falls on both.

    pip install trl==1.16.0 && python benchmark/vs_trl.py

TRL is not a requirement of this project; only this comparison needs it. Both runs use every core (torch's default
threads) and run one after the other, so nothing else should run beside them.
"""

import os
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass

import tyro

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
import rewards  # noqa: E402
import grpo  # noqa: E402
from grpo import load_model  # noqa: E402

COMMON = {"num_prompts": 4, "group_size": 4, "max_new_tokens": 48, "temperature": 0.7, "learning_rate": 2e-5,
          "beta": 0.04, "clip_eps": 0.2, "micro_batch_size": 8}


@dataclass
class Args:
    steps: int = 8
    """training steps of each run; the first is left out of the median (warm-up)"""
    repeats: int = 1
    """runs of each implementation, alternating (ours, TRL, ours, TRL, ...)"""
    model: str = grpo.Args.model
    """Hub id, save_pretrained folder or .gguf file; saved once as a folder that both load"""
    out: str = "benchmark/vs_trl"
    """output folder: model/, grpo/ (our run), trl/ and table.md"""
    seed: int = 1
    """seed of both runs"""
    fixed_length: bool = True
    """make EOS a token the model does not sample (<repo_name>), so that every completion is exactly 48 tokens in both
    runs and both do the same work; off, the lengths follow the sampling and differ between the runs"""
    trl_gradient_checkpointing: bool = False
    """TRL's GRPOConfig turns gradient checkpointing on by default; off, TRL does the same work as grpo.py"""


def ours(args: Args, model_dir: str) -> list[float]:
    """Seconds between the ends of consecutive steps of `python grpo.py`, from the wall times of its TensorBoard log."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    folder = os.path.join(args.out, "grpo")
    os.makedirs(folder, exist_ok=True)
    flags = [f"--{key.replace('_', '-')}={value}" for key, value in COMMON.items()]
    argv = [sys.executable, os.path.join(ROOT, "grpo.py"), "--model", model_dir, "--steps", str(args.steps), "--seed",
            str(args.seed), "--num-minibatches", "1", "--num-iterations", "1", "--eval-every", "0", *flags]
    with open(os.path.join(folder, "log.txt"), "w") as log:
        subprocess.run(argv, cwd=folder, stdout=log, stderr=subprocess.STDOUT, check=True)
    logs = sorted(os.listdir(os.path.join(folder, "runs")))
    events = EventAccumulator(os.path.join(folder, "runs", logs[-1]), size_guidance={"scalars": 0})
    events.Reload()
    ends = [e.wall_time for e in events.Scalars("charts/step_seconds")]
    return [b - a for a, b in zip(ends, ends[1:])]


def trl(args: Args, model_dir: str) -> list[float]:
    """Seconds between the ends of consecutive optimizer steps of TRL's GRPOTrainer on the same work."""
    from datasets import Dataset
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    task = rewards.builtin_task("arithmetic", 1)
    dataset = Dataset.from_list([{"prompt": [{"role": "user", "content": r["prompt"]}], "answer": r["answer"]}
                                 for r in task.train])

    def correctness(completions, answer, **kwargs):  # TRL passes chat completions and the dataset's columns
        return rewards.correctness_reward([c[0]["content"] for c in completions], answer)

    def format_bonus(completions, answer, **kwargs):
        return rewards.format_reward([c[0]["content"] for c in completions], answer)

    class StepEnds(TrainerCallback):
        def __init__(self):
            self.ends = []

        def on_step_end(self, *a, **k):
            self.ends.append(time.time())

    config = GRPOConfig(
        output_dir=os.path.join(args.out, "trl"), max_steps=args.steps, seed=args.seed, use_cpu=True, bf16=False,
        num_generations=COMMON["group_size"], per_device_train_batch_size=COMMON["micro_batch_size"],
        gradient_accumulation_steps=COMMON["num_prompts"] * COMMON["group_size"] // COMMON["micro_batch_size"],
        max_completion_length=COMMON["max_new_tokens"], temperature=COMMON["temperature"], top_p=1.0, top_k=0,
        learning_rate=COMMON["learning_rate"], lr_scheduler_type="linear", beta=COMMON["beta"],
        epsilon=COMMON["clip_eps"], num_iterations=1, loss_type="grpo", reward_weights=[1.0, 0.2], max_grad_norm=1.0,
        logging_steps=1, report_to="none", save_strategy="no", disable_dropout=True,
        gradient_checkpointing=args.trl_gradient_checkpointing)
    clock = StepEnds()
    trainer = GRPOTrainer(model=model_dir, reward_funcs=[correctness, format_bonus], args=config,
                          train_dataset=dataset, callbacks=[clock])
    trainer.train()
    return [b - a for a, b in zip(clock.ends, clock.ends[1:])]


def main(args: Args) -> None:
    model_dir = os.path.join(args.out, "model_fixed_length" if args.fixed_length else "model")
    if not os.path.isdir(model_dir):  # a plain save_pretrained folder, which TRL loads (the default is a GGUF file)
        tokenizer, model = load_model(args.model)
        if args.fixed_length:  # both scripts stop a completion at the tokenizer's and the generation config's EOS
            tokenizer.eos_token = "<repo_name>"
            model.generation_config.eos_token_id = tokenizer.eos_token_id
        model.save_pretrained(model_dir)
        tokenizer.save_pretrained(model_dir)
        del model
    seconds = {"grpo.py": [], "TRL GRPOTrainer": []}  # per repeat, the seconds of steps 2..steps
    for _ in range(args.repeats):
        seconds["grpo.py"].append(ours(args, os.path.abspath(model_dir)))
        seconds["TRL GRPOTrainer"].append(trl(args, model_dir))
    checkpointing = "on" if args.trl_gradient_checkpointing else "off"
    lengths = "every completion 48 tokens" if args.fixed_length else "completions end at EOS"
    lines = [f"| implementation (TRL's gradient checkpointing {checkpointing}; {lengths}) | s/step, median of steps "
             f"2-{args.steps} of {args.repeats} run(s) | range | median of each run |", "|---|---|---|---|"]
    pooled = {name: [s for run in runs for s in run] for name, runs in seconds.items()}  # every run's steps
    median = {name: statistics.median(steps) for name, steps in pooled.items()}
    for name, steps in pooled.items():
        each = ", ".join(f"{statistics.median(run):.1f}" for run in seconds[name])
        lines.append(f"| {name} | {median[name]:.1f} | {min(steps):.1f}-{max(steps):.1f} | {each} |")
    pairs = ", ".join(f"{statistics.median(a) / statistics.median(b):.2f}x" for a, b in zip(*seconds.values()))
    lines += ["", f"grpo.py takes {median['grpo.py'] / median['TRL GRPOTrainer']:.2f}x TRL's time per step "
              f"(each pair of runs: {pairs})."]
    with open(os.path.join(args.out, "table.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main(tyro.cli(Args))
