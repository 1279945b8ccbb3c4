"""Prompt rows from JSONL, JSON and Parquet files: each row says how its responses are verified.

    rows = load_rows("skywork_or1.parquet")        # [Row(prompt, verifier, answers | tests | choices, ...)]
    rows = load_source("synthetic:code", split="test", size=200, seed=0)
    run = RunData(seed=0)                          # a run's data sections, each source read once
    train, eval_sets = run.train(cfg.data), run.eval_sets(cfg.data)

Row formats accepted (one file may mix them, and so may a run's data.train across files):
- ORZ conversation: `[{"from": "human", "value": q}, {"from": "assistant", "ground_truth": {"value": a}}]`
- ORZ evaluation:   `{"prompt": [{"from": "user", "value": q}], "final_answer": a}`
- flat:             `{"prompt": q, "answer": a}`, optionally `"verifier": name` (a custom reward's
  name, or math / code / multiple_choice), `"data_source"` and `"env"` (its environment's name)
- verl / Skywork-OR1: `{"data_source", "prompt": [{"role": "user", "content": q}],
  "reward_model": {"style", "ground_truth"}, "extra_info", "ability"}`. The ground truth is a
  list of acceptable math answers (often the string of a Python list, `"['3']"`), or code tests
  as a dict or its JSON string in one of three forms: `inputs`/`outputs` (+ `fn_name`, call-based),
  `import_prefix` + `test_code` + `entry_point` (a `check(fn)` harness), or `assert_case`.
- multiple choice: `{"question", "choices": [...], "answer": "C" or 2}`, or GPQA's own columns
  `Question`, `Correct Answer`, `Incorrect Answer 1..3` (shuffled with a seed drawn from the question).
- code (LiveCodeBench, APPS/TACO): a question (`question`, `question_content` or `prompt`), optional
  `starter_code`, and tests as `tests: {"inputs", "outputs", "fn_name"}`, an APPS `input_output`
  JSON string, or LiveCodeBench's `public_test_cases` / `private_test_cases` (+ `metadata.func_name`).

A row that fits none stops loading with a DatasetFormatError naming the file, the row (1-based)
and what is wrong.
"""
from __future__ import annotations

import ast
import base64
import io
import json
import pickle
import random
import zlib
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from orz.config import ConfigError, DataConfig

BUILTIN_VERIFIERS = ("math", "code", "multiple_choice")
LETTERS = "ABCDEFGHIJ"
MULTIPLE_CHOICE_INSTRUCTION = "Answer with the letter of the correct choice."
STDIN_INSTRUCTION = ("Write a Python 3 program that reads the input from standard input and writes the answer to "
                     "standard output.")
STARTER_INSTRUCTION = "Complete this starter code, keeping its function names and signatures:"
CODE_INSTRUCTION = "Give the complete solution in one ```python code block."
# Run before the solution of an `assert_case` test, as the judges of LeetCode-style data do.
COMMON_IMPORTS = ("from typing import *\nfrom collections import *\nfrom functools import *\n"
                  "from itertools import *\nfrom heapq import *\nfrom bisect import *\nimport math\n"
                  "inf = float('inf')\n")
_LCB_TESTS = ("tests", "input_output", "public_test_cases")
_CODE_TRUTH_KEYS = ("inputs", "import_prefix", "assert_case")


class DatasetFormatError(ValueError):
    """A row of a prompt file that cannot be read; `path` and `row` (1-based) locate it."""

    def __init__(self, path: str | Path, row: int, problem: str):
        super().__init__(f"{path}, row {row}: {problem}")
        self.path = str(path)
        self.row = row
        self.problem = problem


@dataclass(frozen=True)
class CodeTests:
    """The tests of one code problem, in one of three modes:
    - stdin/stdout (`fn_name` None, no checks): inputs[i] is stdin, outputs[i] the expected stdout;
    - call-based (`fn_name`): inputs[i] the positional arguments, outputs[i] the return value;
    - checks: each of `checks` is code run after `prefix` + the solution; it passes if it exits 0."""

    inputs: list[Any]
    outputs: list[Any]
    fn_name: str | None = None
    checks: tuple[str, ...] = ()
    prefix: str = ""
    wrapped_returns: bool = False  # call-based: outputs[i] may be [value] for value (APPS, TACO)

    def __post_init__(self):
        if self.checks and (self.inputs or self.outputs):
            raise ValueError("tests are either checks or input/output pairs, not both")
        if not self.checks and (len(self.inputs) != len(self.outputs) or not self.inputs):
            raise ValueError(f"need as many outputs as inputs, at least one; got "
                             f"{len(self.inputs)} inputs, {len(self.outputs)} outputs")

    @property
    def mode(self) -> str:
        return "check" if self.checks else "call" if self.fn_name else "stdio"

    def __len__(self) -> int:
        return len(self.checks) or len(self.inputs)


