"""Seeded, verifiable synthetic tasks for tests, benchmarks and the CPU demo.

    rows = arithmetic_rows(1000, seed=0, split="train")   # [{"prompt", "answer", "solution"}, ...]
    rows = countdown_rows(1000, seed=0, split="test")      # verifier "countdown": countdown_reward
    rows = code_rows(1000, seed=0, split="train")          # verifier "code": stdout tests

Rows have the datasets' format (prompt, answer) plus `solution`, a worked solution ending in the
chosen answer format, for pre-training. Which split a problem belongs to is a hash of the problem
itself, so train and test never share a problem, whatever the seeds and sizes.
Countdown answers are scored with `countdown_reward` (a custom reward the router registers), not
by mathematical equivalence; code answers run in the sandbox.
"""
from __future__ import annotations

import hashlib
import random
import re
from collections import Counter
from collections.abc import Callable
from fractions import Fraction

from orz.data.answers import extract_answer
from orz.data.templates import RESPONSE_FORMATS

SPLITS = ("train", "test")
TEST_FRACTION = 0.1  # share of all possible problems held out for "test"


def _split_of(problem_key: str) -> str:
    digest = hashlib.blake2b(problem_key.encode(), digest_size=8).digest()
    return "test" if int.from_bytes(digest, "big") < TEST_FRACTION * 2**64 else "train"


def _generate(
    n: int, seed: int, split: str, task: str, make: Callable[[random.Random], tuple[str, dict]]
) -> list[dict]:
    """Draws problems with `make` until n of them fall in `split`."""
    if split not in SPLITS:
        raise ValueError(f"unknown split {split!r}; valid: {list(SPLITS)}")
    rng = random.Random(f"{task}:{seed}:{split}")
    rows: list[dict] = []
    for _ in range(1000 * n + 1000):
        if len(rows) == n:
            return rows
        key, row = make(rng)
        if _split_of(f"{task}:{key}") == split:
            rows.append(row)
    raise RuntimeError(f"could not draw {n} {split} problems for {task}: the problem space is too small")


# --------------------------------------------------------------------------------------------------
# Arithmetic


def arithmetic_rows(
    n: int,
    seed: int,
    split: str = "train",
    *,
    digits: tuple[int, int] = (1, 8),
    ops: str = "+-*",
    answer_format: str = "answer_tag",
) -> list[dict]:
    """`a op b` with operands of digits[0]..digits[1] digits; worked solutions go column by
    column (+, -) or partial product by partial product (*), so longer numbers mean longer
    solutions. answer_format: "answer_tag" (`... </think> <answer>42</answer>`) or "boxed"."""
    respond = RESPONSE_FORMATS[answer_format]
    low, high = digits
    if not 1 <= low <= high or not ops or set(ops) - set("+-*"):
        raise ValueError(f"need 1 <= digits[0] <= digits[1] and ops from '+-*'; got {digits=}, {ops=}")

    def make(rng: random.Random) -> tuple[str, dict]:
        a, b = (_number(rng, rng.randint(low, high)) for _ in range(2))
        op = rng.choice(ops)
        steps, result = _WORKED[op](a, b)
        question = f"What is {a} {op} {b}?"
        return question, {"prompt": question, "answer": str(result), "solution": respond(steps, str(result))}

    return _generate(n, seed, split, "arithmetic", make)


def _number(rng: random.Random, num_digits: int) -> int:
    return rng.randint(10 ** (num_digits - 1) if num_digits > 1 else 0, 10**num_digits - 1)


def _digits(x: int) -> list[int]:
    """Decimal digits, least significant first."""
    return [int(c) for c in reversed(str(x))]


def _worked_sum(a: int, b: int) -> tuple[str, int]:
    lines, carry = [], 0
    da, db = _digits(a), _digits(b)
    for i in range(max(len(da), len(db))):
        x, y = (da[i] if i < len(da) else 0), (db[i] if i < len(db) else 0)
        total = x + y + carry
        lines.append(f"{x}+{y}+{carry}={total}, write {total % 10} carry {total // 10}")
        carry = total // 10
    if carry:
        lines.append(f"write {carry}")
    return "\n".join(lines), a + b


