"""Memory where the vocabulary makes it large: the log-probs of a micro-batch over a 152k vocabulary (Qwen's) add at
most about 1.5 float32 (B, L, V) tensors at their peak, the logits included: no float32 copy of all the logits, no
copy for the temperature, the entropy a chunk at a time. Each measurement runs in a fresh process (its peak resident
set, against its resident set just before)."""

import subprocess
import sys

import pytest
from conftest import ROOT

# 4 completions of 256 tokens after an 8-token prompt; a one-layer model of width 16, so that the logits are nearly
# all of the memory; one (B, L, V) float32 tensor is 0.58 GiB
MEASURE = """
import resource, sys
import torch
from transformers import LlamaConfig, LlamaForCausalLM
import grpo
torch.set_num_threads(1)
V, B, P, T = 152_064, 4, 8, 256
config = LlamaConfig(vocab_size=V, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                     num_key_value_heads=2, max_position_embeddings=512)
model = LlamaForCausalLM(config)
ids = torch.randint(0, V, (B, P + T))
mask = torch.ones_like(ids)
dtype, grad = sys.argv[1], sys.argv[2] == "grad"
autocast = torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype == "bfloat16")
with torch.set_grad_enabled(grad), autocast:  # the kernels' and threads' own memory first, on 2 tokens
    grpo.token_logprobs(model, ids[:1, -4:], mask[:1, -4:], 2, 0.7)
with open("/proc/self/statm") as f:
    before = int(f.read().split()[1]) * resource.getpagesize()
with torch.set_grad_enabled(grad), autocast:
    logprobs, entropy = grpo.token_logprobs(model, ids, mask, T, 0.7)
    if grad:
        logprobs.sum().backward()
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
assert logprobs.shape == entropy.shape == (B, T) and logprobs.isfinite().all()
print((peak - before) / (B * T * V * 4))
"""


def added_logits_tensors(dtype: str, grad: str) -> float:
    """What one token_logprobs call (and, with grad, its backward) adds at its peak, in float32 (B, L, V) tensors."""
    result = subprocess.run([sys.executable, "-c", MEASURE, dtype, grad], capture_output=True, text=True, cwd=ROOT,
                            timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    return float(result.stdout.split()[-1])


@pytest.mark.parametrize("dtype", ["float32", pytest.param("bfloat16", marks=pytest.mark.slow)])
def test_log_probs_over_a_152k_vocabulary_add_at_most_1_5_logits_tensors(dtype):
    """Without a gradient (pi_old, pi_ref): the logits themselves (1 in float32, 0.5 in bf16) and a few chunks."""
    added = added_logits_tensors(dtype, "no_grad")
    print(f"{dtype}, no grad: {added:.2f} float32 (B, L, V) tensors")
    assert added <= 1.5


@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_training_pass_over_a_152k_vocabulary_keeps_one_float32_copy(dtype):
    """With a gradient, forward and backward: the logits, the float32 chunks logsumexp keeps for its backward (one
    tensor in all) and the logits' gradient, at most 2.5 tensors (5 before the log-probs were taken in chunks)."""
    added = added_logits_tensors(dtype, "grad")
    print(f"{dtype}, with grad: {added:.2f} float32 (B, L, V) tensors")
    assert added <= 2.5