@dataclass(frozen=True)
class Row:
    """One prompt and what its verifier needs; `source` and `number` (1-based) locate it."""

    prompt: str  # the question the template wraps, with its choices or code instructions
    verifier: str  # "math", "code", "multiple_choice" or the name of a custom reward
    answers: tuple[str, ...] = ()  # math: every acceptable answer; multiple_choice: the letter
    tests: CodeTests | None = None  # code
    choices: tuple[str, ...] = ()  # multiple_choice, in the order shown (A, B, ...)
    data_source: str = ""  # per-source metrics; verl's compute_score reads it
    ground_truth: Any = None  # as the file gives it, for custom rewards
    extra_info: Any = None
    env: str = ""  # its environment (multi-turn rollout, orz.rollout.envs); "": rollout.env's
    source: str = field(default="", compare=False)  # where it was read: not part of what the row is
    number: int = field(default=0, compare=False)

    @property
    def answer(self) -> str:
        return self.answers[0] if self.answers else ""

    def record(self) -> dict[str, Any]:
        """The row as plain JSON-able data: what a custom reward function or endpoint receives."""
        record = asdict(self)
        record["answers"] = list(self.answers)
        return record


def load_rows(path: str | Path) -> list[Row]:
    """Every row of a .jsonl, .json (a list of rows) or .parquet file."""
    return parse_rows(str(path), _read_raw_rows(Path(path)))


def parse_rows(source: str, numbered: Iterator[tuple[int, Any]] | list[tuple[int, Any]]) -> list[Row]:
    """Rows from (1-based number, decoded row) pairs; `source` names them in errors."""
    rows = []
    for number, raw in numbered:
        try:
            rows.append(_parse(raw, source, number))
        except (ValueError, TypeError, KeyError) as error:
            reason = f"missing field {error}" if isinstance(error, KeyError) else str(error)
            raise DatasetFormatError(source, number, reason) from None
    if not rows:
        raise ValueError(f"{source}: holds no rows")
    return rows


def load_source(spec: str, *, split: str, size: int, seed: int, digits: tuple[int, int] = (1, 8),
                ops: str = "+-*") -> list[Row]:
    """A data file, or a seeded synthetic task (train and test never overlap):
    `synthetic:arithmetic` (math), `synthetic:countdown` (verifier "countdown"), `synthetic:code`."""
    from orz.data import synthetic

    makers = {
        "synthetic:arithmetic": lambda: synthetic.arithmetic_rows(size, seed, split, digits=digits, ops=ops),
        "synthetic:countdown": lambda: synthetic.countdown_rows(size, seed, split),
        "synthetic:code": lambda: synthetic.code_rows(size, seed, split, digits=digits, ops=ops),
    }
    if spec.startswith("synthetic:"):
        if spec not in makers:
            raise ValueError(f"unknown synthetic task {spec!r}; valid: {sorted(makers)}")
        return parse_rows(spec, enumerate(({"data_source": spec, **row} for row in makers[spec]()), start=1))
    return load_rows(spec)


