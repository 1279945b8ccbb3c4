"""orz.evaluation.metrics against hand-computed numbers: pass@k, maj@k (ties, k = n), avg@k, quantiles."""
import math
from fractions import Fraction

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from orz.evaluation.metrics import (
    avg_at_k,
    benchmark_figures,
    cluster_answers,
    default_ks,
    maj_at_k,
    majority,
    pass_at_k,
    quantile,
)


@pytest.mark.parametrize(
    "n, c, k, expected",
    [
        (4, 2, 1, 1 / 2),  # c / n
        (4, 2, 2, 5 / 6),  # 1 - C(2,2)/C(4,2) = 1 - 1/6
        (4, 1, 2, 1 / 2),  # 1 - C(3,2)/C(4,2) = 1 - 3/6
        (5, 1, 3, 3 / 5),  # 1 - C(4,3)/C(5,3) = 1 - 4/10
        (10, 3, 4, 1 - 35 / 210),  # 1 - C(7,4)/C(10,4)
        (4, 0, 4, 0.0),  # k = n, nothing right
        (4, 1, 4, 1.0),  # k = n, one right: every draw holds it
        (4, 4, 1, 1.0),
        (3, 1, 3, 1.0),  # fewer wrong samples (2) than k (3)
    ],
)
def test_pass_at_k_hand_computed(n, c, k, expected):
    assert pass_at_k(n, c, k) == pytest.approx(expected, abs=1e-12)


@given(st.integers(1, 60).flatmap(lambda n: st.tuples(st.just(n), st.integers(0, n), st.integers(1, n))))
def test_pass_at_k_equals_the_exact_binomial_ratio(nck):
    n, c, k = nck
    exact = 1 - Fraction(math.comb(n - c, k), math.comb(n, k))
    assert pass_at_k(n, c, k) == pytest.approx(float(exact), abs=1e-12)


def test_pass_at_k_is_stable_where_the_binomials_overflow_a_float():
    # C(2048, 1024) ~ 1e615: the naive ratio of floats is inf/inf. Exact value by Fraction.
    exact = float(1 - Fraction(math.comb(2048 - 3, 1024), math.comb(2048, 1024)))
    assert pass_at_k(2048, 3, 1024) == pytest.approx(exact, rel=1e-12)
    assert 0.87 < exact < 0.88  # 1 - (1/2)^3, nearly


@pytest.mark.parametrize("n, c, k", [(4, 5, 1), (4, -1, 1), (4, 2, 0), (4, 2, 5)])
def test_pass_at_k_rejects_impossible_counts(n, c, k):
    with pytest.raises(ValueError, match=f"n={n}, c={c}, k={k}"):
        pass_at_k(n, c, k)


def test_default_ks():
    assert default_ks(1) == (1,)
    assert default_ks(32) == (1, 2, 4, 8, 16, 32)
    assert default_ks(5) == (1, 2, 4, 5)


def _same_value(a, b):
    return Fraction(a) == Fraction(b)


def test_clusters_by_equivalence_in_sample_order():
    answers = ["0.5", None, "1/2", "3", "0.50", "3", None]
    assert cluster_answers(answers, _same_value) == [0, None, 0, 3, 0, 3, None]


def test_identical_strings_share_a_cluster_without_calling_equivalent():
    calls = []

    def never(a, b):
        calls.append((a, b))
        return False

    assert cluster_answers(["x", "y", "x", "y", "z"], never) == [0, 1, 0, 1, 4]
    assert calls == [("y", "x"), ("z", "x"), ("z", "y")]  # each new string against each earlier cluster once


def test_majority_breaks_ties_by_earliest_first_member():
    assert majority([0, 1, 1, 0]) == 0  # 2-2: cluster 0 appeared first
    assert majority([1, 1, 0, 0][::-1]) == 0
    assert majority([None, 1, 1, 3, 3, 3]) == 3  # a plain majority wins wherever it starts
    assert majority([None, 2, 1, 2, 1]) == 1  # 2-2: the ids are first positions, 1 came first
    assert majority([None, None]) is None


def test_maj_at_k_hand_computed():
    # answers 0.5, 1/2, 3, 3 for truth 1/2: clusters [0, 0, 2, 2], 2-2 tie -> cluster 0 (right).
    clusters, verdicts = [0, 0, 2, 2], [True, True, False, False]
    assert [maj_at_k(clusters, verdicts, k) for k in (1, 2, 3, 4)] == [True, True, True, True]
    # answers 8, 7, 8, (truncated) for truth 7: k=2 is a 1-1 tie that 8 wins by coming first.
    clusters, verdicts = [0, 1, 0, None], [False, True, False, False]
    assert [maj_at_k(clusters, verdicts, k) for k in (1, 2, 3, 4)] == [False, False, False, False]
    # 7 first this time: the k=2 tie goes to 7; by k=4, 8 has two votes to one.
    clusters, verdicts = [0, 1, 1, None], [True, False, False, False]
    assert [maj_at_k(clusters, verdicts, k) for k in (1, 2, 3, 4)] == [True, True, False, False]
    assert maj_at_k([None, None], [False, False], 2) is False  # nobody answered


def test_maj_at_k_rejects_k_beyond_n():
    with pytest.raises(ValueError, match="k=3"):
        maj_at_k([0, 0], [True, True], 3)


def test_avg_at_k_is_the_mean_of_verdicts():
    verdicts = [[True, False, False, False], [True, True, True, False], [False] * 4]
    assert avg_at_k(verdicts) == pytest.approx(np.mean(verdicts))
    assert avg_at_k(verdicts) == pytest.approx(sum(pass_at_k(4, sum(v), 1) for v in verdicts) / 3)


@given(st.lists(st.floats(-1e6, 1e6), min_size=1, max_size=50), st.floats(0, 1))
def test_quantile_matches_numpy(values, q):
    assert quantile(values, q) == pytest.approx(float(np.quantile(values, q)), rel=1e-9, abs=1e-6)


def test_quantile_by_hand():
    assert quantile([10, 20, 30, 40, 50], 0.95) == pytest.approx(48.0)  # 40 + 0.8 * 10
    assert quantile([], 0.95) == 0.0
    assert quantile([7], 0.95) == 7


def test_benchmark_figures_hand_computed():
    verdicts = [[True, True, False, False], [False, True, False, False]]
    clusters = [[0, 0, 2, 2], [0, 1, 0, None]]
    figures = benchmark_figures(verdicts, clusters, (1, 2, 4), [10, 20, 30, 40, 50, 60, 70, 80], [False] * 7 + [True])
    assert figures == pytest.approx({
        "problems": 2, "samples_per_problem": 4,
        "avg@4": 0.375, "pass@1": 0.375, "pass@2": (5 / 6 + 1 / 2) / 2, "pass@4": 1.0,
        "maj@1": 0.5, "maj@2": 0.5, "maj@4": 0.5,
        "response_tokens_mean": 45.0, "response_tokens_p95": 76.5, "truncated_rate": 0.125,
    })
    assert "maj@4" not in benchmark_figures(verdicts, None, (4,), [1] * 8, [False] * 8)  # code: no voting


def test_benchmark_figures_reject_uneven_samples_and_bad_k():
    with pytest.raises(ValueError, match=r"same number of samples; got \[1, 2\]"):
        benchmark_figures([[True], [True, False]], None, (1,), [1, 1, 1], [False] * 3)
    with pytest.raises(ValueError, match="1..2"):
        benchmark_figures([[True, False]], None, (4,), [1, 1], [False] * 2)
