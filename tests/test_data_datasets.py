"""load_rows: every accepted format and file type (Skywork-OR1's verl parquet included), the verifier
each row names, real benchmark files, and precise errors."""
import json
import os

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from orz.config import DataConfig
from orz.data.datasets import COMMON_IMPORTS, CodeTests, DatasetFormatError, RunData, load_rows, load_source
from jsonl_files import write_jsonl

CONVERSATION = [{"from": "human", "value": "What is 2+2?"},
                {"from": "assistant", "ground_truth": {"value": "4"}}]
EVALUATION = {"prompt": [{"from": "user", "value": "What is 3+3?"}], "final_answer": "6"}
FLAT = {"prompt": "What is 4+4?", "answer": 8}
VERL = {"prompt": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 5+5?"}],
        "reward_model": {"ground_truth": "10", "style": "rule"}, "data_source": "x"}
EXPECTED = [("What is 2+2?", "4"), ("What is 3+3?", "6"), ("What is 4+4?", "8"), ("What is 5+5?", "10")]


def load_prompts(path):
    """(prompt, answer) of every row, all of them math."""
    rows = load_rows(path)
    assert {r.verifier for r in rows} == {"math"}
    return [(r.prompt, r.answer) for r in rows]


def test_jsonl_with_every_row_format(tmp_path):
    assert load_prompts(write_jsonl(tmp_path / "p.jsonl", [CONVERSATION, EVALUATION, FLAT, VERL])) == EXPECTED


def test_json_list(tmp_path):
    path = tmp_path / "p.json"
    path.write_text(json.dumps([CONVERSATION, EVALUATION, FLAT, VERL]))
    assert load_prompts(path) == EXPECTED


def test_parquet_flat_and_verl(tmp_path):
    path = tmp_path / "p.parquet"
    pq.write_table(pa.Table.from_pylist([{"prompt": "What is 4+4?", "answer": "8"}]), path)
    assert load_prompts(path) == [EXPECTED[2]]
    verl_path = tmp_path / "verl.parquet"
    pq.write_table(pa.Table.from_pylist([VERL]), verl_path)
    assert load_prompts(verl_path) == [EXPECTED[3]]


@pytest.mark.parametrize("bad_row, problem", [
    ({"question": "q", "answer": "1"}, "no 'prompt' field"),
    ({"prompt": "q"}, "no answer"),
    ({"prompt": "q", "reward_model": "4"}, "no answer"),
    ({"prompt": "", "answer": "1"}, "non-empty string"),
    ({"prompt": "q", "answer": ""}, "the answer must be"),
    ({"prompt": "q", "answer": True}, "the answer must be"),
    ({"prompt": [{"from": "assistant", "value": "hi"}], "final_answer": "1"}, "no user message"),
    ([{"from": "human", "value": "q"}], "no assistant message"),
    ("just a string", "must be an object"),
])
def test_bad_row_names_file_row_and_problem(tmp_path, bad_row, problem):
    path = write_jsonl(tmp_path / "bad.jsonl", [FLAT, FLAT, bad_row])
    with pytest.raises(DatasetFormatError) as error:
        load_prompts(path)
    assert (error.value.path, error.value.row) == (str(path), 3)
    assert problem in str(error.value) and str(path) in str(error.value) and "row 3" in str(error.value)
    assert isinstance(error.value, ValueError)


def test_invalid_json_line_and_wrong_top_level(tmp_path):
    path = tmp_path / "broken.jsonl"
    path.write_text(json.dumps(FLAT) + "\n\n{not json\n")
    with pytest.raises(DatasetFormatError, match="row 3: invalid JSON"):
        load_prompts(path)
    path = tmp_path / "object.json"
    path.write_text(json.dumps(FLAT))
    with pytest.raises(DatasetFormatError, match="expected a JSON list"):
        load_prompts(path)
    with pytest.raises(ValueError, match="unsupported file type"):
        load_prompts(tmp_path / "rows.csv")


@pytest.mark.parametrize("name, size", [("aime2024.json", 30), ("math500.json", 500)])
def test_real_benchmark_files(shared_data, name, size):
    rows = load_prompts(os.path.join(shared_data, name))
    assert len(rows) == size
    assert all(prompt.strip() and answer.strip() for prompt, answer in rows)
    if name == "aime2024.json":
        assert rows[0][1] == "73" and "Aimeville" in rows[0][0]


# ---- Skywork-OR1's rows as shipped (verl parquet) ---------------------------------------------

def _skywork(source, truth, ability):
    return {"data_source": source, "prompt": [{"role": "user", "content": f"{source} problem"}], "ability": ability,
            "reward_model": {"style": "rule", "ground_truth": truth}, "extra_info": {"index": 0}}


SKYWORK = [
    _skywork("train-math-deepscaler", "['3', '\\\\frac{6}{2}']", "math"),  # the string of a Python list
    _skywork("train-math-interval", "[0, 1]", "math"),  # an interval, not a list of answers
    _skywork("train-code-taco", json.dumps({"inputs": ["1 2\n"], "outputs": ["3\n"]}), "code"),
    _skywork("train-code-leetcode", json.dumps({"inputs": [[[1, 2], 3]], "outputs": [[0, 1]], "fn_name": "twoSum"}),
             "code"),
    _skywork("train-code-humaneval", json.dumps({"import_prefix": "import math\n", "entry_point": "add",
                                                 "test_code": "def check(candidate):\n    assert candidate(1, 2) == 3\n"
                                                              "    assert candidate(0, 0) == 0\n"}), "code"),
    _skywork("train-code-mbpp", json.dumps({"assert_case": ["assert add(1, 2) == 3"]}), "code"),
]


