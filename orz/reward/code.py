"""Code reward: Python solutions judged against test cases in the sandbox.

    reward = CodeReward(CodeScoringConfig(scoring="all_pass"))   # reward.code
    judgements = reward.judge(responses, [row.tests, ...], finish_reasons)   # per response: .score, .code, ...

Three test modes (orz.data.datasets.CodeTests): stdin/stdout (the solution is a script),
call-based (a function, or a method of LeetCode's `class Solution`, on JSON arguments), and checks
(code run after the solution: Skywork-OR1's `check(fn)` harnesses and assert lines). Each test
case is one sandboxed process; solutions are judged in parallel threads (see sandbox.py for what
isolates them). The code is read as Skywork-OR1's scorer reads it: after `</think>`, the last
fenced python block.
"""
from __future__ import annotations

import json
import math
import re
import secrets
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from orz.config import CodeScoringConfig
from orz.data.datasets import CodeTests
from orz.data.templates import THINK_CLOSE
from orz.reward.sandbox import Sandbox, SandboxLimits

_HARNESS = (Path(__file__).parent / "code_harness.py").read_text()
_FENCED = re.compile(r"```(?:python|py|python3)?[ \t]*\n(.*?)```", re.DOTALL)
# "last_fenced": the last ```python block after </think>; "response": everything after </think> is
# the program (for prompts that open the code block themselves).
EXTRACTIONS = ("last_fenced", "response")
# "all_pass": 1 when every test passes (stops at the first failure); "pass_fraction": the fraction
# passed, a denser but more hackable signal.
SCORINGS = ("all_pass", "pass_fraction")


def extract_code(response: str, extraction: str = "last_fenced") -> str | None:
    """The program in a response: what follows `</think>` (the whole response without one), as its
    last fenced python block, or all of it with extraction="response"; None when there is none."""
    answer = response.split(THINK_CLOSE)[-1]
    if extraction == "response":
        return answer if answer.strip() else None
    blocks = _FENCED.findall(answer)
    return blocks[-1] if blocks else None


def outputs_match(actual: str, expected: str) -> bool:
    """stdout comparison, as most judges do it: equal token by token, whitespace and line breaks
    aside; decimals equal to within 1e-6 (relative or absolute), integers exactly."""
    got, want = actual.split(), expected.split()
    return len(got) == len(want) and all(_tokens_match(g, w) for g, w in zip(got, want))


_INTEGER = re.compile(r"[-+]?\d+")


def _tokens_match(got: str, want: str) -> bool:
    if got == want:
        return True
    if _INTEGER.fullmatch(got) and _INTEGER.fullmatch(want):
        return int(got) == int(want)  # 123456790 is not 123456789, however close relatively
    try:
        return math.isclose(float(got), float(want), rel_tol=1e-6, abs_tol=1e-6)
    except ValueError:
        return False


def returns_match(actual: Any, expected: Any, wrapped: bool = False) -> bool:
    """A call's JSON result against the expected value. `wrapped` (APPS, TACO): a one-element list
    also stands for the value itself."""
    expected = json.loads(json.dumps(expected))
    return actual == expected or (wrapped and isinstance(expected, list) and len(expected) == 1
                                  and actual == expected[0])


@dataclass(frozen=True)
class CodeJudgement:
    """One response's verdict: `score` by the configured scoring, the code it ran (None: none found)."""

    score: float
    code: str | None
    tests_passed: int = 0
    tests_run: int = 0
    timeouts: int = 0  # test cases killed for the wall clock
    cpu_s: float = 0.0  # CPU seconds of every test process
    wall_s: float = 0.0
    launch_failures: int = 0  # test cases whose sandbox could not be set up (judged 0, but no verdict)


