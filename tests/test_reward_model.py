"""--reward-model with tiny sequence classifiers built here, each with a character tokenizer of its own (no token has
the policy's id) and its own chat template (or none), loaded through the command line as a user's: the scores the
scripts use equal a direct call on each conversation alone, unpadded, in one process and on each rank of two; every
script raises the held-out score of a reward model that prefers 7s, on a task of prompts alone; bad input fails in
one `error:` line before the policy loads; a task of prompts alone drops the rule rewards, and a task with answers
weighs the reward model beside them."""

import json
import os
import random
import shutil
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
import tyro
from conftest import FIRST_FAST, MODULES, OWN_ARGS, ROOT, read_run, run_script
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors
from transformers import (AutoModelForSequenceClassification, AutoTokenizer, LlamaConfig,
                          LlamaForSequenceClassification, PreTrainedTokenizerFast)

import grpo
import rewards

RM_SPECIALS = ["[END]", "[UNK]", "[PAD]", "[CLS]"]
# the policy's characters (conftest.CHARS) in another order after other specials, and the template's: no character
# has the id it has in the policy's tokenizer
RM_CHARS = list("|<>:usertmn\n?=-+ba9876543210 ")
# a conversation as "<u>prompt|<a>completion|[END]" (a system message "<s>...|")
TEMPLATE = "{% for m in messages %}<{{ m['role'][0] }}>{{ m['content'] }}|{% endfor %}[END]"
# text prompts and chat-message prompts, completions of 0 to 9 characters: batches of 3 are ragged
PROMPTS = ["12", "3", [{"role": "user", "content": "4+5=?"}], "678",
           [{"role": "system", "content": "a b"}, {"role": "user", "content": "9"}], "0", "ab"]
COMPLETIONS = ["7", "77 7", "", "a+b=3", "123456789", "0", "-"]
# the largest difference measured between a batched score and the same conversation scored alone: 1.5e-8 (float32,
# sums in another order)
TOLERANCE = 1e-5


def rm_tokenizer(template: str | None = TEMPLATE, pad: bool = True, cls: bool = False) -> PreTrainedTokenizerFast:
    """A character tokenizer of RM_SPECIALS and RM_CHARS with EOS [END], a pad token [PAD] unless `pad` is False, the
    chat `template`, and (cls) a [CLS] before each text, as BERT's, where special tokens are added."""
    vocab = {token: i for i, token in enumerate(RM_SPECIALS + RM_CHARS)}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.Split(Regex("."), "isolated")
    backend.decoder = decoders.Fuse()
    if cls:
        backend.post_processor = processors.TemplateProcessing(single="[CLS] $A", special_tokens=[("[CLS]", 3)])
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="[END]", unk_token="[UNK]",
                                        **({"pad_token": "[PAD]"} if pad else {}))
    tokenizer.chat_template = template
    return tokenizer


def reward_model(tokenizer, num_labels: int = 1, seed: int = 0, pad_token_id: int | None = None
                 ) -> LlamaForSequenceClassification:
    """A one-layer Llama classifier for `tokenizer` (smaller than the policy, its own vocabulary), seeded; the pad
    token in its config the tokenizer's unless `pad_token_id` is given."""
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=128,
                         num_labels=num_labels, pad_token_id=tokenizer.pad_token_id if pad_token_id is None
                         else pad_token_id)
    torch.manual_seed(seed)
    return LlamaForSequenceClassification(config)


def save(model, tokenizer, path) -> str:
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path)


