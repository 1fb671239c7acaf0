import builtins
import itertools
import json
import os
import re
import string
import sys
import threading
import time
import types
from fractions import Fraction

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

import rewards


@pytest.mark.parametrize("difficulty, sizes", [(1, (331, 110)), (2, (5000, 200)), (3, (5000, 200)), (4, (5000, 200))])
def test_arithmetic_answers_match_their_questions(difficulty, sizes):
    task = rewards.load_task("arithmetic", difficulty)
    assert (len(task.train), len(task.test)) == sizes  # difficulty 1: 21 x 21 = 441 questions, a quarter held out
    train_prompts = {r["prompt"] for r in task.train}
    assert not train_prompts & {r["prompt"] for r in task.test}  # disjoint splits
    for record in task.train[:500] + task.test:
        expression = record["prompt"].removeprefix("What is ").split("?")[0]
        assert rewards.evaluate_expression(expression)[0] == int(record["answer"])
        assert rewards.correctness_reward([f"\\boxed{{{record['answer']}}}"], [record["answer"]]) == [1.0]


def test_countdown_puzzles_are_solvable_and_checked():
    task = rewards.load_task("countdown", 1)
    for record in task.test[:50]:
        target, numbers = record["answer"].split("|")
        numbers = [int(n) for n in numbers.split(",")]
        assert str(numbers) in record["prompt"] and f"equal to {target}." in record["prompt"]
        solutions = []  # brute force over the left-nested form the generator uses
        for a, b, c in itertools.permutations(numbers):
            for op1, op2 in itertools.product("+-*/", repeat=2):
                expression = f"(({a} {op1} {b}) {op2} {c})"
                value = rewards.evaluate_expression(expression)
                if value is not None and value[0] == int(target):
                    solutions.append(expression)
        assert solutions
        assert rewards.countdown_reward([f"so \\boxed{{{solutions[0]}}}"], [record["answer"]]) == [1.0]


def test_countdown_reward_rules():
    answer = "24|4,6,1"
    cases = {
        "\\boxed{4 * 6 * 1}": 1.0,
        "<answer>(4 * 6) / 1 = 24</answer>": 1.0,
        "\\boxed{4 * 6}": 0.0,  # a number unused
        "\\boxed{4 * 6 * 1 * 1}": 0.0,  # a number used twice
        "\\boxed{24}": 0.0,
        "4 * 6 * 1": 0.0,  # no boxed expression
        "\\boxed{4 * 6 / (1 - 1)}": 0.0,  # division by zero
        "\\boxed{__import__('os')}": 0.0,
    }
    assert rewards.countdown_reward(list(cases), [answer] * len(cases)) == list(cases.values())


@pytest.mark.parametrize(
    "text, expected",
    [
        ("The answer is \\boxed{42}.", "42"),
        ("\\boxed{\\frac{1}{2}} then \\boxed{7}", "7"),
        ("\\boxed{\\frac{1}{2}}", "\\frac{1}{2}"),
        ("<answer> 13 </answer>", "13"),
        ("first 3, then 1,200 apples", "1,200"),
        ("no numbers here", None),
        ("\\boxed{12", "12"),  # unclosed box: falls back to the last number
        ("\\boxed{20 + 23 = 43}", "43"),  # `expr = value`: the value
        ("<answer>3 * 4 = 12</answer>", "12"),
        ("78 + 84 = 152\n\nThe answer is \\boxed{}.", "152"),  # the copied empty box hides nothing
        ("\\boxed{7} and then \\boxed{ }", "7"),  # the last non-empty box
    ],
)
def test_extract_answer(text, expected):
    assert rewards.extract_answer(text) == expected


