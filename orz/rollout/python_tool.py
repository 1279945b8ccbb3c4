"""The built-in `python` environment: tool-integrated reasoning with a Python interpreter.

A turn that closes a block (the format's delimiters, the turn's stop string) has its code run in
the sandbox (orz.reward.sandbox: the code reward's limits, its non-root mode, and
rollout.tool_timeout_s as the wall clock); the model then reads the output, wrapped. Two formats
(rollout.tool_format):

    code  <code>print(6*7)</code>                  ->  \\n<output>\\n42\\n\\n</output>\\n
    chat  <tool_call>{"name": "python", "arguments": {"code": "print(6*7)"}}</tool_call>
          -> the chat template's tool message holding "42\\n", then its next assistant header
             (Qwen3, Hermes: <|im_end|>\\n<|im_start|>user\\n<tool_response>\\n42\\n...)

In the chat format the prompt shows PYTHON_FUNCTION, an OpenAI function schema, through the
chat template's `tools`. The output is cut to max_observation_tokens characters with the
wrapping (a token holds one character or more in most tokenizers; the rollout then cuts the ids
to max_observation_tokens whatever the tokenizer). A turn without a closed block ends the sample.
The output is never read as the answer: the verifier reads the model's own turns only.

A call is well formed when its block parses (chat: a JSON call of `python` with a string `code`)
and its code compiles. With rollout.tool_format_reward = r, a sample's environment reward is r
when it made at least one call and every call was well formed, else 0.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, replace

from orz.config import RolloutConfig
from orz.reward.sandbox import Sandbox
from orz.rollout.envs import StepResult

OUTPUT_OPEN, OUTPUT_CLOSE = "\n<output>\n", "\n</output>\n"
_CUT = "\n[output cut]"
PYTHON_FUNCTION = {"type": "function", "function": {
    "name": "python",
    "description": "Runs a Python program and returns what it prints (stdout, then stderr).",
    "parameters": {"type": "object", "required": ["code"],
                   "properties": {"code": {"type": "string", "description": "the program; print what you need"}}}}}


DELIMITERS = {"code": ("<code>", "</code>"), "chat": ("<tool_call>", "</tool_call>")}  # rollout.tool_format's own


@dataclass(frozen=True)
class ToolFormat:
    """How a call is written (between `open` and `close`; JSON when `json_call`) and how its
    output comes back (between `output_open` and `output_close`)."""

    open: str = DELIMITERS["code"][0]
    close: str = DELIMITERS["code"][1]
    output_open: str = OUTPUT_OPEN
    output_close: str = OUTPUT_CLOSE
    json_call: bool = False


def delimiters(rollout: RolloutConfig) -> tuple[str, str]:
    """(open, close) of a call: rollout.tool_open/tool_close, else rollout.tool_format's own."""
    default_open, default_close = DELIMITERS[rollout.tool_format]
    return rollout.tool_open or default_open, rollout.tool_close or default_close


def tool_format(rollout: RolloutConfig, tokenizer) -> ToolFormat:
    """rollout.tool_format with its delimiters; chat: a JSON call, answered by the tokenizer's own
    chat template as a tool message."""
    open_, close = delimiters(rollout)
    if rollout.tool_format == "code":
        return ToolFormat(open_, close)
    from orz.data.templates import tool_message_wrap

    return ToolFormat(open_, close, *tool_message_wrap(tokenizer), json_call=True)


def prompt_tools(rollout: RolloutConfig) -> tuple[dict, ...]:
    """The function schemas a chat template shows the model: the python function in the chat format."""
    return (PYTHON_FUNCTION,) if rollout.tool_format == "chat" else ()


def closed_block(turn_text: str, tool_open: str, tool_close: str) -> str | None:
    """The text of the block the turn closes: between the last `tool_open` and the `tool_close`
    that ends the turn; None when the turn does not end by closing a block."""
    if not turn_text.endswith(tool_close):
        return None
    body = turn_text[: -len(tool_close)]
    start = body.rfind(tool_open)
    return None if start < 0 else body[start + len(tool_open):]


def call_code(block: str) -> str:
    """The code of a JSON call {"name": "python", "arguments": {"code": ...}} (arguments may be a
    JSON string, as OpenAI writes them); ValueError says what is wrong."""
    try:
        call = json.loads(block)
        arguments = call.get("arguments") if isinstance(call, dict) else None
        if isinstance(arguments, str):
            arguments = json.loads(arguments)
    except json.JSONDecodeError as err:
        raise ValueError(f"the call is not JSON ({err})") from None
    if not isinstance(call, dict) or call.get("name") != "python":
        raise ValueError('the call must be {"name": "python", "arguments": {"code": "..."}}')
    if not isinstance(arguments, dict) or not isinstance(arguments.get("code"), str):
        raise ValueError('the call\'s arguments must hold "code", a string')
    return arguments["code"]


def compiles(code: str) -> bool:
    """Whether `code` is a Python program (compiled, never run, here)."""
    try:
        compile(code, "main.py", "exec")
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return False
    return True


class PythonTool:
    """One sample's interpreter; every sample of a run shares `sandbox` (it is thread-safe)."""

    def __init__(self, sandbox: Sandbox, timeout_s: float, max_chars: int, form: ToolFormat = ToolFormat(),
                 format_reward: float = 0.0):
        self.sandbox, self.form, self.format_reward = sandbox, form, format_reward
        self.limits = replace(sandbox.limits, wall_s=timeout_s)
        self.max_chars = max(max_chars - len(form.output_open) - len(form.output_close), 0)
        self.malformed = 0
        self.rewarded = 0.0

    def reset(self, row: dict) -> None:
        pass

    def step(self, turn_text: str) -> StepResult:
        block = closed_block(turn_text, self.form.open, self.form.close)
        if block is None:
            return StepResult(done=True)
        counts = {"tool_calls": 1, "tool_errors": 0, "tool_timeouts": 0, "tool_format_errors": 0}
        try:
            code = call_code(block) if self.form.json_call else block
        except ValueError as err:
            self.malformed += 1
            return self._answer(f"error: {err}", counts | {"tool_errors": 1, "tool_format_errors": 1})
        if not compiles(code):  # still run: the model reads Python's own message
            self.malformed += 1
            counts["tool_format_errors"] = 1
        result = self.sandbox.run([self.sandbox.python, "-I", "main.py"], {"main.py": code}, limits=self.limits)
        output = result.stdout + result.stderr
        if result.timed_out:
            output += f"timed out after {self.limits.wall_s:g} s"
        failed = result.timed_out or result.returncode != 0
        return self._answer(output, counts | {"tool_errors": int(failed), "tool_timeouts": int(result.timed_out)})

    def _answer(self, output: str, counts: dict[str, int]) -> StepResult:
        """The wrapped, cut output; the reward brings the sample's sum to r·[every call so far well formed]."""
        if len(output) > self.max_chars:
            output = output[: max(self.max_chars - len(_CUT), 0)] + _CUT
        earned = self.format_reward if not self.malformed else 0.0
        reward, self.rewarded = earned - self.rewarded, earned
        return StepResult(observation=self.form.output_open + output + self.form.output_close,
                          reward=reward or None, counts=counts)