class CodeReward:
    """Scores batches of responses that contain Python code; call `close()` when done."""

    def __init__(self, cfg: CodeScoringConfig = CodeScoringConfig(), limits: SandboxLimits | None = None):
        """limits: the sandbox's; by default cfg's wall_s, cpu_s and memory_mb, and SandboxLimits'
        own defaults for the rest."""
        if cfg.extraction not in EXTRACTIONS or cfg.scoring not in SCORINGS:
            raise ValueError(f"code extraction must be one of {list(EXTRACTIONS)} and scoring one of {list(SCORINGS)}; "
                             f"got {cfg.extraction!r}, {cfg.scoring!r}")
        self.cfg = cfg
        self.sandbox = Sandbox(limits or SandboxLimits(wall_s=cfg.wall_s, cpu_s=cfg.cpu_s, memory_mb=cfg.memory_mb))
        self.sandbox.refuse_weak(cfg.allow_weak_sandbox, "code scoring")
        self._threads = ThreadPoolExecutor(cfg.max_parallel, thread_name_prefix="orz-code-reward")

    def judge(self, responses: Sequence[str], tests: Sequence[CodeTests],
              finish_reasons: Sequence[str | None] | None = None) -> list[CodeJudgement]:
        """One judgement per response; a truncated response (finish reason other than "stop")
        scores 0 without running."""
        if finish_reasons is None:
            finish_reasons = ["stop"] * len(responses)
        if not len(responses) == len(tests) == len(finish_reasons):
            raise ValueError(f"batch sizes differ: {len(responses)} responses, {len(tests)} test "
                             f"sets, {len(finish_reasons)} finish reasons")
        return list(self._threads.map(lambda args: self._judge_response(*args),
                                      zip(responses, tests, finish_reasons)))

    def run_tests(self, solution: str, tests: CodeTests) -> CodeJudgement:
        """The judgement of one solution's source code (no extraction)."""
        passed = timeouts = failures = 0
        cpu_s = wall_s = 0.0
        cases = tests.checks or list(zip(tests.inputs, tests.outputs))
        for run, case in enumerate(cases, start=1):
            ok, result = self._run_one(solution, tests, case)
            passed += ok
            timeouts += result.timed_out
            failures += result.launch_failed
            cpu_s, wall_s = cpu_s + result.cpu_s, wall_s + result.wall_s
            if not ok and self.cfg.scoring == "all_pass":
                return CodeJudgement(0.0, solution, passed, run, timeouts, cpu_s, wall_s, failures)
        return CodeJudgement(passed / len(cases), solution, passed, len(cases), timeouts, cpu_s, wall_s, failures)

    def _judge_response(self, response: str, tests: CodeTests, finish_reason: str | None) -> CodeJudgement:
        code = extract_code(response, self.cfg.extraction)
        if code is None or finish_reason != "stop":
            return CodeJudgement(0.0, code)
        return self.run_tests(code, tests)

    def _run_one(self, solution: str, tests: CodeTests, case: Any):
        """(passed, sandbox result) of one test case."""
        files = {"harness.py": _HARNESS, "solution.py": solution}
        argv, stdin = [self.sandbox.python, "-I", "harness.py", "stdio"], ""
        if tests.mode == "check":
            token = secrets.token_hex(16)
            files.update({"solution.py": f"{tests.prefix}{solution}\n", "check.py": case, "token": token})
            argv = [self.sandbox.python, "-I", "harness.py", "check"]
        elif tests.mode == "call":
            files["args.json"] = json.dumps(case[0])
            argv = [self.sandbox.python, "-I", "harness.py", "call", tests.fn_name]
        else:
            stdin = str(case[0])
        result = self.sandbox.run(argv, files, stdin)
        if result.returncode != 0:
            return False, result
        if tests.mode == "check":
            return result.stdout.rstrip().endswith(token), result
        if tests.mode == "stdio":
            return outputs_match(result.stdout, str(case[1])), result
        lines = result.stdout.strip().splitlines()
        try:
            return bool(lines) and returns_match(json.loads(lines[-1]), case[1], tests.wrapped_returns), result
        except json.JSONDecodeError:
            return False, result

    def close(self) -> None:
        self._threads.shutdown()

    def __enter__(self) -> CodeReward:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
