"""Tasks and reward functions: the one module that ppo.py, grpo.py, dapo.py and gspo.py share.

A task is a list of records {"prompt": str | list[chat messages], "answer": str} with a train and
a test split, plus the reward functions that score completions of it. `--task` names one of:
  - a built-in task generated from a seed, so no download is needed: `arithmetic`, `countdown`;
  - `reasoning_gym:NAME` (`reasoning_gym:chain_sum`): a procedural dataset of the optional
    `reasoning-gym` package, generated offline and scored by its own checker;
  - a `.jsonl` file with one record per line (fields chosen with `prompt_field` / `answer_field`);
  - a Hugging Face Hub dataset id such as `openai/gsm8k`, a local dataset folder (a copy of one, in
    the Hub's layout) or a `.parquet` file (these need the `datasets` package).

Every reward function has the signature
`fn(completions: list[str], answers: list[str]) -> list[float]`, never raises on any string, and
answers in bounded time: linear-time scans find the stated answer, and HuggingFace's math-verify
(https://github.com/huggingface/Math-Verify) reads it when it is LaTeX (`\\$1{,}000`,
`\\frac{3}{4}`, `5\\%`, at most MAX_ANSWER_CHARS characters) and compares it symbolically, under
its time limit. Plain numbers are compared exactly, without it.
The one exception is a reasoning-gym task's correctness: that package's own checker, which this
module only keeps from raising.
"""

import functools
import json
import os
import random
import re
import threading
from dataclasses import dataclass
from decimal import Decimal
from fractions import Fraction
from typing import Callable

import sympy
import torch
from math_verify import LatexExtractionConfig, parse, verify
from math_verify.errors import TimeoutException
from transformers import AutoConfig, AutoModelForSequenceClassification, AutoTokenizer

ANSWER_INSTRUCTION = "Put your final answer in \\boxed{}."
# longer "numbers" are never a valid answer; the limit also keeps Fraction() cheap
MAX_NUMBER_CHARS = 40
MAX_EXPRESSION_CHARS = 200  # countdown: the longest expression the parser will look at
MAX_ANSWER_CHARS = 300  # the longest answer handed to math-verify (MATH's are far shorter)
MATH_VERIFY_SECONDS = 1  # its limit per parse and per comparison (a SIGALRM: whole seconds)
# LaTeX only: its ExprExtractionConfig hands text to sympy's parse_expr, which runs eval() on it
MATH_VERIFY_CONFIG = [LatexExtractionConfig(boxed_match_priority=0)]
# the last number of a text: a comma only between digits, so "18, total" is 18 and 1,200 is whole
NUMBER_RE = re.compile(r"[-\u2212]?\d+(?:,\d+)*(?:\.\d+)?|[-\u2212]?\.\d+")
# 12, -0.5, .5, 3/4, 1,200: no exponent, no '_', and commas only between groups of three (2,5 is
# not 25)
PLAIN_NUMBER_RE = re.compile(r"-?(?:(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d*)?|\.\d+)(?:/\d+)?")
BRACE_RE = re.compile(r"\\boxed\{|\{|\}")
# math-verify reads 2E999999 as a number, built in one C call that no time limit interrupts: it
# hangs
E_NOTATION_RE = re.compile(r"[\d.][eE][+-]?\d")
# a unit or a word written in \text{} (or \mbox{}, \mathrm{}), and the spacing around it:
# `5 \text{ cm}`, `5\,\text{cm}` and `\text{5 cm}` are one answer
TEXT_RE = re.compile(r"\\(?:text|mbox|mathrm)\{([^{}]*)\}")
SPACING_RE = re.compile(r"\s+|\\[,:;! ]|~|\\q?quad(?![a-zA-Z])")
PERCENT = sympy.UnevaluatedExpr(sympy.Rational(1, 100))  # latex2sympy's `\\%`


# ----------------------------------------------------------------------------- answer extraction
def last_boxed(text: str) -> str | None:
    """Content of the last non-empty `\\boxed{...}`, with nested braces; None if there is none.

    Empty boxes are skipped: small models often end by copying the instruction's `\\boxed{}`,
    which must not hide the answer they wrote before it. One regex scan over the braces, so linear
    in len(text)."""
    # (start, end) of each closed box's content
    boxes = []
    # (start of its content, whether it opens a box) for each brace still open
    open_braces = []
    for match in BRACE_RE.finditer(text):
        if match.group() == "}":
            if open_braces:
                start, is_box = open_braces.pop()
                if is_box:
                    boxes.append((start, match.start()))
        else:
            open_braces.append((match.end(), match.group() != "{"))
    # the last opened first
    for start, end in sorted(boxes, reverse=True):
        if text[start:end].strip():
            return text[start:end]
    return None


def last_answer_tag(text: str) -> str | None:
    """Content of the last `<answer>...</answer>`; None if there is none."""
    start = text.rfind("<answer>")
    if start < 0:
        return None
    end = text.find("</answer>", start)
    return None if end < 0 else text[start + len("<answer>") : end]


