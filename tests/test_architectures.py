"""Any causal LM: tiny randomly initialised models of several architectures, built from their configs (no download).
The shared-prompt forward gives the log-probs of whole rows on each; models whose cache holds recurrent state
(Qwen3-Next's linear attention) run whole rows and a plain generate, and say so; GRPO and PPO (its critic) train on
each (slow)."""

import glob
import os
import shutil
import subprocess
import sys

import pytest
import torch
import tyro
import grpo
import ppo
from conftest import OWN_ARGS
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, GenerationConfig

SIZE = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            max_position_embeddings=64)
ARCHITECTURES = {
    "llama": dict(num_key_value_heads=2),
    "qwen3_next": dict(num_key_value_heads=2, head_dim=8, layer_types=["linear_attention", "full_attention"],
                       linear_num_value_heads=4, linear_num_key_heads=2, linear_key_head_dim=8, linear_value_head_dim=8,
                       linear_conv_kernel_dim=4, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
                       shared_expert_intermediate_size=16, decoder_sparse_step=1),  # hybrid, and mixture of experts
    "qwen3_moe": dict(num_key_value_heads=2, head_dim=8, num_experts=4, num_experts_per_tok=2,
                      moe_intermediate_size=16),
    "mixtral": dict(num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2),
    "gemma3_text": dict(num_key_value_heads=2, head_dim=8, sliding_window=4,  # shorter than a prompt and its answer
                        layer_types=["sliding_attention", "full_attention"]),
    "gpt_neox": dict(rotary_pct=0.25),
    "opt": dict(ffn_dim=64, word_embed_proj_dim=32),
}
RECURRENT = {"qwen3_next"}  # whose cache cannot be copied from a prompt to its rows


@pytest.fixture(scope="module", params=list(ARCHITECTURES))
def architecture(request, tiny_model, tmp_path_factory) -> tuple[str, str]:
    """(model type, folder): the tiny model's tokenizer with a random model of that architecture."""
    path = str(tmp_path_factory.mktemp(request.param))
    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    config = AutoConfig.for_model(request.param, vocab_size=len(tokenizer), pad_token_id=0, bos_token_id=1,
                                  eos_token_id=2, **SIZE, **ARCHITECTURES[request.param])
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return request.param, path


@pytest.mark.parametrize("module", [grpo])  # token_logprobs and shares_cache are the same text in every script
def test_log_probs_equal_whole_rows_and_the_cache_is_shared_where_it_can_be(module, architecture):
    kind, path = architecture
    _, model = module.load_model(path)
    assert module.shares_cache(model) == (kind not in RECURRENT)
    ids = torch.tensor([[5, 6, 7, 8, 11, 12, 13, 14], [5, 6, 7, 8, 15, 2, 0, 0], [0, 9, 10, 8, 16, 17, 2, 0]])
    attention = torch.tensor([[1] * 8, [1] * 6 + [0] * 2, [0] + [1] * 6 + [0]])  # prompts of 4 (two rows) and 3 tokens
    with torch.no_grad():
        got, _ = module.token_logprobs(model, ids, attention, 4, 0.7)
        logits = model(input_ids=ids, attention_mask=attention, position_ids=(attention.cumsum(-1) - 1).clamp(min=0))[0]
        expected = torch.log_softmax(logits[:, -5:-1].float() / 0.7, -1).gather(-1, ids[:, -4:, None]).squeeze(-1)
    real = attention[:, -4:].bool()
    assert torch.allclose(got[real], expected[real], atol=1e-5)


@pytest.mark.slow
# GSPO and DAPO load, sample and train each model as GRPO does (the same text); PPO builds its critic on the model
@pytest.mark.parametrize("module", [grpo, ppo])
def test_grpo_and_ppo_train_two_steps(module, architecture, copy_task, tmp_path, monkeypatch):
    kind, path = architecture
    monkeypatch.chdir(tmp_path)
    argv = ["--model", path, "--task", copy_task, "--steps", "2", "--eval-every", "1", "--eval-prompts", "4",
            "--num-prompts", "2", "--group-size", "4", "--max-new-tokens", "6", "--output-dir", "ckpt",
            *(["--num-prompts", "4", "--group-size", "1"] if module.__name__ == "ppo" else []),
            *OWN_ARGS.get(module.__name__, [])]
    module.main(tyro.cli(module.Args, args=argv))
    (last,) = glob.glob("ckpt/*/step_2")
    assert AutoModelForCausalLM.from_pretrained(last).config.model_type == kind


def test_a_model_without_its_weights_has_the_modules_and_generation_config_of_the_loaded_one(architecture, tmp_path):
    """load_model(..., weights=False), as ranks > 0 build the model under torchrun: the same parameters and buffers
    (names, shapes, dtypes), on the meta device, and the checkpoint's generation config (its EOS ids: here one more
    than the config's), which sampling stops on."""
    path = shutil.copytree(architecture[1], tmp_path / "model")
    generation = GenerationConfig.from_pretrained(path)
    generation.eos_token_id = [2, 7]
    generation.save_pretrained(path)
    _, loaded = grpo.load_model(str(path))
    _, skeleton = grpo.load_model(str(path), weights=False)

    def described(model):
        return [(name, x.shape, x.dtype) for name, x in [*model.named_parameters(), *model.named_buffers()]]
    assert described(skeleton) == described(loaded)
    assert all(x.is_meta for x in skeleton.parameters())
    assert skeleton.generation_config.eos_token_id == loaded.generation_config.eos_token_id == [2, 7]


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["qwen3_next", "qwen3_moe"])  # parts with weights of their own, holding linear layers
def test_fsdp2_shards_each_architecture_under_torchrun(kind, tiny_model, copy_task, tmp_path):
    """`torchrun --nproc_per_node 2` (gloo), bf16, with the reference model: FSDP2 shards the hybrid model (its
    linear attention holds weights of its own and linear layers, and reads its convolution's weight itself) and the
    mixture of experts (experts that are not linear layers), and a step trains."""
    path = str(tmp_path / kind)
    config = AutoConfig.for_model(kind, vocab_size=len(AutoTokenizer.from_pretrained(tiny_model)), pad_token_id=0,
                                  bos_token_id=1, eos_token_id=2, **SIZE, **ARCHITECTURES[kind])
    AutoModelForCausalLM.from_config(config).save_pretrained(path)
    AutoTokenizer.from_pretrained(tiny_model).save_pretrained(path)
    argv = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", grpo.__file__,
            "--model", path, "--task", copy_task, "--steps", "1", "--eval-every", "0", "--num-prompts", "2",
            "--group-size", "2", "--num-minibatches", "1", "--max-new-tokens", "4", "--dtype", "bfloat16", "--beta",
            "0.1", "--output-dir", str(tmp_path / "ckpt")]
    result = subprocess.run(argv, cwd=tmp_path, capture_output=True, text=True, timeout=600,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    (checkpoint,) = glob.glob(str(tmp_path / "ckpt" / "*" / "step_1"))
    assert AutoModelForCausalLM.from_pretrained(checkpoint).config.model_type == kind