class RunData:
    """The rows a run's `data` sections name, each file or synthetic task read once for the whole
    run: its check before start-up, every stage and the evaluation share what was read."""

    def __init__(self, seed: int):
        self.seed = seed
        self._read: dict[tuple, list[Row]] = {}

    def train(self, data: DataConfig) -> list[Row]:
        """Every `data.train` source's rows, in order."""
        if not data.train:
            raise ConfigError("data.train is empty: give data files or a synthetic task ('synthetic:arithmetic')")
        return [row for i, spec in enumerate(data.train)
                for row in self._source(data, spec, "train", f"data.train[{i}]")]

    def eval_sets(self, data: DataConfig) -> dict[str, list[Row]]:
        """`data.eval`'s sets by name (a synthetic task's test split never overlaps its train split)."""
        return {name: self._source(data, spec, "test", f"data.eval.{name}") for name, spec in data.eval.items()}

    def _source(self, data: DataConfig, spec: str, split: str, setting: str) -> list[Row]:
        """`setting` (the key that names the source) names it in the error when it cannot be read."""
        size = data.synthetic_train_size if split == "train" else data.synthetic_eval_size
        key = (spec, split, size, tuple(data.synthetic_digits), data.synthetic_ops)
        if key not in self._read:
            try:
                self._read[key] = load_source(spec, split=split, size=size, seed=self.seed,
                                              digits=tuple(data.synthetic_digits), ops=data.synthetic_ops)
            except OSError as err:
                raise ConfigError(f"{setting}={spec}: cannot read it ({err.strerror or err})") from None
            except DatasetFormatError:  # names its file and row
                raise
            except ValueError as err:  # an empty file, an unknown synthetic task or format
                raise ConfigError(f"{setting}={spec}: {err}") from None
        return self._read[key]


def _read_raw_rows(path: Path) -> Iterator[tuple[int, Any]]:
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


# ---- which verifier, and what it needs ------------------------------------------------------


def _parse(raw: Any, source: str, number: int) -> Row:
    where = {"source": source, "number": number}
    if isinstance(raw, list):
        return Row(_last_user_message(raw), "math", _conversation_answers(raw), **where)
    if not isinstance(raw, dict):
        raise ValueError(f"a row must be an object or a conversation list, got {type(raw).__name__}")
    env = raw.get("env") or ""
    if not isinstance(env, str):
        raise ValueError(f"'env' must be an environment's name, got {env!r:.80}")
    common = {**where, "data_source": str(raw.get("data_source") or ""), "extra_info": raw.get("extra_info"), "env": env}
    verifier = raw.get("verifier")
    if verifier is not None and (not isinstance(verifier, str) or not verifier.strip()):
        raise ValueError(f"'verifier' must be a name, got {verifier!r:.80}")
    if verifier == "multiple_choice" or (verifier is None and ("choices" in raw or "Correct Answer" in raw)):
        return _multiple_choice(raw, common)
    if verifier == "code" or (verifier is None and any(f in raw for f in _LCB_TESTS)):
        return _code(raw, common)
    reward_model = raw.get("reward_model")
    truth = reward_model.get("ground_truth") if isinstance(reward_model, dict) else None
    if truth is None:
        truth = next((raw[k] for k in ("answer", "final_answer", "ground_truth") if raw.get(k) is not None), None)
    question = _question(raw)
    if verifier not in (None, "math"):  # a custom reward: it reads the ground truth as it is
        answers = tuple(str(a) for a in (truth if isinstance(truth, list) else [truth]) if a is not None)
        return Row(question, verifier, answers, ground_truth=truth, **common)
    if truth is None:
        raise ValueError(f"no answer: expected 'answer', 'final_answer' or 'reward_model.ground_truth' "
                         f"(fields: {sorted(raw)})")
    decoded = _json_object(truth)
    if raw.get("ability") == "code" or (isinstance(decoded, dict) and any(k in decoded for k in _CODE_TRUTH_KEYS)):
        if verifier == "math":
            raise ValueError("'verifier' is math but the ground truth holds code tests")
        return Row(question, "code", tests=_tests_from_truth(decoded), ground_truth=truth, **common)
    return Row(question, "math", _math_answers(truth), ground_truth=truth, **common)


def _question(raw: dict) -> str:
    if "prompt" not in raw:
        raise ValueError(f"no 'prompt' field (fields: {sorted(raw)})")
    prompt = raw["prompt"]
    return _text(prompt if isinstance(prompt, str) else _last_user_message(prompt), "the question")


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
    return _text(texts[-1], "the question")


def _conversation_answers(messages: list) -> tuple[str, ...]:
    for message in messages:
        if isinstance(message, dict) and message.get("from") == "assistant" and "ground_truth" in message:
            truth = message["ground_truth"]
            return _math_answers(truth.get("value") if isinstance(truth, dict) else None)
    raise ValueError("conversation has no assistant message with 'ground_truth': {'value': ...}")