def stated_answer(text: str) -> str | None:
    """Content of the last `\\boxed{}`, else of the last `<answer>` tag; None if there is
    neither."""
    boxed = last_boxed(text)
    return last_answer_tag(text) if boxed is None else boxed


def extract_answer(text: str, reference: str | None = None) -> str | None:
    """The final answer of a completion: `\\boxed{}`, else an `<answer>` tag, else the last number.

    A stated answer of the form `expr = value` (`\\boxed{20 + 23 = 43}`) is its value, the part
    after the last '=', unless the `reference` it is graded against is itself an equation (MATH's
    planes, lines and conics, `x^2 + y^2 = 25`): then it is the whole equation."""
    stated = stated_answer(text)
    if stated is None:
        numbers = NUMBER_RE.findall(text)
        return numbers[-1] if numbers else None
    # an equation is graded whole against an equation (math-verify compares equations)
    if reference is not None and "=" in reference:
        return stated.strip()
    return stated.rsplit("=", 1)[-1].strip()


def parse_number(text: str | None) -> Fraction | None:
    """`12`, `12.0`, `1,200`, `$5`, `3/4`, `-0.5`, `\u22125` -> an exact Fraction; anything else
    (`2,5`, `4 2`) -> None.

    Only plain integers, decimals and fractions reach `Fraction`: `1e999999999` would make it
    build a billion-digit integer (a hang or a MemoryError inside the reward)."""
    if text is None:
        return None
    text = text.strip().strip("$").rstrip(".").replace("\u2212", "-")
    if len(text) > MAX_NUMBER_CHARS or not PLAIN_NUMBER_RE.fullmatch(text):
        return None
    try:
        return Fraction(text.replace(",", ""))
    # 3/0, and a decimal over a number (1.5/2), which Fraction() does not read
    except (ValueError, ZeroDivisionError):
        return None


# ----------------------------------------------------------------------------- answer comparison
def read_answer(text: str) -> list:
    """math-verify's reading of an answer written as LaTeX: [a sympy value], or [] when it cannot
    read it in time.

    Its time limit is a SIGALRM, which only the main thread can set: elsewhere it raises, and this
    returns []."""
    if len(text) > MAX_ANSWER_CHARS or E_NOTATION_RE.search(text):
        return []
    # it catches its own errors; the except is for those it lets through
    try:
        return parse(f"\\boxed{{{text}}}", MATH_VERIFY_CONFIG, fallback_mode="no_fallback",
                     parsing_timeout=MATH_VERIFY_SECONDS)
    except (Exception, TimeoutException):
        return []


def plain_latex(text: str) -> str:
    """`text` with each `\\text{...}` replaced by its content and all spacing dropped, as LaTeX's
    math mode drops it: `5\\,\\text{cm}` and `\\text{5 cm}` are both `5cm`. Linear in len(text)."""
    return SPACING_RE.sub("", TEXT_RE.sub(r"\1", text))


@functools.lru_cache(maxsize=4096)
def read_reference(text: str) -> tuple:
    """`read_answer` of a reference, kept: a group of completions shares one."""
    return tuple(read_answer(text))


def exact_values(value) -> list[Fraction]:
    """The numbers a value read by math-verify stands for, exactly; [] for anything else.

    A number or a signed fraction of numbers (`-\\frac{\\frac{3}{2}}{2}`), perhaps a percentage
    (`5\\%` stands for 5 and for 0.05, as in math-verify); not a sum or a product (`20 + 23`,
    `3 \\times 4`: the question restated), nor a symbol or a set, except `\\textbf{25}`, read as a
    Symbol named '25', and `{5}`, read as the set {5}. A decimal keeps the digits it was written
    with, so `\\$42.0000001` is not 42."""
    if isinstance(value, sympy.Rational):  # Integer included
        return [Fraction(int(value.p), int(value.q))]
    if isinstance(value, sympy.Float):
        number = Decimal(str(value))
        if number.is_finite() and abs(number.adjusted()) < 400:
            return [Fraction(number)]
        return []
    if isinstance(value, sympy.Symbol):
        number = parse_number(value.name)
        return [] if number is None else [number]
    if isinstance(value, sympy.FiniteSet) and len(value.args) == 1:
        return exact_values(value.args[0])
    if not isinstance(value, sympy.Mul):
        return []
    result = Fraction(1)
    numerators = 0
    percent = False
    # latex2sympy writes a/b as a * b**-1, -a as -1 * a, and a% as a * (1/100)
    for factor in value.args:
        if factor == PERCENT:
            percent = True
        elif factor == -1:
            result = -result
        else:
            inverse = isinstance(factor, sympy.Pow) and factor.exp == -1
            parts = exact_values(factor.base if inverse else factor)
            if len(parts) != 1 or (inverse and parts[0] == 0):
                return []
            if inverse:
                result = result / parts[0]
            else:
                numerators += 1
                result = result * parts[0]
    if numerators > 1:
        return []
    if percent:
        return [result, result / 100]
    return [result]


