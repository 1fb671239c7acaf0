"""Sparse upcycling (Komatsuzaki et al. 2022, arXiv 2212.05055): a mixture-of-experts model made from a dense Llama-type
model by copying each MLP into E experts behind a new router, as a Mixtral model that every script loads by path.

    python experiments/moe.py --out experiments/models/smollm2-moe            # SmolLM2-135M-Instruct, 4 experts, top 2

Mixtral's router takes a softmax over the E experts and keeps the top k, renormalised to sum to 1; with identical
experts the layer's output is then sum_k w_k MLP(x) = MLP(x), so the upcycled model computes the dense model's
logits (to float rounding) and starts training from its accuracy. The router is random (normal, the model's
initializer_range), so tokens spread over the experts from the start; the experts drift apart as they train.
"""

import os
import sys
from dataclasses import dataclass

import torch
import tyro
from transformers import MixtralConfig, MixtralForCausalLM

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@dataclass
class Args:
    model: str = "HuggingFaceTB/SmolLM2-135M-Instruct"  # a dense Llama-type model, as the scripts' --model takes it
    out: str = "experiments/models/smollm2-moe"  # the save_pretrained folder written
    experts: int = 4  # E, copies of each MLP
    top_k: int = 2  # experts each token uses
    seed: int = 0  # of the router's initialisation


def upcycle(dense, experts: int, top_k: int, seed: int) -> MixtralForCausalLM:
    c = dense.config
    if c.model_type != "llama" or c.mlp_bias or c.attention_bias:
        raise SystemExit(f"error: upcycling takes a Llama-type model without biases, not {c.model_type}")
    config = MixtralConfig(
        vocab_size=c.vocab_size, hidden_size=c.hidden_size, intermediate_size=c.intermediate_size,
        num_hidden_layers=c.num_hidden_layers, num_attention_heads=c.num_attention_heads,
        num_key_value_heads=c.num_key_value_heads, head_dim=c.head_dim, hidden_act=c.hidden_act,
        max_position_embeddings=c.max_position_embeddings, rms_norm_eps=c.rms_norm_eps,
        rope_parameters=c.rope_parameters, tie_word_embeddings=c.tie_word_embeddings,
        initializer_range=c.initializer_range, bos_token_id=c.bos_token_id, eos_token_id=c.eos_token_id,
        pad_token_id=c.pad_token_id, num_local_experts=experts, num_experts_per_tok=top_k, router_jitter_noise=0.0,
        output_router_logits=False)
    with torch.device("meta"):  # no random initialisation: every weight is assigned below
        moe = MixtralForCausalLM(config)
    weights = {k: v for k, v in dense.state_dict().items() if ".mlp." not in k}  # embeddings, attention, norms
    generator = torch.Generator().manual_seed(seed)
    for i, layer in enumerate(dense.model.layers):
        mlp = layer.mlp
        gate_up = torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight])  # (2I, H)
        weights[f"model.layers.{i}.mlp.experts.gate_up_proj"] = gate_up.expand(experts, -1, -1).clone()  # (E, 2I, H)
        weights[f"model.layers.{i}.mlp.experts.down_proj"] = mlp.down_proj.weight.expand(experts, -1, -1).clone()
        weights[f"model.layers.{i}.mlp.gate.weight"] = torch.randn(experts, c.hidden_size, generator=generator) \
            * c.initializer_range  # (E, H)
    missing, unexpected = moe.load_state_dict(weights, strict=False, assign=True)
    if unexpected or set(missing) - {"lm_head.weight"} or (missing and not c.tie_word_embeddings):
        raise SystemExit(f"error: this transformers' Mixtral has another layout (needs transformers >= 5): {missing}")
    moe.tie_weights()  # (tied: lm_head.weight is the embedding)
    moe.model.rotary_emb = type(moe.model.rotary_emb)(config)  # its buffers, computed, not loaded
    moe.generation_config = dense.generation_config
    return moe.float().eval()


def main(args: Args) -> None:
    sys.path.insert(0, ROOT)
    from grpo import load_model  # as the scripts load it: the default model resolves to its offline GGUF copy

    tokenizer, dense = load_model(args.model)
    moe = upcycle(dense, args.experts, args.top_k, args.seed)
    ids = tokenizer("Upcycling copies each MLP into several experts.", return_tensors="pt").input_ids
    with torch.no_grad():
        gap = (moe(ids).logits - dense(ids).logits).abs().max().item()
    moe.save_pretrained(args.out)
    tokenizer.save_pretrained(args.out)
    n = sum(p.numel() for p in moe.parameters())
    print(f"saved {args.out}: {args.experts} experts, top {args.top_k}, {n / 1e6:.0f}M parameters; "
          f"largest logit difference from the dense model {gap:.2e}")


if __name__ == "__main__":
    main(tyro.cli(Args))
