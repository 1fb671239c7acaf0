"""Low precision, exact where the maths is: before any update every ratio is exactly 1, the KL to the reference is
exactly 0 and (where the loss clips) nothing is clipped, in bf16 as in float32, with and without gradient
checkpointing, on one process and two; a later mini-batch's old log-probs are those of the weights before the step's
first update; --dtype auto picks bf16 on a GPU that multiplies it natively, float32 on a CPU."""

import glob
import os

import pytest
import torch
import tyro
from conftest import MODULES, OWN_ARGS, ScriptedRewards, loss_statistics, read_run, run_script
from safetensors.torch import load_file
from test_distributed import launch

import grpo
import ppo

CONTRAST = [1, 0, 0, 1] * 4  # scripted correctness: every group of 4 has contrast, so every advantage is non-zero
# 4 prompts x 4 completions in 2 mini-batches of 2 groups, ragged micro-batches of 3 rows
STEP = ["--steps", "1", "--eval-every", "0", "--num-prompts", "4", "--group-size", "4", "--num-minibatches", "2",
        "--micro-batch-size", "3", "--max-new-tokens", "8", "--beta", "0.04", "--output-dir", "ckpt"]


def exact(module) -> dict:
    """What is exact before any update, whatever the loss: every ratio 1 and the KL 0; and, where the loss clips (it
    returns a clip_fraction), nothing clipped."""
    expected = {"losses/ratio_mean": 1.0, "losses/kl": 0.0}
    if "clip_fraction" in loss_statistics(module):
        expected["losses/clip_fraction"] = 0.0
    return expected


def first_step(module, tiny_model, copy_task, tmp_path, monkeypatch, *argv) -> tuple[dict, dict]:
    """One step of module.main with scripted rewards; its logged losses and the weights it saved."""
    monkeypatch.setattr(module.rewards, "score", ScriptedRewards([CONTRAST]))
    monkeypatch.chdir(tmp_path)
    module.main(tyro.cli(module.Args, args=["--model", tiny_model, "--task", copy_task, *STEP,
                                            *OWN_ARGS.get(module.__name__, []), *argv]))
    (checkpoint,) = glob.glob(str(tmp_path / "ckpt" / "*" / "step_1"))
    scalars = {tag: values[0][1] for tag, values in read_run(str(tmp_path))[0].items()}
    merged = ["merged"] if "--lora-rank" in argv else []  # a LoRA run's last checkpoint: its merged model
    return scalars, load_file(os.path.join(checkpoint, *merged, "model.safetensors"))


@pytest.mark.parametrize("variant", [[], ["--gradient-checkpointing"], ["--float32-head"]],
                         ids=["shared_prompt", "checkpointing", "float32_head"])
@pytest.mark.parametrize("module", MODULES)
def test_before_any_update_every_ratio_is_1_nothing_is_clipped_and_the_kl_is_0(module, variant, tiny_model,
                                                                                 copy_task, tmp_path, monkeypatch):
    """bf16 compute; lr 1e-30 moves no float32 weight (AdamW's weight decay included: checked), so the second
    mini-batch trains on the weights its old log-probs were computed with, and the reference is the policy."""
    scalars, weights = first_step(module, tiny_model, copy_task, tmp_path, monkeypatch, "--dtype", "bfloat16",
                                  "--learning-rate", "1e-30", *variant)
    initial = load_file(os.path.join(tiny_model, "model.safetensors"))
    assert all(torch.equal(weights[k], initial[k]) for k in initial)
    assert {tag: scalars[tag] for tag in exact(module)} == exact(module)
    if module.__name__ == "ppo":  # V_old is computed as the training pass computes V
        assert scalars["losses/value_clip_fraction"] == 0.0


