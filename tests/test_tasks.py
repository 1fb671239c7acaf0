"""Task sources beyond the built-in ones: a dataset folder in the Hub's layout (GSM8K's), a .parquet file, and
reasoning-gym's procedural datasets. All offline."""
import sys

import pytest
import torch

import rewards

datasets = pytest.importorskip("datasets")
pq = pytest.importorskip("pyarrow.parquet")
pa = pytest.importorskip("pyarrow")


@pytest.fixture(autouse=True)
def datasets_cache(tmp_path, monkeypatch):
    """datasets writes an Arrow copy of what it loads: into tmp_path, not the user's cache."""
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path / "cache"))


def write_gsm8k(path, questions: list[str], answers: list[int]):
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.table({"question": questions,
                             "answer": [f"She sold 48 / 2 = <<48/2=24>>24.\n#### {a}" for a in answers]}), path)


GSM8K_README = """---
configs:
- config_name: main
  data_files:
  - split: train
    path: main/train-*
  - split: test
    path: main/test-*
- config_name: socratic
  data_files:
  - split: train
    path: socratic/train-*
  - split: test
    path: socratic/test-*
---
"""


@pytest.mark.parametrize("readme", [False, True], ids=["parquet-only", "with-the-hubs-readme"])
def test_gsm8k_in_the_hubs_layout_loads_its_main_config_from_a_local_folder(tmp_path, monkeypatch, readme):
    """A local copy of openai/gsm8k (its files, with or without the README that names its configs) loads as --task
    openai/gsm8k does: config `main`, never `socratic`, its test split held out, answers read after '####'."""
    folder = tmp_path / "gsm8k"
    write_gsm8k(folder / "main" / "train-00000-of-00001.parquet", [f"main q{i}" for i in range(4)], [72, 10, 5, 1])
    write_gsm8k(folder / "main" / "test-00000-of-00001.parquet", ["main t0", "main t1"], [8, 9])
    write_gsm8k(folder / "socratic" / "train-00000-of-00001.parquet", ["socratic q0"], [3])
    write_gsm8k(folder / "socratic" / "test-00000-of-00001.parquet", ["socratic t0"], [4])
    if readme:
        (folder / "README.md").write_text(GSM8K_README)
    monkeypatch.chdir(tmp_path)
    for name in [str(folder), "gsm8k"]:  # a relative folder has no '/' and is still a folder
        task = rewards.load_task(name)
        assert [r["answer"] for r in task.train] == ["72", "10", "5", "1"]
        assert [r["answer"] for r in task.test] == ["8", "9"]
        assert task.train[0]["prompt"] == f"main q0\n{rewards.ANSWER_INSTRUCTION}"
        assert task.correctness(["so \\boxed{72}", "\\boxed{73}"], ["72", "72"]) == [1.0, 0.0]


def test_a_parquet_file_is_a_task_with_the_last_tenth_held_out(tmp_path):
    path = tmp_path / "data.parquet"
    write_gsm8k(path, [f"q{i}" for i in range(20)], list(range(20)))
    task = rewards.load_task(str(path))
    assert [r["answer"] for r in task.train] == [str(i) for i in range(18)]
    assert [r["answer"] for r in task.test] == ["18", "19"]
    assert task.test[0]["prompt"] == f"q18\n{rewards.ANSWER_INSTRUCTION}"
    # no such answer field: a task of prompts alone (validate asks for a --reward-model), told nothing of answers
    prompts_only = rewards.load_task(str(path), answer_field="answer_text")
    assert not prompts_only.has_answers and prompts_only.test[0]["prompt"] == "q18"
    with pytest.raises(FileNotFoundError, match="no such file"):
        rewards.load_task(str(tmp_path / "missing.parquet"))


@pytest.mark.parametrize("name", ["chain_sum", "basic_arithmetic"])
def test_reasoning_gym_splits_are_large_and_do_not_overlap(name):
    pytest.importorskip("reasoning_gym")
    task = rewards.load_task(f"reasoning_gym:{name}")
    train, test = {r["prompt"] for r in task.train}, {r["prompt"] for r in task.test}
    assert len(train) == len(task.train) > 4500 and len(test) == len(task.test) > 150  # few repeats dropped
    assert not train & test
    assert all(r["prompt"].endswith(rewards.ANSWER_INSTRUCTION) for r in task.train + task.test)


