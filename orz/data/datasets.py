"""Prompt datasets from JSONL, JSON and Parquet files, as rows `{"prompt": str, "answer": str}`.

Row formats accepted (one file may mix them):
- ORZ conversation: `[{"from": "human", "value": q}, {"from": "assistant", "ground_truth": {"value": a}}]`
- ORZ evaluation:   `{"prompt": [{"from": "user", "value": q}], "final_answer": a}`
- flat:             `{"prompt": q, "answer": a}`
- verl:             `{"prompt": [{"role": "user", "content": q}], "reward_model": {"ground_truth": a}}`

A row that fits none stops loading with a DatasetFormatError naming the file, the row (1-based)
and what is wrong.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any


class DatasetFormatError(ValueError):
    """A row of a prompt file that cannot be read; `path` and `row` (1-based) locate it."""

    def __init__(self, path: str | Path, row: int, problem: str):
        super().__init__(f"{path}, row {row}: {problem}")
        self.path = str(path)
        self.row = row
        self.problem = problem


def load_prompts(path: str | Path) -> list[dict[str, str]]:
    """Reads every row of a .jsonl, .json (a list of rows) or .parquet file."""
    path = Path(path)
    rows = []
    for number, raw in _read_raw_rows(path):
        try:
            rows.append(_to_prompt_row(raw))
        except ValueError as error:
            raise DatasetFormatError(path, number, str(error)) from None
    return rows


def _read_raw_rows(path: Path):
    """Yields (row number, decoded row) pairs."""
    suffix = path.suffix.lower()
    if suffix == ".jsonl":
        with open(path, encoding="utf-8") as f:
            for number, line in enumerate(f, start=1):
                if line.strip():
                    try:
                        yield number, json.loads(line)
                    except json.JSONDecodeError as error:
                        raise DatasetFormatError(path, number, f"invalid JSON: {error}") from None
    elif suffix == ".json":
        with open(path, encoding="utf-8") as f:
            try:
                data = json.load(f)
            except json.JSONDecodeError as error:
                raise DatasetFormatError(path, 1, f"invalid JSON: {error}") from None
        if not isinstance(data, list):
            raise DatasetFormatError(path, 1, f"expected a JSON list of rows, got {type(data).__name__}")
        yield from enumerate(data, start=1)
    elif suffix == ".parquet":
        import pyarrow.parquet as pq

        yield from enumerate(pq.read_table(path).to_pylist(), start=1)
    else:
        raise ValueError(f"{path}: unsupported file type {suffix!r}; use .jsonl, .json or .parquet")


def _to_prompt_row(raw: Any) -> dict[str, str]:
    if isinstance(raw, list):
        return _from_conversation(raw)
    if not isinstance(raw, dict):
        raise ValueError(f"a row must be an object or a conversation list, got {type(raw).__name__}")
    if "prompt" not in raw:
        raise ValueError(f"no 'prompt' field (fields: {sorted(raw)})")
    prompt = raw["prompt"]
    question = prompt if isinstance(prompt, str) else _last_user_message(prompt)
    for key in ("answer", "final_answer"):
        if key in raw:
            return _row(question, raw[key])
    reward_model = raw.get("reward_model")
    if isinstance(reward_model, dict) and reward_model.get("ground_truth") is not None:
        return _row(question, reward_model["ground_truth"])
    raise ValueError(f"no answer: expected 'answer', 'final_answer' or 'reward_model.ground_truth' "
                     f"(fields: {sorted(raw)})")


def _from_conversation(messages: list) -> dict[str, str]:
    question = _last_user_message(messages)
    for message in messages:
        if isinstance(message, dict) and message.get("from") == "assistant" and "ground_truth" in message:
            truth = message["ground_truth"]
            return _row(question, truth.get("value") if isinstance(truth, dict) else None)
    raise ValueError("conversation has no assistant message with 'ground_truth': {'value': ...}")


def _last_user_message(messages: Any) -> str:
    """Text of the last user turn, ORZ style (`from`/`value`) or chat style (`role`/`content`)."""
    if not isinstance(messages, list):
        raise ValueError(f"'prompt' must be a string or a list of messages, got {type(messages).__name__}")
    texts = [
        m.get("value") or m.get("content")  # Parquet fills a struct's missing fields with None
        for m in messages
        if isinstance(m, dict) and (m.get("from") in ("human", "user") or m.get("role") == "user")
    ]
    if not texts:
        raise ValueError("no user message (expected 'from': 'human'/'user' or 'role': 'user')")
    return texts[-1]


def _row(question: Any, answer: Any) -> dict[str, str]:
    if not isinstance(question, str) or not question.strip():
        raise ValueError(f"the question must be a non-empty string, got {question!r:.80}")
    if isinstance(answer, bool) or not isinstance(answer, (str, int, float)) or str(answer).strip() == "":
        raise ValueError(f"the answer must be a non-empty string or a number, got {answer!r:.80}")
    return {"prompt": question, "answer": str(answer)}
