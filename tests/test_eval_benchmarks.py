"""Benchmark files through the one loader (math, multiple choice, code, in every shipped format) and
reading a response's letter; bad rows stop loading with the file, the row and what is wrong."""
import base64
import json
import os
import pickle
import zlib

import pytest

from orz.data.datasets import CodeTests, DatasetFormatError, parse_rows
from orz.evaluation.benchmarks import benchmark_from_rows, load_benchmark
from orz.reward.choice import extract_choice
from jsonl_files import write_jsonl

GPQA_ROW = {"Question": "Which particle is a lepton?", "Correct Answer": "electron",
            "Incorrect Answer 1": "proton", "Incorrect Answer 2": "neutron", "Incorrect Answer 3": "pion"}


def _write(tmp_path, name, rows):
    path = tmp_path / name
    if name.endswith(".jsonl"):
        write_jsonl(path, rows)
    else:
        path.write_text(json.dumps(rows))
    return path


def test_math_rows_in_every_dataset_format(tmp_path):
    rows = [
        {"prompt": [{"from": "user", "value": "1+1?"}], "final_answer": "2"},
        {"prompt": "2+2?", "answer": 4},
        [{"from": "human", "value": "3+3?"}, {"from": "assistant", "ground_truth": {"value": "6"}}],
    ]
    bench = load_benchmark("mix", _write(tmp_path, "mix.json", rows))
    assert bench.kind == "math"
    assert [(p.prompt, p.answer, p.number) for p in bench.problems] == [("1+1?", "2", 1), ("2+2?", "4", 2), ("3+3?", "6", 3)]


def test_multiple_choice_letters_and_indices(tmp_path):
    rows = [{"question": "Pick two.", "choices": ["1", "2", "3"], "answer": "b"},
            {"prompt": "Pick three.", "choices": ["1", "2", "3", "4"], "answer": 2}]
    bench = load_benchmark("mc", _write(tmp_path, "mc.jsonl", rows))
    assert bench.kind == "multiple_choice"
    assert [p.answer for p in bench.problems] == ["B", "C"]
    assert bench.problems[0].prompt == "Pick two.\n\nA) 1\nB) 2\nC) 3\n\nAnswer with the letter of the correct choice."
    assert bench.problems[1].choices == ("1", "2", "3", "4")


def test_gpqa_columns_are_shuffled_the_same_way_every_time(tmp_path):
    rows = [GPQA_ROW, {**GPQA_ROW, "Question": "Which particle is a lepton, again?"}]
    first = load_benchmark("gpqa", _write(tmp_path, "gpqa.jsonl", rows))
    again = load_benchmark("gpqa", _write(tmp_path, "gpqa2.json", rows))
    assert first.problems == again.problems
    for p in first.problems:
        assert sorted(p.choices) == ["electron", "neutron", "pion", "proton"]
        assert p.choices["ABCD".index(p.answer)] == "electron"
    # Pinned: random.Random(str) seeds from the string's SHA-512, the same in every process and
    # Python version, so these letters are what every user of the file gets.
    assert [p.answer for p in first.problems] == ["D", "A"]


def test_code_tests_from_each_format(tmp_path):
    functional_cases = [{"input": "[2, 7, 11, 15]\n9", "output": "[0, 1]", "testtype": "functional"}]
    private = [{"input": "[3, 3]\n6", "output": "[0, 1]", "testtype": "functional"}]
    compressed = base64.b64encode(zlib.compress(pickle.dumps(json.dumps(private)))).decode()
    rows = [
        {"question": "Add.", "tests": {"inputs": ["1 2\n"], "outputs": ["3\n"]}},
        {"prompt": "Add.", "input_output": json.dumps({"inputs": [[1, 2]], "outputs": [3], "fn_name": "add"}),
         "starter_code": "def add(a, b):\n    pass"},
        {"question_content": "Two sum.", "starter_code": "class Solution:\n    def twoSum(self, nums, target):",
         "public_test_cases": json.dumps(functional_cases), "private_test_cases": compressed,
         "metadata": json.dumps({"func_name": "twoSum"})},
        {"question_content": "Echo.", "public_test_cases": json.dumps([{"input": "x\n", "output": "x\n", "testtype": "stdin"}]),
         "private_test_cases": json.dumps([{"input": "y\n", "output": "y\n", "testtype": "stdin"}])},
    ]
    bench = load_benchmark("lcb", _write(tmp_path, "lcb.jsonl", rows))
    assert bench.kind == "code"
    tests = [p.tests for p in bench.problems]
    assert tests[0] == CodeTests(["1 2\n"], ["3\n"])
    assert tests[1] == CodeTests([[1, 2]], [3], "add", wrapped_returns=True)  # APPS: [value] may stand for value
    assert tests[2] == CodeTests([[[2, 7, 11, 15], 9], [[3, 3], 6]], [[0, 1], [0, 1]], "twoSum")
    assert tests[3] == CodeTests(["x\n", "y\n"], ["x\n", "y\n"])
    assert "reads the input from standard input" in bench.problems[0].prompt
    assert "```python\ndef add(a, b):\n    pass\n```" in bench.problems[1].prompt