@pytest.mark.parametrize(
    "completion, answer, expected",
    [("\\boxed{12.0}", "12", 1.0), ("1,200", "1200", 1.0), ("\\boxed{$5}", "5", 1.0), ("\\\\boxed{3/4}", "0.75", 1.0),
     ("-7", "-7", 1.0), ("\\boxed{13}", "12", 0.0), ("12 or 13", "12", 0.0), ("", "12", 0.0),
     ("\\boxed{yes}", "yes", 1.0), ("\\boxed{20 + 23 = 43}", "43", 1.0), ("\\boxed{20 + 23 = 44}", "43", 0.0),
     ("20 + 23 = 43. The answer is \\boxed{}.", "43", 1.0), ("\\boxed{43 = 20 + 23}", "43", 0.0)],
)
def test_correctness_reward_numeric_equivalence(completion, answer, expected):
    assert rewards.correctness_reward([completion], [answer]) == [expected]


@pytest.mark.parametrize(
    "completion, answer, expected",
    [("\\boxed{\\$5}", "5", 1.0), ("\\boxed{\\$1,000.00}", "1000", 1.0), ("\\boxed{1{,}000}", "1000", 1.0),
     ("\\boxed{5\\%}", "5", 1.0), ("\\boxed{5\\%}", "0.05", 1.0), ("\\boxed{5 \\text{ apples}}", "5", 1.0),
     ("\\boxed{\\textbf{25}}", "25", 1.0), ("\\boxed{\\frac{3}{4}}", "0.75", 1.0),
     ("\\boxed{-\\frac{1}{2}}", "-0.5", 1.0), ("\\boxed{-\\frac{1}{2}}", "-1/2", 1.0),
     ("\\boxed{\u22125}", "-5", 1.0), ("so it is \u22125 degrees", "-5", 1.0),
     ("\\boxed{\\dfrac{84}{2}}", "42", 1.0), ("\\boxed{x = \\$12}", "12", 1.0),
     # wrong answers that plain-number parsing used to pass
     ("\\boxed{2,5}", "25", 0.0), ("\\boxed{4 2}", "42", 0.0),
     # a plain-number reference wants a number, compared exactly
     ("\\boxed{20 + 23}", "43", 0.0), ("\\boxed{3 \\times 4}", "12", 0.0), ("\\boxed{\\$42.0000001}", "42", 0.0),
     ("\\boxed{\\frac{3}{5}}", "0.75", 0.0), ("\\boxed{5\\%}", "6", 0.0), ("\\boxed{\\sqrt{4}}", "2", 0.0),
     # MATH-style references: math-verify's symbolic comparison
     ("\\boxed{\\dfrac{\\pi}{2}}", "\\frac{\\pi}{2}", 1.0), ("\\boxed{0.5}", "\\frac{1}{2}", 1.0),
     ("\\boxed{x^2 + 1}", "1 + x^2", 1.0), ("\\boxed{\\frac{\\pi}{3}}", "\\frac{\\pi}{2}", 0.0),
     ("\\boxed{(1, 2)}", "(1,2)", 1.0), ("\\boxed{sey}", "yes", 0.0)],  # a word is compared as text, not as y*e*s
)
def test_correctness_reward_reads_what_gsm8k_and_math_models_write(completion, answer, expected):
    assert rewards.correctness_reward([completion], [answer]) == [expected]


@pytest.mark.parametrize(
    "completion, answer, expected",
    [("\\boxed{\\frac{\\frac{3}{2}}{2}}", "0.75", 1.0), ("\\boxed{-\\frac{\\frac{1}{2}}{\\frac{1}{4}}}", "-2", 1.0),
     ("\\boxed{{{\\frac{3}{4}}}}", "0.75", 1.0), ("\\boxed{\\boxed{7}}", "7", 1.0),
     ("\\boxed{\\left(\\frac{1}{2}\\right)}", "0.5", 1.0),
     ("\\boxed{\\frac{\\sqrt{3}}{2}}", "\\frac{\\sqrt{3}}{2}", 1.0),
     ("\\boxed{\\frac{3}{4}}}}", "0.75", 1.0),  # stray closing braces after the box
     ("\\boxed{\\frac{3}{4}", "0.75", 0.0),  # an unclosed box: the last number, 4, is the answer
     ("\\boxed{\\frac{1}{0}}", "0", 0.0), ("\\boxed{\\left( 3 }", "3", 0.0),
     ("\\boxed{\\frac{1}{2}", "\\frac{1}{2}", 0.0)],
)
def test_correctness_reward_on_nested_and_unbalanced_latex(completion, answer, expected):
    assert rewards.correctness_reward([completion], [answer]) == [expected]


