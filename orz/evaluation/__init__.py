"""Evaluation: benchmark files and how responses are read (benchmarks.py), figures from verdicts
(metrics.py, pure), and the Evaluator that the CLI (`python -m orz.eval`) and the trainer share
(runner.py). Nothing is re-exported here: the verifier pool's workers import benchmarks.py, and
must not pull in torch through runner.py."""