class Boom:
    def __reduce__(self):
        return (os.system, ("echo pwned",))


def test_a_pickled_object_in_private_tests_is_refused_not_run(tmp_path):
    blob = base64.b64encode(zlib.compress(pickle.dumps(Boom()))).decode()
    row = {"question_content": "q", "public_test_cases": json.dumps([{"input": "", "output": "", "testtype": "stdin"}]),
           "private_test_cases": blob}
    with pytest.raises(DatasetFormatError, match=r"row 1: 'private_test_cases' .*refusing to load"):
        load_benchmark("lcb", _write(tmp_path, "evil.jsonl", [row]))


@pytest.mark.parametrize(
    "name, rows, row, problem",
    [
        ("missing_answer.jsonl", [{"prompt": "1+1?", "answer": "2"}, {"prompt": "2+2?"}], 2, "no answer"),
        ("empty_answer.json", [{"prompt": "1+1?", "answer": " "}], 1, "the answer must be a non-empty"),
        ("not_a_row.jsonl", [{"prompt": "1+1?", "answer": "2"}, 17], 2, "must be an object or a conversation"),
        ("mc_no_answer.jsonl", [{"question": "q", "choices": ["a", "b"], "answer": "A"},
                                {"question": "q", "choices": ["a", "b"]}], 2, "no answer"),
        ("mc_bad_letter.jsonl", [{"question": "q", "choices": ["a", "b"], "answer": "C"}], 1, "a letter A-B or an index 0-1"),
        ("mc_one_choice.jsonl", [{"question": "q", "choices": ["a"], "answer": "A"}], 1, "list of 2 to 10"),
        ("gpqa_missing.jsonl", [GPQA_ROW, {k: v for k, v in GPQA_ROW.items() if k != "Incorrect Answer 3"}], 2,
         "missing field 'Incorrect Answer 3'"),
        ("code_no_tests.jsonl", [{"question": "q", "tests": {"inputs": ["1"], "outputs": ["1"]}}, {"question": "q"}], 2,
         "no 'prompt' field"),
        ("code_uneven.jsonl", [{"question": "q", "tests": {"inputs": ["1", "2"], "outputs": ["1"]}}], 1,
         "2 inputs, 1 outputs"),
        ("code_no_fn.jsonl", [{"question_content": "q", "public_test_cases": json.dumps(
            [{"input": "1", "output": "1", "testtype": "functional"}])}], 1, "func_name"),
    ],
)
def test_malformed_rows_name_file_row_and_problem(tmp_path, name, rows, row, problem):
    path = _write(tmp_path, name, rows)
    with pytest.raises(DatasetFormatError, match=problem) as caught:
        load_benchmark("bad", path)
    assert (caught.value.path, caught.value.row) == (str(path), row)
    assert str(caught.value).startswith(f"{path}, row {row}: ")


def test_invalid_json_line_and_empty_file(tmp_path):
    path = tmp_path / "broken.jsonl"
    path.write_text('{"prompt": "1+1?", "answer": "2"}\n{"prompt": \n')
    with pytest.raises(DatasetFormatError, match=r"broken.jsonl, row 2: invalid JSON"):
        load_benchmark("broken", path)
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    with pytest.raises(ValueError, match="empty.jsonl: holds no rows"):
        load_benchmark("empty", empty)


def test_rows_in_memory_read_like_a_file(tmp_path):
    rows = [{"prompt": "1+1?", "answer": "2"}, {"question": "q", "choices": ["a", "b"], "answer": "A"}]
    in_memory = benchmark_from_rows("mix", parse_rows(str(tmp_path / "a.json"), enumerate(rows, start=1)))
    assert in_memory.problems == load_benchmark("mix", _write(tmp_path, "a.json", rows)).problems
    assert in_memory.kind == "mixed" and [p.verifier for p in in_memory.problems] == ["math", "multiple_choice"]
    with pytest.raises(DatasetFormatError, match=r"<arith rows>, row 2: no 'prompt' field"):
        parse_rows("<arith rows>", enumerate([rows[0], {"question": "q"}], start=1))


@pytest.mark.parametrize(
    "response, letter",
    [
        ("<think> hmm </think> <answer>C</answer>", "C"),
        ("<answer> (B) </answer>", "B"),
        ("so \\boxed{\\text{D}}", "D"),
        ("\\boxed{A) electron}", "A"),
        ("The answer is (B).", "B"),
        ("<answer>E</answer>", None),  # only four choices
        ("<answer>electron</answer>", None),
        ("no answer at all", None),
    ],
)
def test_extract_choice(response, letter):
    assert extract_choice(response, 4, ("boxed", "answer_tag")) == letter


def test_the_shared_benchmark_files_load(shared_data):
    for name, size in (("aime2024.json", 30), ("math500.json", 500)):
        path = os.path.join(shared_data, name)
        if not os.path.exists(path):
            pytest.skip(f"{path} is absent")
        bench = load_benchmark(name, path)
        assert bench.kind == "math" and len(bench.problems) == size
        assert all(p.prompt and p.answer for p in bench.problems)
