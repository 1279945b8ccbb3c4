"""Benchmark figures from per-sample verdicts: avg@k, pass@k, maj@k, quantiles. Pure Python; no
Ray, vLLM or verifier here (answer equivalence comes in as a function).

For one problem with n samples of which c are correct:
    avg@n  = c / n                                           (mean accuracy over the samples)
    pass@k = 1 - C(n-c, k) / C(n, k)                         (Chen et al. 2021, unbiased)
    maj@k  = whether the answer most of the first k samples agree on is correct
A benchmark's figure is the mean of its problems' figures.
"""
from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable, Sequence

import numpy as np


def pass_at_k(n: int, c: int, k: int) -> float:
    """1 - C(n-c, k) / C(n, k): the chance that k of the n samples, drawn without replacement,
    hold at least one of the c correct ones.

    Computed as 1 - prod_{i=n-c+1}^{n} (1 - k/i), which never forms the binomials (C(1024, 512)
    overflows a float); it is 1 exactly when fewer than k samples are wrong."""
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"need 0 <= c <= n and 1 <= k <= n; got n={n}, c={c}, k={k}")
    if n - c < k:
        return 1.0
    return 1.0 - math.prod(1.0 - k / i for i in range(n - c + 1, n + 1))


def default_ks(n: int) -> tuple[int, ...]:
    """1, 2, 4, ... below n, and n: the k of pass@k and maj@k reported when none are asked for."""
    ks, k = [], 1
    while k < n:
        ks.append(k)
        k *= 2
    return (*ks, n)


def cluster_answers(answers: Sequence[str | None], equivalent: Callable[[str, str], bool]) -> list[int | None]:
    """Groups equal answers; returns, per answer, the index of its cluster's first member (None
    for a missing answer, which joins no cluster).

    Greedy in sample order: an answer joins the first existing cluster whose first member it is
    `equivalent(answer, first_member)` to, or starts a new one. Identical strings always share a
    cluster without calling `equivalent`. Clusters of the first k answers are therefore exactly
    the clusters that the first k answers get here, so one call serves every maj@k."""
    clusters: list[int | None] = []
    representatives: list[int] = []
    seen: dict[str, int] = {}
    for i, answer in enumerate(answers):
        if answer is None:
            clusters.append(None)
            continue
        if answer not in seen:
            seen[answer] = next((r for r in representatives if equivalent(answer, answers[r])), i)
            if seen[answer] == i:
                representatives.append(i)
        clusters.append(seen[answer])
    return clusters


def majority(clusters: Sequence[int | None]) -> int | None:
    """The cluster most answers belong to (None if no sample has an answer). Ties go to the
    cluster whose first member came first, i.e. the smallest id (cluster_answers' ids are the
    positions of first members)."""
    counts = Counter(c for c in clusters if c is not None)
    if not counts:
        return None
    return min(counts, key=lambda c: (-counts[c], c))


def maj_at_k(clusters: Sequence[int | None], verdicts: Sequence[bool], k: int) -> bool:
    """Whether the majority answer of the first k samples is correct: the verdict of the winning
    cluster's first member (every member is equivalent to it)."""
    if not 1 <= k <= len(clusters) == len(verdicts):
        raise ValueError(f"need 1 <= k <= n and one verdict per sample; got k={k}, "
                         f"{len(clusters)} clusters, {len(verdicts)} verdicts")
    winner = majority(clusters[:k])
    return winner is not None and bool(verdicts[winner])


def avg_at_k(verdicts: Sequence[Sequence[bool]]) -> float:
    """Mean over problems of the fraction of each problem's samples that are correct."""
    return mean([sum(map(bool, v)) / len(v) for v in verdicts]) if verdicts else 0.0


def mean(values: Sequence[float]) -> float:
    return sum(values) / len(values) if values else 0.0


def quantile(values: Sequence[float], q: float) -> float:
    """numpy's q-quantile (linear interpolation between ranks); 0 for no values."""
    return float(np.quantile(values, q)) if len(values) else 0.0


def benchmark_figures(
    verdicts: Sequence[Sequence[bool]],
    clusters: Sequence[Sequence[int | None]] | None,
    ks: Sequence[int],
    response_tokens: Sequence[int],
    truncated: Sequence[bool],
) -> dict[str, float]:
    """Every accuracy and length figure of one benchmark.

    verdicts[p][s]: sample s of problem p is correct; clusters[p][s]: its answer cluster (None
    when answers cannot be voted on, e.g. code: then no maj@k); response_tokens and truncated:
    one entry per sample, all problems together."""
    sizes = {len(v) for v in verdicts}
    if len(sizes) > 1:
        raise ValueError(f"every problem needs the same number of samples; got {sorted(sizes)}")
    n = sizes.pop() if sizes else 0
    if any(not 1 <= k <= n for k in ks):
        raise ValueError(f"every k must be in 1..{n} (samples per problem); got {list(ks)}")
    figures: dict[str, float] = {"problems": len(verdicts), "samples_per_problem": n, f"avg@{n}": avg_at_k(verdicts)}
    for k in ks:
        figures[f"pass@{k}"] = mean([pass_at_k(n, sum(map(bool, v)), k) for v in verdicts])
    if clusters is not None:
        for k in ks:
            figures[f"maj@{k}"] = mean([float(maj_at_k(c, v, k)) for c, v in zip(clusters, verdicts)])
    figures.update(
        response_tokens_mean=mean(response_tokens),
        response_tokens_p95=quantile(response_tokens, 0.95),
        truncated_rate=mean([float(t) for t in truncated]),
    )
    return figures