@pytest.mark.parametrize("module", MODULES)
def test_a_lora_runs_frozen_base_is_stored_in_bf16_and_its_ratios_and_kl_stay_exact(module, tiny_model, copy_task,
                                                                                     tmp_path, monkeypatch):
    """--lora-rank 2 in bf16: the policy's frozen linear layers (the LM head too) are stored in bf16 (autocast would
    cast them again at every product, each decoding step's too, caching no cast of a frozen weight), its adapters,
    embeddings and norms in float32; the logits are those of float32 storage bit for bit; before any update every ratio
    is exactly 1 and the KL to the base (the adapter off) exactly 0."""
    tokenizer, model = module.load_model(tiny_model)
    model = module.add_lora(model, module.Args(lora_rank=2))
    for name, parameter in model.named_parameters():
        if "lora_B" in name:  # peft starts B at 0 (the adapter then changes nothing): move it
            torch.nn.init.normal_(parameter, std=0.1)
    ids = torch.tensor([[5, 6, 7, 8, 9]])
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        stored_float32 = model(ids).logits
        module.frozen_in_compute_dtype(model, torch.bfloat16)
        stored_bf16 = model(ids).logits
    assert torch.equal(stored_bf16, stored_float32)
    sharded, shard = [], module.shard
    monkeypatch.setattr(module, "shard", lambda model, *rest: sharded.append(model) or shard(model, *rest))
    scalars, weights = first_step(module, tiny_model, copy_task, tmp_path, monkeypatch, "--dtype", "bfloat16",
                                  "--learning-rate", "1e-30", "--lora-rank", "2")
    dtypes = {name: p.dtype for name, p in sharded[-1].named_parameters()}  # the policy, sharded last
    linear = [name for name in dtypes if ".base_layer." in name or name.endswith("lm_head.weight")]
    assert {dtypes[name] for name in linear} == {torch.bfloat16}
    assert {dtypes[name] for name in dtypes if name not in linear} == {torch.float32}
    assert {tag: scalars[tag] for tag in exact(module)} == exact(module)
    initial = load_file(os.path.join(tiny_model, "model.safetensors"))
    assert all(torch.equal(weights[k], initial[k]) for k in initial)  # the merged model: the base, lr 1e-30


@pytest.mark.parametrize("module", MODULES)
def test_generates_own_log_probs_are_the_trainers_in_float32(module, tiny_model, copy_task, tmp_path, monkeypatch):
    """`sample` keeps the log-prob of each token it draws (--sampler hf), for the sampler charts: in float32 it is
    pi_old, the trainer's log-prob before any update, up to rounding. (A draw's log-prob taken without the
    temperature, or of another token, would be off by far more.) hf's loss is not weighted: nothing truncated."""
    scalars, _ = first_step(module, tiny_model, copy_task, tmp_path, monkeypatch, "--dtype", "float32",
                            "--learning-rate", "1e-30")
    assert 0 <= scalars["charts/sampler_gap_mean"] <= scalars["charts/sampler_gap_max"] < 1e-4
    assert 0 <= scalars["charts/sampler_kl"] < 1e-8 and scalars["losses/tis_truncated_fraction"] == 0.0


@pytest.mark.parametrize("module", MODULES)
def test_generates_log_probs_are_logged_and_weigh_nothing(module, tiny_model, copy_task, tmp_path, monkeypatch):
    """--sampler hf: the sampler's log-probs, lowered by 1 (were they weighed, every weight would be min(e, 2)), move
    the sampler charts by 1 and leave the loss and the trained weights as they were."""
    args = ["--dtype", "float32", "--learning-rate", "1e-2"]
    (tmp_path / "plain").mkdir()
    plain, plain_weights = first_step(module, tiny_model, copy_task, tmp_path / "plain", monkeypatch, *args)
    sample = module.sample

    def lowered(*rest):
        batch = sample(*rest)
        return batch._replace(sampler_logprobs=batch.sampler_logprobs - 1) if rest[-1] is not None else batch

    monkeypatch.setattr(module, "sample", lowered)
    (tmp_path / "lowered").mkdir()
    shifted, shifted_weights = first_step(module, tiny_model, copy_task, tmp_path / "lowered", monkeypatch, *args)
    assert shifted["charts/sampler_gap_mean"] == pytest.approx(1, abs=1e-3)
    assert shifted["losses/policy_loss"] == plain["losses/policy_loss"]
    assert all(torch.equal(shifted_weights[k], plain_weights[k]) for k in plain_weights)