@pytest.fixture(scope="session")
def reward_models(tmp_path_factory) -> dict[str, str]:
    """Untrained tiny reward models, saved: with the chat template; with none (and a [CLS] before each text); with
    the template but no pad token, the template ending in EOS as Llama 3's (no_pad_token); and the same with EOS as
    the pad token in the model's config, as a reward model trained with EOS for padding is saved (eos_pad): it reads
    a conversation's score before its closing EOS, in a direct call as in training."""
    root = tmp_path_factory.mktemp("reward_models")
    kinds = {"template": (rm_tokenizer(), None), "no_template": (rm_tokenizer(None, cls=True), None),
             "no_pad_token": (rm_tokenizer(pad=False), None),
             "eos_pad": (rm_tokenizer(pad=False), RM_SPECIALS.index("[END]"))}
    return {kind: save(reward_model(tokenizer, pad_token_id=pad), tokenizer, root / kind)
            for kind, (tokenizer, pad) in kinds.items()}


def conversation(prompt, completion) -> list[dict]:
    return [*(prompt if isinstance(prompt, list) else [{"role": "user", "content": prompt}]),
            {"role": "assistant", "content": completion}]


class Direct:
    """The reward model as from_pretrained gives it (its own config), scoring one conversation alone, unpadded: its
    chat template's text, tokenized with no more special tokens; with no template, the messages' contents one after
    another, tokenized with the tokenizer's own special tokens."""

    def __init__(self, path: str):
        self.tokenizer = AutoTokenizer.from_pretrained(path)
        self.model = AutoModelForSequenceClassification.from_pretrained(path, dtype=torch.float32).eval()

    @torch.no_grad()
    def __call__(self, prompt, completion) -> float:
        messages = conversation(prompt, completion)
        if self.tokenizer.chat_template:
            text = self.tokenizer.apply_chat_template(messages, tokenize=False)
            inputs = self.tokenizer(text, add_special_tokens=False, return_tensors="pt")
        else:
            inputs = self.tokenizer("".join(m["content"] for m in messages), return_tensors="pt")
        return self.model(**inputs).logits[0, 0].item()


def test_the_reward_model_reads_each_conversation_in_its_own_template_and_tokens(reward_models, tiny_model):
    with_template = rewards.RewardModel(reward_models["template"], torch.float32, torch.device("cpu"), 3)
    assert with_template.texts(PROMPTS[3:5], COMPLETIONS[3:5]) == ["<u>678|<a>a+b=3|[END]",
                                                                    "<s>a b|<u>9|<a>123456789|[END]"]
    without = rewards.RewardModel(reward_models["no_template"], torch.float32, torch.device("cpu"), 3)
    assert without.texts(PROMPTS[3:5], COMPLETIONS[3:5]) == ["678a+b=3", "a b9123456789"]
    # its own special tokens where it has no template: a [CLS] first
    assert without.tokenizer("7")["input_ids"] == [RM_SPECIALS.index("[CLS]"), len(RM_SPECIALS) + RM_CHARS.index("7")]
    # not the policy's ids: no character of the policy's has its id in the reward model's tokenizer
    policy = AutoTokenizer.from_pretrained(tiny_model)
    chars = list("0123456789+-=?ab ")
    assert all(a != b for a, b in zip(policy.convert_tokens_to_ids(chars),
                                      with_template.tokenizer.convert_tokens_to_ids(chars)))


@pytest.mark.parametrize("kind", ["template", "no_template", "eos_pad", "no_pad_token"])
def test_batched_scores_equal_each_conversation_scored_alone(kind, reward_models):
    """Batches of 3, ragged and padded on the right, text and chat-message prompts: each score equals the reward
    model's own call on that conversation alone, unpadded, and comes as float32 on the CPU."""
    path = reward_models[kind]
    scores = rewards.RewardModel(path, torch.float32, torch.device("cpu"), 3)(PROMPTS, COMPLETIONS)
    assert scores.dtype == torch.float32 and scores.device.type == "cpu" and scores.shape == (len(PROMPTS),)
    direct = Direct(path)
    expected = torch.tensor([direct(p, c) for p, c in zip(PROMPTS, COMPLETIONS)])
    assert expected.std() > 1e-3  # distinct scores: one read at a wrong place, or another row's, would show
    assert (scores - expected).abs().max().item() < TOLERANCE


