"""Benchmark files and how a response to each kind of problem is read.

    bench = load_benchmark("gpqa", "gpqa_diamond.jsonl")      # kind detected from the first row
    bench = benchmark_from_rows("arith", rows)                # rows in memory (the trainer's eval sets)
    bench.kind, bench.problems[0].question, bench.problems[0].answer

Three kinds, told apart by the first row's fields (a file holds one kind; .jsonl, .json or .parquet):
- math: every row format orz.data.datasets reads (ORZ evaluation `{"prompt": [{"from": "user",
  "value": q}], "final_answer": a}`, flat `{"prompt": q, "answer": a}`, ORZ conversation, verl).
  Verdict: math-verify equivalence of the extracted answer (MathReward).
- multiple_choice (GPQA, MMLU style): `{"question": q, "choices": [...], "answer": "C" or 2}`, or
  GPQA's own columns `Question`, `Correct Answer`, `Incorrect Answer 1..3` (the choices are then
  shuffled with a seed drawn from the question text, so every run and every user sees one order).
  Verdict: the extracted letter equals the right one.
- code (LiveCodeBench, APPS/TACO style): a question (`question`, `question_content` or `prompt`),
  optional `starter_code`, and tests as `tests: {"inputs", "outputs", "fn_name"}`, an APPS
  `input_output` JSON string of the same, or LiveCodeBench's `public_test_cases` and
  `private_test_cases` (+ `metadata.func_name` for functional tests). Verdict: every test passes
  in the sandbox (CodeReward, "all_pass").
A row that does not fit its kind stops loading with a DatasetFormatError naming the file, the row
(1-based) and what is wrong.
"""
from __future__ import annotations

import base64
import io
import json
import pickle
import random
import re
import zlib
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from orz.data.datasets import DatasetFormatError, _read_raw_rows, _to_prompt_row
from orz.evaluation.metrics import cluster_answers
from orz.reward.code import CodeTests
from orz.reward.math import extract_answer, is_equivalent

Kind = Literal["math", "multiple_choice", "code"]
KINDS: tuple[Kind, ...] = ("math", "multiple_choice", "code")
LETTERS = "ABCDEFGHIJ"
_CODE_FIELDS = ("tests", "input_output", "public_test_cases")


@dataclass(frozen=True)
class Problem:
    question: str  # what the template wraps: the problem text, with its choices or starter code
    answer: str  # math: the ground truth; multiple_choice: the right letter; code: "" (tests decide)
    row: int  # 1-based row of its file, to find it again
    choices: tuple[str, ...] = ()  # multiple_choice only, in the order shown (A, B, ...)
    tests: CodeTests | None = None  # code only


@dataclass(frozen=True)
class Benchmark:
    name: str  # the column in the report: "aime24", "gpqa_diamond", ...
    path: str
    kind: Kind
    problems: tuple[Problem, ...]


def load_benchmark(name: str, path: str | Path, kind: Kind | None = None) -> Benchmark:
    """Reads every problem of a benchmark file; `kind` None detects it from the first row."""
    return _parse(name, str(path), list(_read_raw_rows(Path(path))), kind)


def benchmark_from_rows(name: str, rows: Sequence[Any], kind: Kind | None = None) -> Benchmark:
    """A benchmark from rows already in memory, in the formats a file may hold (the trainer's
    held-out sets, synthetic ones included: `{"prompt": q, "answer": a}`)."""
    return _parse(name, f"<{name} rows>", list(enumerate(rows, start=1)), kind)


def _parse(name: str, source: str, rows: list[tuple[int, Any]], kind: Kind | None) -> Benchmark:
    if kind is not None and kind not in KINDS:
        raise ValueError(f"unknown benchmark kind {kind!r}; valid: {list(KINDS)}")
    if not rows:
        raise ValueError(f"{source}: holds no problems")
    kind = kind or detect_kind(rows[0][1])
    parse = _PARSERS[kind]
    problems = []
    for number, raw in rows:
        try:
            problems.append(parse(raw, number))
        except (ValueError, TypeError, KeyError) as error:
            raise DatasetFormatError(source, number, f"{kind} problem: {_reason(error)}") from None
    return Benchmark(name, source, kind, tuple(problems))