@pytest.mark.parametrize("module", MODULES)
def test_after_the_first_update_ratios_and_the_kl_move(module, tiny_model, copy_task, tmp_path, monkeypatch):
    """The same step at a real learning rate: the second mini-batch sees the first's update."""
    scalars, _ = first_step(module, tiny_model, copy_task, tmp_path, monkeypatch, "--dtype", "bfloat16",
                            "--learning-rate", "1e-2")
    assert scalars["losses/kl"] > 0 and scalars["losses/ratio_mean"] != 1.0


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("module", MODULES)
def test_old_log_probs_are_those_of_the_weights_before_the_first_update(module, dtype, tiny_model, copy_task,
                                                                        tmp_path, monkeypatch):
    """Every training micro-batch's pi_old, recomputed on its rows from a fresh copy of the initial weights: equal
    bit for bit, though after the first update the current log-probs of the second mini-batch differ from it (a loop
    that took the current log-probs, detached, as pi_old everywhere fails here)."""
    token_logprobs, compute_policy_loss, trained, compared = module.token_logprobs, module.compute_policy_loss, [], []

    def recording_token_logprobs(model, input_ids, attention_mask, *rest):  # the training passes' rows
        if torch.is_grad_enabled():
            trained.append((input_ids, attention_mask, *rest[:2]))
        return token_logprobs(model, input_ids, attention_mask, *rest)

    def recording_policy_loss(logprobs, old_logprobs, *rest):
        compared.append((logprobs.detach(), old_logprobs))
        return compute_policy_loss(logprobs, old_logprobs, *rest)

    monkeypatch.setattr(module, "token_logprobs", recording_token_logprobs)
    monkeypatch.setattr(module, "compute_policy_loss", recording_policy_loss)
    first_step(module, tiny_model, copy_task, tmp_path, monkeypatch, "--dtype", dtype, "--learning-rate", "1e-2",
               "--beta", "0")
    _, initial = module.load_model(tiny_model)
    autocast = torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype == "bfloat16")
    assert len(trained) == len(compared) == 6  # 2 mini-batches of 8 rows, in micro-batches of 3, 3 and 2
    for (input_ids, attention_mask, T, temperature), (logprobs, old_logprobs) in zip(trained, compared):
        with torch.no_grad(), autocast:
            assert torch.equal(old_logprobs, token_logprobs(initial, input_ids, attention_mask, T, temperature)[0])
    assert all(torch.equal(logprobs, old) for logprobs, old in compared[:3])  # mini-batch 1: before its update
    assert not any(torch.equal(logprobs, old) for logprobs, old in compared[3:])


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_the_float32_head_computes_the_logits_from_bf16_hidden_states_in_float32(tied, tmp_path):
    """--float32-head under bf16 autocast: the logits are float32, F.linear(hidden, W) of the float32 hidden states
    and weight (neither rounded to bf16), and the reference copy computes its own head so, from its own weight."""
    from conftest import save_tiny_model

    _, model = grpo.load_model(save_tiny_model(str(tmp_path), tied=tied))
    ids = torch.tensor([[5, 6, 7, 8]])
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        rounded = model(ids).logits
        grpo.float32_head(model)
        out = model(ids, output_hidden_states=True)
        hidden = out.hidden_states[-1]  # (1, 4, H): after the final norm (Llama's: float32; autocast rounds it)
        assert rounded.dtype == torch.bfloat16 and out.logits.dtype == torch.float32
        with torch.autocast("cpu", enabled=False):
            assert torch.equal(out.logits, torch.nn.functional.linear(hidden.float(), model.lm_head.weight))
        assert not torch.equal(out.logits, rounded.float())
        reference = grpo.reference_copy(model, torch.bfloat16)
        assert reference.lm_head.weight.dtype == torch.float32
        assert torch.equal(reference(ids).logits, out.logits)
        assert reference.lm_head.forward.__self__ is reference.lm_head  # its own head, not the policy's
        assert reference.lm_head.weight.data_ptr() != model.lm_head.weight.data_ptr()


