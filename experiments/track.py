"""Run one of the four scripts unchanged and record, per sampled batch, what its TensorBoard logs do not hold:

  - the lengths of the completions that were scored correct and of those that were not (claim 2);
  - for a mixture-of-experts model, the fraction of completion tokens whose chosen experts change between the old
    policy (the weights that sampled the batch) and the new one (after the step's updates), per layer (claim 4).

    python experiments/track.py grpo --model experiments/models/smollm2-moe --beta 0   # any arguments of the script

It wraps the script's `rollout`. `main` calls it for a batch at the start of each step, while the model holds that
step's old weights, and for the next one after the step's updates: the routing of a batch is read when it is drawn and
again when the next one is, and the change is recorded under the batch's own step (so none for the last step, after
which nothing is drawn). Routing is read with one plain forward pass (positions from the attention mask, as in
generation), the same way both times. Records go to track.jsonl in the working directory, beside the script's runs/,
one line per batch and one per measured change. For GRPO and GSPO a batch is a step; DAPO's dynamic sampling draws
several rounds a step, whose routing between rounds does not change. One process only; a tracked run is not resumed.
On an MoE its two routing passes a batch count in the step's charts/time_sample.
"""

import importlib.util
import json
import os
import sys

import torch
import tyro

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@torch.no_grad()
def expert_choices(model, input_ids, attention_mask, completion_mask) -> torch.Tensor | None:
    """The experts each completion token is routed to, in every MoE layer: (layers, tokens, top_k), sorted; None for a
    dense model. Reads the top-k indices Mixtral-type routers return."""
    routers = [m for m in model.modules() if type(m).__name__.endswith("TopKRouter")]
    if not routers:
        if getattr(model.config, "num_experts_per_tok", None):
            raise SystemExit("error: a mixture-of-experts model without Mixtral-type routers (transformers >= 5)")
        return None
    chosen = []
    hooks = [r.register_forward_hook(lambda module, inputs, out: chosen.append(out[2])) for r in routers]
    try:
        model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False, logits_to_keep=1,
              position_ids=(attention_mask.cumsum(-1) - 1).clamp(min=0))
    finally:
        for h in hooks:
            h.remove()
    T = completion_mask.shape[1]
    per_layer = [c.view(*input_ids.shape, -1)[:, -T:][completion_mask.bool()] for c in chosen]  # (tokens, top_k) each
    return torch.stack(per_layer).sort(-1).values  # (layers, tokens, top_k)


def tracked(rollout, path: str):
    """`rollout`, recording each batch's lengths by correctness and the change in its routing after the step."""
    previous = None  # the last batch's index, inputs and experts under the weights that sampled it
    count = 0  # batches so far

    def wrapper(model, *rest):
        nonlocal previous, count
        batch = rollout(model, *rest)
        count += 1
        input_ids, attention_mask, completion_mask = batch.input_ids, batch.attention_mask, batch.completion_mask
        records = []
        if previous is not None and previous[2] is not None:  # the model now holds the last step's new weights
            changed = (expert_choices(model, *previous[1]) != previous[2]).any(-1).float()  # (layers, tokens)
            records.append({"batch": previous[0], "experts_changed": changed.mean().item(),
                            "experts_changed_per_layer": changed.mean(1).tolist()})
        lengths, correct = completion_mask.sum(1).float(), batch.reward_parts["correctness"] == 1  # (B,), (B,)
        records.append({"batch": count, "length_correct": lengths[correct].tolist(),
                        "length_wrong": lengths[~correct].tolist()})
        with open(path, "a") as f:
            f.writelines(json.dumps(record) + "\n" for record in records)
        inputs = (input_ids, attention_mask, completion_mask)
        previous = (count, inputs, expert_choices(model, *inputs))
        return batch
    return wrapper


if __name__ == "__main__":
    if len(sys.argv) < 2 or sys.argv[1] not in ["grpo", "gspo", "dapo", "ppo"]:
        raise SystemExit("usage: python experiments/track.py {grpo,gspo,dapo,ppo} [the script's arguments]")
    sys.path.insert(0, ROOT)
    spec = importlib.util.spec_from_file_location(sys.argv[1], os.path.join(ROOT, f"{sys.argv[1]}.py"))
    script = sys.modules[sys.argv[1]] = importlib.util.module_from_spec(spec)  # (tyro reads Args' source)
    spec.loader.exec_module(script)
    script.rollout = tracked(script.rollout, "track.jsonl")
    script.main(tyro.cli(script.Args, args=sys.argv[2:]))
