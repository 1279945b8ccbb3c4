"""Code reward: Python solutions judged against test cases in the sandbox.

    reward = CodeReward(CodeRewardConfig(scoring="all_pass"))
    scores, metrics = reward.score(responses, [CodeTests(inputs, outputs)], finish_reasons)

Two test styles, as in TACO and LiveCodeBench: stdin/stdout (the solution is a script) and
call-based (a function, or a method of LeetCode's `class Solution`, on JSON arguments). Each test
case is one sandboxed process; solutions are judged in parallel threads, each run under its own
dedicated uid (see sandbox.py).
"""
from __future__ import annotations

import json
import math
import re
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from orz.reward.sandbox import Sandbox, SandboxLimits

_HARNESS = (Path(__file__).parent / "code_harness.py").read_text()
_FENCED = re.compile(r"```(?:python|py|python3)?[ \t]*\n(.*?)```", re.DOTALL)


@dataclass(frozen=True)
class CodeTests:
    """The test cases of one problem.

    stdin/stdout when `fn_name` is None: inputs[i] is the stdin text, outputs[i] the expected
    stdout. Call-based otherwise: inputs[i] is the list of positional arguments of `fn_name` and
    outputs[i] its expected return value (JSON-comparable)."""

    inputs: list[Any]
    outputs: list[Any]
    fn_name: str | None = None

    def __post_init__(self):
        if len(self.inputs) != len(self.outputs) or not self.inputs:
            raise ValueError(f"need as many outputs as inputs, at least one; got "
                             f"{len(self.inputs)} inputs, {len(self.outputs)} outputs")


@dataclass(frozen=True)
class CodeRewardConfig:
    # "all_pass": 1 when every test passes (stops at the first failure); "pass_fraction": the
    # fraction passed, a denser but more hackable signal.
    scoring: Literal["all_pass", "pass_fraction"] = "all_pass"
    max_parallel: int = 4  # solutions judged at once, each in its own thread and uid
    limits: SandboxLimits = field(default_factory=lambda: SandboxLimits(wall_s=6.0, cpu_s=4))


def extract_code(response: str) -> str | None:
    """The last fenced code block (```python ... ```) of a response, or None."""
    blocks = _FENCED.findall(response)
    return blocks[-1] if blocks else None


def outputs_match(actual: str, expected: str) -> bool:
    """stdout comparison, as most judges do it: equal token by token, whitespace and line breaks
    aside, with numbers equal to within 1e-6 (relative or absolute)."""
    got, want = actual.split(), expected.split()
    return len(got) == len(want) and all(_tokens_match(g, w) for g, w in zip(got, want))


def _tokens_match(got: str, want: str) -> bool:
    if got == want:
        return True
    try:
        return math.isclose(float(got), float(want), rel_tol=1e-6, abs_tol=1e-6)
    except ValueError:
        return False


@dataclass(frozen=True)
class _Judgement:
    score: float
    extracted: bool
    timeouts: int  # test cases killed for the wall clock


class CodeReward:
    """Scores batches of responses that contain Python code; call `close()` when done."""

    def __init__(self, cfg: CodeRewardConfig = CodeRewardConfig()):
        self.cfg = cfg
        self.sandbox = Sandbox(cfg.limits)
        self._threads = ThreadPoolExecutor(cfg.max_parallel, thread_name_prefix="orz-code-reward")

    def score(
        self,
        responses: Sequence[str],
        tests: Sequence[CodeTests],
        finish_reasons: Sequence[str | None] | None = None,
    ) -> tuple[list[float], dict[str, float]]:
        """Per-response rewards and batch metrics; a truncated response (finish reason other
        than "stop") scores 0 without running."""
        if finish_reasons is None:
            finish_reasons = ["stop"] * len(responses)
        if not len(responses) == len(tests) == len(finish_reasons):
            raise ValueError(f"batch sizes differ: {len(responses)} responses, {len(tests)} test "
                             f"sets, {len(finish_reasons)} finish reasons")
        judgements = list(self._threads.map(
            lambda args: self._judge_response(*args), zip(responses, tests, finish_reasons)
        ))
        n = max(len(judgements), 1)
        scores = [j.score for j in judgements]
        return scores, {
            "code/score_mean": sum(scores) / n,
            "code/all_pass_rate": sum(s == 1.0 for s in scores) / n,
            "code/extraction_failure_rate": sum(not j.extracted for j in judgements) / n,
            "code/timeouts": float(sum(j.timeouts for j in judgements)),
        }

    def __call__(self, responses, tests, finish_reasons=None) -> list[float]:
        return self.score(responses, tests, finish_reasons)[0]

    def judge(self, solution: str, tests: CodeTests) -> float:
        """Score of one solution's source code (no extraction)."""
        return self._run_tests(solution, tests).score

    def _judge_response(self, response: str, tests: CodeTests, finish_reason: str | None) -> _Judgement:
        code = extract_code(response)
        if code is None or finish_reason != "stop":
            return _Judgement(0.0, code is not None, 0)
        return self._run_tests(code, tests)

    def _run_tests(self, solution: str, tests: CodeTests) -> _Judgement:
        passed = timeouts = 0
        for test_input, expected in zip(tests.inputs, tests.outputs):
            ok, timed_out = self._run_one(solution, tests.fn_name, test_input, expected)
            passed += ok
            timeouts += timed_out
            if not ok and self.cfg.scoring == "all_pass":
                return _Judgement(0.0, True, timeouts)
        return _Judgement(passed / len(tests.inputs), True, timeouts)

    def _run_one(self, solution: str, fn_name: str | None, test_input: Any, expected: Any) -> tuple[bool, bool]:
        files = {"harness.py": _HARNESS, "solution.py": solution}
        if fn_name is None:
            argv, stdin = [self.sandbox.python, "-I", "harness.py", "stdio"], str(test_input)
        else:
            files["args.json"] = json.dumps(test_input)
            argv, stdin = [self.sandbox.python, "-I", "harness.py", "call", fn_name], ""
        result = self.sandbox.run(argv, files, stdin)
        if result.returncode != 0:
            return False, result.timed_out
        if fn_name is None:
            return outputs_match(result.stdout, str(expected)), False
        lines = result.stdout.strip().splitlines()
        try:
            return bool(lines) and json.loads(lines[-1]) == json.loads(json.dumps(expected)), False
        except json.JSONDecodeError:
            return False, False

    def close(self) -> None:
        self._threads.shutdown()

    def __enter__(self) -> CodeReward:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