def same_answer(predicted: str | None, reference: str) -> bool:
    """Whether a stated answer equals the reference.

    A reference that is a plain number (GSM8K's, the built-in tasks') needs a number, compared
    exactly: `20 + 23` is not 43 (else repeating the question would pay), nor is 42.0000001 42.
    Any other reference (MATH's `\\frac{\\pi}{2}`) matches the same text up to `\\text{}` and
    spacing (`plain_latex`: `5 \\text{ cm}` is `\\text{5 cm}`), else is compared by math-verify's
    `verify`, within its rounding; a word (`yes`) as text only, since math-verify reads `yes` as
    the product of symbols y*e*s, equal to `sey`. Outside the main thread math-verify has no time
    limit, so there only plain numbers and equal texts match."""
    if predicted is None:
        return False
    predicted = predicted.strip().replace("\u2212", "-")
    reference = reference.strip()
    if predicted == reference:
        return True
    reference_number = parse_number(reference)
    predicted_number = parse_number(predicted)
    # the cheap path, which most answers take
    if reference_number is not None and predicted_number is not None:
        return predicted_number == reference_number
    # units and words in \text{}: equal once \text{} and spacing are dropped
    if reference_number is None and plain_latex(predicted) == plain_latex(reference):
        return True
    if reference.isalpha() or threading.current_thread() is not threading.main_thread():
        return False
    # sympy can raise almost anything, and a reward must not
    try:
        if reference_number is not None:
            values = read_answer(predicted)
            return any(reference_number in exact_values(value) for value in values)
        gold = read_reference(reference)
        guess = read_answer(predicted)
        if not gold or not guess:
            return False
        return verify(list(gold), guess, timeout_seconds=MATH_VERIFY_SECONDS)
    except (Exception, TimeoutException):
        return False


# ----------------------------------------------------------------------------- reward functions
def correctness_reward(completions: list[str], answers: list[str]) -> list[float]:
    """1.0 when the completion's final answer (`extract_answer`) equals the reference
    (`same_answer`), else 0.0."""
    return [float(same_answer(extract_answer(completion, answer), answer))
            for completion, answer in zip(completions, answers)]


def format_reward(completions: list[str], answers: list[str]) -> list[float]:
    """1.0 when the completion states a final answer in `\\boxed{...}` or an `<answer>` tag, else
    0.0.

    An empty `\\boxed{}` does not count: small models otherwise learn to copy the instruction's
    `\\boxed{}`."""
    stated = [stated_answer(completion) for completion in completions]
    return [float(answer is not None and answer.strip() != "") for answer in stated]


def countdown_reward(completions: list[str], answers: list[str]) -> list[float]:
    """1.0 when the final expression uses each given number exactly once and equals the target.

    The answer is stored as "target|n1,n2,...". The expression comes from `\\boxed{}` or an
    `<answer>` tag, and is parsed by `evaluate_expression` (never `eval`)."""
    scores = []
    for completion, answer in zip(completions, answers):
        target, numbers = answer.split("|")
        expression = stated_answer(completion)
        # "3 + 4 = 7": keep the left-hand side
        if expression is not None and "=" in expression:
            expression = expression.split("=")[0]
        evaluated = None
        if expression is not None:
            evaluated = evaluate_expression(expression)
        correct = evaluated is not None and evaluated[0] == int(target)
        if correct:
            given = sorted(int(number) for number in numbers.split(","))
            correct = sorted(evaluated[1]) == given
        scores.append(float(correct))
    return scores


def evaluate_expression(text: str) -> tuple[Fraction, list[int]] | None:
    """Value of an expression of integers, + - * / and parentheses, with the integers it used.

    A small recursive-descent parser over at most MAX_EXPRESSION_CHARS characters, so depth and
    work are bounded; returns None on any syntax error or division by zero."""
    text = text.strip()
    if len(text) > MAX_EXPRESSION_CHARS:
        return None
    text = text.replace("\\times", "*").replace("\\div", "/")
    tokens = re.findall(r"\d+|[-+*/()]|\S", text)
    # the index of the next token
    position = 0
    # the integers read, in order
    used = []

    def peek() -> str | None:
        return tokens[position] if position < len(tokens) else None

    def take() -> str:
        nonlocal position
        position += 1
        return tokens[position - 1]

    # expression := term (('+' | '-') term)*
    def expression() -> Fraction:
        value = term()
        while peek() in ("+", "-"):
            if take() == "+":
                value = value + term()
            else:
                value = value - term()
        return value

    # term := factor (('*' | '/') factor)*
    def term() -> Fraction:
        value = factor()
        while peek() in ("*", "/"):
            if take() == "*":
                value = value * factor()
            else:
                value = value / factor()
        return value

    # factor := integer | '(' expression ')'
    def factor() -> Fraction:
        if peek() is None:
            raise ValueError("unexpected end of the expression")
        token = take()
        if token.isdigit() and len(token) <= 6:
            used.append(int(token))
            return Fraction(int(token))
        if token == "(":
            value = expression()
            if peek() != ")":
                raise ValueError("unclosed parenthesis")
            take()
            return value
        raise ValueError(f"unexpected token {token!r}")

    try:
        value = expression()
    except (ValueError, ZeroDivisionError, RecursionError):
        return None
    return (value, used) if position == len(tokens) else None


