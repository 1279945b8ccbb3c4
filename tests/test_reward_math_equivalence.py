"""is_equivalent against a table of true and false cases, and extract_answer against another."""
import time

import pytest

from orz.data.answers import extract_answer
from orz.reward.math import is_equivalent

# (prediction, ground truth, equivalent?)
EQUIVALENCE = [
    # fractions, decimals
    (r"\frac{1}{2}", "0.5", True), ("0.5", r"\frac{1}{2}", True),
    (r"\dfrac{1}{2}", r"\frac12", True), (r"\tfrac{3}{4}", "0.75", True),
    ("1/2", r"\frac{1}{2}", True), (r"\frac{2}{4}", r"\frac{1}{2}", True),
    ("1.5", r"\frac{3}{2}", True), (r"-\frac{1}{2}", "-0.5", True),
    ("3.0", "3", True), ("0.50", "0.5", True), (r"\frac{1}{3}", "0.33", False),
    (r"\frac{1}{3}", r"\frac{1}{4}", False),
    (r"\frac{1}{2}", "-0.5", False), ("0.5", "5", False), (r"\frac{7}{2}", "3.5", True),
    (r"3\frac{1}{2}", r"\frac{7}{2}", True),
    (r"\frac{\sqrt{3}}{2}", r"\sqrt{3}/2", True), (r"\frac{-1}{2}", r"-\frac{1}{2}", True),
    ("2/3", "0.6667", False), ("0.6666667", r"\frac23", True),
    # integers, signs, separators
    ("73", "73", True), ("073", "73", True), ("-3", "3", False), ("1,000", "1000", True),
    ("1{,}000", "1000", True), ("12,345,678", "12345678", True),
    (r"1\,000", "1000", True), ("1 000", "1000", True), ("10^6", "1000000", True),
    ("2^{10}", "1024", True), (r"1.5\times10^{3}", "1500", True),
    ("1000", "100", False), ("+5", "5", True), ("5", "6", False), ("0", "-0", True),
    (r"1\,234\,567", "1234567", True), (r"10\,000", "10000", True), ("1 2", "12", False),
    # degrees, units, percent, money
    (r"30^\circ", "30", True), (r"30^{\circ}", "30", True), (r"90^\circ", r"\frac{\pi}{2}", False),
    (r"10\text{ cm}", "10", True),
    (r"10 \text{cm}", "10", True), (r"5\ \text{meters}", "5", True), (r"\$5", "5", True),
    (r"\$1,000", "1000", True), (r"5\text{ dollars}", "5", True),
    (r"50\%", "50", True), (r"50\%", "0.5", True), (r"25\%", r"\frac14", True),
    (r"12.5\%", "12.5", True), (r"12.5\%", "0.125", True), ("12.5", r"12.5\%", True),
    (r"12.5\%", "12.6", False), (r"10\%", "20", False),
    (r"100\text{ degrees}", "100", True), (r"3\text{ hours}", "4", False),
    # sets and tuples
    (r"\{1,2\}", r"\{2,1\}", True), (r"\{1, 2, 3\}", r"\{3,2,1\}", True),
    (r"\{1,2\}", r"\{1,3\}", False), ("1,2", "2,1", True), ("1, 2, 3", "3, 2, 1", True),
    ("(1,2)", "(1,2)", True), ("(1,2)", "(2,1)", False), (r"\left(1,2\right)", "(1,2)", True),
    (r"\left( 3, \frac{\pi}{2} \right)", r"\left( 3, \frac{\pi}{2} \right)", True),
    (r"(3,\pi/2)", r"\left( 3, \frac{\pi}{2} \right)", True),
    (r"(3, \frac{\pi}{2})", r"\left( 3, \frac{\pi}{2} \right)", True),
    (r"(3, \pi)", r"\left( 3, \frac{\pi}{2} \right)", False),
    ("(1,2,3)", "(1,2,3)", True), ("(1,2,3)", "(1,2,4)", False),
    ("(0.5, 1)", r"(\frac12, 1)", True),
    # intervals
    ("[1,2)", "[1,2)", True), ("[1,2)", "(1,2]", False), (r"(-\infty, 2]", r"(-\infty,2]", True),
    (r"(-\infty, 2)", r"(-\infty,2]", False),
    (r"[0,\infty)", r"[0, \infty)", True),
    (r"(-\infty,-1)\cup(1,\infty)", r"(-\infty,-1)\cup(1,\infty)", True),
    (r"(1,\infty)\cup(-\infty,-1)", r"(-\infty,-1)\cup(1,\infty)", True),
    ("[-2,3]", "[-2,3]", True), ("[-2,3]", "[-2,4]", False),
    (r"\left[ -2, 3 \right]", "[-2,3]", True), (r"x \in [1,2]", "[1,2]", True),
    # matrices and vectors
    (r"\begin{pmatrix}1\\2\end{pmatrix}", r"\begin{pmatrix}1\\2\end{pmatrix}", True),
    (r"\begin{bmatrix}1\\2\end{bmatrix}", r"\begin{pmatrix}1\\2\end{pmatrix}", True),
    (r"\begin{pmatrix}1&2\\3&4\end{pmatrix}", r"\begin{pmatrix}1&2\\3&4\end{pmatrix}", True),
    (r"\begin{pmatrix}1&2\\3&5\end{pmatrix}", r"\begin{pmatrix}1&2\\3&4\end{pmatrix}", False),
    (r"\begin{pmatrix}\frac12\\0.25\end{pmatrix}", r"\begin{pmatrix}0.5\\\frac14\end{pmatrix}", True),
    (r"\begin{pmatrix}2\\1\end{pmatrix}", r"\begin{pmatrix}1\\2\end{pmatrix}", False),
    # expressions
    ("2x+1", "1+2x", True), ("x^2+2x+1", "(x+1)^2", True), ("x^2-1", "(x-1)(x+1)", True),
    ("2x+1", "2x-1", False), (r"\sqrt{8}", r"2\sqrt{2}", True),
    (r"\sqrt{2}", "2", False), (r"\pi/2", r"\frac{\pi}{2}", True), (r"2\pi", r"\pi", False),
    (r"\frac{\sqrt{2}}{2}", r"\frac{1}{\sqrt{2}}", True), (r"3\sqrt{3}", r"\sqrt{27}", True),
    ("p - q", "p - q", True), ("-q + p", "p - q", True), ("q - p", "p - q", False),
    (r"\sin^2 x + \cos^2 x", "1", True),
    ("1+i", "i+1", True), ("1-i", "1+i", False), (r"\log_2 8", "3", True),
    (r"\binom{5}{2}", "10", True), ("5!", "120", True),
    (r"\infty", r"\infty", True), (r"-\infty", r"\infty", False), ("a+b", "b+a", True),
    ("ab", "ba", True), (r"\frac{x}{2}", "0.5x", True),
    # equations, x=3
    ("x=3", "3", True), ("3", "x=3", True), ("x = 3", "x=3", True), ("x=4", "3", False),
    ("y=2x+1", "y=1+2x", True), ("y=2x+1", "y=2x+2", False),
    (r"x=\frac{1}{2}", "0.5", True), ("k=7", "7", True), ("a=2, b=3", "a=2,b=3", True),
    ("x^2+y^2=1", "y^2+x^2=1", True),
    # spacing and \left/\right
    (r"\frac {1} {2}", "0.5", True), (r"\left(\frac{1}{2}\right)", "0.5", True),
    (r"\left[1,2\right]", "[1,2]", True), (r"\! 5", "5", True), (r"\;5", "5", True),
    (r"\quad 7", "7", True), (r"\displaystyle\frac{1}{2}", "0.5", True), ("  42  ", "42", True),
    # text and multiple choice
    (r"\text{(A)}", "A", True), (r"\textbf{(B)}", "B", True), ("(C)", "C", True), ("A", "B", False),
    (r"\text{Monday}", "Monday", True), (r"\text{Tuesday}", "Monday", False),
    (r"\text{B}", r"\text{(B)}", True), ("D", r"\text{(C)}", False),
    # AIME / MATH500 style integers and answers
    ("236", "236", True), ("45", "45", True), ("045", "45", True), ("204", "236", False),
    (r"\boxed{73}", "73", True), ("73.", "73", True),
    ("p-q", "p - q", True), (r"\frac{14}{3}", r"\frac{14}{3}", True),
    (r"\frac{14}{3}", "4.67", False),
    # inequalities
    ("x>2", "x>2", True), ("x > 2", "2 < x", True), (r"x\ge 2", "x>2", False),
    (r"x \leq 5", "x<=5", True), ("-1<x<1", "(-1,1)", True), ("x>2", r"(2,\infty)", True),
    (r"x\le 3", r"(-\infty,3]", True), ("x<3", r"(-\infty,3]", False),
    # wrong answers of various kinds
    ("7", r"\frac{14}{2}", True), ("8", r"\frac{14}{2}", False),
    (r"\frac{1}{2}", r"\frac{1}{2}x", False), ("x", "y", False),
    (r"2\sqrt{3}", r"3\sqrt{2}", False),
    ("", "5", False), ("abc", "5", False), ("10%", "0.1", True), ("0.1", r"10\%", True),
    (r"\frac{1}{1000}", "0.001", True), ("0.0001", "0.001", False), ("1000000", "1,000,000", True),
    ("999999", "1,000,000", False),
    # more wrong answers: near misses of every kind above
    (r"\frac{3}{2}", "1.4", False), ("2.5", r"\frac{5}{3}", False), (r"\sqrt{3}", "1.73", False),
    ("x+1", "x+2", False), ("(1,2,3)", "(1,2)", False), (r"\{1,2,3\}", r"\{1,2\}", False),
    ("[0,1]", "[0,1)", False), ("y=x", "y=-x", False), ("45", "46", False), ("0", "1", False),
    (r"\pi", "3.14", False), ("3", "3.5", False), ("-5", "5", False), ("2^{10}", "1000", False),
    (r"50\%", "5", False), (r"\frac{1}{2}", r"\frac{2}{1}", False), ("1000001", "1,000,000", False),
]

