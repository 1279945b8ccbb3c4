"""Custom rewards, by name: a user's Python function, or an HTTP endpoint.

    reward.custom: {brevity: "my_rewards:brevity", judge: "http://10.0.0.7:8000/score"}

A function is `fn(response: str, row: dict) -> float | dict` (row: Row.record() plus its
"finish_reason"), or verl's `compute_score(data_source, solution_str, ground_truth, extra_info)`,
recognised by its parameter names, so verl reward files work unchanged. A dict result gives its
"score"; its other numeric entries are logged. Functions run in a KillablePool: a hard timeout per
item, and an exception scores 0 and is counted, never raised into the trainer.

An endpoint receives batches as POST {"responses": [...], "prompts": [...], "rows": [...]} and
answers {"scores": [...]} (or "rewards", as OpenRLHF's remote reward does), within `timeout_s`.
"""
from __future__ import annotations

import inspect
import json
import numbers
import time
import urllib.request
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any

from orz.import_path import load_by_path
from orz.reward.pool import ItemResult, KillablePool

# Rewards every run knows by name, as if given in reward.custom.
BUILTIN = {"countdown": "orz.data.synthetic:countdown_reward"}
_VERL_PARAMETERS = ("data_source", "solution_str", "ground_truth")


def is_endpoint(spec: str) -> bool:
    return spec.startswith(("http://", "https://"))


def resolve(name: str, spec: str) -> Callable[..., Any]:
    """The function `spec` ("package.module:function") names; errors name the reward, the path
    and the module."""
    return load_by_path(f"reward.custom.{name}", spec, "function", " nor an http(s) URL")


def _is_verl(function: Callable) -> bool:
    try:
        parameters = list(inspect.signature(function).parameters)
    except (TypeError, ValueError):
        return False
    return tuple(parameters[:3]) == _VERL_PARAMETERS


_resolved: dict[str, tuple[Callable, bool]] = {}  # in each pool worker: spec -> (function, verl style)


def call(item: tuple[str, str, dict]) -> dict[str, float]:
    """Pool worker side: {"score": x, ...} of one (spec, response, row record)."""
    spec, response, row = item
    if spec not in _resolved:
        function = resolve("?", spec)
        _resolved[spec] = function, _is_verl(function)
    function, verl = _resolved[spec]
    if verl:
        result = function(row["data_source"], response, row["ground_truth"], row["extra_info"])
    else:
        result = function(response, row)
    if isinstance(result, dict):
        if "score" not in result:
            raise ValueError(f"a reward's dict result needs 'score', got keys {sorted(result)}")
        extras = {k: float(v) for k, v in result.items() if k != "score" and isinstance(v, numbers.Real)}
        return {"score": float(result["score"]), **extras}  # bool, numpy and torch scalars too
    return {"score": float(result)}


class FunctionRewards:
    """Every custom function of a run, in one pool of killable workers."""

    def __init__(self, specs: dict[str, str], num_workers: int, timeout_s: float, memory_limit_mb: int | None):
        self.specs = specs
        self.pool = KillablePool(call, num_workers, timeout_s, chunk_size=8, memory_limit_mb=memory_limit_mb)

    def run(self, name: str, responses: Sequence[str], records: Sequence[dict]) -> list[ItemResult]:
        return self.pool.map([(self.specs[name], r, row) for r, row in zip(responses, records)])

    def close(self) -> None:
        self.pool.close()


class EndpointReward:
    """An HTTP reward: batches of `batch_size`, sent at once (up to `max_parallel`), each answered
    within `timeout_s` of being sent or scored 0."""

    def __init__(self, name: str, url: str, batch_size: int, timeout_s: float, max_parallel: int = 64):
        self.name, self.url, self.batch_size, self.timeout_s = name, url, batch_size, timeout_s
        self.max_parallel = max_parallel

    def run(self, responses: Sequence[str], records: Sequence[dict]) -> list[ItemResult]:
        starts = range(0, len(responses), self.batch_size)
        batches = [(list(responses[i : i + self.batch_size]), list(records[i : i + self.batch_size])) for i in starts]
        results = []
        for first in range(0, len(batches), self.max_parallel):  # each wave gets the whole timeout
            wave = batches[first : first + self.max_parallel]
            threads = ThreadPoolExecutor(len(wave), thread_name_prefix=f"orz-reward-{self.name}")
            futures = [threads.submit(self._post, *batch) for batch in wave]
            deadline = time.monotonic() + self.timeout_s
            for future, (batch, _) in zip(futures, wave):
                try:
                    results += future.result(timeout=max(0.0, deadline - time.monotonic()))
                except FutureTimeout:
                    results += [ItemResult("timeout", None, self.timeout_s)] * len(batch)
                except Exception as error:  # unreachable, refused, a bad answer: the batch scores 0
                    results += [ItemResult("error", f"{type(error).__name__}: {error}"[:300])] * len(batch)
            threads.shutdown(wait=False, cancel_futures=True)  # a late answer is dropped, its socket times out
        return results

    def _post(self, responses: list[str], records: list[dict]) -> list[ItemResult]:
        start = time.monotonic()
        body = json.dumps({"responses": responses, "prompts": [r["prompt"] for r in records], "rows": records},
                          default=str).encode()
        request = urllib.request.Request(self.url, body, {"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=self.timeout_s) as answer:
            reply = json.loads(answer.read())
        scores = reply.get("scores", reply.get("rewards")) if isinstance(reply, dict) else None
        if not isinstance(scores, list) or len(scores) != len(responses):
            raise ValueError(f"{self.url} answered {str(reply)[:120]!r}; expected {{'scores': [{len(responses)} numbers]}}")
        seconds = (time.monotonic() - start) / len(responses)
        return [ItemResult("ok", {"score": float(s)}, seconds) for s in scores]