def prompts_task(path, n: int = 200) -> str:
    """A task of prompts alone: n distinct prompts of 3 digits, no answers (the last 20 held out)."""
    with open(path, "w") as f:
        f.writelines(json.dumps({"prompt": f"{i:03d}"}) + "\n" for i in range(n))
    return str(path)


@pytest.fixture(scope="session")
def prompts_only(tmp_path_factory) -> str:
    return prompts_task(tmp_path_factory.mktemp("data") / "prompts.jsonl")


def sevens(rng: random.Random) -> str:
    """A completion of 0 to 6 of the policy's characters, a random share of them 7s."""
    share = rng.random()
    return "".join("7" if rng.random() < share else rng.choice("0123456789+-=?ab ") for _ in range(rng.randint(0, 6)))


@pytest.fixture(scope="session")
def sevens_reward_model(tmp_path_factory) -> str:
    """A tiny reward model trained to prefer completions with more 7s: 100 steps of the Bradley-Terry loss
    -log sigmoid(r_more - r_fewer) on 32 pairs each (random 3-digit prompts, random completions with different
    counts of 7s), AdamW at lr 3e-3: 1.5 s. Its accuracy on 500 new pairs was 1.0; its score rises about 2.6 with each
    7 (measured, after the prompt "183": "" -6.12, "12" -6.08, "7" -1.98, "77" 0.69, "777" 3.01, "7777" 4.87)."""
    tokenizer = rm_tokenizer()
    model = reward_model(tokenizer)
    rng = random.Random(0)

    def pairs(n: int) -> list[tuple[str, str, str]]:  # (prompt, more 7s, fewer 7s)
        out = []
        while len(out) < n:
            a, b = sorted([sevens(rng), sevens(rng)], key=lambda c: c.count("7"))
            if a.count("7") < b.count("7"):
                out.append((f"{rng.randrange(1000):03d}", b, a))
        return out

    def scores(prompts: list[str], completions: list[str]) -> torch.Tensor:
        texts = [tokenizer.apply_chat_template(conversation(p, c), tokenize=False)
                 for p, c in zip(prompts, completions)]
        return model(**tokenizer(texts, padding=True, add_special_tokens=False, return_tensors="pt")).logits[:, 0]

    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    for _ in range(100):
        prompts, more, fewer = zip(*pairs(32))
        loss = -F.logsigmoid(scores(prompts, more) - scores(prompts, fewer)).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    model.eval()
    with torch.no_grad():
        prompts, more, fewer = zip(*pairs(500))
        accuracy = (scores(prompts, more) > scores(prompts, fewer)).float().mean().item()
    assert accuracy > 0.95, accuracy
    return save(model, tokenizer, tmp_path_factory.mktemp("sevens_reward_model"))


# The learning runs: on-policy (one mini-batch), 4 prompts of 8 completions of 4 tokens, 10 steps at lr 3e-3, the
# held-out greedy completions of 8 prompts scored before and after. Measured, 4 scripts x seeds 1-16 (64 runs): every
# run rose from -5.942 (the untrained policy's greedy completions hold no 7) to 4.787 (four 7s each), +10.73, and
# with an evaluation every 2 steps (seeds 1-4) had reached it by step 2 (GRPO and GSPO with seed 3: by step 4).
# MARGIN asks for more than two more 7s a completion on average (two: +6.8, three: +9.1).
LEARN = ["--steps", "10", "--eval-every", "10", "--eval-prompts", "8", "--num-prompts", "4", "--group-size", "8",
         "--max-new-tokens", "4", "--learning-rate", "3e-3", "--num-minibatches", "1", "--micro-batch-size", "32",
         "--output-dir", "ckpt"]
MARGIN = 8.0
ONE_THREAD = {**os.environ, "OMP_NUM_THREADS": "1"}