# ----------------------------------------------------------------------------- tasks
RewardFunc = Callable[[list[str], list[str]], list[float]]


@dataclass
class Task:
    # {"prompt": str | list[dict], "answer": str}
    train: list[dict]
    test: list[dict]
    # the task's checker; evaluation reports its mean
    correctness: RewardFunc = correctness_reward
    # the answer that checker reads in a completion (or None)
    reads: Callable[[str], str | None] = extract_answer
    # how many references held a whole solution, reduced to its `\boxed{}` answer (preflight says)
    references_reduced: int = 0
    has_answers: bool = True  # False: a task of prompts alone, every answer None
    reward_model: Callable | None = None  # --reward-model's RewardModel, set by the scripts

    @property
    def reward_funcs(self) -> dict[str, RewardFunc]:
        """The reward functions `--reward-weights` can weight, by name."""
        return {"correctness": self.correctness, "format": format_reward}


def score(completions: list[str], answers: list[str], task: Task, weights: dict, prompts=None):
    """The reward of each completion, sum of weight * function over `weights`, and each function's
    scores (and the errors) for logging, as tensors (B,). A function that raises on a completion
    scores it 0, counted in parts["errors"] (the scripts log it as charts/reward_errors), and the
    run goes on. "reward_model" is task.reward_model's score of each prompt and completion."""
    parts = {name: torch.zeros(len(completions)) for name in [*weights, "errors"]}
    for name in weights:
        if name == "reward_model":
            parts[name] = task.reward_model(prompts, completions)
            continue
        for i, (completion, answer) in enumerate(zip(completions, answers)):
            try:
                parts[name][i] = task.reward_funcs[name]([completion], [answer])[0]
            except Exception as error:
                parts["errors"][i] += 1
                print(f"reward {name} raised {error!r} on {completion[:80]!r}: scored 0")
    reward = sum(weights[name] * parts[name] for name in weights)  # (B,)
    return reward.float(), parts


# ----------------------------------------------------------------------------- a reward model
def check_reward_model(name: str | None) -> None:
    """Exit with one `error:` line unless --reward-model `name` (None: none), read from its config
    alone, is a sequence classifier with one output, as TRL and OpenRLHF expect."""
    if name is None:
        return
    path = os.path.expanduser(name)
    if name.startswith((".", "/", "~")) and not os.path.exists(path):
        raise SystemExit(f"error: --reward-model {name}: no such file or folder")
    try:
        config = AutoConfig.from_pretrained(path)
        AutoTokenizer.from_pretrained(path)  # (light; a folder saved without one fails here)
    except (OSError, ValueError) as error:
        raise SystemExit(f"error: --reward-model {name}: {str(error).splitlines()[0]}")
    architectures = config.architectures or ["model of no architecture"]
    if not any(a.endswith("ForSequenceClassification") for a in architectures):
        raise SystemExit(f"error: --reward-model {name}: a {', '.join(architectures)}, not a "
                         "sequence classifier (...ForSequenceClassification) with one output")
    if config.num_labels != 1:
        raise SystemExit(f"error: --reward-model {name}: {config.num_labels} outputs, not one")


class RewardModel:
    """--reward-model: a sequence classifier with one output, frozen, in the compute dtype, reading
    each prompt and completion as a conversation in its own chat template (docs/reward_model.md)."""

    def __init__(self, name: str, dtype: torch.dtype, device: torch.device, batch_size: int):
        path = os.path.expanduser(name)
        self.tokenizer = AutoTokenizer.from_pretrained(path, padding_side="right")
        model = AutoModelForSequenceClassification.from_pretrained(path, dtype=dtype)
        self.model = model.to(device).eval().requires_grad_(False)
        # it scores the last token that is not padding, the pad token its config's, else its
        # tokenizer's; with neither, one conversation at a time, scored at its last token
        config = self.model.config
        if config.pad_token_id is None:
            config.pad_token_id = self.tokenizer.pad_token_id
        self.tokenizer.pad_token_id = config.pad_token_id
        self.batch_size = batch_size if config.pad_token_id is not None else 1

    def texts(self, prompts: list, completions: list[str]) -> list[str]:
        """The conversations the model reads, as text (its template's special tokens included)."""
        texts = []
        for prompt, completion in zip(prompts, completions):
            messages = prompt if isinstance(prompt, list) else [{"role": "user", "content": prompt}]
            messages = [*messages, {"role": "assistant", "content": completion}]
            if self.tokenizer.chat_template:
                texts.append(self.tokenizer.apply_chat_template(messages, tokenize=False))
            else:
                texts.append("".join(message["content"] for message in messages))
        return texts

    @torch.no_grad()
    def __call__(self, prompts: list, completions: list[str]) -> torch.Tensor:
        """The score of each (prompt, completion), float32 on the CPU, (B,)."""
        texts = self.texts(prompts, completions)
        scores = []
        for start in range(0, len(texts), self.batch_size):
            # (a template has its own special tokens)
            inputs = self.tokenizer(texts[start : start + self.batch_size],
                                    padding=self.batch_size > 1,
                                    add_special_tokens=not self.tokenizer.chat_template,
                                    return_tensors="pt").to(self.model.device)
            scores.append(self.model(**inputs).logits[:, 0].float().cpu())
        return torch.cat(scores)


