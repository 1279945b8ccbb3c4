"""One reward router for training and evaluation: each response is scored by its row's verifier.

    router = RewardRouter(RouterConfig(custom={"brevity": "my_rewards:brevity"},
                                       weights={"brevity": 0.1}), rows)
    pending = router.submit(responses, rows, finish_reasons)     # as groups finish: a Future
    verdicts = pending.result()                                  # one Verdict per response
    metrics = reward_metrics(verdicts)                           # over any number of submits

Verifiers: "math" (math-verify, in a pool of killable processes), "code" (the sandbox),
"multiple_choice" (the letter), and custom rewards by name (a function in a killable pool, or an
HTTP endpoint; see custom.py). Every verifier a batch needs runs at once, so sandbox start-ups
overlap math-verify's CPU work; each has a hard per-item timeout. A truncated response scores 0
on its verifier without running.

The reward of a response is w_v · (its verifier's score) + Σ_g w_g · g(response) over the other
rewards g named in `weights`, which apply to every row (format bonuses, length penalties, a
reward endpoint); w_v is 1 unless `weights` names the verifier.
"""
from __future__ import annotations

from collections import defaultdict
from collections.abc import Collection, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from orz.config import CodeScoringConfig, RewardConfig
from orz.data.answers import extract_answer
from orz.data.datasets import BUILTIN_VERIFIERS, DatasetFormatError, Row
from orz.faults import FaultSite
from orz.reward import custom
from orz.reward.choice import extract_choice
from orz.reward.code import CodeReward, extract_code
from orz.reward.math import MathReward, MathRewardConfig
from orz.timeline.record import RECORDER

# The reward-model role's score (added by the trainer, which runs that role); a row whose verifier
# is "model" has no verifiable reward.
MODEL = "model"


@dataclass(frozen=True)
class RouterConfig:
    math: MathRewardConfig = field(default_factory=MathRewardConfig)
    code: CodeScoringConfig = field(default_factory=CodeScoringConfig)
    custom: dict[str, str] = field(default_factory=dict)  # name -> "module:function" or http(s) URL
    weights: dict[str, float] = field(default_factory=dict)  # name -> weight (see the module docstring)
    custom_workers: int = 2
    custom_timeout_s: float = 10.0  # per item (functions) or per batch (endpoints)
    endpoint_batch_size: int = 64

    def __post_init__(self):
        """Refuses names that collide or that nothing defines, and functions that cannot be imported."""
        specs = self.specs
        for name, spec in self.custom.items():
            if name in BUILTIN_VERIFIERS:
                raise ValueError(f"reward.custom.{name}: '{name}' is a built-in verifier; pick another name")
            if not custom.is_endpoint(spec):
                custom.resolve(name, spec)
        unknown = sorted(set(self.weights) - {*BUILTIN_VERIFIERS, MODEL} - set(specs))
        if unknown:
            raise ValueError(f"reward.weights names {unknown}, which no verifier or reward.custom entry defines; "
                             f"known: {sorted({*BUILTIN_VERIFIERS, MODEL, *specs})}")

    @property
    def specs(self) -> dict[str, str]:
        """Every custom reward by name: the built-in ones and reward.custom."""
        return {**custom.BUILTIN, **self.custom}

    @classmethod
    def from_config(cls, reward: RewardConfig, *, format_reward: float | None = None,
                    num_workers: int | None = None, scoring: str | None = None,
                    envs: Collection[str] = ()) -> RouterConfig:
        """The router of a run's `reward` section (the evaluator overrides what makes a verdict binary).
        envs: the environments' names, whose weights in reward.weights the trainer applies, not the router."""
        return cls(
            math=MathRewardConfig(extraction=tuple(reward.extraction), timeout_s=reward.timeout_s,
                                  format_reward=reward.format_reward if format_reward is None else format_reward,
                                  num_workers=num_workers or reward.num_workers),
            code=replace(reward.code, scoring=scoring or reward.code.scoring),
            custom=dict(reward.custom), weights={k: w for k, w in reward.weights.items() if k not in envs},
            custom_workers=reward.custom_workers, custom_timeout_s=reward.custom_timeout_s,
        )