@pytest.mark.parametrize("module", FIRST_FAST)
def test_each_script_raises_the_held_out_score_of_a_reward_model_that_prefers_sevens(module, tiny_model, prompts_only,
                                                                                    sevens_reward_model, tmp_path):
    """A task of prompts alone, --reward-model and no weights given: the run says the rules are off, trains on the
    reward model's score alone (charts/reward_reward_model, no rule's chart) and logs its held-out mean score,
    charts/eval_reward_model, with no accuracy. The score must rise by MARGIN (above). 7 s."""
    result = run_script(module, "--model", tiny_model, "--task", prompts_only, "--reward-model", sevens_reward_model,
                        *LEARN, *OWN_ARGS.get(module.__name__, []), cwd=str(tmp_path), env=ONE_THREAD)
    assert result.returncode == 0
    assert f"--task {prompts_only}: prompts alone (no field 'answer'): the rule rewards are off" in result.stdout
    assert "step 10/10: " in result.stdout and "held-out reward-model score" in result.stdout
    scalars, _ = read_run(str(tmp_path))
    assert "charts/eval_accuracy" not in scalars and "charts/reward_correctness" not in scalars
    assert "charts/reward_format" not in scalars and "charts/reward_reward_model" in scalars
    (first_step, first), (last_step, last) = scalars["charts/eval_reward_model"]
    print(f"{module.__name__}: held-out reward-model score {first:.3f} at step 0, {last:.3f} at step {last_step}")
    assert (first_step, last_step) == (0, 10)
    assert last - first >= MARGIN


@pytest.mark.slow
def test_under_torchrun_each_rank_scores_its_own_completions_as_the_reward_model_scores_each_alone(
        tiny_model, prompts_only, reward_models, tmp_path):
    """grpo.py under `torchrun --nproc_per_node 2` (gloo, CPU), RewardModel.__call__ recording on each rank what it
    scored (tests/recording_reward_model.py): every score equals the direct call on that conversation alone; the
    ranks score different prompts and completions, each its share; the logged means are those of both ranks' scores
    (a prompts-only task: the reward is the reward model's score alone). 2 steps, an evaluation before and after
    each, batches of 3 (ragged)."""
    path = reward_models["template"]
    argv = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
            os.path.join(ROOT, "tests", "recording_reward_model.py"), "grpo", "--model", tiny_model, "--task",
            prompts_only, "--reward-model", path, "--steps", "2", "--eval-every", "1", "--eval-prompts", "8",
            "--max-new-tokens", "4", "--num-prompts", "4", "--group-size", "4", "--micro-batch-size", "3",
            "--output-dir", "ckpt"]
    result = subprocess.run(argv, cwd=tmp_path, capture_output=True, text=True, timeout=600,
                            env={**ONE_THREAD, "REPORT_SCORES": str(tmp_path / "scores")})
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    ranks = [json.loads((tmp_path / f"scores.{rank}.json").read_text()) for rank in (0, 1)]
    direct = Direct(path)
    for calls in ranks:
        assert [call["caller"] for call in calls] == ["evaluate", "score", "evaluate", "score", "evaluate"]
        for call in calls:
            expected = [direct(p, c) for p, c in zip(call["prompts"], call["completions"])]
            assert max(abs(a - b) for a, b in zip(call["scores"], expected)) < TOLERANCE
        # a step: this rank's 2 prompts, 4 completions each
        assert all(len(call["scores"]) == 8 and len(set(call["prompts"])) == 2 for call in calls[1::2])
    for first, second in zip(*ranks):  # different prompts, and so different completions, on each rank
        assert not set(first["prompts"]) & set(second["prompts"]) and first["completions"] != second["completions"]
    held_out = sorted(ranks[0][0]["prompts"] + ranks[1][0]["prompts"])
    assert held_out == [f"{i:03d}" for i in range(180, 188)]  # the first 8 held-out prompts, shared out
    scalars, _ = read_run(str(tmp_path))
    for (step, logged), first, second in zip(scalars["charts/eval_reward_model"], ranks[0][::2], ranks[1][::2]):
        scores = first["scores"] + second["scores"]
        assert logged == pytest.approx(sum(scores) / len(scores), rel=1e-6, abs=1e-6)
    for chart in ("charts/reward_mean", "charts/reward_reward_model"):
        for (step, logged), first, second in zip(scalars[chart], ranks[0][1::2], ranks[1][1::2]):
            scores = first["scores"] + second["scores"]
            assert logged == pytest.approx(sum(scores) / len(scores), rel=1e-6, abs=1e-6)
    assert [s for s, _ in scalars["charts/eval_reward_model"]] == [0, 1, 2]
    assert [s for s, _ in scalars["charts/reward_mean"]] == [1, 2]


