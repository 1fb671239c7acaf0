"""Run a script's main() with sampling and scoring replaced by fixed functions of the prompt, so that one process
and several (under torchrun) train on exactly the same completions with the same rewards; SGD in place of AdamW, whose
first step is nearly sign(g). Usage: python tests/fixed_rollouts.py grpo ARGS... (or under torchrun)."""

import importlib
import json
import os
import sys

import torch
import tyro

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MAX_NEW_TOKENS = 4
BARE_EOS = os.environ.get("BARE_EOS") == "1"  # rank 0's completions are all a bare EOS (one process: the first half)


def fixed_sample(model, tokenizer, prompt_ids, repeat, gen_config, draw):
    """What `sample` returns, for completions drawn from a generator seeded by the prompt: completion j of a group
    starts with the digit j, then random digits, and ends with EOS at a random place, or not at all (truncated).
    With BARE_EOS, the completions of rank 0's prompts (of the first half, in one process) are one EOS token."""
    width, T, pad = max(len(ids) for ids in prompt_ids), MAX_NEW_TOKENS, tokenizer.pad_token_id
    eos = gen_config.eos_token_id[0]
    digits = tokenizer.convert_tokens_to_ids(list("0123456789"))
    rows, prompt_masks, completion_masks = [], [], []
    rank, world = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    for p, ids in enumerate(prompt_ids):
        generator = torch.Generator().manual_seed(sum((i + 1) * t for i, t in enumerate(ids)))
        bare = BARE_EOS and (rank == 0 if world > 1 else p < len(prompt_ids) // 2)
        for j in range(repeat):
            completion = [digits[j % 10]] + [digits[d] for d in torch.randint(0, 10, (T - 1,), generator=generator)]
            end = int(torch.randint(1, T + 1, (1,), generator=generator))  # EOS at position `end`; T: truncated
            if bare:
                completion[0], end = eos, 0
            if end < T:
                completion[end] = eos
            length = min(end + 1, T)
            rows.append([pad] * (width - len(ids)) + ids + completion)
            prompt_masks.append([0] * (width - len(ids)) + [1] * len(ids))
            completion_masks.append([1] * length + [0] * (T - length))
    completion_mask = torch.tensor(completion_masks)
    attention_mask = torch.cat([torch.tensor(prompt_masks), completion_mask], 1)
    truncated = completion_mask.sum(1) == T
    device = next(model.parameters()).device
    texts = [tokenizer.decode(row[width : width + sum(m)], skip_special_tokens=True)
             for row, m in zip(rows, completion_masks)]
    batch = importlib.import_module(sys.argv[1]).Batch  # the script's
    # the sampler's log-probs, as `sample` records them (for the charts only): these completions have none, 0
    sampler_logprobs = torch.zeros(completion_mask.shape, device=device)
    return batch(input_ids=torch.tensor(rows, device=device), attention_mask=attention_mask.to(device),
                 completion_mask=completion_mask.to(device), truncated=truncated.to(device), completions=texts,
                 sampler_logprobs=sampler_logprobs)


def fixed_score(completions, answers, task, weights, prompts=None):
    """Correctness 1 for a completion that starts with an even digit: every group of two or more has contrast."""
    correct = torch.tensor([float(c[:1] in "02468") for c in completions])
    return correct, {"correctness": correct}


def recording(shard):
    """`shard`, also writing what this process holds of each sharded module to $REPORT_SHARDS.{rank}.json: the bytes
    of its parameters' local shards and of the whole parameters, and the device of the input module."""
    def wrapped(module, layer_names, device, *args, **kwargs):
        full = sum(p.numel() * p.element_size() for p in module.parameters())
        where = str(next(module.parameters()).device)
        module = shard(module, layer_names, device, *args, **kwargs)
        local = sum(p.to_local().numel() * p.element_size() for p in module.parameters())
        records.append({"full": full, "local": local, "loaded_on": where})
        with open(f"{os.environ['REPORT_SHARDS']}.{os.environ.get('RANK', '0')}.json", "w") as f:
            json.dump(records, f)
        return module
    records = []
    return wrapped


def recording_saved(token_logprobs):
    """`token_logprobs`, also writing to $REPORT_SAVED.{rank}.json, after each pass with a gradient, the tensors that
    autograd keeps for its backward and whose memory is still held then (FSDP2 frees the weights it gathered for a
    layer once the layer has run): [dtype, shape, bytes] of each, one storage once."""
    def wrapped(*args, **kwargs):
        if not torch.is_grad_enabled():
            return token_logprobs(*args, **kwargs)
        kept = []
        with torch.autograd.graph.saved_tensors_hooks(lambda x: kept.append(x) or x, lambda x: x):
            result = token_logprobs(*args, **kwargs)
        held = {x.untyped_storage().data_ptr(): [str(x.dtype), list(x.shape), x.untyped_storage().nbytes()]
                for x in kept if x.untyped_storage().nbytes() > 0}
        passes.append(list(held.values()))
        with open(f"{os.environ['REPORT_SAVED']}.{os.environ.get('RANK', '0')}.json", "w") as f:
            json.dump(passes, f)
        return result
    passes = []
    return wrapped


if __name__ == "__main__":
    module = importlib.import_module(sys.argv[1])
    if "REPORT_SHARDS" in os.environ:
        module.shard = recording(module.shard)
    if "REPORT_SAVED" in os.environ:
        module.token_logprobs = recording_saved(module.token_logprobs)
    module.sample, module.rewards.score = fixed_sample, fixed_score
    torch.optim.AdamW = lambda params, lr, **options: torch.optim.SGD(params, lr=lr)
    module.main(tyro.cli(module.Args, args=sys.argv[2:] + ["--max-new-tokens", str(MAX_NEW_TOKENS)]))
