"""Evaluation: benchmark files (benchmarks.py), figures from verdicts (metrics.py, pure), and the
Evaluator that the CLI (`python -m orz.eval`) and the trainer share (runner.py)."""
from orz.evaluation.benchmarks import Benchmark, Problem, load_benchmark
from orz.evaluation.runner import EvalConfig, EvalReport, Evaluator

__all__ = ["Benchmark", "Problem", "load_benchmark", "EvalConfig", "EvalReport", "Evaluator"]