BUILTIN_TASKS = ("arithmetic", "countdown")
BUILTIN_SIZES = (5000, 200)  # train and test records of a built-in task
REASONING_GYM = "reasoning_gym:"  # --task reasoning_gym:NAME


def make_arithmetic(rng: random.Random, difficulty: int) -> dict:
    """An integer arithmetic question: 1 = a + b with numbers 0..20 (441 distinct, learnable by a
    135M model on a CPU in minutes); 2 = a + b; 3 = a op b; 4 = (a op b) op c, with numbers
    0..99."""
    largest = 20 if difficulty == 1 else 99
    # c is drawn at every difficulty, used at 4 only: the seeded tasks depend on these draws
    a, b, c = (rng.randint(0, largest) for _ in range(3))
    operators = "+" if difficulty <= 2 else "+-*"
    expression = f"{a} {rng.choice(operators)} {b}"
    if difficulty >= 4:
        expression = f"({expression}) {rng.choice(operators)} {c}"
    value = evaluate_expression(expression)[0]
    prompt = f"What is {expression}? {ANSWER_INSTRUCTION}"
    return {"prompt": prompt, "answer": str(value.numerator)}


def make_countdown(rng: random.Random, difficulty: int) -> dict:
    """Reach a target with `difficulty + 2` numbers (1..20), each used once, and + - * /.

    The target is built from a random expression over the numbers, so every puzzle has a
    solution."""
    while True:
        numbers = [rng.randint(1, 20) for _ in range(difficulty + 2)]
        expression = str(numbers[0])
        for number in numbers[1:]:
            expression = f"({expression} {rng.choice('+-*/')} {number})"
        evaluated = evaluate_expression(expression)
        if evaluated is None:
            continue
        value = evaluated[0]
        if value.denominator == 1 and 0 < value < 1000:
            break
    target = value.numerator
    prompt = (
        f"Using the numbers {numbers}, each exactly once, and + - * / with parentheses, "
        f"write an expression equal to {target}. Put the expression in \\boxed{{}}."
    )
    return {"prompt": prompt, "answer": f"{target}|{','.join(map(str, numbers))}"}