def _worked_difference(a: int, b: int) -> tuple[str, int]:
    if a < b:
        steps, result = _worked_difference(b, a)
        return f"{a}<{b}, so compute {b}-{a} and negate\n{steps}\nnegate: {-result}", -result
    lines, borrow = [], 0
    da, db = _digits(a), _digits(b)
    for i in range(len(da)):
        x, y = da[i], (db[i] if i < len(db) else 0)
        value = x - borrow - y
        new_borrow = int(value < 0)
        lines.append(f"{x}-{borrow}-{y}={value}, write {value + 10 * new_borrow} borrow {new_borrow}")
        borrow = new_borrow
    return "\n".join(lines), a - b


def _worked_product(a: int, b: int) -> tuple[str, int]:
    lines, total = [], 0
    for place, digit in enumerate(_digits(b)):
        partial = a * digit * 10**place
        lines.append(f"{a}*{digit}*{10**place}={partial}")
        if place:
            lines.append(f"{total}+{partial}={total + partial}")
        total += partial
    return "\n".join(lines), a * b


_WORKED = {"+": _worked_sum, "-": _worked_difference, "*": _worked_product}

# --------------------------------------------------------------------------------------------------
# Countdown


def countdown_rows(
    n: int,
    seed: int,
    split: str = "train",
    *,
    count: tuple[int, int] = (3, 4),
    largest: int = 50,
    max_target: int = 999,
    answer_format: str = "answer_tag",
) -> list[dict]:
    """Reach `target` with each of `numbers` (count[0]..count[1] numbers in 1..largest) exactly
    once, using + - * / and parentheses. The answer is one reference expression; any other
    expression that `countdown_verify` accepts is as good."""
    respond = RESPONSE_FORMATS[answer_format]

    def make(rng: random.Random) -> tuple[str, dict]:
        while True:
            numbers = [rng.randint(1, largest) for _ in range(rng.randint(*count))]
            expression, steps, target = _random_expression(rng, numbers)
            if 1 <= target <= max_target:
                break
        listed = ", ".join(map(str, numbers))
        question = (f"Using the numbers {listed}, each exactly once, with + - * / and parentheses, "
                    f"write an expression equal to {target}.")
        row = {"prompt": question, "answer": expression, "solution": respond("\n".join(steps), expression),
               "verifier": "countdown", "extra_info": {"numbers": numbers, "target": target},
               "numbers": numbers, "target": target}
        return f"{sorted(numbers)}->{target}", row

    return _generate(n, seed, split, "countdown", make)


