"""Benchmarks: named sets of rows, read by the one loader (orz.data.datasets), judged by the one
router (orz.reward.router).

    bench = load_benchmark("gpqa", "gpqa_diamond.jsonl")
    bench = benchmark_from_rows("arith", rows)          # rows in memory (the trainer's eval sets)
    bench.kind, bench.problems[0].prompt, bench.problems[0].answer

A benchmark's kind is its rows' verifier ("math", "multiple_choice", "code", a custom reward's
name), or "mixed" when they differ.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from orz.data.datasets import Row, load_rows
from orz.evaluation.metrics import cluster_answers
from orz.reward.math import is_equivalent


@dataclass(frozen=True)
class Benchmark:
    name: str  # the column in the report: "aime24", "gpqa_diamond", ...
    path: str
    problems: tuple[Row, ...]

    @property
    def kind(self) -> str:
        verifiers = {row.verifier for row in self.problems}
        return verifiers.pop() if len(verifiers) == 1 else "mixed"


def load_benchmark(name: str, path: str | Path) -> Benchmark:
    """Every problem of a benchmark file."""
    return Benchmark(name, str(path), tuple(load_rows(path)))


def benchmark_from_rows(name: str, rows: Sequence[Row]) -> Benchmark:
    if not rows:
        raise ValueError(f"benchmark {name!r} holds no problems")
    return Benchmark(name, rows[0].source, tuple(rows))


def cluster_math_answers(answers: tuple[str | None, ...]) -> list[int | None]:
    """Clusters of one problem's extracted answers under math-verify equivalence (a pool worker
    function: module level, plain data in and out)."""
    return cluster_answers(answers, is_equivalent)