def _text(value: Any, what: str) -> str:
    if isinstance(value, bool) or not isinstance(value, (str, int, float)) or not str(value).strip():
        raise ValueError(f"{what} must be a non-empty string, got {value!r:.80}")
    return str(value)


def _math_answers(truth: Any) -> tuple[str, ...]:
    """Acceptable answers: a list, the string of a Python list of strings (`"['3', '\\\\frac{6}{2}']"`,
    as Skywork-OR1 stores them), or one answer. `"[0, 1]"` stays one answer (an interval)."""
    if isinstance(truth, str) and truth.strip().startswith("["):
        try:
            listed = ast.literal_eval(truth.strip())
        except (ValueError, SyntaxError, MemoryError, RecursionError):
            listed = None
        if isinstance(listed, list) and listed and all(isinstance(a, str) for a in listed):
            truth = listed
    answers = truth if isinstance(truth, (list, tuple)) else [truth]
    if not answers:
        raise ValueError("the answer list is empty")
    return tuple(_text(a, "the answer") for a in answers)


def _json_object(value: Any) -> Any:
    """A dict given as itself or as JSON text; anything else unchanged."""
    if isinstance(value, str) and value.lstrip().startswith("{"):
        try:
            return json.loads(value)
        except json.JSONDecodeError:
            return value
    return value


# ---- code -----------------------------------------------------------------------------------


def _tests_from_truth(truth: Any) -> CodeTests:
    """Skywork-OR1's three test forms (see the module docstring)."""
    if not isinstance(truth, dict):
        raise ValueError(f"code tests must be an object (or its JSON string), got {truth!r:.80}")
    if "import_prefix" in truth or "test_code" in truth:
        for key in ("test_code", "entry_point"):
            if not truth.get(key):
                raise ValueError(f"code tests with 'import_prefix' need '{key}'")
        checks = _split_check(str(truth["test_code"]), str(truth["entry_point"]))
        return CodeTests([], [], checks=checks, prefix=str(truth.get("import_prefix") or ""))
    if "assert_case" in truth:
        asserts = truth["assert_case"]
        if not isinstance(asserts, list) or not asserts:
            raise ValueError(f"'assert_case' must be a non-empty list of assert lines, got {asserts!r:.80}")
        return CodeTests([], [], checks=tuple(map(str, asserts)), prefix=COMMON_IMPORTS)
    if "inputs" not in truth or "outputs" not in truth:
        raise ValueError(f"code tests need 'inputs' and 'outputs', 'import_prefix' + 'test_code', or 'assert_case'"
                         f" (fields: {sorted(truth)})")
    fn_name = truth.get("fn_name") or None
    inputs, outputs = list(truth["inputs"]), list(truth["outputs"])
    if fn_name is None:  # APPS sometimes gives a case's stdin or stdout as a list of lines
        inputs, outputs = [_lines(x) for x in inputs], [_lines(x) for x in outputs]
    # APPS, TACO and Skywork-OR1 wrap a call's expected value in a one-element list.
    return CodeTests(inputs, outputs, fn_name, wrapped_returns=fn_name is not None)


def _lines(text: Any) -> str:
    return "\n".join(map(str, text)) if isinstance(text, list) else str(text)


def _split_check(test_code: str, entry_point: str) -> tuple[str, ...]:
    """One check per statement of `def check(candidate)`, each with the code around it (helpers,
    constants), then `check(entry_point)`: a test case per process, as Skywork-OR1 runs them, but
    split by the syntax tree, so statements over several lines stay whole."""
    try:
        tree = ast.parse(test_code)
    except SyntaxError as error:
        raise ValueError(f"'test_code' is not valid Python: {error}") from None
    check = next((n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "check"), None)
    if check is None or not check.body:
        raise ValueError("'test_code' has no 'def check(candidate)' with test cases in it")
    around = [n for n in tree.body if n is not check]
    checks = []
    for statement in check.body:
        one = ast.FunctionDef(**{**{f: getattr(check, f) for f in check._fields}, "body": [statement]})
        module = ast.fix_missing_locations(ast.Module(body=[*around, one], type_ignores=[]))
        checks.append(f"{ast.unparse(module)}\ncheck({entry_point})\n")
    return tuple(checks)


