"""Tasks and reward functions: the one module that ppo.py, grpo.py, dapo.py and gspo.py share.

A task is a list of records {"prompt": str | list[chat messages], "answer": str} with a train and a
test split, plus the reward functions that score completions of it. `--task` names one of:
  - a built-in task generated from a seed, so no download is needed: `arithmetic`, `countdown`;
  - `reasoning_gym:NAME` (`reasoning_gym:chain_sum`): a procedural dataset of the optional `reasoning-gym` package,
    generated offline and scored by its own checker;
  - a `.jsonl` file with one record per line (fields chosen with `prompt_field` / `answer_field`);
  - a Hugging Face Hub dataset id such as `openai/gsm8k`, a local dataset folder (a copy of one, in the Hub's layout)
    or a `.parquet` file (these need the `datasets` package).

Every reward function has the signature `fn(completions: list[str], answers: list[str]) -> list[float]`,
never raises on any string, and answers in bounded time: linear-time scans find the stated answer, and
HuggingFace's math-verify (https://github.com/huggingface/Math-Verify) reads it when it is LaTeX (`\\$1{,}000`,
`\\frac{3}{4}`, `5\\%`, at most MAX_ANSWER_CHARS characters) and compares it symbolically, under its time limit.
Plain numbers are compared exactly, without it.
The one exception is a reasoning-gym task's correctness: that package's own checker, which this module only
keeps from raising.
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

ANSWER_INSTRUCTION = "Put your final answer in \\boxed{}."
MAX_NUMBER_CHARS = 40  # longer "numbers" are never a valid answer; also keeps Fraction() cheap
MAX_EXPRESSION_CHARS = 200  # countdown: the longest expression the parser will look at
MAX_ANSWER_CHARS = 300  # the longest answer handed to math-verify (MATH's are far shorter)
MATH_VERIFY_SECONDS = 1  # its limit per parse and per comparison (a SIGALRM, so whole seconds)
# LaTeX only: its ExprExtractionConfig hands text to sympy's parse_expr, which runs eval() on it
MATH_VERIFY_CONFIG = [LatexExtractionConfig(boxed_match_priority=0)]
NUMBER_RE = re.compile(r"[-\u2212]?\d[\d,]*(?:\.\d+)?|[-\u2212]?\.\d+")
# 12, -0.5, .5, 3/4, 1,200: no exponent, no '_', and commas only between groups of three (2,5 is not 25)
PLAIN_NUMBER_RE = re.compile(r"-?(?:(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d*)?|\.\d+)(?:/\d+)?")
BRACE_RE = re.compile(r"\\boxed\{|\{|\}")
# math-verify reads 2E999999 as a number, built in one C call that no time limit interrupts: it hangs
E_NOTATION_RE = re.compile(r"[\d.][eE][+-]?\d")
PERCENT = sympy.UnevaluatedExpr(sympy.Rational(1, 100))  # latex2sympy's `\\%`


# ----------------------------------------------------------------------------- answer extraction
def last_boxed(text: str) -> str | None:
    """Content of the last non-empty `\\boxed{...}`, with nested braces; None if there is none.

    Empty boxes are skipped: small models often end by copying the instruction's `\\boxed{}`, which must not
    hide the answer they wrote before it. One regex scan over the braces, so linear in len(text)."""
    boxes, open_braces = [], []  # (start, end) of each closed box's content; one (start, is_box) per open brace
    for match in BRACE_RE.finditer(text):
        if match.group() == "}":
            if open_braces:
                start, is_box = open_braces.pop()
                if is_box:
                    boxes.append((start, match.start()))
        else:
            open_braces.append((match.end(), match.group() != "{"))
    for start, end in sorted(boxes, reverse=True):  # the last opened first
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
    """Content of the last `\\boxed{}`, else of the last `<answer>` tag; None if there is neither."""
    found = last_boxed(text)
    return last_answer_tag(text) if found is None else found


def extract_answer(text: str) -> str | None:
    """The final answer of a completion: `\\boxed{}`, else an `<answer>` tag, else the last number.

    A stated answer of the form `expr = value` (`\\boxed{20 + 23 = 43}`) is its value, the part after the last '='."""
    found = stated_answer(text)
    if found is not None:
        return found.rsplit("=", 1)[-1].strip()
    numbers = NUMBER_RE.findall(text)
    return numbers[-1] if numbers else None


def parse_number(text: str | None) -> Fraction | None:
    """`12`, `12.0`, `1,200`, `$5`, `3/4`, `-0.5`, `\u22125` -> an exact Fraction; anything else (`2,5`, `4 2`) -> None.

    Only plain integers, decimals and fractions reach `Fraction`: `1e999999999` would make it build a
    billion-digit integer (a hang or a MemoryError inside the reward)."""
    if text is None:
        return None
    text = text.strip().strip("$").rstrip(".").replace("\u2212", "-")
    if len(text) > MAX_NUMBER_CHARS or not PLAIN_NUMBER_RE.fullmatch(text):
        return None
    try:
        return Fraction(text.replace(",", ""))
    except ZeroDivisionError:  # 3/0
        return None


# ----------------------------------------------------------------------------- answer comparison
def read_answer(text: str) -> list:
    """math-verify's reading of an answer written as LaTeX: [a sympy value], or [] when it cannot read it in time.

    Its time limit is a SIGALRM, which only the main thread can set: elsewhere it raises, and this returns []."""
    if len(text) > MAX_ANSWER_CHARS or E_NOTATION_RE.search(text):
        return []
    try:
        return parse(f"\\boxed{{{text}}}", MATH_VERIFY_CONFIG, fallback_mode="no_fallback",
                     parsing_timeout=MATH_VERIFY_SECONDS)
    except (Exception, TimeoutException):  # it catches its own errors; this is for those it lets through
        return []


@functools.lru_cache(maxsize=4096)
def read_reference(text: str) -> tuple:
    """`read_answer` of a reference, kept: a group of completions shares one."""
    return tuple(read_answer(text))


def exact_values(value) -> list[Fraction]:
    """The numbers a value read by math-verify stands for, exactly; [] for anything else.

    A number or a signed fraction of numbers (`-\\frac{\\frac{3}{2}}{2}`), perhaps a percentage (`5\\%` stands for 5 and
    for 0.05, as in math-verify); not a sum or a product (`20 + 23`, `3 \\times 4`: the question restated), nor a
    symbol or a set, except `\\textbf{25}`, read as a Symbol named '25', and `{5}`, read as the set {5}. A decimal keeps
    the digits it was written with, so `\\$42.0000001` is not 42."""
    if isinstance(value, sympy.Rational):  # Integer included
        return [Fraction(int(value.p), int(value.q))]
    if isinstance(value, sympy.Float):
        number = Decimal(str(value))
        return [Fraction(number)] if number.is_finite() and abs(number.adjusted()) < 400 else []
    if isinstance(value, sympy.Symbol):
        number = parse_number(value.name)
        return [] if number is None else [number]
    if isinstance(value, sympy.FiniteSet) and len(value.args) == 1:
        return exact_values(value.args[0])
    if not isinstance(value, sympy.Mul):
        return []
    result, numerators, percent = Fraction(1), 0, False
    for factor in value.args:  # latex2sympy writes a/b as a * b**-1, -a as -1 * a, and a% as a * (1/100)
        if factor == PERCENT:
            percent = True
        elif factor == -1:
            result = -result
        else:
            inverse = isinstance(factor, sympy.Pow) and factor.exp == -1
            parts = exact_values(factor.base if inverse else factor)
            if len(parts) != 1 or (inverse and parts[0] == 0):
                return []
            numerators += not inverse
            result = result / parts[0] if inverse else result * parts[0]
    if numerators > 1:
        return []
    return [result, result / 100] if percent else [result]


def same_answer(predicted: str | None, reference: str) -> bool:
    """Whether a stated answer equals the reference.

    A reference that is a plain number (GSM8K's, the built-in tasks') needs a number, compared exactly: `20 + 23` is
    not 43 (else repeating the question would pay), nor is 42.0000001 42. Any other reference (MATH's `\\frac{\\pi}{2}`)
    is compared by math-verify's `verify`, within its rounding; a word (`yes`) as text only, since math-verify reads
    `yes` as the product of symbols y*e*s, equal to `sey`. Outside the main thread math-verify has no time limit, so
    there only plain numbers and equal texts match."""
    if predicted is None:
        return False
    predicted, reference = predicted.strip().replace("\u2212", "-"), reference.strip()
    if predicted == reference:
        return True
    exact, number = parse_number(reference), parse_number(predicted)
    if exact is not None and number is not None:  # the cheap path, which most answers take
        return number == exact
    if reference.isalpha() or threading.current_thread() is not threading.main_thread():
        return False
    try:  # sympy can raise almost anything, and a reward must not
        if exact is not None:
            return any(exact in exact_values(value) for value in read_answer(predicted))
        gold, guess = read_reference(reference), read_answer(predicted)
        return bool(gold and guess) and verify(list(gold), guess, timeout_seconds=MATH_VERIFY_SECONDS)
    except (Exception, TimeoutException):
        return False


# ----------------------------------------------------------------------------- reward functions
def correctness_reward(completions: list[str], answers: list[str]) -> list[float]:
    """1.0 when the completion's final answer (`extract_answer`) equals the reference (`same_answer`), else 0.0."""
    return [float(same_answer(extract_answer(c), a)) for c, a in zip(completions, answers)]


def format_reward(completions: list[str], answers: list[str]) -> list[float]:
    """1.0 when the completion states a final answer in `\\boxed{...}` or an `<answer>` tag, else 0.0.

    An empty `\\boxed{}` does not count: small models otherwise learn to copy the instruction's `\\boxed{}`."""
    found = [stated_answer(c) for c in completions]
    return [float(f is not None and f.strip() != "") for f in found]


def countdown_reward(completions: list[str], answers: list[str]) -> list[float]:
    """1.0 when the final expression uses each given number exactly once and equals the target.

    The answer is stored as "target|n1,n2,...". The expression comes from `\\boxed{}` or an
    `<answer>` tag, and is parsed by `evaluate_expression` (never `eval`)."""
    scores = []
    for completion, answer in zip(completions, answers):
        target, numbers = answer.split("|")
        found = stated_answer(completion)
        if found is not None and "=" in found:  # "3 + 4 = 7": keep the left-hand side
            found = found.split("=")[0]
        result = evaluate_expression(found) if found is not None else None
        ok = result is not None and result[0] == int(target)
        ok = ok and sorted(result[1]) == sorted(int(n) for n in numbers.split(","))
        scores.append(float(ok))
    return scores


def evaluate_expression(text: str) -> tuple[Fraction, list[int]] | None:
    """Value of an expression of integers, + - * / and parentheses, with the integers it used.

    A small recursive-descent parser over at most MAX_EXPRESSION_CHARS characters, so depth and
    work are bounded; returns None on any syntax error or division by zero."""
    text = text.strip()
    if len(text) > MAX_EXPRESSION_CHARS:
        return None
    tokens = re.findall(r"\d+|[-+*/()]|\S", text.replace("\\times", "*").replace("\\div", "/"))
    pos, used = 0, []

    def peek() -> str | None:
        return tokens[pos] if pos < len(tokens) else None

    def take() -> str:
        nonlocal pos
        pos += 1
        return tokens[pos - 1]

    def expression() -> Fraction:  # expression := term (('+' | '-') term)*
        value = term()
        while peek() in ("+", "-"):
            value = value + term() if take() == "+" else value - term()
        return value

    def term() -> Fraction:  # term := factor (('*' | '/') factor)*
        value = factor()
        while peek() in ("*", "/"):
            value = value * factor() if take() == "*" else value / factor()
        return value

    def factor() -> Fraction:  # factor := integer | '(' expression ')'
        token = take() if peek() is not None else ""
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
    return (value, used) if pos == len(tokens) else None


# ----------------------------------------------------------------------------- tasks
RewardFunc = Callable[[list[str], list[str]], list[float]]


@dataclass
class Task:
    train: list[dict]  # {"prompt": str | list[dict], "answer": str}
    test: list[dict]
    correctness: RewardFunc = correctness_reward  # the task's checker; evaluation reports its mean
    reads: Callable[[str], str | None] = extract_answer  # the answer that checker reads in a completion (or None)

    @property
    def reward_funcs(self) -> dict[str, RewardFunc]:
        """The reward functions `--reward-weights` can weight, by name."""
        return {"correctness": self.correctness, "format": format_reward}


def score(completions: list[str], answers: list[str], task: Task, weights: dict[str, float]):
    """The reward of each completion, sum of weight * function over `weights`, and each function's scores (and the
    errors) for logging, as tensors (B,). A function that raises on a completion scores it 0, counted in
    parts["errors"] (the scripts log it as charts/reward_errors), and the run goes on."""
    parts = {name: torch.zeros(len(completions)) for name in [*weights, "errors"]}
    for name in weights:
        for i, (completion, answer) in enumerate(zip(completions, answers)):
            try:
                parts[name][i] = task.reward_funcs[name]([completion], [answer])[0]
            except Exception as e:
                parts["errors"][i] += 1
                print(f"reward {name} raised {e!r} on {completion[:80]!r}: scored 0")
    return sum(weights[name] * parts[name] for name in weights).float(), parts


BUILTIN_TASKS = ("arithmetic", "countdown")
BUILTIN_SIZES = (5000, 200)  # train and test records of a built-in task
REASONING_GYM = "reasoning_gym:"  # --task reasoning_gym:NAME


def make_arithmetic(rng: random.Random, difficulty: int) -> dict:
    """An integer arithmetic question: 1 = a + b with numbers 0..20 (441 distinct, learnable by a 135M model on a
    CPU in minutes); 2 = a + b; 3 = a op b; 4 = (a op b) op c, with numbers 0..99."""
    a, b, c = (rng.randint(0, 20 if difficulty == 1 else 99) for _ in range(3))
    ops = "+" if difficulty <= 2 else "+-*"
    expr = f"{a} {rng.choice(ops)} {b}"
    if difficulty >= 4:
        expr = f"({expr}) {rng.choice(ops)} {c}"
    value = evaluate_expression(expr)[0]
    return {"prompt": f"What is {expr}? {ANSWER_INSTRUCTION}", "answer": str(value.numerator)}


def make_countdown(rng: random.Random, difficulty: int) -> dict:
    """Reach a target with `difficulty + 2` numbers (1..20), each used once, and + - * /.

    The target is built from a random expression over the numbers, so every puzzle has a solution."""
    while True:
        numbers = [rng.randint(1, 20) for _ in range(difficulty + 2)]
        expr = str(numbers[0])
        for n in numbers[1:]:
            expr = f"({expr} {rng.choice('+-*/')} {n})"
        value = evaluate_expression(expr)
        if value is not None and value[0].denominator == 1 and 0 < value[0] < 1000:
            break
    target = value[0].numerator
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
    rng, records, seen = random.Random(seed), [], set()
    for _ in range(20 * sum(BUILTIN_SIZES)):  # bounded: small difficulties have few distinct records
        record = make(rng, difficulty)
        if record["prompt"] not in seen:
            seen.add(record["prompt"])
            records.append(record)
        if len(records) == sum(BUILTIN_SIZES):
            break
    n_test = min(BUILTIN_SIZES[1], len(records) // 4)  # a quarter, at most 200: 110 of difficulty 1's 441
    countdown = name == "countdown"  # its checker reads only a stated answer, never the last number
    return Task(records[n_test:], records[:n_test], *((countdown_reward, stated_answer) if countdown else ()))


def to_record(row, prompt_field: str, answer_field: str, where: str) -> dict:
    """One raw row as {"prompt", "answer"}, or a ValueError naming `where` it is, the field it lacks and those it has.
    A GSM8K-style answer keeps only what follows '####'."""
    for name in (prompt_field, answer_field):
        if not isinstance(row, dict) or name not in row:
            has = f"it has {sorted(row)}" if isinstance(row, dict) else f"it is a {type(row).__name__}"
            raise ValueError(f"{where} has no field {name!r} ({has}; set --prompt-field / --answer-field)")
    answer = str(row[answer_field])
    return {"prompt": row[prompt_field], "answer": answer.split("####")[-1].strip()}


def hold_out(records: list[dict]) -> tuple[list[dict], list[dict]]:
    """Train and test splits of one list: the last 10% (at least one record) is held out."""
    n_test = max(1, len(records) // 10)
    return records[:-n_test], records[-n_test:]


def jsonl_task(path: str, prompt_field: str, answer_field: str) -> Task:
    """One record per line, blank lines skipped; the last 10% held out. An error names the line and what is wrong."""
    if not os.path.isfile(path):
        raise FileNotFoundError(f"--task {path}: no such file")
    records = []
    with open(path) as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"--task {path}: line {number} is not valid JSON ({e.msg})") from None
            records.append(to_record(row, prompt_field, answer_field, f"--task {path}: line {number}"))
    if len(records) < 2:
        empty = " (the file is empty)" if not records else ""
        raise ValueError(f"--task {path}: needs at least 2 records, found {len(records)}{empty}")
    return Task(*hold_out(records))


def hub_task(name: str, prompt_field: str, answer_field: str) -> Task:
    """A Hub dataset id, a local dataset folder (as `datasets.load_dataset` reads it) or a `.parquet` file: its test
    split, or else the last 10% of its train split held out. GSM8K's config `main`, on the Hub or in a folder of its
    layout (`main/train-00000-of-00001.parquet`), is read as `data_dir`, which needs no README. The prompt field falls
    back to `question` (GSM8K and most QA sets), and each text prompt is told where the graded answer goes."""
    try:
        import datasets
    except ImportError as e:
        raise ImportError(f"--task {name}: Hub datasets and parquet files need `pip install datasets`") from e
    if name.endswith(".parquet") and not os.path.isfile(name):
        raise FileNotFoundError(f"--task {name}: no such file")
    main = name == "openai/gsm8k" or os.path.isdir(os.path.join(name, "main"))
    try:
        ds = (datasets.load_dataset("parquet", data_files=name) if name.endswith(".parquet")
              else datasets.load_dataset(name, data_dir="main" if main else None))
    except Exception as e:  # an unreadable file or folder, no network, ...: one line
        raise ValueError(f"--task {name}: {type(e).__name__}: {str(e).strip().partition(chr(10))[0]}") from None
    if "train" not in ds:
        raise ValueError(f"--task {name}: no train split (it has {sorted(ds)})")
    if prompt_field not in ds["train"].column_names and "question" in ds["train"].column_names:
        prompt_field = "question"
    splits = {split: [to_record(row, prompt_field, answer_field, f"--task {name}: {split} record {i}")
                      for i, row in enumerate(ds[split])] for split in ("train", "test") if split in ds}
    # no test split: hold out the end of train, never evaluate on what is trained on
    train, test = (splits["train"], splits["test"]) if "test" in splits else hold_out(splits["train"])
    if not train or not test:
        raise ValueError(f"--task {name}: needs records to train on and to hold out; found {len(train)}, {len(test)}")
    for record in train + test:
        if isinstance(record["prompt"], str):
            record["prompt"] = f"{record['prompt']}\n{ANSWER_INSTRUCTION}"
    return Task(train, test)


def reasoning_gym_task(name: str, seed: int = 0) -> Task:
    """A procedural dataset of reasoning-gym (https://github.com/open-thought/reasoning-gym), generated offline,
    BUILTIN_SIZES entries: train from `seed`, test from `seed + 5000` (entry i of seed s is drawn from Random(s + i), so
    seed + 1 would repeat train shifted by one), repeated questions and test questions that train has dropped.

    A record's answer is its entry's index: the correctness reward hands that entry and the completion's stated answer
    (`\\boxed{}` or `<answer>`) to the dataset's own `score_answer`, which may give partial credit. That checker is
    reasoning-gym's code: this module's time limits and no-eval guarantee do not cover it."""
    task = f"--task {REASONING_GYM}{name}"
    try:
        import reasoning_gym
        from reasoning_gym.factory import DATASETS
    except ImportError as e:
        raise ImportError(f"{task}: reasoning-gym tasks need `pip install reasoning-gym`") from e
    if name not in DATASETS:
        raise ValueError(f"{task}: no such dataset (list them with python -c "
                         f"'import reasoning_gym.factory as f; print(sorted(f.DATASETS))')")
    try:
        generated = [reasoning_gym.create_dataset(name, seed=seed + i * BUILTIN_SIZES[0], size=n)
                     for i, n in enumerate(BUILTIN_SIZES)]
    except Exception as e:  # e.g. `composite` needs a config of its own
        raise ValueError(f"{task}: cannot be generated with its default config ({e!r})") from None
    entries, splits, seen = [], ([], []), set()
    for dataset, split in zip(generated, splits):
        for entry in dataset:
            if entry["question"] not in seen:
                seen.add(entry["question"])
                split.append({"prompt": f"{entry['question']}\n{ANSWER_INSTRUCTION}", "answer": str(len(entries))})
                entries.append((dataset.score_answer, entry))
    if not splits[1]:
        raise ValueError(f"{task}: every held-out question is also a training one")

    def correctness(completions: list[str], answers: list[str]) -> list[float]:
        scores = []
        for completion, answer in zip(completions, answers):
            try:  # a checker may raise on an odd answer; a reward must not
                score_answer, entry = entries[int(answer)]
                found = stated_answer(completion)
                scores.append(float(score_answer(None if found is None else found.strip(), entry)))
            except Exception:
                scores.append(0.0)
        return scores

    return Task(*splits, correctness, stated_answer)


def load_task(
    task: str, difficulty: int = 1, prompt_field: str = "prompt", answer_field: str = "answer"
) -> Task:
    """Resolve `--task`: a built-in name, `reasoning_gym:NAME`, a `.jsonl` or `.parquet` path, a dataset folder or a
    Hub dataset id (anything else with a '/')."""
    if task in BUILTIN_TASKS:
        return builtin_task(task, difficulty)
    if task.startswith(REASONING_GYM):
        return reasoning_gym_task(task.removeprefix(REASONING_GYM))
    if task.endswith(".jsonl"):
        return jsonl_task(task, prompt_field, answer_field)
    if "/" in task or task.endswith(".parquet") or os.path.isdir(task):
        return hub_task(task, prompt_field, answer_field)
    raise ValueError(f"--task {task!r}: not one of {BUILTIN_TASKS}, {REASONING_GYM}NAME, a .jsonl or .parquet file, "
                     "a dataset folder or a Hub dataset id")


def encode_prompts(tokenizer, records: list[dict], max_tokens: int) -> int:
    """Each record's "prompt_ids", through the chat template when the tokenizer has one, cut to the last `max_tokens`
    tokens. Returns how many were cut, and says so: a cut is never silent."""
    cut = 0
    for record in records:
        prompt = record["prompt"]
        if not tokenizer.chat_template and not isinstance(prompt, str):
            raise SystemExit("error: --task: prompts given as chat messages need a --model whose tokenizer has a chat "
                             "template")
        if tokenizer.chat_template:
            messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
            prompt = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        ids = tokenizer(prompt, add_special_tokens=not tokenizer.chat_template).input_ids  # the template has its own
        record["prompt_ids"], cut = ids[-max_tokens:], cut + (len(ids) > max_tokens)
    if cut:
        print(f"warning: {cut} of {len(records)} prompts are longer than --max-prompt-tokens {max_tokens}; "
              f"each is cut to its last {max_tokens} tokens")
    return cut


def preflight(completions: list[str], reward: torch.Tensor, truncated: torch.Tensor, task: Task, group_size: int,
              max_new_tokens: int, prompts_cut: int, templated: bool) -> list[str]:
    """A summary of the first sampled batch, printed before the first update, with a warning for each figure that
    means the run cannot learn, naming the argument to change. Returns the warnings."""
    n, found = len(completions), sum(task.reads(c) is not None for c in completions)
    stated = sum(stated_answer(c) is not None for c in completions)
    groups = n // group_size  # (one completion a prompt, PPO's: a critic's baseline, no group to compare within)
    flat = int((reward.view(groups, -1).std(1) == 0).sum()) if group_size > 1 else 0  # groups with all A_i = 0
    best = int(reward.argmax())
    print(f"preflight, the first batch: {n} completions of {groups} prompts (chat template "
          f"{'applied' if templated else 'absent: plain text'}; {prompts_cut} prompts cut to --max-prompt-tokens)\n"
          f"  truncated at --max-new-tokens {max_new_tokens}: {int(truncated.sum())} of {n}\n"
          f"  an answer the reward can read: {found} of {n} ({stated} in \\boxed{{}} or <answer>)\n"
          + (f"  groups with zero reward spread (every advantage 0): {flat} of {groups}\n" if group_size > 1 else "")
          + f"  e.g. (reward {reward[best]:.2f}): {json.dumps(completions[best])[:300]}")
    warnings = [message for failing, message in [
        (truncated.float().mean() > 0.5, "most completions reach the length limit unfinished, and a cut answer "
         "scores nothing: raise --max-new-tokens"),
        (found == 0, "no completion holds an answer the reward can read: check --task's prompts and answers, and use "
         "a chat (instruct) --model" + ("" if templated else " (this tokenizer has no chat template)")),
        (group_size > 1 and flat == groups, "every group's completions have the same reward, so every advantage is 0 "
         "and nothing is learned: raise --group-size or --temperature, or choose an easier --task"),
    ] if failing]
    for message in warnings:
        print(f"warning: {message}")
    return warnings
