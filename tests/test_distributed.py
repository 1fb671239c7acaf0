"""Each script under torchrun with FSDP2, two processes on CPU (gloo): the same update as one process, and a short
run that logs once and writes one checkpoint that loads on one process."""

import glob
import importlib.util
import json
import os
import shutil
import subprocess
import sys

import pytest
import torch
from conftest import MODULES, OWN_ARGS, ROOT, read_run
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

import grpo
import ppo

pytestmark = pytest.mark.slow  # every test starts two processes under torchrun, most of them twice
# completions per process: 2 prompts x 4 (PPO: 4 x 1); 3 per micro-batch, so the micro-batches are ragged
GROUPS = {"ppo": ["--num-prompts", "8", "--group-size", "1"]}
TOLERANCE = 1e-6  # largest difference measured in a weight: 3.7e-9 to 7.5e-9 (float32 sums in another order)


def batch(module) -> list[str]:
    """The prompts and groups of a step, and the script's own arguments."""
    name = module.__name__
    return [*GROUPS.get(name, ["--num-prompts", "4", "--group-size", "4"]), *OWN_ARGS.get(name, [])]


def launch(argv: list[str], cwd, processes: int, **env: str) -> subprocess.CompletedProcess:
    """`python argv...` alone, or under `torchrun --nproc_per_node processes`, one thread per process."""
    torchrun = ["-m", "torch.distributed.run", "--nproc_per_node", str(processes)]
    launcher = [sys.executable] + (torchrun if processes > 1 else [])
    result = subprocess.run(launcher + argv, cwd=cwd, capture_output=True, text=True, timeout=600,
                            env={**os.environ, "OMP_NUM_THREADS": "1", **env})
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return result


@pytest.mark.parametrize("module, bare_eos, lora", [(m, "0", []) for m in MODULES] + [(grpo, "1", []), (ppo, "1", [])]
                         + [(m, "0", ["--lora-rank", "2"]) for m in (grpo, ppo)])
def test_two_processes_take_the_same_update_as_one(module, bare_eos, lora, tiny_model, copy_task, tmp_path):
    """Fixed completions and rewards (tests/fixed_rollouts.py), SGD at lr 0.1, two steps of one update each, KL on
    (beta 0.1, DAPO 0) so the reference model is sharded too: the weights after two steps, and the logged rewards,
    equal one process's. This covers GRPO's and GSPO's sample means, DAPO's token normaliser over both ranks' tokens
    and its filter, and PPO's critic, GAE and advantage whitening over both ranks' tokens. With BARE_EOS, rank 0's
    completions are all one token and rank 1's longer: both must still make the same model calls (each a collective
    under FSDP2), or they wait for each other forever. With LoRA: the merged models that the last checkpoints hold."""
    argv = [os.path.join(ROOT, "tests", "fixed_rollouts.py"), module.__name__, "--model", tiny_model, "--task",
            copy_task, "--steps", "2", "--eval-every", "0", "--output-dir", "ckpt", "--learning-rate", "0.1",
            "--num-minibatches", "1", "--micro-batch-size", "3", "--beta", "0" if module.__name__ == "dapo" else "0.1",
            "--dtype", "float32",
            *batch(module), *lora]
    weights, rewards = [], []
    for processes in (1, 2):
        (tmp_path / str(processes)).mkdir()
        launch(argv, tmp_path / str(processes), processes, BARE_EOS=bare_eos)
        (checkpoint,) = glob.glob(str(tmp_path / str(processes) / "ckpt" / "*" / "step_2"))
        weights.append(load_file(os.path.join(checkpoint, *(["merged"] if lora else []), "model.safetensors")))
        rewards.append(read_run(str(tmp_path / str(processes)))[0]["charts/reward_mean"])
    initial = load_file(os.path.join(tiny_model, "model.safetensors"))
    assert max((weights[0][k] - initial[k]).abs().max().item() for k in initial) > 1e-3  # it trained
    assert max((weights[0][k] - weights[1][k]).abs().max().item() for k in initial) < TOLERANCE
    assert rewards[0] == rewards[1]