def _code(raw: dict, common: dict) -> Row:
    """A code row. LiveCodeBench, APPS and TACO rows ship a bare problem statement, which gets the
    instructions to answer in code; a verl row, or one that names its verifier, has its own prompt."""
    truth = raw["reward_model"].get("ground_truth") if isinstance(raw.get("reward_model"), dict) else None
    if truth is not None:
        tests = _tests_from_truth(_json_object(truth))
    elif "tests" in raw or "input_output" in raw:
        truth = raw["tests"] if "tests" in raw else raw["input_output"]
        tests = _tests_from_truth(_json_object(truth))
    elif "public_test_cases" in raw:
        tests = _livecodebench_tests(raw)
    else:
        raise ValueError(f"a code row needs tests: 'tests', 'input_output', 'public_test_cases' or "
                         f"'reward_model.ground_truth' (fields: {sorted(raw)})")
    if "reward_model" in raw or ("verifier" in raw and "prompt" in raw):
        return Row(_question(raw), "code", tests=tests, ground_truth=truth, **common)
    question = next((raw[f] for f in ("question", "question_content", "prompt") if f in raw), None)
    question = _text(question, "the question ('question', 'question_content' or 'prompt')")
    starter = raw.get("starter_code") or ""
    how = f"{STARTER_INSTRUCTION}\n```python\n{starter.rstrip()}\n```" if starter.strip() else STDIN_INSTRUCTION
    return Row(f"{question}\n\n{how}\n{CODE_INSTRUCTION}", "code", tests=tests, ground_truth=truth, **common)


def _livecodebench_tests(raw: dict) -> CodeTests:
    cases = _lcb_cases(raw["public_test_cases"], "public_test_cases")
    if raw.get("private_test_cases"):
        cases += _lcb_cases(raw["private_test_cases"], "private_test_cases")
    metadata = _json_object(raw.get("metadata") or {})
    functional = [c.get("testtype") == "functional" for c in cases]
    if any(functional) != all(functional):
        raise ValueError("mixes stdin and functional test cases")
    if not all(functional):
        return CodeTests([c["input"] for c in cases], [c["output"] for c in cases])
    fn_name = metadata.get("func_name") if isinstance(metadata, dict) else None
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


# ---- multiple choice ------------------------------------------------------------------------


def _multiple_choice(raw: dict, common: dict) -> Row:
    if "Correct Answer" in raw:  # GPQA's columns: the right answer first, so shuffle
        question = raw["Question"]
        correct = _text(raw["Correct Answer"], "'Correct Answer'").strip()
        wrong = [_text(raw[f"Incorrect Answer {i}"], f"'Incorrect Answer {i}'").strip() for i in (1, 2, 3)]
        choices = [correct, *wrong]
        random.Random(str(question)).shuffle(choices)
        letter = LETTERS[choices.index(correct)]
    else:
        question = raw.get("question", raw.get("prompt"))
        choices = raw.get("choices")
        if not isinstance(choices, list) or not 2 <= len(choices) <= len(LETTERS):
            raise ValueError(f"'choices' must be a list of 2 to {len(LETTERS)} options, got {choices!r:.80}")
        choices = [_text(c, f"choice {LETTERS[i]}").strip() for i, c in enumerate(choices)]
        if "answer" not in raw:
            raise ValueError(f"no answer: expected 'answer', a letter A-{LETTERS[len(choices) - 1]} or a "
                             f"0-based index (fields: {sorted(raw)})")
        letter = _answer_letter(raw["answer"], len(choices))
    question = _text(question, "the question ('question' or 'prompt')").strip()
    options = "\n".join(f"{LETTERS[i]}) {choice}" for i, choice in enumerate(choices))
    return Row(f"{question}\n\n{options}\n\n{MULTIPLE_CHOICE_INSTRUCTION}", "multiple_choice", (letter,),
               choices=tuple(choices), **common)


def _answer_letter(answer: Any, num_choices: int) -> str:
    valid = LETTERS[:num_choices]
    if isinstance(answer, int) and not isinstance(answer, bool) and 0 <= answer < num_choices:
        return LETTERS[answer]
    if isinstance(answer, str) and len(answer.strip()) == 1 and answer.strip().upper() in valid:
        return answer.strip().upper()
    raise ValueError(f"'answer' must be a letter A-{valid[-1]} or an index 0-{num_choices - 1}, got {answer!r:.80}")