def builtin_task(name: str, difficulty: int, seed: int = 0) -> Task:
    """Distinct records from a fixed seed, so every run sees the same train and test splits."""
    if not 1 <= difficulty <= 4:
        raise ValueError(f"--difficulty must be 1, 2, 3 or 4, got {difficulty}")
    make = make_arithmetic if name == "arithmetic" else make_countdown
    rng = random.Random(seed)
    records = []
    seen_prompts = set()
    # bounded: small difficulties have few distinct records
    for _ in range(20 * sum(BUILTIN_SIZES)):
        record = make(rng, difficulty)
        if record["prompt"] not in seen_prompts:
            seen_prompts.add(record["prompt"])
            records.append(record)
        if len(records) == sum(BUILTIN_SIZES):
            break
    # a quarter, at most 200: 110 of difficulty 1's 441
    test_size = min(BUILTIN_SIZES[1], len(records) // 4)
    train = records[test_size:]
    test = records[:test_size]
    # countdown's checker reads only a stated answer, never the last number
    if name == "countdown":
        return Task(train, test, countdown_reward, stated_answer)
    return Task(train, test)


def to_record(row, prompt_field: str, answer_field: str | None, where: str) -> tuple[dict, bool]:
    """One raw row as {"prompt", "answer"}, and whether its answer was reduced to a `\\boxed{}`
    answer; or a ValueError naming `where` it is, the field it lacks and those it has. With no
    `answer_field` (a task of prompts alone) the answer is None.

    A GSM8K-style answer keeps only what follows '####'; an answer holding a whole solution that
    states its answer in `\\boxed{}` (MATH's `solution` field) keeps only the content of its last
    `\\boxed{}`, as open-r1 and verl read it."""
    for name in [prompt_field, answer_field][: 1 + (answer_field is not None)]:
        if not isinstance(row, dict) or name not in row:
            if isinstance(row, dict):
                contents = f"it has {sorted(row)}"
            else:
                contents = f"it is a {type(row).__name__}"
            raise ValueError(f"{where} has no field {name!r} ({contents}; set --prompt-field / "
                             "--answer-field)")
    # a prompt to sample from, and an answer to grade against: text (or a number, as its text)
    prompt = row[prompt_field]
    text = isinstance(prompt, str) and prompt.strip() != ""
    if not text and not (isinstance(prompt, list) and prompt):
        raise ValueError(f"{where}: the prompt ({prompt_field!r}) is {json.dumps(prompt)[:40]}: "
                         "it must be non-empty text or a list of chat messages")
    # chat messages: each an object with a role and a content; a chat template fails on any other
    # once the model has loaded, or renders it as nothing, unsaid
    messages = prompt if isinstance(prompt, list) else []
    for number, message in enumerate(messages, 1):
        if not isinstance(message, dict):
            raise ValueError(f"{where}: message {number} of the prompt ({prompt_field!r}) is a "
                             f"{type(message).__name__}, not an object with a role and a content")
        for key in ("role", "content"):
            if key not in message:
                raise ValueError(f"{where}: message {number} of the prompt ({prompt_field!r}) has "
                                 f"no {key!r} (it has {sorted(message)})")
    if answer_field is None:
        return {"prompt": prompt, "answer": None}, False
    answer = row[answer_field]
    if isinstance(answer, bool) or not isinstance(answer, (str, int, float)):
        raise ValueError(f"{where}: the answer ({answer_field!r}) is {json.dumps(answer)[:40]}: "
                         "it must be text or a number")
    answer = str(answer).split("####")[-1].strip()
    boxed = last_boxed(answer)
    if boxed is not None:
        answer = boxed.strip()
    return {"prompt": prompt, "answer": answer}, boxed is not None


def hold_out(records: list[dict]) -> tuple[list[dict], list[dict]]:
    """Train and test splits of one list: the last 10% (at least one record) is held out."""
    test_size = max(1, len(records) // 10)
    return records[:-test_size], records[-test_size:]


def jsonl_task(path: str, prompt_field: str, answer_field: str) -> Task:
    """One record per line, blank lines skipped; the last 10% held out. An error names the line and
    what is wrong. A first record without `answer_field` makes a task of prompts alone."""
    if not os.path.isfile(path):
        raise FileNotFoundError(f"--task {path}: no such file")
    records = []
    references_reduced = 0
    answers = None  # whether the records have answers: as the first one does
    with open(path, "rb") as file:
        for number, raw in enumerate(file, 1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as error:
                byte = raw[error.start : error.start + 1]
                raise ValueError(f"--task {path}: line {number} is not UTF-8 text (byte "
                                 f"{error.start + 1}: {byte!r})") from None
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as error:
                raise ValueError(f"--task {path}: line {number} is not valid JSON "
                                 f"({error.msg})") from None
            where = f"--task {path}: line {number}"
            if answers is None:
                answers = not isinstance(row, dict) or answer_field in row
            record, reduced = to_record(row, prompt_field, answer_field if answers else None, where)
            records.append(record)
            references_reduced += reduced
    if len(records) < 2:
        empty = " (the file is empty)" if not records else ""
        raise ValueError(f"--task {path}: needs at least 2 records, found {len(records)}{empty}")
    train, test = hold_out(records)
    return Task(train, test, references_reduced=references_reduced, has_answers=answers)


def hub_task(name: str, prompt_field: str, answer_field: str) -> Task:
    """A Hub dataset id, a local dataset folder (as `datasets.load_dataset` reads it) or a
    `.parquet` file: its test split, or else the last 10% of its train split held out. GSM8K's
    config `main`, on the Hub or in a folder of its layout (`main/train-00000-of-00001.parquet`),
    is read as `data_dir`, which needs no README. The prompt field falls back to `question` (GSM8K
    and most QA sets), and each text prompt is told where the graded answer goes."""
    try:
        import datasets
    except ImportError as error:
        raise ImportError(f"--task {name}: Hub datasets and parquet files need "
                          "`pip install datasets`") from error
    if name.endswith(".parquet") and not os.path.isfile(name):
        raise FileNotFoundError(f"--task {name}: no such file")
    gsm8k_main = name == "openai/gsm8k" or os.path.isdir(os.path.join(name, "main"))
    # an unreadable file or folder, no network, ...: one line
    try:
        if name.endswith(".parquet"):
            dataset = datasets.load_dataset("parquet", data_files=name)
        else:
            dataset = datasets.load_dataset(name, data_dir="main" if gsm8k_main else None)
    except Exception as error:
        first_line = str(error).strip().partition("\n")[0]
        raise ValueError(f"--task {name}: {type(error).__name__}: {first_line}") from None
    if "train" not in dataset:
        raise ValueError(f"--task {name}: no train split (it has {sorted(dataset)})")
    columns = dataset["train"].column_names
    if prompt_field not in columns and "question" in columns:
        prompt_field = "question"
    answer_field = answer_field if answer_field in columns else None  # None: prompts alone
    splits = {}
    references_reduced = 0
    for split in ("train", "test"):
        if split not in dataset:
            continue
        splits[split] = []
        for i, row in enumerate(dataset[split]):
            where = f"--task {name}: {split} record {i}"
            record, reduced = to_record(row, prompt_field, answer_field, where)
            splits[split].append(record)
            references_reduced += reduced
    if "test" in splits:
        train = splits["train"]
        test = splits["test"]
    else:
        # no test split: hold out the end of train, never evaluate on what is trained on
        train, test = hold_out(splits["train"])
    if not train or not test:
        raise ValueError(f"--task {name}: needs records to train on and to hold out; found "
                         f"{len(train)}, {len(test)}")
    for record in train + test:
        if isinstance(record["prompt"], str) and answer_field is not None:
            record["prompt"] = f"{record['prompt']}\n{ANSWER_INSTRUCTION}"
    return Task(train, test, references_reduced=references_reduced, has_answers=bool(answer_field))


def reasoning_gym_task(name: str, seed: int = 0) -> Task:
    """A procedural dataset of reasoning-gym (https://github.com/open-thought/reasoning-gym),
    generated offline, BUILTIN_SIZES entries: train from `seed`, test from `seed + 5000` (entry i
    of seed s is drawn from Random(s + i), so seed + 1 would repeat train shifted by one), repeated
    questions and test questions that train has dropped.

    A record's answer is its entry's index: the correctness reward hands that entry and the
    completion's stated answer (`\\boxed{}` or `<answer>`) to the dataset's own `score_answer`,
    which may give partial credit. That checker is reasoning-gym's code: this module's time limits
    and no-eval guarantee do not cover it."""
    task = f"--task {REASONING_GYM}{name}"
    try:
        import reasoning_gym
        from reasoning_gym.factory import DATASETS
    except ImportError as error:
        raise ImportError(f"{task}: reasoning-gym tasks need "
                          "`pip install reasoning-gym`") from error
    if name not in DATASETS:
        raise ValueError(f"{task}: no such dataset (list them with python -c "
                         f"'import reasoning_gym.factory as f; print(sorted(f.DATASETS))')")
    # a dataset may need a config of its own (`composite` does)
    try:
        generated = [reasoning_gym.create_dataset(name, seed=seed + i * BUILTIN_SIZES[0], size=size)
                     for i, size in enumerate(BUILTIN_SIZES)]
    except Exception as error:
        raise ValueError(f"{task}: cannot be generated with its default config "
                         f"({error!r})") from None
    # (the dataset's checker, the entry) of each record, indexed by its answer
    entries = []
    train = []
    test = []
    seen_questions = set()
    for dataset, split in zip(generated, (train, test)):
        for entry in dataset:
            if entry["question"] in seen_questions:
                continue
            seen_questions.add(entry["question"])
            prompt = f"{entry['question']}\n{ANSWER_INSTRUCTION}"
            split.append({"prompt": prompt, "answer": str(len(entries))})
            entries.append((dataset.score_answer, entry))
    if not test:
        raise ValueError(f"{task}: every held-out question is also a training one")

    def correctness(completions: list[str], answers: list[str]) -> list[float]:
        scores = []
        for completion, answer in zip(completions, answers):
            # a checker may raise on an odd answer; a reward must not
            try:
                score_answer, entry = entries[int(answer)]
                stated = stated_answer(completion)
                if stated is not None:
                    stated = stated.strip()
                scores.append(float(score_answer(stated, entry)))
            except Exception:
                scores.append(0.0)
        return scores

    return Task(train, test, correctness, stated_answer)


def load_task(
    task: str, difficulty: int = 1, prompt_field: str = "prompt", answer_field: str = "answer"
) -> Task:
    """Resolve `--task`: a built-in name, `reasoning_gym:NAME`, a `.jsonl` or `.parquet` path, a
    dataset folder or a Hub dataset id (anything else with a '/')."""
    if task in BUILTIN_TASKS:
        return builtin_task(task, difficulty)
    if task.startswith(REASONING_GYM):
        return reasoning_gym_task(task.removeprefix(REASONING_GYM))
    if task.endswith(".jsonl"):
        return jsonl_task(task, prompt_field, answer_field)
    # a file of another kind (task.json, task.csv): say what is read
    extension = os.path.splitext(task)[1]
    other_file = os.path.isfile(task) and extension != ".parquet"
    if other_file or extension in (".json", ".csv", ".tsv", ".txt", ".arrow"):
        raise ValueError(f"--task {task}: a {extension or 'plain'} file; tasks are read from "
                         ".jsonl files (one JSON record a line), .parquet files, dataset folders "
                         "in the Hub's layout, Hub dataset ids, arithmetic, countdown and "
                         f"{REASONING_GYM}NAME")
    if "/" in task or task.endswith(".parquet") or os.path.isdir(task):
        return hub_task(task, prompt_field, answer_field)
    raise ValueError(f"--task {task!r}: not one of {BUILTIN_TASKS}, {REASONING_GYM}NAME, a .jsonl "
                     "or .parquet file, a dataset folder or a Hub dataset id")


def reasoning_gym_system_prompts() -> dict[str, str]:
    """reasoning-gym's system prompts by name ("default", "simple", "DeepSeekZero", ...); {} when it
    is not installed."""
    try:
        from reasoning_gym.utils import SYSTEM_PROMPTS
    except ImportError:
        return {}
    return dict(SYSTEM_PROMPTS)


def resolve_system_prompt(value: str, task: str) -> str | None:
    """`--system-prompt`: the system prompt given before each text prompt of `--task`, or None.

    "auto" gives a `reasoning_gym:` task reasoning-gym's own "default" prompt, which asks for the
    answer in `<answer>...</answer>` (its checker reads that or the `\\boxed{}` its prompts ask
    for), and every other task none, so that their prompts are unchanged; "none" gives none; a name
    in reasoning-gym's SYSTEM_PROMPTS ("simple", "DeepSeekZero", ...), when it is installed, gives
    that prompt; any other value is the prompt itself."""
    if value == "none":
        return None
    if value == "auto" and not task.startswith(REASONING_GYM):
        return None
    system_prompts = reasoning_gym_system_prompts()
    # None without reasoning-gym: loading the task then says to install it
    if value == "auto":
        return system_prompts.get("default")
    return system_prompts.get(value, value)


def encode_prompts(tokenizer, records: list[dict], max_tokens: int,
                   system_prompt: str | None = None) -> int:
    """Each record's "prompt_ids", through the chat template when the tokenizer has one, cut to the
    last `max_tokens` tokens. Returns how many were cut, and says so: a cut is never silent.

    A `system_prompt` (`resolve_system_prompt`'s; None or "" for none) goes before each text
    prompt: as a system message through the chat template, else as text and a blank line. A prompt
    given as chat messages is used as it is."""
    cut = 0
    for record in records:
        prompt = record["prompt"]
        if not tokenizer.chat_template and not isinstance(prompt, str):
            raise SystemExit("error: --task: prompts given as chat messages need a --model whose "
                             "tokenizer has a chat template")
        if tokenizer.chat_template:
            if isinstance(prompt, str):
                messages = [{"role": "user", "content": prompt}]
                if system_prompt:
                    messages.insert(0, {"role": "system", "content": system_prompt})
            else:
                messages = prompt
            prompt = tokenizer.apply_chat_template(messages, tokenize=False,
                                                   add_generation_prompt=True)
        elif system_prompt:
            prompt = f"{system_prompt}\n\n{prompt}"
        # the template has its own special tokens
        ids = tokenizer(prompt, add_special_tokens=not tokenizer.chat_template).input_ids
        record["prompt_ids"] = ids[-max_tokens:]
        if len(ids) > max_tokens:
            cut += 1
    if cut:
        print(f"warning: {cut} of {len(records)} prompts are longer than --max-prompt-tokens "
              f"{max_tokens}; each is cut to its last {max_tokens} tokens")
    return cut


def preflight(completions: list[str], reward: torch.Tensor, truncated: torch.Tensor, task: Task,
              group_size: int, max_new_tokens: int, prompts_cut: int,
              templated: bool) -> list[str]:
    """A summary of the first sampled batch, printed before the first update, with a warning for
    each figure that means the run cannot learn, naming the argument to change. Returns the
    warnings."""
    n_completions = len(completions)
    readable = sum(task.reads(completion) is not None for completion in completions)
    stated = sum(stated_answer(completion) is not None for completion in completions)
    n_truncated = int(truncated.sum())
    # one completion a prompt (PPO's) has a critic's baseline, no group to compare within
    groups = n_completions // group_size
    # groups whose every advantage A_i is 0
    flat = 0
    if group_size > 1:
        flat = int((reward.view(groups, -1).std(1) == 0).sum())
    best = int(reward.argmax())
    template = "applied" if templated else "absent: plain text"
    lines = [f"preflight, the first batch: {n_completions} completions of {groups} prompts (chat "
             f"template {template}; {prompts_cut} prompts cut to --max-prompt-tokens)"]
    if task.references_reduced:
        n_references = len(task.train) + len(task.test)
        lines.append(f"  references reduced to their \\boxed{{}} answer (the answer field held a "
                     f"whole solution): {task.references_reduced} of {n_references}")
    lines.append(f"  truncated at --max-new-tokens {max_new_tokens}: {n_truncated} of "
                 f"{n_completions}")
    if task.has_answers:
        lines.append(f"  an answer the reward can read: {readable} of {n_completions} ({stated} "
                     "in \\boxed{} or <answer>)")
    if group_size > 1:
        lines.append(f"  groups with zero reward spread (every advantage 0): {flat} of {groups}")
    lines.append(f"  e.g. (reward {reward[best]:.2f}): {json.dumps(completions[best])[:300]}")
    print("\n".join(lines))

    warnings = []
    if truncated.float().mean() > 0.5:
        warnings.append("most completions reach the length limit unfinished, and a cut answer "
                        "scores nothing: raise --max-new-tokens")
    if readable == 0 and task.has_answers:
        no_answer = ("no completion holds an answer the reward can read: check --task's prompts "
                     "and answers, and set --system-prompt to ask for an answer in the format the "
                     "task's checker reads, \\boxed{} or <answer>...</answer>")
        if not templated:
            no_answer += "; and use a chat (instruct) --model: this tokenizer has no chat template"
        warnings.append(no_answer)
    if group_size > 1 and flat == groups:
        warnings.append("every group's completions have the same reward, so every advantage is 0 "
                        "and nothing is learned: raise --group-size or --temperature, or choose an "
                        "easier --task")
    for warning in warnings:
        print(f"warning: {warning}")
    return warnings
