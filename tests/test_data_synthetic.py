"""Synthetic tasks: seeded, disjoint splits, correct worked solutions, a safe Countdown verifier."""
import re
import time

import pytest

from orz.data.synthetic import arithmetic_rows, countdown_rows, countdown_verify
from orz.data.answers import extract_answer


def test_same_seed_same_rows_other_seed_other_rows():
    assert arithmetic_rows(50, seed=1) == arithmetic_rows(50, seed=1)
    assert arithmetic_rows(50, seed=1) != arithmetic_rows(50, seed=2)
    assert countdown_rows(20, seed=1) == countdown_rows(20, seed=1)


@pytest.mark.parametrize("make, kwargs", [
    (arithmetic_rows, {}),
    (arithmetic_rows, {"digits": (1, 1)}),  # a space of only 300 problems
    (countdown_rows, {}),
])
def test_held_out_split_never_overlaps_training(make, kwargs):
    train = {r["prompt"] for seed in range(3) for r in make(400, seed=seed, split="train", **kwargs)}
    test = {r["prompt"] for seed in range(3) for r in make(100, seed=seed, split="test", **kwargs)}
    assert train and test and not train & test


@pytest.mark.parametrize("answer_format", ["answer_tag", "boxed"])
def test_arithmetic_answers_are_right_and_solutions_end_with_them(answer_format):
    for row in arithmetic_rows(300, seed=0, answer_format=answer_format):
        a, op, b = re.fullmatch(r"What is (\d+) ([-+*]) (\d+)\?", row["prompt"]).groups()
        assert int(row["answer"]) == {"+": int(a) + int(b), "-": int(a) - int(b), "*": int(a) * int(b)}[op]
        assert extract_answer(row["solution"]) == row["answer"]
        ending = "</answer>" if answer_format == "answer_tag" else "}."
        assert row["solution"].endswith(row["answer"] + ending)


def test_worked_solutions_grow_with_digits():
    lengths = {d: sum(len(r["solution"]) for r in arithmetic_rows(40, 0, digits=(d, d))) for d in (1, 4, 8)}
    assert lengths[1] < lengths[4] < lengths[8]


def test_every_operation_and_both_signs_appear():
    rows = arithmetic_rows(300, seed=0, digits=(1, 3))
    assert {re.search(r" ([-+*]) ", r["prompt"]).group(1) for r in rows} == {"+", "-", "*"}
    assert any(r["answer"].startswith("-") for r in rows)


def test_countdown_reference_answers_verify():
    for row in countdown_rows(200, seed=0):
        assert countdown_verify(row["answer"], row["numbers"], row["target"])
        assert 1 <= row["target"] <= 999 and 3 <= len(row["numbers"]) <= 4
        assert row["solution"].endswith(f"<answer>{row['answer']}</answer>")


@pytest.mark.parametrize("expression, numbers, target, valid", [
    ("(1+2)*3", [1, 2, 3], 9, True),
    ("3*(2+1)", [1, 2, 3], 9, True),
    ("(1+2)*3 = 9", [3, 2, 1], 9, True),
    ("(1+2)*3 = 8", [3, 2, 1], 9, False),
    ("1+2*3", [1, 2, 3], 9, False),  # precedence: 7
    ("(10-4)/(5-3)", [10, 4, 5, 3], 3, True),
    ("7/2*2", [7, 2, 2], 7, True),  # exact rationals
    ("(1+2)*3", [1, 2, 3, 4], 9, False),  # 4 unused
    ("3*3", [3], 9, False),  # 3 used twice
    ("(1+2)*3", [1, 2, 2], 9, False),
    ("-1+10", [1, 10], 9, False),  # no unary minus
    ("4/(2-2)", [4, 2, 2], 1, False),
    ("", [1], 1, False),
    ("(1+2", [1, 2], 3, False),
    ("1+2)", [1, 2], 3, False),
    ("1 2", [1, 2], 12, False),
    ("2**3", [2, 3], 8, False),
    ("__import__('os').system('true')", [1], 1, False),
    ("1.5*2", [1, 5, 2], 3, False),
])
def test_countdown_verify(expression, numbers, target, valid):
    assert countdown_verify(expression, numbers, target) is valid


def test_countdown_verify_is_safe_on_hostile_input():
    start = time.monotonic()
    assert not countdown_verify("(" * 10_000 + "1" + ")" * 10_000, [1], 1)
    assert not countdown_verify("9" * 100_000, [1], 1)
    assert not countdown_verify("1" + "*1" * 300, [1] * 301, 1)  # over 500 characters
    assert time.monotonic() - start < 1.0