# Bad input: one `error:` line before the policy (or the reward model) loads. The folder: ./causal, the tiny policy
# itself (a causal LM); ./two_outputs, a classifier with num_labels 2; ./no_tokenizer, a classifier saved without its
# tokenizer; ./rm, a good one; a task with answers and one of prompts alone.
BAD_INPUTS = {
    "no_such_path": (["--reward-model", "./no/such/rm"], "--reward-model ./no/such/rm: no such file or folder"),
    "causal_lm": (["--reward-model", "./causal"], "--reward-model ./causal: a LlamaForCausalLM, not a sequence "
                                                  "classifier (...ForSequenceClassification) with one output"),
    "two_outputs": (["--reward-model", "./two_outputs"], "--reward-model ./two_outputs: 2 outputs, not one"),
    "no_tokenizer": (["--reward-model", "./no_tokenizer"], "--reward-model ./no_tokenizer: "),
    # a task of prompts alone whose only reward weighs 0
    "prompts_alone_weight_0": (["--task", "prompts.jsonl", "--reward-model", "./rm", "--reward-weights.reward-model",
                                "0"], "score its completions with a --reward-model of weight > 0"),
    "no_answers": (["--task", "prompts.jsonl"], "--task prompts.jsonl: no answers (no field 'answer'): score its "
                                                "completions with a --reward-model"),
    # the reward model's weight alone, with no --reward-model: no reward left
    "weight_alone": (["--reward-weights.correctness", "0", "--reward-weights.format", "0"], "and not all 0"),
    # a weight given to a reward model there is not
    "weight_without_model": (["--reward-weights.reward-model", "0.5"],
                             "--reward-weights.reward-model needs a --reward-model")}


def write_inputs(folder, tiny_model: str) -> None:
    shutil.copytree(tiny_model, folder / "causal")
    tokenizer = rm_tokenizer()
    save(reward_model(tokenizer, num_labels=2), tokenizer, folder / "two_outputs")
    save(reward_model(tokenizer), tokenizer, folder / "rm")
    reward_model(tokenizer).save_pretrained(folder / "no_tokenizer")
    prompts_task(folder / "prompts.jsonl", 20)
    with open(folder / "copy.jsonl", "w") as f:
        f.writelines(json.dumps({"prompt": str(i % 10), "answer": str(i % 10)}) + "\n" for i in range(20))


def refuse_to_load(monkeypatch, module) -> None:
    monkeypatch.setattr(module, "load_model", lambda *args: pytest.fail("the policy loaded"))
    monkeypatch.setattr(rewards, "RewardModel", lambda *args: pytest.fail("the reward model loaded"))


@pytest.mark.parametrize("module", MODULES)
@pytest.mark.parametrize("argv, message", [*BAD_INPUTS.values(), (None, "--reward-weights: correctness, format and "
                                                                        "reward_model only")],
                         ids=[*BAD_INPUTS, "unknown_weight"])