def _reason(error: Exception) -> str:
    return f"missing field {error}" if isinstance(error, KeyError) else str(error)


def detect_kind(raw: Any) -> Kind:
    if isinstance(raw, dict):
        if "choices" in raw or "Correct Answer" in raw:
            return "multiple_choice"
        if any(field in raw for field in _CODE_FIELDS):
            return "code"
    return "math"


# ---- math ------------------------------------------------------------------------------------


def _math(raw: Any, row: int) -> Problem:
    parsed = _to_prompt_row(raw)
    return Problem(parsed["prompt"], parsed["answer"], row)


def cluster_math_answers(answers: tuple[str | None, ...]) -> list[int | None]:
    """Clusters of one problem's extracted answers under math-verify equivalence (a pool worker
    function: module level, plain data in and out)."""
    return cluster_answers(answers, is_equivalent)


# ---- multiple choice -------------------------------------------------------------------------

MULTIPLE_CHOICE_INSTRUCTION = "Answer with the letter of the correct choice."


def _multiple_choice(raw: Any, row: int) -> Problem:
    if not isinstance(raw, dict):
        raise ValueError(f"a row must be an object, got {type(raw).__name__}")
    if "Correct Answer" in raw:  # GPQA's columns: the right answer first, so shuffle
        question = raw["Question"]
        correct = _text(raw["Correct Answer"], "'Correct Answer'")
        wrong = [_text(raw[f"Incorrect Answer {i}"], f"'Incorrect Answer {i}'") for i in (1, 2, 3)]
        choices = [correct, *wrong]
        random.Random(str(question)).shuffle(choices)
        letter = LETTERS[choices.index(correct)]
    else:
        question = raw.get("question", raw.get("prompt"))
        choices = raw["choices"]
        if not isinstance(choices, list) or not 2 <= len(choices) <= len(LETTERS):
            raise ValueError(f"'choices' must be a list of 2 to {len(LETTERS)} options, got {choices!r:.80}")
        choices = [_text(c, f"choice {LETTERS[i]}") for i, c in enumerate(choices)]
        if "answer" not in raw:
            raise ValueError(f"no answer: expected 'answer', a letter A-{LETTERS[len(choices) - 1]} or a "
                             f"0-based index (fields: {sorted(raw)})")
        letter = _answer_letter(raw["answer"], len(choices))
    question = _text(question, "the question ('question' or 'prompt')")
    options = "\n".join(f"{LETTERS[i]}) {choice}" for i, choice in enumerate(choices))
    return Problem(f"{question}\n\n{options}\n\n{MULTIPLE_CHOICE_INSTRUCTION}", letter, row, choices=tuple(choices))


def _text(value: Any, what: str) -> str:
    if isinstance(value, bool) or not isinstance(value, (str, int, float)) or not str(value).strip():
        raise ValueError(f"{what} must be a non-empty string, got {value!r:.80}")
    return str(value).strip()


def _answer_letter(answer: Any, num_choices: int) -> str:
    valid = LETTERS[:num_choices]
    if isinstance(answer, int) and not isinstance(answer, bool) and 0 <= answer < num_choices:
        return LETTERS[answer]
    if isinstance(answer, str) and len(answer.strip()) == 1 and answer.strip().upper() in valid:
        return answer.strip().upper()
    raise ValueError(f"'answer' must be a letter A-{valid[-1]} or an index 0-{num_choices - 1}, got {answer!r:.80}")


# \text{C}, (C), C), C., "C: blah", "(C) blah"
_LETTER = re.compile(r"^\s*(?:\\(?:text|textbf|mathrm)\{\s*)?\(?\s*([A-J])\s*(?:\)|\}|\.|:|\s|$)")


