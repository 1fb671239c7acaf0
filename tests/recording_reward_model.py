"""Run a script's main() with rewards.RewardModel.__call__ wrapped to record, in each process, every call: the function
that called it (`evaluate`, or `score` in a step's rollout), its prompts and completions, and the scores it returned,
written after each call to $REPORT_SCORES.{rank}.json. Usage: python tests/recording_reward_model.py grpo ARGS...
(or under torchrun)."""

import importlib
import json
import os
import sys

import tyro

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import rewards  # noqa: E402 (after the path: the scripts' own rewards.py)


def recording(call):
    def wrapped(self, prompts, completions):
        scores = call(self, prompts, completions)
        calls.append({"caller": sys._getframe(1).f_code.co_name, "prompts": prompts, "completions": completions,
                      "scores": scores.tolist()})
        with open(f"{os.environ['REPORT_SCORES']}.{os.environ.get('RANK', '0')}.json", "w") as f:
            json.dump(calls, f)
        return scores
    calls = []
    return wrapped


if __name__ == "__main__":
    module = importlib.import_module(sys.argv[1])
    rewards.RewardModel.__call__ = recording(rewards.RewardModel.__call__)
    module.main(tyro.cli(module.Args, args=sys.argv[2:]))