def test_bad_reward_model_input_stops_main_in_one_line_before_a_model_loads(module, argv, message, tiny_model, tmp_path,
                                                                           monkeypatch):
    """In-process, each script's main. An unknown weight's name (None here) cannot pass the command line (tyro
    knows the three names: the slow test below), but main checks the arguments it is given."""
    write_inputs(tmp_path, tiny_model)
    monkeypatch.chdir(tmp_path)
    refuse_to_load(monkeypatch, module)
    before = sorted(os.listdir(tmp_path))
    common = ["--model", tiny_model, "--task", "copy.jsonl"]
    if argv is None:
        args = tyro.cli(module.Args, args=common)
        args.reward_weights = {"correctness": 1.0, "length": 1.0}
    else:
        args = tyro.cli(module.Args, args=common + argv)
    with pytest.raises(SystemExit) as stopped:
        module.main(args)
    assert str(stopped.value).startswith("error: ") and message in str(stopped.value)
    assert "\n" not in str(stopped.value) and sorted(os.listdir(tmp_path)) == before


# those that read the reward model's files, where transformers might add lines of its own, and one of the rest
ON_THE_COMMAND_LINE = ["no_such_path", "causal_lm", "two_outputs", "no_tokenizer", "no_answers"]


@pytest.mark.slow
@pytest.mark.parametrize("argv, message", [BAD_INPUTS[name] for name in ON_THE_COMMAND_LINE], ids=ON_THE_COMMAND_LINE)
def test_bad_reward_model_input_fails_on_the_command_line_in_one_line_with_exit_code_1(argv, message, tiny_model,
                                                                                      tmp_path):
    """grpo.py as a user runs it: exit code 1, the one line on stderr (5 s each, nearly all of it imports: slow; the
    test above checks every case in every script's main in-process)."""
    write_inputs(tmp_path, tiny_model)
    result = run_script(grpo, "--model", tiny_model, "--task", "copy.jsonl", *argv, cwd=str(tmp_path),
                        env={**ONE_THREAD, "HF_HUB_OFFLINE": "1"})
    assert result.returncode == 1 and result.stderr.startswith("error: ") and message in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1 and "Loading weights" not in result.stderr
    assert not os.path.exists(tmp_path / "runs") and not os.path.exists(tmp_path / "checkpoints")


@pytest.mark.parametrize("module", MODULES)
def test_a_task_of_prompts_alone_drops_the_rules_in_one_line_and_a_task_with_answers_keeps_them(
        module, tiny_model, reward_models, tmp_path, monkeypatch, capsys):
    """validate, in-process: the weights the run goes on with, and the line that says the rules are off."""
    write_inputs(tmp_path, tiny_model)
    monkeypatch.chdir(tmp_path)
    rm = ["--reward-model", reward_models["template"]]
    cases = [(["--task", "prompts.jsonl", *rm], {"reward_model": 1.0}),
             (["--task", "prompts.jsonl", *rm, "--reward-weights.reward-model", "2"], {"reward_model": 2.0}),
             (["--task", "prompts.jsonl", *rm, "--reward-weights.correctness", "3"], {"reward_model": 1.0}),
             (["--task", "copy.jsonl", *rm], {"correctness": 1.0, "format": 0.2, "reward_model": 1.0}),
             (["--task", "copy.jsonl"], {"correctness": 1.0, "format": 0.2})]
    for argv, weights in cases:
        args, _, task = module.validate(tyro.cli(module.Args, args=["--model", tiny_model, *argv]))
        lines = [line for line in capsys.readouterr().out.splitlines() if "prompts alone" in line]
        assert args.reward_weights == weights and task.has_answers == ("copy.jsonl" in argv)
        assert lines == ([] if task.has_answers else
                         ["--task prompts.jsonl: prompts alone (no field 'answer'): the rule rewards are off, "
                          "the reward model alone scores"])