def extract_choice(text: str, num_choices: int, extraction: Sequence[str]) -> str | None:
    """The letter a response answers with: the first of `extraction`'s answer forms (as for math),
    then "the answer is (C)"; None when it names no valid letter."""
    answer = extract_answer(text, (*extraction, "answer_is"))
    match = _LETTER.match(answer) if answer is not None else None
    letter = match.group(1) if match else None
    return letter if letter is not None and letter in LETTERS[:num_choices] else None


# ---- code ------------------------------------------------------------------------------------

STDIN_INSTRUCTION = ("Write a Python 3 program that reads the input from standard input and writes the answer to "
                     "standard output.")
STARTER_INSTRUCTION = "Complete this starter code, keeping its function names and signatures:"
CODE_INSTRUCTION = "Give the complete solution in one ```python code block."


def _code(raw: Any, row: int) -> Problem:
    if not isinstance(raw, dict):
        raise ValueError(f"a row must be an object, got {type(raw).__name__}")
    question = next((raw[f] for f in ("question", "question_content", "prompt") if f in raw), None)
    question = _text(question, "the question ('question', 'question_content' or 'prompt')")
    tests = _code_tests(raw)
    starter = raw.get("starter_code") or ""
    if starter.strip():
        how = f"{STARTER_INSTRUCTION}\n```python\n{starter.rstrip()}\n```"
    else:
        how = STDIN_INSTRUCTION
    return Problem(f"{question}\n\n{how}\n{CODE_INSTRUCTION}", "", row, tests=tests)


def _code_tests(raw: dict) -> CodeTests:
    if "tests" in raw or "input_output" in raw:
        tests = raw["tests"] if "tests" in raw else raw["input_output"]
        tests = json.loads(tests) if isinstance(tests, str) else tests
        if not isinstance(tests, dict) or "inputs" not in tests or "outputs" not in tests:
            raise ValueError(f"tests must be an object with 'inputs' and 'outputs', got {tests!r:.80}")
        return CodeTests(list(tests["inputs"]), list(tests["outputs"]), tests.get("fn_name"))
    cases = _lcb_cases(raw["public_test_cases"], "public_test_cases")
    if raw.get("private_test_cases"):
        cases += _lcb_cases(raw["private_test_cases"], "private_test_cases")
    metadata = raw.get("metadata") or {}
    metadata = json.loads(metadata) if isinstance(metadata, str) else metadata
    functional = [c.get("testtype") == "functional" for c in cases]
    if any(functional) != all(functional):
        raise ValueError("mixes stdin and functional test cases")
    if not all(functional):
        return CodeTests([c["input"] for c in cases], [c["output"] for c in cases])
    fn_name = metadata.get("func_name")
    if not fn_name:
        raise ValueError("functional test cases need 'metadata': {'func_name': ...}")
    # LiveCodeBench writes a call's arguments one JSON value per line.
    inputs = [[json.loads(line) for line in c["input"].splitlines() if line.strip()] for c in cases]
    return CodeTests(inputs, [json.loads(c["output"]) for c in cases], fn_name)


def _lcb_cases(value: Any, field: str) -> list[dict]:
    """A LiveCodeBench test-case list: JSON text, a list, or (newer private tests) base64 of
    zlib of a pickled JSON string, unpickled here with every class refused, so a crafted file
    cannot run code."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError:
            try:
                value = json.loads(_StringsOnly(io.BytesIO(zlib.decompress(base64.b64decode(value)))).load())
            except Exception as error:  # any decoding failure means the same thing to the user
                raise ValueError(f"'{field}' is neither JSON nor LiveCodeBench's compressed form ({error})") from None
    if not isinstance(value, list) or not value or not all(isinstance(c, dict) and {"input", "output"} <= c.keys()
                                                           for c in value):
        raise ValueError(f"'{field}' must be a non-empty list of {{'input', 'output', 'testtype'}}, "
                         f"got {value!r:.80}")
    return list(value)


class _StringsOnly(pickle.Unpickler):
    def find_class(self, module, name):
        raise pickle.UnpicklingError(f"refusing to load {module}.{name}")


_PARSERS = {"math": _math, "multiple_choice": _multiple_choice, "code": _code}