def test_reasoning_gym_correctness_is_the_datasets_own_check_of_the_stated_answer():
    """chain_sum's questions ("... problem: 901 + 506 - 566 =") are checked here by rewards.evaluate_expression."""
    pytest.importorskip("reasoning_gym")
    task = rewards.load_task("reasoning_gym:chain_sum")
    for record in task.test[:50]:
        expression = record["prompt"].split(": ", 1)[1].split("=")[0]
        right = str(rewards.evaluate_expression(expression)[0])
        completions = [f"The sum is \\boxed{{{right}}}.", f"<answer> {right} </answer>", f"\\boxed{{{int(right) + 1}}}",
                       f"it is {right}", "\\boxed{}", ""]  # an unstated answer scores 0, as in reasoning-gym
        assert task.correctness(completions, [record["answer"]] * len(completions)) == [1.0, 1.0, 0.0, 0.0, 0.0, 0.0]
    assert task.correctness(["\\boxed{1}", "\\boxed{1}"], ["not an index", "99999999"]) == [0.0, 0.0]  # never raises


def test_reasoning_gym_errors_are_one_line(monkeypatch):
    pytest.importorskip("reasoning_gym")
    with pytest.raises(ValueError, match=r"no such dataset \(list them with .*f\.DATASETS") as error:
        rewards.load_task("reasoning_gym:no_such_puzzle")
    assert "\n" not in str(error.value)
    with pytest.raises(ValueError, match="cannot be generated with its default config"):
        rewards.load_task("reasoning_gym:composite")  # needs a list of datasets
    monkeypatch.setitem(sys.modules, "reasoning_gym", None)  # as if not installed
    with pytest.raises(ImportError, match="pip install reasoning-gym") as error:
        rewards.load_task("reasoning_gym:chain_sum")
    assert "\n" not in str(error.value)


@pytest.mark.parametrize("file, rows, message", [
    ("one.parquet", 1, "needs records to train on and to hold out; found 0, 1"),
    ("none.parquet", 0, "none.parquet: "),
    ("data/test-00000-of-00001.parquet", 2, "no train split (it has ['test'])"),
], ids=["one-row", "no-rows", "test-split-only"])
def test_a_dataset_that_cannot_make_a_task_is_a_one_line_error(tmp_path, file, rows, message):
    write_gsm8k(tmp_path / file, [f"q{i}" for i in range(rows)], list(range(rows)))
    with pytest.raises(ValueError) as error:  # a .parquet file, or the folder of a split's file
        rewards.load_task(str(tmp_path / file) if "/" not in file else str(tmp_path))
    assert message in str(error.value) and "\n" not in str(error.value)


def test_a_math_style_dataset_is_graded_by_the_boxed_answer_of_its_solution(tmp_path, capsys):
    """MATH's layout: `problem` and `solution`, a worked solution ending in its `\\boxed{}` answer. Each reference is
    reduced to that answer when the task loads, and the preflight says how many were."""
    path = tmp_path / "math.parquet"
    solutions = [f"Since $2x = {i}$, we get $x = \\boxed{{\\frac{{{i}}}{{2}}}}$." for i in range(1, 21)]
    pq.write_table(pa.table({"problem": [f"Solve 2x = {i}." for i in range(1, 21)], "solution": solutions}), path)
    task = rewards.load_task(str(path), prompt_field="problem", answer_field="solution")
    assert [r["answer"] for r in task.test] == ["\\frac{19}{2}", "\\frac{20}{2}"]
    assert task.test[0]["prompt"] == f"Solve 2x = 19.\n{rewards.ANSWER_INSTRUCTION}"
    assert task.references_reduced == 20
    completions = ["so \\boxed{9.5}", "\\boxed{10}", "\\boxed{19}"]
    references = ["\\frac{19}{2}", "\\frac{20}{2}", "\\frac{19}{2}"]
    assert task.correctness(completions, references) == [1.0, 1.0, 0.0]
    reward = torch.tensor([1.0, 0.0])
    rewards.preflight(["\\boxed{1}", "\\boxed{2}"], reward, torch.tensor([False, False]), task, 2, 48, 0, True)
    assert "references reduced to their \\boxed{} answer (the answer field held a whole solution): 20 of 20" in (
        capsys.readouterr().out)