@dataclass(frozen=True)
class Verdict:
    """What became of one response."""

    verifier: str
    source: str  # the row's data source (its file or synthetic task when it names none)
    score: float  # the reward: the weighted sum of `components`
    correct: bool  # its verifier gave full marks
    extracted: str | None  # the answer, letter or code read from it
    components: dict[str, float]  # each reward's own value, by name
    statuses: dict[str, str]  # each reward's: ok | timeout | crash | error | truncated
    seconds: float = 0.0
    cpu_s: float = 0.0
    tests_passed: int = 0  # code
    tests_run: int = 0
    test_timeouts: int = 0
    extras: dict[str, float] = field(default_factory=dict)  # "<reward>/<key>": a custom dict result's entries

    @property
    def status(self) -> str:
        """Its verifier's status."""
        return self.statuses[self.verifier]


@dataclass(frozen=True)
class _Part:
    """One reward's result for one response."""

    value: float
    status: str = "ok"
    correct: bool = False
    extracted: str | None = None
    seconds: float = 0.0
    cpu_s: float = 0.0
    tests: tuple[int, int, int] = (0, 0, 0)  # passed, run, timed out
    extras: dict[str, float] = field(default_factory=dict)


class RewardRouter(FaultSite):
    """Holds the verifier pools a set of rows needs; `close()` when done."""

    def __init__(self, cfg: RouterConfig, rows: Sequence[Row]):
        """Starts what `rows` (every row it will score) and the weights need, nothing more."""
        self.cfg = cfg
        self.specs = cfg.specs
        # Rewards named in weights besides a row's own verifier apply to every row.
        self.every_row = [name for name in cfg.weights if name in self.specs]
        self.needed = {row.verifier for row in rows} | set(self.every_row)
        self._refuse_unscorable(rows)
        needed = self.needed
        self.math = self.code = self.functions = None
        self._jobs = ThreadPoolExecutor(4, thread_name_prefix="orz-reward-job")
        self._backends = ThreadPoolExecutor(8, thread_name_prefix="orz-reward-backend")
        try:  # a backend that fails to start (a refused sandbox) leaves none of the others running
            self.math = MathReward(cfg.math) if "math" in needed else None
            self.code = CodeReward(cfg.code) if "code" in needed else None
            functions = {n: self.specs[n] for n in needed if n in self.specs and not custom.is_endpoint(self.specs[n])}
            self.functions = custom.FunctionRewards(functions, cfg.custom_workers, cfg.custom_timeout_s,
                                                    cfg.math.memory_limit_mb) if functions else None
        except BaseException:
            self.close()
            raise
        self.endpoints = {n: custom.EndpointReward(n, self.specs[n], cfg.endpoint_batch_size, cfg.custom_timeout_s)
                          for n in needed if n in self.specs and custom.is_endpoint(self.specs[n])}

    @classmethod
    def from_config(cls, reward: RewardConfig, rows: Sequence[Row], envs: Collection[str] = ()) -> RewardRouter:
        """The router of a run's `reward` section, for `rows` (envs: see RouterConfig.from_config)."""
        return cls(RouterConfig.from_config(reward, envs=envs), rows)

    def _refuse_unscorable(self, rows: Sequence[Row]) -> None:
        """Refuses a row whose verifier nothing defines, or one this router was not built for."""
        refuse_unknown_verifiers(rows, self.cfg)
        for row in rows:
            if row.verifier not in self.needed:
                raise ValueError(f"{row.source}, row {row.number}: verifier {row.verifier!r} was not started; "
                                 f"build the router with every row it will score (it has {sorted(self.needed)})")

    @property
    def sandbox_isolation(self) -> dict[str, str] | None:
        return self.code.sandbox.isolation if self.code else None

    def submit(self, responses: Sequence[str], rows: Sequence[Row],
               finish_reasons: Sequence[str | None] | None = None) -> Future[list[Verdict]]:
        """Starts scoring; the Future holds one Verdict per response, in order. Call it as often
        as responses finish: submits run concurrently."""
        finish_reasons = list(finish_reasons) if finish_reasons is not None else ["stop"] * len(responses)
        if not len(responses) == len(rows) == len(finish_reasons):
            raise ValueError(f"batch sizes differ: {len(responses)} responses, {len(rows)} rows, "
                             f"{len(finish_reasons)} finish reasons")
        self._refuse_unscorable(rows)
        return self._jobs.submit(self._score, list(responses), list(rows), finish_reasons)

    def score(self, responses: Sequence[str], rows: Sequence[Row],
              finish_reasons: Sequence[str | None] | None = None) -> list[Verdict]:
        return self.submit(responses, rows, finish_reasons).result()

    # ---- inside a job ----------------------------------------------------------------------
    def _score(self, responses: list[str], rows: list[Row], finish_reasons: list[str | None]) -> list[Verdict]:
        self._raise_armed_fault()  # trainer.fault=reward@N: this job's Future holds it
        own: dict[str, list[int]] = defaultdict(list)  # verifier -> finished responses it judges
        for i, (row, reason) in enumerate(zip(rows, finish_reasons)):
            if reason == "stop":
                own[row.verifier].append(i)
        others = {g: [i for i, row in enumerate(rows) if row.verifier != g] for g in self.every_row}
        runs = [(name, indices) for name, indices in [*own.items(), *others.items()] if indices]
        futures = [self._backends.submit(self._run, name, indices, responses, rows, finish_reasons)
                   for name, indices in runs]
        parts: list[dict[str, _Part]] = [{} for _ in responses]
        for (name, indices), future in zip(runs, futures):
            for i, part in zip(indices, future.result()):
                parts[i][name] = part
        for i, row in enumerate(rows):
            if row.verifier not in parts[i]:  # truncated: scores 0, but what it holds is still recorded
                parts[i][row.verifier] = _Part(0.0, "truncated", extracted=self._extract(row, responses[i]))
        return [self._verdict(row, parts[i]) for i, row in enumerate(rows)]

    def _extract(self, row: Row, response: str) -> str | None:
        """What a built-in verifier reads from a response (answer, code or letter), unjudged."""
        if row.verifier == "math":
            return extract_answer(response, self.cfg.math.extraction)
        if row.verifier == "code":
            return extract_code(response, self.cfg.code.extraction)
        if row.verifier == "multiple_choice":
            return extract_choice(response, len(row.choices), self.cfg.math.extraction)
        return None

    def _verdict(self, row: Row, parts: dict[str, _Part]) -> Verdict:
        own = parts[row.verifier]
        components = {name: part.value for name, part in parts.items()}
        score = sum(self.cfg.weights.get(name, 1.0) * value for name, value in components.items())
        extras = {f"{name}/{key}": v for name, part in parts.items() for key, v in part.extras.items()}
        passed, run, timeouts = own.tests
        statuses = {name: part.status for name, part in parts.items()}
        return Verdict(row.verifier, row.data_source or row.source, score, own.correct, own.extracted, components,
                       statuses, own.seconds, sum(p.cpu_s for p in parts.values()), passed, run, timeouts, extras)

    def _run(self, name: str, indices: list[int], responses: list[str], rows: list[Row],
             finish_reasons: list[str | None]) -> list[_Part]:
        """One verifier's judgements of `indices`: a span of its lane on the run's timeline."""
        with RECORDER.span(f"reward/{name}", "score", items=len(indices)):
            return self._judge(name, indices, responses, rows, finish_reasons)

    def _judge(self, name: str, indices: list[int], responses: list[str], rows: list[Row],
               finish_reasons: list[str | None]) -> list[_Part]:
        texts = [responses[i] for i in indices]
        if name == "math":
            outcomes = self.math.judge(texts, [rows[i].answers for i in indices])
            return [_Part(self.math.reward_of(o), o.status, o.status == "ok" and o.value.correct,
                          o.value.answer if o.status == "ok" else self._extract(rows[i], responses[i]),
                          o.seconds, o.cpu_seconds) for o, i in zip(outcomes, indices)]
        if name == "code":
            judged = self.code.judge(texts, [rows[i].tests for i in indices])
            return [_Part(j.score, "error" if j.launch_failures else "ok", j.score == 1.0, j.code, j.wall_s, j.cpu_s,
                          (j.tests_passed, j.tests_run, j.timeouts)) for j in judged]
        if name == MODEL:  # scored by the reward-model role only
            return [_Part(0.0) for _ in indices]
        if name == "multiple_choice":
            letters = [self._extract(rows[i], responses[i]) for i in indices]
            return [_Part(float(a == rows[i].answer), "ok", a == rows[i].answer, a) for a, i in zip(letters, indices)]
        records = [{**rows[i].record(), "finish_reason": finish_reasons[i]} for i in indices]
        outcomes = (self.endpoints[name].run(texts, records) if name in self.endpoints
                    else self.functions.run(name, texts, records))
        return [_custom_part(o) for o in outcomes]

    def close(self) -> None:
        self._jobs.shutdown()
        self._backends.shutdown()
        for backend in (self.math, self.code, self.functions):  # endpoints hold nothing between calls
            if backend is not None:
                backend.close()

    def __enter__(self) -> RewardRouter:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def refuse_unknown_verifiers(rows: Sequence[Row], cfg: RouterConfig) -> None:
    """Refuses, naming its file and row, a row whose verifier no built-in or reward.custom entry defines."""
    known = {*BUILTIN_VERIFIERS, MODEL, *cfg.specs}
    for row in rows:
        if row.verifier not in known:
            raise DatasetFormatError(row.source, row.number, f"unknown verifier {row.verifier!r}; known: "
                                     f"{sorted(known)} (add it to reward.custom)")