@pytest.mark.parametrize("module", MODULES)
def test_a_two_process_run_logs_once_and_saves_one_checkpoint_that_loads_on_one_process(module, tiny_model, copy_task,
                                                                                       tmp_path):
    argv = [module.__file__, "--model", tiny_model, "--task", copy_task, "--steps", "2", "--eval-every", "1",
            "--eval-prompts", "8", "--max-new-tokens", "4", "--output-dir", "ckpt", *batch(module)]
    result = launch(argv, tmp_path, 2)
    assert result.stdout.count("held-out greedy accuracy:") == 1 and result.stdout.count("step 0/2: held-out") == 1
    scalars, _ = read_run(str(tmp_path))  # exactly one TensorBoard run
    assert [s for s, _ in scalars["charts/reward_mean"]] == [1, 2]
    assert [s for s, _ in scalars["charts/eval_accuracy"]] == [0, 1, 2]
    (checkpoint,) = glob.glob(str(tmp_path / "ckpt" / "*" / "step_*"))
    assert checkpoint.endswith("step_2")
    model = AutoModelForCausalLM.from_pretrained(checkpoint)
    assert model(torch.tensor([[5, 6]])).logits.shape == (1, 2, model.config.vocab_size)
    state = torch.load(os.path.join(checkpoint, "training_state.pt"), weights_only=True)
    assert len(state["rng"]) == 2 and state["step"] == 2  # each rank's RNG state, to resume with as many


@pytest.mark.parametrize("module", [grpo, ppo])
def test_a_two_process_run_resumes_to_the_same_weights(module, tiny_model, copy_task, tmp_path):
    """Three steps under torchrun, against the same run resumed after step 1 (each process's RNG state restored,
    the optimizer state re-sharded from the full copy, PPO's critic too): bit-identical weights after step 3."""
    argv = [module.__file__, "--model", tiny_model, "--task", copy_task, "--steps", "3", "--save-every", "1",
            "--keep-checkpoints", "0", "--eval-every", "0", "--max-new-tokens", "4", "--learning-rate", "1e-3",
            "--dtype", "float32", "--output-dir", "ckpt", *batch(module)]
    (tmp_path / "whole").mkdir()
    launch(argv, tmp_path / "whole", 2)
    (run_dir,) = glob.glob(str(tmp_path / "whole" / "ckpt" / "*"))
    run = os.path.basename(run_dir)
    shutil.copytree(tmp_path / "whole", tmp_path / "resumed")
    for step in (2, 3):
        shutil.rmtree(tmp_path / "resumed" / "ckpt" / run / f"step_{step}")
    (tmp_path / "resumed" / "ckpt" / run / "latest").write_text("step_1")  # as if stopped after step 1
    launch([argv[0], "--resume", os.path.join("ckpt", run, "latest")], tmp_path / "resumed", 2)
    states = [torch.load(os.path.join(root, "ckpt", run, "step_3", "training_state.pt"), weights_only=True)
              for root in (tmp_path / "whole", tmp_path / "resumed")]
    weights = [load_file(os.path.join(root, "ckpt", run, "step_3", "model.safetensors"))
               for root in (tmp_path / "whole", tmp_path / "resumed")]
    assert all(torch.equal(weights[0][k], weights[1][k]) for k in weights[0])
    assert all(torch.equal(states[0].get("critic", {})[k], v) for k, v in states[1].get("critic", {}).items())


@pytest.mark.parametrize("module", [grpo, ppo])
def test_after_set_up_each_process_holds_its_share_of_the_weights(module, tiny_model, copy_task, tmp_path):
    """Two processes, --dtype bfloat16: rank 0 alone loads the policy (and PPO's critic) whole, on the CPU, never
    whole on a device; rank 1's and every reference model are on the meta device (no memory) until sharded; after
    sharding each process holds half of the float32 policy (and of PPO's critic) and half of the reference model (its
    linear layers in bf16, the rest float32), as docs/distributed.md counts it."""
    argv = [os.path.join(ROOT, "tests", "fixed_rollouts.py"), module.__name__, "--model", tiny_model, "--task",
            copy_task, "--steps", "1", "--eval-every", "0", "--output-dir", "ckpt", "--dtype", "bfloat16",
            "--beta", "0.1", *batch(module)]
    launch(argv, tmp_path, 2, REPORT_SHARDS=str(tmp_path / "shards"))
    model = AutoModelForCausalLM.from_pretrained(tiny_model)
    linear = sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear))  # (no biases)
    ranks = []
    for rank in (0, 1):
        with open(tmp_path / f"shards.{rank}.json") as f:
            ranks.append(json.load(f))  # reference, (PPO's critic,) policy: in the order main shards them
    assert [r["loaded_on"] for r in ranks[0]] == ["meta"] + ["cpu"] * (1 + (module is ppo))
    assert [r["loaded_on"] for r in ranks[1]] == ["meta"] * (2 + (module is ppo))
    for records in ranks:
        assert records[0]["full"] == records[-1]["full"] - 2 * linear  # the reference's linear layers in bf16
        for r in records:  # a shard is half of each parameter's rows, the first rank taking the odd one
            assert 0.45 * r["full"] <= r["local"] <= 0.55 * r["full"], r
    for first, second in zip(*ranks):
        assert first["local"] + second["local"] == first["full"]


