"""load_prompts: every accepted format and file type, real benchmark files, and precise errors."""
import json
import os

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from orz.data.datasets import DatasetFormatError, load_prompts

CONVERSATION = [{"from": "human", "value": "What is 2+2?"},
                {"from": "assistant", "ground_truth": {"value": "4"}}]
EVALUATION = {"prompt": [{"from": "user", "value": "What is 3+3?"}], "final_answer": "6"}
FLAT = {"prompt": "What is 4+4?", "answer": 8}
VERL = {"prompt": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 5+5?"}],
        "reward_model": {"ground_truth": "10", "style": "rule"}, "data_source": "x"}
EXPECTED = [{"prompt": "What is 2+2?", "answer": "4"}, {"prompt": "What is 3+3?", "answer": "6"},
            {"prompt": "What is 4+4?", "answer": "8"}, {"prompt": "What is 5+5?", "answer": "10"}]


def _write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_jsonl_with_every_row_format(tmp_path):
    assert load_prompts(_write_jsonl(tmp_path / "p.jsonl", [CONVERSATION, EVALUATION, FLAT, VERL])) == EXPECTED


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
    path = _write_jsonl(tmp_path / "bad.jsonl", [FLAT, FLAT, bad_row])
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
    assert all(r["prompt"].strip() and r["answer"].strip() for r in rows)
    if name == "aime2024.json":
        assert rows[0]["answer"] == "73" and "Aimeville" in rows[0]["prompt"]
