"""experiments/: the sparse-upcycled mixture-of-experts model computes the dense model it was made from, and track.py
records, between the old and the new policy of a step, exactly the tokens whose experts changed."""

import json
import os
import subprocess
import sys

import pytest
import torch
from conftest import MODULES, ROOT
from transformers import AutoModelForCausalLM

sys.path.insert(0, os.path.join(ROOT, "experiments"))
import moe  # noqa: E402
import track  # noqa: E402


@pytest.fixture(scope="module")
def tiny_moe(tiny_model, tmp_path_factory):
    """The tiny Llama upcycled into 4 experts, top 2, saved as the scripts load it: (path, dense, moe)."""
    path = str(tmp_path_factory.mktemp("tiny_moe"))
    dense = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
    model = moe.upcycle(dense, experts=4, top_k=2, seed=0)
    model.save_pretrained(path)
    MODULES[0].load_model(tiny_model)[0].save_pretrained(path)  # its tokenizer
    return path, dense, model


def test_upcycled_moe_computes_the_dense_model_and_spreads_tokens_over_experts(tiny_moe):
    path, dense, model = tiny_moe
    input_ids = torch.randint(4, 21, (3, 12))
    mask = torch.ones_like(input_ids)
    with torch.no_grad():
        torch.testing.assert_close(model(input_ids).logits, dense(input_ids).logits, atol=1e-5, rtol=1e-5)
    chosen = track.expert_choices(model, input_ids, mask, mask)  # (layers, tokens, 2): every token a completion one
    assert chosen.shape == (2, 36, 2) and len({tuple(c) for c in chosen[0].tolist()}) > 1  # not one fixed pair
    loaded = MODULES[0].load_model(path)[1]  # through --model
    assert type(loaded).__name__ == "MixtralForCausalLM" and track.expert_choices(dense, input_ids, mask, mask) is None
    with torch.no_grad():
        torch.testing.assert_close(loaded(input_ids).logits, model(input_ids).logits)


def test_track_counts_the_tokens_whose_experts_change_within_a_step(tiny_moe, tmp_path):
    """A fake `rollouts` yields one batch twice. Between the draws nothing changes: 0. Then the router rows of experts 0
    and 1 swap: a token's chosen pair changes exactly when it holds one of the two, which the test counts by hand."""
    _, _, model = tiny_moe
    input_ids = torch.randint(4, 21, (4, 9))
    attention_mask = torch.ones_like(input_ids)
    attention_mask[0, :2] = 0  # a left-padded prompt
    completion_mask = torch.ones(4, 5, dtype=torch.long)
    completion_mask[1, 3:] = 0  # a completion that ended early
    parts = {"correctness": torch.tensor([1.0, 0.0, 1.0, 0.0])}
    batch = (input_ids, attention_mask, completion_mask, None, None, None, parts, 0.0)

    def rollouts(*args):
        while True:
            yield batch

    path = str(tmp_path / "track.jsonl")
    batches = track.tracked(rollouts, path)(model, None, None, None, None, 0, 1)
    next(batches)
    before = track.expert_choices(model, input_ids, attention_mask, completion_mask)  # (layers, 18 tokens, 2)
    next(batches)  # the same weights
    routers = [m for m in model.modules() if type(m).__name__.endswith("TopKRouter")]
    saved = [r.weight.detach().clone() for r in routers]
    with torch.no_grad():
        for r in routers:
            r.weight[[0, 1]] = r.weight[[1, 0]].clone()
    next(batches)
    with torch.no_grad():
        for r, w in zip(routers, saved):
            r.weight.copy_(w)
    records = [json.loads(line) for line in open(path)]
    assert [r["batch"] for r in records] == [1, 2, 3] and "experts_changed" not in records[0]
    assert records[1]["experts_changed"] == 0.0
    holds_one = ((before == 0).any(-1) ^ (before == 1).any(-1)).float()  # (layers, tokens)
    assert 0 < records[2]["experts_changed"] < 1
    assert records[2]["experts_changed"] == pytest.approx(holds_one.mean().item())
    assert records[2]["experts_changed_per_layer"] == pytest.approx(holds_one.mean(1).tolist())
    assert records[0]["length_correct"] == [5.0, 5.0] and records[0]["length_wrong"] == [3.0, 5.0]


def test_track_runs_a_script_unchanged(tiny_moe, copy_task, tmp_path):
    """`python experiments/track.py grpo ...` trains as grpo.py does and writes a record per step, with the expert
    changes from the second on."""
    argv = ["--model", tiny_moe[0], "--task", copy_task, "--steps", "3", "--max-new-tokens", "3", "--eval-every", "0",
            "--learning-rate", "1e-2"]
    result = subprocess.run([sys.executable, os.path.join(ROOT, "experiments", "track.py"), "grpo", *argv],
                            capture_output=True, text=True, cwd=tmp_path, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "step 3: reward" in result.stdout
    records = [json.loads(line) for line in open(tmp_path / "track.jsonl")]
    assert [r["batch"] for r in records] == [1, 2, 3]
    assert all(len(r["length_correct"]) + len(r["length_wrong"]) == 16 for r in records)
    assert all(0 < r["experts_changed"] <= 1 for r in records[1:])  # lr 1e-2 moves the routing