def _custom_part(outcome: Any) -> _Part:
    if outcome.status != "ok":
        return _Part(0.0, outcome.status, seconds=outcome.seconds)
    result = dict(outcome.value)
    score = result.pop("score")
    return _Part(score, "ok", score >= 1.0, None, outcome.seconds, outcome.cpu_seconds, extras=result)


def _mean(values: Sequence[float]) -> float:
    return sum(values) / len(values) if values else 0.0


def reward_metrics(verdicts: Sequence[Verdict]) -> dict[str, float]:
    """`reward/*` over a batch: overall, per verifier (`reward/<verifier>/...`) and per data
    source (`reward/source/<source>/...`): accuracy, scores, failures, time and CPU seconds."""
    finished = [v for v in verdicts if v.status != "truncated"]
    metrics = {
        "reward/accuracy": _mean([v.correct for v in verdicts if v.verifier != MODEL]),  # what is verifiable
        "reward/truncated_rate": 1 - len(finished) / max(len(verdicts), 1),
        "reward/extraction_failure_rate": _mean([v.extracted is None for v in finished if v.verifier in BUILTIN_VERIFIERS]),
        **_failures("reward", verdicts, None),
        **{f"reward/verify_s_{name}": float(np.quantile([v.seconds for v in finished], q)) if finished else 0.0
           for name, q in (("p50", 0.5), ("p99", 0.99), ("max", 1.0))},
        "reward/verify_cpu_s": sum(v.cpu_s for v in verdicts),
    }
    by_verifier, by_source = defaultdict(list), defaultdict(list)
    for v in verdicts:
        by_verifier[v.verifier].append(v)
        by_source[v.source].append(v)
    for name, group in by_verifier.items():
        metrics |= {f"reward/{name}/count": float(len(group)), f"reward/{name}/accuracy": _mean([v.correct for v in group]),
                    f"reward/{name}/score_mean": _mean([v.score for v in group]),
                    f"reward/{name}/cpu_s": sum(v.cpu_s for v in group), **_failures(f"reward/{name}", group, name)}
    if code := by_verifier.get("code"):
        metrics |= {"reward/code/executed": float(sum(v.tests_run > 0 for v in code)),
                    "reward/code/test_pass_rate": sum(v.tests_passed for v in code) / max(sum(v.tests_run for v in code), 1)}
    for name, group in by_source.items():
        metrics |= {f"reward/source/{name}/count": float(len(group)),
                    f"reward/source/{name}/accuracy": _mean([v.correct for v in group]),
                    f"reward/source/{name}/score_mean": _mean([v.score for v in group])}
    components = {name for v in verdicts for name in v.components} | {key for v in verdicts for key in v.extras}
    for name in sorted(components - set(by_verifier)):  # the rewards added to every row, and dict entries
        values = [v.components.get(name, v.extras.get(name)) for v in verdicts]
        metrics[f"reward/{name}/mean"] = _mean([x for x in values if x is not None])
        if any(name in v.statuses for v in verdicts):
            metrics |= _failures(f"reward/{name}", [v for v in verdicts if name in v.statuses], name)
    return metrics


def _failures(prefix: str, verdicts: Sequence[Verdict], name: str | None) -> dict[str, float]:
    """Timeouts (and code test cases killed), crashes and errors of reward `name` (None: all)."""
    statuses = [s for v in verdicts for n, s in v.statuses.items() if name in (None, n)]
    test_timeouts = sum(v.test_timeouts for v in verdicts) if name in (None, "code") else 0
    return {
        f"{prefix}/timeouts": float(statuses.count("timeout") + test_timeouts),
        f"{prefix}/crashes": float(statuses.count("crash")),
        f"{prefix}/errors": float(statuses.count("error")),
    }
