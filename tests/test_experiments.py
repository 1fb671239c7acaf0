"""experiments/: the sparse-upcycled mixture-of-experts model computes the dense model it was made from; track.py
records, between the old and the new policy of a step, exactly the tokens whose experts changed, and leaves the run as
it was; claims.py runs a claim's variants once and writes its table and figure."""

import json
import os
import shutil
import subprocess
import sys

import pytest
import torch
from conftest import MODULES, ROOT
from transformers import AutoConfig, AutoModelForCausalLM, LlamaForCausalLM

sys.path.insert(0, os.path.join(ROOT, "experiments"))
import claims  # noqa: E402
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


def routers(model):
    return [m for m in model.modules() if type(m).__name__.endswith("TopKRouter")]


def test_upcycled_moe_computes_the_dense_model_and_spreads_tokens_over_experts(tiny_moe, tiny_model):
    path, dense, model = tiny_moe
    input_ids = torch.randint(4, 21, (3, 12), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(input_ids)
    with torch.no_grad():
        torch.testing.assert_close(model(input_ids).logits, dense(input_ids).logits, atol=1e-5, rtol=1e-5)
    chosen = track.expert_choices(model, input_ids, mask, mask)  # (layers, tokens, 2): every token a completion one
    assert chosen.shape == (2, 36, 2) and len({tuple(c) for c in chosen[0].tolist()}) > 1  # not one fixed pair
    loaded = MODULES[0].load_model(path)[1]  # through --model
    assert type(loaded).__name__ == "MixtralForCausalLM" and track.expert_choices(dense, input_ids, mask, mask) is None
    with torch.no_grad():
        torch.testing.assert_close(loaded(input_ids).logits, model(input_ids).logits)
    config = AutoConfig.from_pretrained(tiny_model, tie_word_embeddings=True)  # as SmolLM2: no lm_head weight
    tied = LlamaForCausalLM(config).eval()
    with torch.no_grad():
        torch.testing.assert_close(moe.upcycle(tied, 4, 2, 0)(input_ids).logits, tied(input_ids).logits)


def test_expert_choices_reads_each_completion_token_where_it_sits(tiny_moe):
    """Rows with left padding and completions that ended early give each real completion token the experts that the
    same sequence, alone and unpadded, routes it to (read from the routers directly)."""
    model = tiny_moe[2]
    prompts, completions = [[5, 6, 7], [8, 9]], [[10, 11, 12], [13]]  # the second row: 1 padded prompt token
    input_ids = torch.tensor([[5, 6, 7, 10, 11, 12], [0, 8, 9, 13, 0, 0]])  # (2, P+T), P = T = 3
    attention_mask = torch.tensor([[1, 1, 1, 1, 1, 1], [0, 1, 1, 1, 0, 0]])
    completion_mask = torch.tensor([[1, 1, 1], [1, 0, 0]])
    chosen = track.expert_choices(model, input_ids, attention_mask, completion_mask)  # (layers, 4 tokens, 2)
    expected = []
    for prompt, completion in zip(prompts, completions):
        seen = []
        hooks = [r.register_forward_hook(lambda m, i, out: seen.append(out[2])) for r in routers(model)]
        with torch.no_grad():
            model(torch.tensor([prompt + completion]))
        for h in hooks:
            h.remove()
        expected.append(torch.stack([s[-len(completion):] for s in seen]))  # (layers, |completion|, 2)
    torch.testing.assert_close(chosen, torch.cat(expected, 1).sort(-1).values)


def test_track_counts_the_tokens_whose_experts_change_within_a_step(tiny_moe, tmp_path):
    """A fake `rollout` returns three different batches. Step 1 leaves the weights: 0 changed. Step 2 swaps the router
    rows of experts 0 and 1: a token's chosen pair changes exactly when it holds one of the two, counted by hand, and
    the change is filed under step 2, the step whose update made it."""
    model = tiny_moe[2]
    generator = torch.Generator().manual_seed(0)
    batches_in = []
    for rows in [3, 4, 2]:
        input_ids = torch.randint(4, 21, (rows, 9), generator=generator)
        attention_mask = torch.ones_like(input_ids)
        attention_mask[0, :2] = 0  # a left-padded prompt
        completion_mask = torch.ones(rows, 5, dtype=torch.long)
        completion_mask[1, 3:] = 0  # a completion that ended early
        parts = {"correctness": torch.arange(rows) % 2 == 0}
        batches_in.append(MODULES[0].Batch(input_ids, attention_mask, completion_mask, None, None, reward_parts=parts))

    path = str(tmp_path / "track.jsonl")
    given = iter(batches_in)
    rollout = track.tracked(lambda *args: next(given), path)
    rollout(model, None, None, None, 0, 0, 1)  # step 1: nothing changes
    rollout(model, None, None, None, 4, 0, 1)  # step 2 swaps experts 0 and 1 in every router
    before = track.expert_choices(model, *batches_in[1][:3])  # (layers, tokens, 2), under the old weights
    saved = [r.weight.detach().clone() for r in routers(model)]
    with torch.no_grad():
        for r in routers(model):
            r.weight[[0, 1]] = r.weight[[1, 0]].clone()
    rollout(model, None, None, None, 8, 0, 1)
    with torch.no_grad():
        for r, w in zip(routers(model), saved):
            r.weight.copy_(w)
    records = [json.loads(line) for line in open(path)]
    changes = {r["batch"]: r for r in records if "experts_changed" in r}
    assert sorted(r["batch"] for r in records if "length_correct" in r) == [1, 2, 3] and sorted(changes) == [1, 2]
    assert changes[1]["experts_changed"] == 0.0
    holds_one = ((before == 0).any(-1) ^ (before == 1).any(-1)).float()  # (layers, tokens)
    assert 0 < changes[2]["experts_changed"] < 1
    assert changes[2]["experts_changed"] == pytest.approx(holds_one.mean().item())
    assert changes[2]["experts_changed_per_layer"] == pytest.approx(holds_one.mean(1).tolist())
    assert records[0] == {"batch": 1, "length_correct": [5.0, 5.0], "length_wrong": [3.0]}


@pytest.mark.slow
def test_track_runs_a_script_unchanged(tiny_moe, copy_task, tmp_path):
    """`python experiments/track.py grpo ...` trains exactly as `python grpo.py ...` (the same rewards step by step)
    and records every step's lengths and, but for the last step, its change in experts."""
    argv = ["--model", tiny_moe[0], "--task", copy_task, "--steps", "3", "--max-new-tokens", "3", "--eval-every", "0",
            "--learning-rate", "1e-2"]
    outputs = []
    for entry, folder in [([os.path.join(ROOT, "experiments", "track.py"), "grpo"], "tracked"),
                          ([MODULES[0].__file__], "plain")]:
        os.makedirs(tmp_path / folder)
        result = subprocess.run([sys.executable, *entry, *argv], capture_output=True, text=True,
                                cwd=tmp_path / folder, timeout=300)
        assert result.returncode == 0, result.stderr[-2000:]
        outputs.append([line for line in result.stdout.splitlines() if ": reward " in line])
    assert len(outputs[0]) == 3 and [o.split(",")[0] for o in outputs[0]] == [o.split(",")[0] for o in outputs[1]]
    records = [json.loads(line) for line in open(tmp_path / "tracked" / "track.jsonl")]
    lengths = [r for r in records if "length_correct" in r]
    assert [r["batch"] for r in lengths] == [1, 2, 3]
    assert all(len(r["length_correct"]) + len(r["length_wrong"]) == 16 for r in lengths)
    changes = [r for r in records if "experts_changed" in r]
    assert [r["batch"] for r in changes] == [1, 2] and all(0 < r["experts_changed"] <= 1 for r in changes)


def test_claims_runs_each_variant_once_and_writes_its_table_and_figure(tiny_model, copy_task, tmp_path, monkeypatch):
    """`claims.py token-level-loss` on the tiny model: both variants run, the section is written between its markers
    with a row per variant and as many cells as columns; a second call runs nothing; a stopped run is not finished."""
    monkeypatch.setitem(claims.PRESETS, "cpu", ["--model", tiny_model, "--task", copy_task, "--max-new-tokens", "16",
                                                "--eval-prompts", "8"])
    monkeypatch.setattr(claims, "DOCS", str(tmp_path / "docs"))
    os.makedirs(tmp_path / "docs")
    shutil.copy(os.path.join(ROOT, "docs", "claims.md"), tmp_path / "docs")
    args = claims.Args("token-level-loss", seeds=[1], out=str(tmp_path / "runs"))
    claims.main(args)
    logs = [tmp_path / "runs" / f"{label}_s1" / "log.txt" for label in ["grpo-beta0", "dapo-as-grpo"]]
    assert all(claims.finished(str(log.parent)) for log in logs)
    assert not os.path.exists(logs[0].parent / "checkpoints")  # removed once finished
    times = [os.path.getmtime(log) for log in logs]
    claims.main(args)
    assert [os.path.getmtime(log) for log in logs] == times  # nothing ran again
    doc = open(tmp_path / "docs" / "claims.md").read()
    section = doc.split("<!-- token-level-loss: written by experiments/claims.py -->")[1].split("<!-- end")[0]
    rows = [line for line in section.splitlines() if line.startswith("|")]
    assert len(rows) == 4 and rows[2].startswith("| `grpo-beta0` | ") and rows[3].startswith("| `dapo-as-grpo` | ")
    assert len({line.count("|") for line in rows}) == 1  # the header's columns, the separator's, each row's cells
    assert "`python experiments/track.py grpo --seed N --model" in section
    assert os.path.getsize(tmp_path / "docs" / "claims" / "token-level-loss.png") > 0
    with open(logs[0], "a") as f:
        f.write("stopped after step 3\n")
    assert not claims.finished(str(logs[0].parent))