@pytest.mark.parametrize("module", [grpo])
def test_dtype_auto_is_bf16_on_a_gpu_that_computes_it_natively_and_float32_on_any_cpu(module, monkeypatch):
    """On CUDA, native bf16 (no emulation: a V100 gets float32); on a CPU float32, even one with AVX-512 BF16 or
    AMX, where bf16 was not faster for every script (docs/precision.md). --dtype bfloat16 still computes in bf16."""
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    for native in (True, False):
        monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: native)
        monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: native)
        assert module.compute_dtype("auto", cpu)[0] == torch.float32
        assert module.compute_dtype("bfloat16", cpu)[0] == torch.bfloat16
    for native, expected in [(True, torch.bfloat16), (False, torch.float32)]:
        monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda including_emulation: native)
        dtype, why = module.compute_dtype("auto", cuda)
        assert dtype == expected and "GPU" in why


@pytest.mark.slow
@pytest.mark.parametrize("module, own", [(grpo, ["--num-prompts", "2"]),
                                         (ppo, ["--num-prompts", "4", "--gradient-checkpointing"])],
                         ids=["grpo_shared_prompt", "ppo_checkpointing"])
def test_the_real_model_before_any_update_in_bf16(module, own, tmp_path):
    """SmolLM2-135M-Instruct, each script's defaults but --beta 0.04 and 16 new tokens, lr 1e-30, bf16, and a quarter
    (PPO) or half (GRPO) of the default completions: two mini-batches still, each its own old, reference and training
    passes. Two runs, one per forward path (a prompt's keys and values shared, or whole rows), the script with the
    most passes on the second: the other scripts' paths are the same code, checked in bf16 on the tiny model above
    (on a CPU without native bf16 each run takes minutes: PPO's took 464 s at the default 16 completions)."""
    result = run_script(module, "--steps", "1", "--eval-every", "0", "--max-new-tokens", "16", "--beta", "0.04",
                        "--dtype", "bfloat16", "--learning-rate", "1e-30", "--output-dir", "ckpt", *own,
                        *OWN_ARGS.get(module.__name__, []), cwd=str(tmp_path))
    assert result.returncode == 0
    scalars = {tag: values[0][1] for tag, values in read_run(str(tmp_path))[0].items()}
    assert {tag: scalars[tag] for tag in exact(module)} == exact(module)


@pytest.mark.slow
@pytest.mark.parametrize("module", MODULES)
def test_two_processes_before_any_update_in_bf16(module, tiny_model, copy_task, tmp_path):
    """Under torchrun (FSDP2, gloo): each process's ratios, clipping and KL are exact too. (DAPO
    trains on every group: with dynamic sampling a rank whose groups of the untrained tiny model
    all score alike would leave the step without an update to measure.)"""
    every_group = ["--no-dynamic-sampling"] if module.__name__ == "dapo" else []
    argv = [module.__file__, "--model", tiny_model, "--task", copy_task, *STEP, "--dtype", "bfloat16",
            "--learning-rate", "1e-30", *OWN_ARGS.get(module.__name__, []), *every_group]
    launch(argv, tmp_path, 2)
    scalars = {tag: values[0][1] for tag, values in read_run(str(tmp_path))[0].items()}
    assert {tag: scalars[tag] for tag in exact(module)} == exact(module)
    (checkpoint,) = glob.glob(str(tmp_path / "ckpt" / "*" / "step_1"))
    weights, initial = [load_file(os.path.join(path, "model.safetensors")) for path in (checkpoint, tiny_model)]
    assert all(torch.equal(weights[k], initial[k]) for k in initial)