def _random_expression(rng: random.Random, numbers: list[int]) -> tuple[str, list[str], int]:
    """Combines the numbers in a random order with random operations whose intermediate results
    stay positive integers; returns (expression, one step per operation, value)."""
    order = rng.sample(numbers, len(numbers))
    expression, value, steps = str(order[0]), order[0], []
    for x in order[1:]:
        choices = ["+", "*"] + (["-"] if value > x else []) + (["/"] if value % x == 0 else [])
        op = rng.choice(choices)
        new_value = {"+": value + x, "-": value - x, "*": value * x, "/": value // x}[op]
        steps.append(f"{value}{op}{x}={new_value}")
        expression, value = f"({expression}){op}{x}" if len(steps) > 1 else f"{expression}{op}{x}", new_value
    return expression, steps, value


def countdown_reward(response: str, row: dict) -> float:
    """1 when the response's answer (<answer> tag or \\boxed) is a valid countdown expression."""
    expression = extract_answer(response)
    info = row["extra_info"]
    return float(expression is not None and countdown_verify(expression, info["numbers"], info["target"]))


_TOKEN = re.compile(r"\s*(?:(\d+)|([-+*/()]))")
_MAX_EXPRESSION_CHARS = 500


def countdown_verify(expression: str, numbers: list[int], target: int) -> bool:
    """Whether `expression` (optionally `expression = target`) uses exactly `numbers`, each once,
    with + - * / and parentheses, and equals `target` in exact rational arithmetic. Parsed by a
    small recursive-descent parser, never eval; anything else (unary minus, names, division by
    zero, over 500 characters) is False."""
    expression = expression.strip()
    if "=" in expression:
        expression, _, right = expression.partition("=")
        if right.strip() != str(target):
            return False
    if len(expression) > _MAX_EXPRESSION_CHARS:
        return False
    try:
        value, used = _Parser(expression).parse()
    except (ValueError, ZeroDivisionError):
        return False
    return value == target and Counter(used) == Counter(numbers)


class _Parser:
    """expr := term (('+'|'-') term)*;  term := atom (('*'|'/') atom)*;  atom := int | '(' expr ')'"""

    def __init__(self, text: str):
        self.tokens: list[str] = []
        position = 0
        while position < len(text):
            match = _TOKEN.match(text, position)
            if match is None:
                if text[position:].strip():
                    raise ValueError(f"unexpected {text[position]!r}")
                break
            self.tokens.append(match.group(1) or match.group(2))
            position = match.end()
        self.position = 0
        self.used: list[int] = []

    def parse(self) -> tuple[Fraction, list[int]]:
        value = self._expr(depth=0)
        if self.position != len(self.tokens):
            raise ValueError("trailing tokens")
        return value, self.used

    def _peek(self) -> str | None:
        return self.tokens[self.position] if self.position < len(self.tokens) else None

    def _take(self) -> str:
        token = self._peek()
        if token is None:
            raise ValueError("unexpected end")
        self.position += 1
        return token

    def _expr(self, depth: int) -> Fraction:
        value = self._term(depth)
        while self._peek() in ("+", "-"):
            value = value + self._term(depth) if self._take() == "+" else value - self._term(depth)
        return value

    def _term(self, depth: int) -> Fraction:
        value = self._atom(depth)
        while self._peek() in ("*", "/"):
            value = value * self._atom(depth) if self._take() == "*" else value / self._atom(depth)
        return value

    def _atom(self, depth: int) -> Fraction:
        if depth > 50:
            raise ValueError("too deeply nested")
        token = self._take()
        if token == "(":
            value = self._expr(depth + 1)
            if self._take() != ")":
                raise ValueError("unbalanced parentheses")
            return value
        if not token.isdigit():
            raise ValueError(f"expected a number, got {token!r}")
        self.used.append(int(token))
        return Fraction(int(token))


# --------------------------------------------------------------------------------------------------
# Code


def code_rows(n: int, seed: int, split: str = "train", *, digits: tuple[int, int] = (1, 2),
              ops: str = "+-*") -> list[dict]:
    """Write a Python program that prints the value of `a op b op c`; judged by its stdout in the
    sandbox. The solution is a fenced `print(...)` block, for pre-training."""
    low, high = digits
    if not 1 <= low <= high or not ops or set(ops) - set("+-*"):
        raise ValueError(f"need 1 <= digits[0] <= digits[1] and ops from '+-*'; got {digits=}, {ops=}")

    def make(rng: random.Random) -> tuple[str, dict]:
        a, b, c = (_number(rng, rng.randint(low, high)) for _ in range(3))
        expression = f"{a} {rng.choice(ops)} {b} {rng.choice(ops)} {c}"
        value = str(_Parser(expression).parse()[0])
        question = f"Write a Python program that prints the value of {expression}."
        return expression, {"prompt": question, "verifier": "code", "answer": value,
                            "tests": {"inputs": [""], "outputs": [value]},
                            "solution": f" ```python\nprint({expression})\n```"}

    return _generate(n, seed, split, "code", make)