def test_in_bf16_autograd_keeps_no_whole_weight_of_a_layer(tiny_model, copy_task, tmp_path):
    """Two processes, --dtype bfloat16: after each training forward pass, what autograd keeps for the backward and
    still holds is activations, never a decoder layer's weight whole: FSDP2 gathers it in bf16 and frees it after the
    layer (a bf16 cast of a float32 weight that FSDP2 gathered would be kept until the backward: a whole copy of the
    model on every process). One process keeps such casts, 2 bytes a parameter beside its 16 of trained state."""
    processes = 2
    argv = [os.path.join(ROOT, "tests", "fixed_rollouts.py"), "grpo", "--model", tiny_model, "--task", copy_task,
            "--steps", "1", "--eval-every", "0", "--output-dir", "ckpt", "--dtype", "bfloat16", "--beta", "0.1",
            *batch(grpo)]
    launch(argv, tmp_path, processes, REPORT_SAVED=str(tmp_path / "saved"))
    model = AutoModelForCausalLM.from_pretrained(tiny_model)
    layer_weights = {tuple(p.shape) for name, p in model.named_parameters() if ".layers." in name and p.dim() == 2}
    for rank in range(processes):
        with open(tmp_path / f"saved.{rank}.json") as f:
            passes = json.load(f)
        assert len(passes) >= 2 and all(len(kept) > 10 for kept in passes)  # every micro-batch's, activations
        whole = [(dtype, shape) for kept in passes for dtype, shape, _ in kept if tuple(shape) in layer_weights]
        assert whole == [], whole


def test_four_processes_with_the_default_batch_take_a_step(tiny_model, copy_task, tmp_path):
    """`torchrun --nproc_per_node 4 grpo.py` with no --num-prompts: 4 prompts a process, 16 in all, pass the checks
    (mini-batches of whole groups on every process) and train; the preflight counts the whole batch."""
    argv = [grpo.__file__, "--model", tiny_model, "--task", copy_task, "--steps", "1", "--eval-every", "0",
            "--max-new-tokens", "4", "--output-dir", "ckpt"]
    result = launch(argv, tmp_path, 4)
    assert "the first batch: 64 completions of 16 prompts" in result.stdout and "step 1/1:" in result.stdout


def test_at_four_processes_each_rank_after_the_first_holds_at_most_half_of_one_process(tmp_path):
    """benchmark/memory.py's runs, one bf16 GRPO step with its reference model on a random 148M Llama, glibc
    returning freed blocks at once (MALLOC_MMAP_THRESHOLD_) so that the resident set follows the tensors alive: set
    up, ranks 1-3 under `torchrun --nproc_per_node 4` hold less than one process less a float32 copy of the model
    (measured 0.74 GB against 1.53: before 2026-12-08 every rank loaded the model and made its reference copy, 1.53);
    each one's peak before its checkpoint is at most half of one process's (measured 1.31 GB against 3.00; before,
    1.53, the set-up's); rank 0's at most one float32 copy of the model more (it alone loads it)."""
    spec = importlib.util.spec_from_file_location("memory", os.path.join(ROOT, "benchmark", "memory.py"))
    memory = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(memory)
    model, task = memory.build(str(tmp_path))
    argv = ["--model", model, "--task", task, "--dtype", "bfloat16", "--beta", "0.04", "--num-prompts", "4",
            "--group-size", "4", "--num-minibatches", "1", "--max-new-tokens", "4", "--micro-batch-size", "4",
            "--eval-every", "0", "--steps", "1", "--output-dir", str(tmp_path / "ckpt")]
    one, _, _ = memory.launch(memory.Args(), 1, str(tmp_path / "1"), argv)
    four, _, _ = memory.launch(memory.Args(), 4, str(tmp_path / "4"), argv)
    copy_gb = sum(p.numel() for p in AutoModelForCausalLM.from_pretrained(model).parameters()) * 4 / 2**30
    # set up, ranks 1-3 hold no whole copy (before: the model and its reference, as one process holds them)
    assert all(four[rank]["start"] < one[0]["start"] - copy_gb for rank in (1, 2, 3)), (one, four)
    assert all(four[rank]["step"] <= 0.5 * one[0]["step"] for rank in (1, 2, 3)), (one, four)
    assert four[0]["step"] <= one[0]["step"] + copy_gb, (one, four)
