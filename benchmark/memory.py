"""Peak memory (resident set) of a script's processes on the CPU: one process against N under torchrun (FSDP2), each
rank apart, at set-up (models loaded and sharded, before the first step), after a step and after its checkpoint, and
the same for a run resumed from a checkpoint. A randomly initialised Llama of about 150M parameters (built once, cached
in --out) trains for one step on a toy task in bf16 with the KL term on (so the reference model exists), one thread
per process.

    python benchmark/memory.py --out /tmp/memory                  # grpo; 1, 2 and 4 processes; their resumes too
    python benchmark/memory.py --script ppo --processes 1 2 --no-resume --max-new-tokens 8

Each process records its peak RSS (getrusage's ru_maxrss) when the script's start_run is called (everything loaded),
when save_checkpoint is first called (the step done) and at exit (the checkpoint written), in a JSON file per
rank; the step time is read from the run's TensorBoard events (charts/step_seconds).
Writes --out/memory.md.
"""

import atexit
import json
import os
import resource
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, field

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PHASES = ["start", "step", "saved", "resume start", "resume step", "resume saved"]


@dataclass
class Args:
    out: str = "memory"
    """the folder of the model, the task, the runs and memory.md"""
    script: str = "grpo"
    """grpo, gspo, dapo or ppo"""
    processes: list[int] = field(default_factory=lambda: [1, 2, 4])
    """numbers of processes measured, one configuration at a time (1: plain python, no torchrun)"""
    resume: bool = True
    """also a run of two steps, checkpointed after each, resumed from step_1 with as many processes"""
    max_new_tokens: int = 16
    """completion length limit of the runs"""
    mmap_threshold: int = 65536
    """glibc's MALLOC_MMAP_THRESHOLD_ in the runs, bytes (0: glibc's own, which rises as large blocks are freed):
    fixed, every block above it is returned to the system when freed, so that the resident set follows the tensors
    alive (as CUDA's max_memory_allocated does) rather than what glibc keeps for later"""


def peak_gb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux


def worker(script: str, record: str, argv: list[str]) -> None:
    """In each process: the script's main() on `argv`, its start_run wrapped to record the peak RSS at set-up, its
    save_checkpoint at the first save; the final peak at exit. {record}_rank{RANK}.json: {"start", "step", "exit":
    GB}."""
    import tyro

    sys.path.insert(0, ROOT)
    module = __import__(script)
    path = f"{record}_rank{os.environ.get('RANK', '0')}.json"
    peaks = {}

    def write(phase: str) -> None:
        peaks[phase] = peak_gb()
        with open(path, "w") as f:
            json.dump(peaks, f)

    start_run = module.start_run

    def recorded_start_run(*args, **kwargs):
        write("start")
        return start_run(*args, **kwargs)

    module.start_run = recorded_start_run
    save_checkpoint = module.save_checkpoint

    def recorded_save_checkpoint(*args, **kwargs):
        if "step" not in peaks:
            write("step")
        return save_checkpoint(*args, **kwargs)

    module.save_checkpoint = recorded_save_checkpoint
    atexit.register(write, "exit")
    module.main(tyro.cli(module.Args, args=argv))


def build(out: str) -> tuple[str, str]:
    """The model folder and the task file in `out`, made once: a random Llama (hidden 768, 12 layers, vocab 32000,
    untied head) with a character tokenizer padded to its vocabulary; a task whose answer is its prompt, a digit."""
    import torch
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    model, task = os.path.join(out, "model"), os.path.join(out, "copy.jsonl")
    if not os.path.exists(task):
        with open(task, "w") as f:
            for i in range(200):
                f.write(json.dumps({"prompt": f"{i % 10}", "answer": f"{i % 10}"}) + "\n")
    if os.path.exists(os.path.join(model, "model.safetensors")):
        return model, task
    tokens = ["<pad>", "<s>", "</s>", "<unk>", *"0123456789+-=?ab "]
    vocab = {token: i for i, token in enumerate(tokens + [f"<{i}>" for i in range(32_000 - len(tokens))])}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Split(Regex("."), "isolated")  # one token per character
    backend.decoder = decoders.Fuse()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="<pad>", bos_token="<s>",
                                        eos_token="</s>", unk_token="<unk>")
    config = LlamaConfig(vocab_size=len(vocab), hidden_size=768, intermediate_size=2560, num_hidden_layers=12,
                         num_attention_heads=12, num_key_value_heads=12, max_position_embeddings=512,
                         pad_token_id=0, bos_token_id=1, eos_token_id=2, tie_word_embeddings=False)
    torch.manual_seed(0)
    llama = LlamaForCausalLM(config)
    print(f"model: {sum(p.numel() for p in llama.parameters()) / 1e6:.1f}M parameters, in {model}")
    llama.save_pretrained(model)
    tokenizer.save_pretrained(model)
    return model, task