def test_skywork_or1_parquet_loads_as_shipped(tmp_path):
    path = tmp_path / "skywork.parquet"
    pq.write_table(pa.Table.from_pylist(SKYWORK), path)
    rows = load_rows(path)
    assert [r.verifier for r in rows] == ["math", "math", "code", "code", "code", "code"]
    assert rows[0].answers == ("3", "\\frac{6}{2}") and rows[1].answers == ("[0, 1]",)
    assert [r.data_source for r in rows][:2] == ["train-math-deepscaler", "train-math-interval"]
    assert rows[0].prompt == "train-math-deepscaler problem" and rows[0].extra_info == {"index": 0}
    assert rows[2].tests == CodeTests(["1 2\n"], ["3\n"])
    assert rows[3].tests == CodeTests([[[1, 2], 3]], [[0, 1]], "twoSum", wrapped_returns=True)
    assert rows[4].tests == CodeTests([], [], checks=(  # one per statement of check(), whole
        "def check(candidate):\n    assert candidate(1, 2) == 3\ncheck(add)\n",
        "def check(candidate):\n    assert candidate(0, 0) == 0\ncheck(add)\n"), prefix="import math\n")
    assert rows[5].tests == CodeTests([], [], checks=("assert add(1, 2) == 3",), prefix=COMMON_IMPORTS)
    assert rows[5].tests.mode == "check" and rows[3].tests.mode == "call" and rows[2].tests.mode == "stdio"


def test_a_row_may_name_a_custom_verifier(tmp_path):
    path = write_jsonl(tmp_path / "custom.jsonl", [
        {"prompt": "Say hi.", "verifier": "greeting", "answer": "hi", "data_source": "chat"},
        {"prompt": "Anything.", "verifier": "brevity"},
    ])
    greeting, brevity = load_rows(path)
    assert (greeting.verifier, greeting.answers, greeting.ground_truth, greeting.data_source) == \
        ("greeting", ("hi",), "hi", "chat")
    assert (brevity.verifier, brevity.answers) == ("brevity", ())
    assert greeting.record()["answers"] == ["hi"] and json.dumps(greeting.record())


@pytest.mark.parametrize("truth, problem", [
    ({"import_prefix": "", "test_code": "def check(c):\n", "entry_point": "f"}, "not valid Python"),
    ({"import_prefix": "", "test_code": "assert f(1) == 1", "entry_point": "f"}, "no 'def check\\(candidate\\)'"),
    ({"import_prefix": "", "test_code": "def check(c):\n    assert c()"}, "need 'entry_point'"),
    ({"assert_case": []}, "non-empty list of assert lines"),
    ({"tests": "nothing"}, "code tests need 'inputs' and 'outputs'"),
])
def test_bad_code_truths_name_the_row(tmp_path, truth, problem):
    path = write_jsonl(tmp_path / "code.jsonl", [_skywork("c", json.dumps(truth), "code")])
    with pytest.raises(DatasetFormatError, match=problem) as error:
        load_rows(path)
    assert error.value.row == 1


def test_synthetic_sources_split_and_name_their_verifier():
    for spec, verifier in (("synthetic:arithmetic", "math"), ("synthetic:countdown", "countdown"),
                           ("synthetic:code", "code")):
        train = load_source(spec, split="train", size=50, seed=0, digits=(1, 2))
        test = load_source(spec, split="test", size=20, seed=0, digits=(1, 2))
        assert {r.verifier for r in train + test} == {verifier} and {r.data_source for r in train} == {spec}
        assert not {r.prompt for r in train} & {r.prompt for r in test}
    with pytest.raises(ValueError, match="unknown synthetic task 'synthetic:poetry'"):
        load_source("synthetic:poetry", split="train", size=1, seed=0)


def test_a_runs_data_sections_are_read_once_at_their_splits_sizes(tmp_path):
    flat = write_jsonl(tmp_path / "flat.jsonl", [{"prompt": "1+1?", "answer": "2"}])
    data = DataConfig(train=["synthetic:code", str(flat)], eval={"held": "synthetic:code", "flat": str(flat)},
                      synthetic_train_size=30, synthetic_eval_size=10, synthetic_digits=(1, 2))
    run = RunData(seed=3)
    train, sets = run.train(data), run.eval_sets(data)
    assert len(train) == 31 and train[-1].answer == "2" and train[:30] == load_source(
        "synthetic:code", split="train", size=30, seed=3, digits=(1, 2))
    assert {name: len(rows) for name, rows in sets.items()} == {"held": 10, "flat": 1}
    assert not {r.prompt for r in train[:30]} & {r.prompt for r in sets["held"]}
    flat.write_text("")  # read once: a later stage naming the same file gets what was read
    assert run.eval_sets(data)["flat"] is sets["flat"] and run.train(data) == train
    with pytest.raises(ValueError, match="data.train is empty"):
        run.train(DataConfig())