EXTRACTION = [
    # (response, extraction forms or None for the default, expected answer)
    (r"so the result is \boxed{5}.", None, "5"),
    (r"first \boxed{1}, then \boxed{2}", None, "2"),
    (r"\boxed{\frac{1}{2}}", None, r"\frac{1}{2}"),
    (r"\boxed{\{1,2\}}", None, r"\{1,2\}"),
    (r"\boxed{\left(3, \frac{\pi}{2}\right)}", None, r"\left(3, \frac{\pi}{2}\right)"),
    (r"hence \boxed 5", None, "5"),
    (r"$\boxed 12$", None, "12"),
    (r"\fbox{7}", None, "7"),
    (r"$\boxed{5}$.", None, "5"),
    (r"\[\boxed{10}\]", None, "10"),
    (r"\boxed{ 5 }", None, "5"),
    (r"\boxed{}", None, None),
    (r"\boxedfoo{3}", None, None),
    (r"\boxed{x", None, None),
    (r"\boxed{x <answer>4</answer>", None, "4"),
    ("<answer>42</answer>", None, "42"),
    ("<answer> $\\frac{1}{2}$ </answer>", None, r"\frac{1}{2}"),
    (r"<answer>\boxed{3}</answer>", None, "3"),
    (r"<think>2+2</think> <answer>4</answer> but \boxed{5}", None, "5"),
    ("<answer>1</answer> then <answer>2</answer>", None, "2"),
    ("<answer>unclosed", None, None),
    ("<answer>  </answer>", None, None),
    ("The answer is 7.", None, None),
    ("The answer is 7.", ("boxed", "answer_is"), "7"),
    ("Final answer: $x=3$", ("answer_is",), "x=3"),
    ("the answer is $\\frac{3}{4}$\nDone.", ("answer_is",), r"\frac{3}{4}"),
    ("we get 12 and then 1,234.", ("last_number",), "1,234"),
    ("ratio -3/4 here", ("last_number",), "-3/4"),
    ("no digits", ("last_number",), None),
    (r"\boxed{9} but the answer is 8", ("answer_is", "boxed"), "8"),
    ("", None, None),
]


@pytest.mark.parametrize("prediction, ground_truth, expected", EQUIVALENCE)
def test_is_equivalent(prediction, ground_truth, expected):
    assert is_equivalent(prediction, ground_truth) is expected


def test_table_is_large_enough():
    assert len(EQUIVALENCE) >= 150
    assert sum(not e for _, _, e in EQUIVALENCE) >= 50


@pytest.mark.parametrize("response, forms, expected", EXTRACTION)
def test_extract_answer(response, forms, expected):
    assert (extract_answer(response) if forms is None else extract_answer(response, forms)) == expected


def test_unknown_answer_form_is_an_error():
    with pytest.raises(ValueError, match="valid"):
        extract_answer("x", ("boxed", "guess"))


def test_extraction_is_linear_on_hostile_text():
    deep = r"\boxed{" + "{" * 200_000 + "}" * 200_000 + "}"
    huge = "x" * 1_000_000 + r"\boxed{3}"
    many = r"\boxed{" * 100_000
    start = time.monotonic()
    assert extract_answer(deep) == "{" * 200_000 + "}" * 200_000
    assert extract_answer(huge) == "3"
    assert extract_answer(many) is None
    assert time.monotonic() - start < 2.0