def launch(args: Args, processes: int, cwd: str, argv: list[str]) -> tuple[dict, float, float]:
    """One run in `cwd`: every rank's peaks ({rank: {"start", "exit"}}), its last step's seconds, its wall time."""
    os.makedirs(cwd)
    record = os.path.join(cwd, "peak")
    torchrun = ["-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(processes)]
    command = [sys.executable, *(torchrun if processes > 1 else []), os.path.abspath(__file__), "--worker",
               args.script, record, *argv]
    begin = time.time()
    malloc = {"MALLOC_MMAP_THRESHOLD_": str(args.mmap_threshold)} if args.mmap_threshold else {}
    result = subprocess.run(command, cwd=cwd, capture_output=True, text=True,
                            env={**os.environ, "OMP_NUM_THREADS": "1", **malloc})
    wall = time.time() - begin
    with open(os.path.join(cwd, "output.txt"), "w") as f:
        f.write(result.stdout + result.stderr)
    if result.returncode != 0:
        raise SystemExit(f"error: {' '.join(command)} failed in {cwd}:\n{result.stdout[-3000:]}{result.stderr[-3000:]}")
    peaks = {}
    for rank in range(processes):
        with open(f"{record}_rank{rank}.json") as f:
            peaks[rank] = json.load(f)
    return peaks, step_seconds(cwd), wall


def step_seconds(cwd: str) -> float:
    """charts/step_seconds of the last step logged by the one run under cwd/runs."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    (run,) = os.listdir(os.path.join(cwd, "runs"))
    events = EventAccumulator(os.path.join(cwd, "runs", run))
    events.Reload()
    return events.Scalars("charts/step_seconds")[-1].value


def main(args: Args) -> None:
    out = os.path.abspath(args.out)
    os.makedirs(out, exist_ok=True)
    model, task = build(out)
    common = ["--model", model, "--task", task, "--dtype", "bfloat16", "--beta", "0.04", "--num-prompts", "4",
              "--group-size", "4", "--num-minibatches", "1", "--max-new-tokens", str(args.max_new_tokens),
              "--micro-batch-size", "4", "--eval-every", "0"]
    rows, walls = [], []  # rows: (processes, rank, phase, peak GB, step seconds)
    for processes in args.processes:
        work, checkpoints = os.path.join(out, "work", str(processes)), os.path.join(out, f"ckpt_{processes}")
        for folder in (work, checkpoints):
            shutil.rmtree(folder, ignore_errors=True)
        runs = {"step": common + ["--steps", "1", "--output-dir", checkpoints]}
        if args.resume:
            runs["checkpoint"] = common + ["--steps", "2", "--save-every", "1", "--keep-checkpoints", "0",
                                           "--output-dir", checkpoints]
        for name, argv in runs.items():
            peaks, seconds, wall = launch(args, processes, os.path.join(work, name), argv)
            walls.append((processes, name, wall))
            print(f"{processes} processes, {name} run: {wall:.0f} s, step {seconds:.1f} s, peaks {peaks}")
            if name == "checkpoint":  # resumed from its step_1, the same processes
                (run,) = os.listdir(os.path.join(work, name, "runs"))
                argv = ["--resume", os.path.join(checkpoints, run, "step_1")]
                peaks, seconds, wall = launch(args, processes, os.path.join(work, "resume"), argv)
                walls.append((processes, "resume", wall))
                print(f"{processes} processes, resume: {wall:.0f} s, step {seconds:.1f} s, peaks {peaks}")
            phases = ("resume start", "resume step", "resume saved") if name == "checkpoint" else PHASES[:3]
            for rank, peak in peaks.items():
                rows.append((processes, rank, phases[0], peak["start"], None))
                rows.append((processes, rank, phases[1], peak["step"], seconds))
                rows.append((processes, rank, phases[2], peak["exit"], None))
        shutil.rmtree(checkpoints)  # gigabytes each
    one = {phase: gb for processes, rank, phase, gb, _ in rows if processes == 1}
    rows.sort(key=lambda row: (row[0], row[1], PHASES.index(row[2])))
    lines = [f"Peak resident set (ru_maxrss) of each process of `{args.script}.py`, {model} (random Llama), "
             "--dtype bfloat16 --beta 0.04 --num-prompts 4 --group-size 4 --num-minibatches 1 "
             f"--micro-batch-size 4 --max-new-tokens {args.max_new_tokens}, OMP_NUM_THREADS=1 per process, "
             f"MALLOC_MMAP_THRESHOLD_={args.mmap_threshold or 'unset'}. start: "
             "at start_run (models loaded and sharded, a resume's checkpoint read); step: after one step, before its "
             "checkpoint; saved: at exit, the checkpoint written.", "",
             "| processes | rank | phase | peak RSS (GB) | / 1 process, same phase | step (s) |", "|-|-|-|-|-|-|"]
    for processes, rank, phase, gb, seconds in rows:
        ratio = f"{gb / one[phase]:.2f}" if phase in one else ""
        step = f"{seconds:.1f}" if seconds is not None else ""
        lines.append(f"| {processes} | {rank} | {phase} | {gb:.2f} | {ratio} | {step} |")
    walls = ", ".join(f"{processes} processes {name} {wall:.0f} s" for processes, name, wall in walls)
    lines += ["", f"Wall time of each run: {walls}."]
    text = "\n".join(lines) + "\n"
    print(text)
    with open(os.path.join(out, "memory.md"), "w") as f:
        f.write(text)


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        worker(sys.argv[2], sys.argv[3], sys.argv[4:])
    else:
        import tyro

        main(tyro.cli(Args))
