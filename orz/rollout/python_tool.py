"""The built-in `python` environment: tool-integrated reasoning with a Python interpreter.

A turn that closes a code block (`rollout.tool_open` ... `rollout.tool_close`, the turn's stop
string) has the block run in the sandbox (orz.reward.sandbox: the code reward's limits, its
non-root mode, and rollout.tool_timeout_s as the wall clock); the model then reads

    <output>
    {stdout, then stderr; "timed out after T s" when killed}
    </output>

its output cut to max_observation_tokens characters with the wrapping (a token holds one
character or more in most tokenizers; the rollout then cuts the ids to max_observation_tokens
whatever the tokenizer). A turn without a closed block ends the sample. The output is never read as the answer: the verifier reads the model's
own turns only.
"""
from __future__ import annotations

from dataclasses import replace

from orz.reward.sandbox import Sandbox
from orz.rollout.envs import StepResult

OUTPUT_OPEN, OUTPUT_CLOSE = "\n<output>\n", "\n</output>\n"
_CUT = "\n[output cut]"


def closed_block(turn_text: str, tool_open: str, tool_close: str) -> str | None:
    """The code of the block the turn closes: between the last `tool_open` and the `tool_close`
    that ends the turn; None when the turn does not end by closing a block."""
    if not turn_text.endswith(tool_close):
        return None
    body = turn_text[: -len(tool_close)]
    start = body.rfind(tool_open)
    return None if start < 0 else body[start + len(tool_open):]


class PythonTool:
    """One sample's interpreter; every sample of a run shares `sandbox` (it is thread-safe)."""

    def __init__(self, sandbox: Sandbox, tool_open: str, tool_close: str, timeout_s: float, max_chars: int):
        self.sandbox, self.tool_open, self.tool_close = sandbox, tool_open, tool_close
        self.limits = replace(sandbox.limits, wall_s=timeout_s)
        self.max_chars = max(max_chars - len(OUTPUT_OPEN) - len(OUTPUT_CLOSE), 0)

    def reset(self, row: dict) -> None:
        pass

    def step(self, turn_text: str) -> StepResult:
        code = closed_block(turn_text, self.tool_open, self.tool_close)
        if code is None:
            return StepResult(done=True)
        result = self.sandbox.run([self.sandbox.python, "-I", "main.py"], {"main.py": code}, limits=self.limits)
        output = result.stdout + result.stderr
        if result.timed_out:
            output += f"timed out after {self.limits.wall_s:g} s"
        if len(output) > self.max_chars:
            output = output[: max(self.max_chars - len(_CUT), 0)] + _CUT
        failed = result.timed_out or result.returncode != 0
        return StepResult(observation=OUTPUT_OPEN + output + OUTPUT_CLOSE,
                          counts={"tool_calls": 1, "tool_errors": int(failed), "tool_timeouts": int(result.timed_out)})