@pytest.mark.parametrize("text", ["<answer>\\frac{3}{4</answer>", "\\boxed{\\frac{", "\\boxed{\\left(\\right.}",
                                  "\\boxed{\\begin{pmatrix}1 & 2}", "\\boxed{\\sqrt[}", "\\boxed{^{_{}}}",
                                  "\\boxed{\\}"])
def test_correctness_reward_never_raises_on_broken_latex(text):
    assert rewards.correctness_reward([text, text], ["0.75", "\\frac{3}{4}"])[0] in (0.0, 1.0)


def test_nothing_from_the_model_is_executed(monkeypatch):
    """math-verify's plain-expression reader hands text to sympy's parse_expr, an eval(); only its LaTeX reader (an
    ANTLR grammar) is used, and sympy evals the number tokens it lexes, never the text around them. A canary name in
    the completions must reach no eval or exec."""
    run = []
    real_eval, real_exec = builtins.eval, builtins.exec
    monkeypatch.setattr(builtins, "eval", lambda source, *a: run.append(str(source)) or real_eval(source, *a))
    monkeypatch.setattr(builtins, "exec", lambda source, *a: run.append(str(source)) or real_exec(source, *a))
    monkeypatch.setattr(os, "system", lambda command: pytest.fail(f"os.system({command!r})"))
    completions = ["\\boxed{__import__('os').system('canary')}", "\\boxed{1 + canary}", "<answer>canary(1)</answer>",
                   "\\boxed{\\text{canary.__class__}}", "1 + 1 = canary"]
    for answer in ["5", "\\frac{1}{2}", "x + 1"]:
        assert rewards.correctness_reward(completions, [answer] * len(completions)) == [0.0] * len(completions)
    assert not [source for source in run if "canary" in source or "__import__" in source]
    assert all(type(config).__name__ == "LatexExtractionConfig" for config in rewards.MATH_VERIFY_CONFIG)


@pytest.mark.parametrize("text", ["9^{9^{9^{9}}}", "(10^{8})!", "\\binom{10^{9}}{10^{8}}", "2E999999", "1.5E+999999",
                                  "\\prod_{n=1}^{10^{6}} n", "10^{10^{8}} - 10^{10^{8}} + 5"])
def test_answers_that_are_slow_to_evaluate_score_0_in_bounded_time(text):
    """math-verify's time limit stops sympy; numbers in E-notation, which sympy would build in one uninterruptible C
    call (2E999999 hangs), never reach it."""
    for answer in ["5", "\\frac{1}{2}"]:
        start = time.perf_counter()
        assert rewards.correctness_reward([f"\\boxed{{{text}}}"], [answer]) == [0.0]
        assert time.perf_counter() - start < 5.0


def test_off_the_main_thread_only_plain_answers_are_graded():
    """math-verify's time limit is a SIGALRM, which only the main thread can set: elsewhere the reward neither raises
    nor hangs, and grades plain numbers and equal texts only."""
    scores = []
    thread = threading.Thread(target=lambda: scores.append(rewards.correctness_reward(
        ["\\boxed{12}", "\\boxed{\\frac{3}{4}}", "\\boxed{9^{9^{9^{9}}}}", "\\boxed{\\frac{1}{2}}"],
        ["12", "0.75", "\\frac{1}{2}", "\\frac{1}{2}"])))
    thread.start()
    thread.join(timeout=30)
    assert scores == [[1.0, 0.0, 0.0, 1.0]]


def test_format_reward():
    texts = ["\\boxed{3}", "<answer>3</answer>", "3", "\\boxed{3", "\\boxed{}", "<answer> </answer>", "\\boxed{x}",
             "\\boxed{3} then \\boxed{}"]
    assert rewards.format_reward(texts, ["3"] * 8) == [1.0, 1.0, 0.0, 0.0, 0.0, 0.0, 1.0, 1.0]