def test_the_reward_is_the_rules_and_the_reward_model_each_by_its_weight(tiny_model, reward_models, tmp_path,
                                                                         monkeypatch):
    """`--reward-weights.correctness 1 --reward-weights.format 0 --reward-weights.reward-model 2` on a task with
    answers: reward = correctness + 2 x the reward model's score (the direct call's), the format reward computed and
    logged at weight 0."""
    write_inputs(tmp_path, tiny_model)
    monkeypatch.chdir(tmp_path)
    path = reward_models["template"]
    args, _, task = grpo.validate(tyro.cli(grpo.Args, args=[
        "--model", tiny_model, "--task", "copy.jsonl", "--reward-model", path, "--reward-weights.correctness", "1",
        "--reward-weights.format", "0", "--reward-weights.reward-model", "2"]))
    task.reward_model = rewards.RewardModel(path, torch.float32, torch.device("cpu"), 3)
    prompts = ["3", "4", "5", "6", [{"role": "user", "content": "7"}]]
    completions = ["3", "\\boxed{4}", "6", "a 7 b", "<answer>7</answer>"]
    answers = ["3", "4", "5", "7", "7"]
    reward, parts = rewards.score(completions, answers, task, args.reward_weights, prompts)
    correct = torch.tensor(task.correctness(completions, answers), dtype=torch.float32)
    assert 0 < correct.sum() < len(correct)  # right and wrong answers
    direct = Direct(path)
    scores = torch.tensor([direct(p, c) for p, c in zip(prompts, completions)])
    assert torch.equal(parts["correctness"], correct) and "format" in parts
    assert (parts["reward_model"] - scores).abs().max() < TOLERANCE
    assert (reward - (correct + 2 * scores)).abs().max() < 2 * TOLERANCE


@pytest.mark.parametrize("module", FIRST_FAST)
def test_evaluation_logs_the_reward_models_score_and_the_accuracy_only_where_there_are_answers(
        module, tiny_model, reward_models, tmp_path, monkeypatch, capsys):
    """A step in-process, evaluated before and after, on a task with answers and on one of prompts alone:
    charts/eval_reward_model in both, the mean of the scores that evaluate's RewardModel calls returned;
    charts/eval_accuracy only with answers; the step line names what it shows."""
    import recording_reward_model

    write_inputs(tmp_path, tiny_model)
    monkeypatch.setenv("REPORT_SCORES", str(tmp_path / "scores"))
    unwrapped = rewards.RewardModel.__call__
    for task in ("copy", "prompts"):
        (tmp_path / task).mkdir()
        monkeypatch.chdir(tmp_path / task)
        monkeypatch.setattr(rewards.RewardModel, "__call__", recording_reward_model.recording(unwrapped))
        module.main(tyro.cli(module.Args, args=[
            "--model", tiny_model, "--task", f"../{task}.jsonl", "--reward-model", reward_models["template"],
            "--steps", "1", "--eval-every", "1", "--eval-prompts", "4", "--max-new-tokens", "3", "--num-prompts", "2",
            "--group-size", "2", "--num-minibatches", "1", "--output-dir", "ckpt", *OWN_ARGS.get(module.__name__, [])]))
        scalars, _ = read_run(str(tmp_path / task))
        calls = json.loads((tmp_path / "scores.0.json").read_text())
        evaluations = [call["scores"] for call in calls if call["caller"] == "evaluate"]
        assert [s for s, _ in scalars["charts/eval_reward_model"]] == [0, 1] and len(evaluations) == 2
        for (_, logged), scores in zip(scalars["charts/eval_reward_model"], evaluations):
            assert len(scores) == 2 and logged == pytest.approx(sum(scores) / len(scores), rel=1e-6, abs=1e-6)
        out = capsys.readouterr().out
        if task == "copy":
            assert [s for s, _ in scalars["charts/eval_accuracy"]] == [0, 1]
            assert "step 1/1: reward" in out and "held-out accuracy" in out and "reward-model score" not in out
        else:
            assert "charts/eval_accuracy" not in scalars
            assert "held-out reward-model score" in out and "accuracy" not in out