HOSTILE = ["\\boxed{}" * 200_000, "\\boxed{{}" * 100_000, "9" * 1_000_000, "{" * 1_000_000, "\\boxed{" * 200_000,
           "\\boxed{" + "{" * 1_000_000 + "1", "(" * 1_000_000, "<answer>" * 200_000, "1," * 500_000, "1." * 500_000,
           "\\boxed{" + "(" * 150 + "1"]


PIECES = ["\\boxed{", "{", "}", "=", "<answer>", "</answer>", "(", ")", "1", "99", "-", ".", "/", ",", "+", "*", " ",
          "e9"]


@settings(max_examples=40, deadline=None)
@given(unit=st.lists(st.sampled_from(PIECES), min_size=1, max_size=12), tail=st.text(max_size=20))
def test_rewards_stay_linear_on_generated_hostile_strings(unit, tail):
    """Any pattern of the characters the checkers look for, repeated to about 200k characters: a scan that is not
    linear-time would take minutes on such a string; each checker must answer 0 or 1 in a few seconds."""
    text = "".join(unit) * (200_000 // len("".join(unit))) + tail
    for fn, answer in [(rewards.correctness_reward, "9"), (rewards.correctness_reward, "\\frac{1}{2}"),
                       (rewards.format_reward, "9"), (rewards.countdown_reward, "24|4,6,1")]:
        start = time.perf_counter()
        assert fn([text], [answer])[0] in (0.0, 1.0)
        assert time.perf_counter() - start < 5.0


@pytest.mark.parametrize("text", HOSTILE, ids=lambda t: f"{t[:10]!r}x{len(t)}")
def test_rewards_never_raise_and_stay_fast_on_hostile_strings(text):
    for fn, answer in [(rewards.correctness_reward, "9"), (rewards.correctness_reward, "\\frac{1}{2}"),
                       (rewards.format_reward, "9"), (rewards.countdown_reward, "24|4,6,1")]:
        start = time.perf_counter()
        scores = fn([text], [answer])
        assert len(scores) == 1 and scores[0] in (0.0, 1.0)
        assert time.perf_counter() - start < 5.0  # linear-time scans: far below this on any machine


def test_parse_number_rejects_huge_numbers():
    assert rewards.parse_number("9" * 41) is None
    assert rewards.parse_number("1,234.5") == Fraction(2469, 2)


@pytest.mark.parametrize("text", ["1e999999999", "1E999999999", "-1e-999999999", "1_000", "1/0", "nan", "inf",
                                  "0x10", "1e5"])
def test_parse_number_accepts_only_plain_numbers(text):
    """`Fraction("1e999999999")` builds a billion-digit integer (a hang or a MemoryError inside the reward):
    exponents never reach it; nor do underscores, hex or special values."""
    start = time.perf_counter()
    assert rewards.parse_number(text) is None
    assert rewards.correctness_reward([f"\\boxed{{{text}}}"], ["10"]) == [0.0]
    assert time.perf_counter() - start < 1.0


@pytest.mark.parametrize("text, value", [("12", 12), ("-0.5", Fraction(-1, 2)), (".5", Fraction(1, 2)),
                                         ("3/4", Fraction(3, 4)), ("$1,200.", 1200), ("7.", 7),
                                         (" 1,234,567 ", 1234567), ("\u22125", -5)])
def test_parse_number_plain_forms(text, value):
    assert rewards.parse_number(text) == value


@pytest.mark.parametrize("text", ["4 2", "2,5", "1,2345", "12,34", ",5"])
def test_parse_number_rejects_what_is_not_one_number(text):
    """Spaces and commas are no longer dropped: `4 2` and `2,5` are not 42 and 25."""
    assert rewards.parse_number(text) is None


def test_hub_dataset_without_a_test_split_holds_out_part_of_train(monkeypatch):
    """A Hub dataset with only a train split must not be evaluated on what it trains on."""

    class Split(list):
        column_names = ["question", "answer"]

    fake = types.ModuleType("datasets")
    fake.load_dataset = lambda name, data_dir=None: {"train": Split({"question": f"q{i}", "answer": str(i)}
                                                                  for i in range(30))}
    monkeypatch.setitem(sys.modules, "datasets", fake)
    task = rewards.load_task("someone/train-only")
    assert len(task.train) == 27 and len(task.test) == 3
    assert not {r["answer"] for r in task.train} & {r["answer"] for r in task.test}
    assert task.test[0]["prompt"] == f"q27\n{rewards.ANSWER_INSTRUCTION}"


def test_jsonl_task(tmp_path):
    path = tmp_path / "t.jsonl"
    path.write_text("\n".join(f'{{"q": "{i}+1", "a": "#### {i + 1}"}}' for i in range(20)))
    task = rewards.load_task(str(path), prompt_field="q", answer_field="a")
    assert len(task.train) == 18 and len(task.test) == 2
    assert task.train[0] == {"prompt": "0+1", "answer": "1"}  # GSM8K-style '####' answers
    with pytest.raises(ValueError, match="--prompt-field"):
        rewards.load_task(str(path))
    with pytest.raises(FileNotFoundError):
        rewards.load_task(str(tmp_path / "missing.jsonl"))
    with pytest.raises(ValueError, match="not one of"):
        rewards.load_task("nonsense")


@pytest.mark.parametrize("text, message", [
    ("", "needs at least 2 records, found 0 (the file is empty)"),
    ('{"prompt": "1", "answer": "1"}\n{"prompt": "2", "answer"\n', "line 2 is not valid JSON"),
    ('{"prompt": "1", "answer": "1"}\n\n{"prompt": "2"}\n', "line 3 has no field 'answer'"),
    ("[1]\n[2]\n", "line 1 has no field 'prompt'")])
def test_jsonl_errors_name_the_line_and_what_is_wrong(text, message, tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text(text)
    with pytest.raises(ValueError, match=re.escape(f"--task {path}: {message}")):
        rewards.load_task(str(path))


def test_hub_record_without_a_field_is_named(monkeypatch):
    """The same field check as a .jsonl line's, naming the split and the record."""

    class Split(list):
        column_names = ("question", "answer")

    rows = [{"question": f"q{i}", "answer": str(i)} for i in range(10)]
    del rows[5]["answer"]
    fake = types.ModuleType("datasets")
    fake.load_dataset = lambda name, data_dir=None: {"train": Split(rows)}
    monkeypatch.setitem(sys.modules, "datasets", fake)
    with pytest.raises(ValueError, match="--task someone/gaps: train record 5 has no field 'answer'"):
        rewards.load_task("someone/gaps")


@pytest.mark.parametrize(
    "completion, answer, expected",
    [("\\boxed{2x - y + 3z + 8 = 0}", "2x - y + 3z + 8 = 0", 1.0),  # MATH's planes, lines and conics
     ("\\boxed{x^2 + y^2 = 25}", "x^2+y^2=25", 1.0), ("The circle is \\boxed{x^2+y^2=25}.", "x^2 + y^2 = 25", 1.0),
     ("\\boxed{x^2 + y^2 = 26}", "x^2+y^2=25", 0.0), ("\\boxed{25}", "x^2+y^2=25", 0.0),
     ("\\boxed{y = 2x + 3}", "y = 2x + 3", 1.0), ("\\boxed{5}", "x = 5", 1.0),
     # a number reference still takes the value of `expr = value`, and never the restated question
     ("\\boxed{20 + 23 = 43}", "43", 1.0), ("\\boxed{20 + 23}", "43", 0.0), ("<answer>3 * 4 = 12</answer>", "12", 1.0)],
)
def test_an_equation_answer_is_compared_with_an_equation_reference(completion, answer, expected):
    assert rewards.correctness_reward([completion], [answer]) == [expected]


@pytest.mark.parametrize(
    "completion, answer, extracted",
    [("So she pays 18, total.", "18", "18"), ("It costs 1,200, all told.", "1200", "1,200"), ("then 3,", "3", "3"),
     ("first 3, then 1,200 apples", "1200", "1,200")],  # a thousands comma is still part of the number
)
def test_the_last_number_drops_a_trailing_comma(completion, answer, extracted):
    assert rewards.extract_answer(completion) == extracted
    assert rewards.correctness_reward([completion], [answer]) == [1.0]


@pytest.mark.parametrize(
    "completion, answer, expected",
    [("\\boxed{5 \\text{ cm}}", "\\text{5 cm}", 1.0), ("\\boxed{5\\text{cm}}", "\\text{5 cm}", 1.0),
     ("\\boxed{5\\,\\text{cm}}", "\\text{5 cm}", 1.0), ("\\boxed{\\text{5 cm}}", "5 \\text{ cm}", 1.0),
     ("\\boxed{\\text{(C)}}", "(C)", 1.0), ("\\boxed{6 \\text{ cm}}", "\\text{5 cm}", 0.0),
     ("\\boxed{5 \\text{ m}}", "\\text{5 cm}", 0.0),
     ("\\boxed{4 2}", "42", 0.0)],  # a number reference still wants one number
)
def test_units_in_text_compare_whatever_the_spacing(completion, answer, expected):
    assert rewards.correctness_reward([completion], [answer]) == [expected]


@pytest.mark.parametrize("number, value", [("1.5/2", "0.75"), (".3/4", "0.075"), ("2.5/5", "0.5")])
def test_a_decimal_over_a_number_never_raises(number, value):
    """`1.5/2` is a plain number to PLAIN_NUMBER_RE but not to Fraction(), which raised out of the reward (and out of
    the scripts' evaluation, which calls it unguarded); math-verify reads it."""
    assert rewards.parse_number(number) is None
    completions = [f"\\boxed{{{number}}}", f"<answer>{number}</answer>"]
    assert rewards.correctness_reward(completions, ["7", "7"]) == [0.0, 0.0]
    assert rewards.correctness_reward(completions, [value, value]) == [1.0, 1.0]


MATH_SOLUTIONS = [f"We halve {i}: $x = \\frac{{{i}}}{{2}}$, so the answer is $\\boxed{{\\frac{{{i}}}{{2}}}}$."
                  for i in range(1, 9)]


def test_a_reference_holding_a_whole_solution_is_graded_by_its_boxed_answer(tmp_path):
    """MATH's `solution` field is the worked solution; the graded answer is its last `\\boxed{}` (open-r1 and verl
    read it so). GSM8K's '####' answers are not counted as reduced."""
    rows = [{"problem": f"Halve {i}.", "solution": solution} for i, solution in enumerate(MATH_SOLUTIONS, 1)]
    rows += [{"problem": "Count.", "solution": "One, two.\n#### 2"}, {"problem": "Box it.", "solution": "\\boxed{}"}]
    path = tmp_path / "math.jsonl"
    path.write_text("\n".join(json.dumps(row) for row in rows))
    task = rewards.load_task(str(path), prompt_field="problem", answer_field="solution")
    answers = [record["answer"] for record in task.train + task.test]
    assert answers == [f"\\frac{{{i}}}{{2}}" for i in range(1, 9)] + ["2", "\\boxed{}"]
    assert task.references_reduced == 8
    completions = ["so \\boxed{\\dfrac{3}{2}}", "\\boxed{1.5}", "\\boxed{3}"]
    assert task.correctness(completions, answers[2:3] * 3) == [1.0, 1.0, 0.0]


GOOD = ["\\boxed{3}", "\\boxed{4}", "so 3", "\\boxed{5}"]


def test_preflight_says_how_many_references_were_reduced_to_their_boxed_answer(capsys):
    records = [{"prompt": "p", "answer": "1"}] * 5
    task = rewards.Task(records[:4], records[4:], references_reduced=4)
    args = (torch.tensor([1.2, 0.2, 1.0, 1.0]), torch.tensor([False] * 4))
    assert rewards.preflight(GOOD, *args, task, 2, 48, 0, True) == []
    assert "references reduced to their \\boxed{} answer (the answer field held a whole solution): 4 of 5\n" in (
        capsys.readouterr().out)
    rewards.preflight(GOOD, *args, rewards.Task(records[:4], records[4:]), 2, 48, 0, True)
    assert "references reduced" not in capsys.readouterr().out


def char_tokenizer(chat_template: str | None = None) -> PreTrainedTokenizerFast:
    """One token per printable character (tests/conftest.py's tokenizer, with a wider alphabet)."""
    vocab = {token: i for i, token in enumerate(["<pad>", "<unk>", *string.printable])}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Split(Regex("[\\s\\S]"), "isolated")
    backend.decoder = decoders.Fuse()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="<pad>", unk_token="<unk>")
    tokenizer.chat_template = chat_template
    return tokenizer


CHAT_TEMPLATE = ("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}<assistant>{% endif %}")


def test_encode_prompts_puts_the_system_prompt_before_each_text_prompt():
    records = [{"prompt": "What is 2 + 3?", "answer": "5"},
               {"prompt": [{"role": "user", "content": "Hi"}], "answer": "1"}]  # chat messages: used as they are
    chat = char_tokenizer(CHAT_TEMPLATE)

    def decoded(tokenizer):
        return [tokenizer.decode(record["prompt_ids"], clean_up_tokenization_spaces=False) for record in records]

    assert rewards.encode_prompts(chat, records, 1000, system_prompt="Answer in <answer> tags.") == 0
    assert decoded(chat) == ["<system>Answer in <answer> tags.\n<user>What is 2 + 3?\n<assistant>",
                             "<user>Hi\n<assistant>"]
    rewards.encode_prompts(chat, records, 1000)  # none: as before
    assert decoded(chat) == ["<user>What is 2 + 3?\n<assistant>", "<user>Hi\n<assistant>"]
    plain = char_tokenizer()  # no chat template: the system prompt is text, then a blank line
    records.pop()
    assert rewards.encode_prompts(plain, records, 1000, system_prompt="Be brief.") == 0
    assert decoded(plain) == ["Be brief.\n\nWhat is 2 + 3?"]


def test_resolve_system_prompt(monkeypatch):
    """--system-prompt: "auto" gives reasoning-gym's own prompt to its tasks and none to the others, whose prompts
    are unchanged; "none" none; a name of reasoning-gym's SYSTEM_PROMPTS that prompt; anything else itself."""
    assert rewards.resolve_system_prompt("auto", "arithmetic") is None
    assert rewards.resolve_system_prompt("auto", "openai/gsm8k") is None
    assert rewards.resolve_system_prompt("none", "reasoning_gym:chain_sum") is None
    assert rewards.resolve_system_prompt("Think, then answer.", "countdown") == "Think, then answer."
    system_prompts = pytest.importorskip("reasoning_gym.utils").SYSTEM_PROMPTS
    assert rewards.resolve_system_prompt("auto", "reasoning_gym:chain_sum") == system_prompts["default"]
    assert "<answer>" in system_prompts["default"]
    assert rewards.resolve_system_prompt("simple", "arithmetic") == system_prompts["simple"]
    monkeypatch.setitem(sys.modules, "reasoning_gym", None)  # as if not installed
    monkeypatch.setitem(sys.modules, "reasoning_gym.utils", None)
    assert rewards.resolve_system_prompt("simple", "arithmetic") == "simple"


def test_preflight_without_a_readable_answer_names_system_prompt_and_the_format_read(capsys):
    """The chat model is named only when the tokenizer has no chat template."""
    completions = ["no", "answer", "in", "these"]
    args = (torch.tensor([0.0, 0.0, 0.0, 0.1]), torch.tensor([False] * 4), rewards.Task([], []), 2, 48, 0)
    (warning,) = rewards.preflight(completions, *args, True)
    assert "--system-prompt" in warning and "\\boxed{}" in warning and "<answer>...</answer>" in warning
    assert "--task" in warning and "chat (instruct) --model" not in warning
    (warning,) = rewards.preflight(completions, *args, False)
    assert "--system-prompt" in warning and "chat (instruct) --model" in warning
