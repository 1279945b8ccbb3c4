"""Math reward: extract a response's final answer and check it against the ground truth with
math-verify (latex2sympy2_extended + sympy), in a pool of killable workers.

    reward = MathReward(MathRewardConfig(num_workers=2))
    results = reward.judge(responses, ground_truths, finish_reasons)   # the router's entry point
    scores = [reward.reward_of(r) for r in results]

A response scores 1 only when its answer is right and it finished (vLLM finish reason "stop"); a
truncated response scores 0, as in ORZ. Parsing and comparing run in worker processes with a hard
per-item wall-clock limit, so a pathological answer (`2^{2^{2^{100}}}`) costs one timeout, not a
stalled trainer.
"""
from __future__ import annotations

import functools
import logging
import re
from collections.abc import Sequence
from dataclasses import dataclass

from math_verify import ExprExtractionConfig, LatexExtractionConfig, parse, verify

from orz.data.answers import DEFAULT_EXTRACTION, EXTRACTORS, extract_answer
from orz.data.templates import ANSWER_CLOSE, ANSWER_OPEN, THINK_CLOSE
from orz.reward.pool import ItemResult, KillablePool

# math-verify warns once that its own timeout is off; it is off on purpose (it uses SIGALRM, which
# only works in the main thread), and the pool's kill is the timeout.
logging.getLogger("math_verify").setLevel(logging.ERROR)

# --------------------------------------------------------------------------------------------------
# Equivalence

_PARSE_CONFIG = (LatexExtractionConfig(boxed_match_priority=0), ExprExtractionConfig())
# A digit group separated by a LaTeX space (`1\,000`, `1\ 000`) or a plain one: math-verify 0.9.0
# reads `1\,000` as 1 (it handles `1,000`, `1{,}000` and `1,\!000` itself).
_SPACED_THOUSANDS = re.compile(r"(?<=\d)(?:\\[,!:; ]|~| )(?=\d{3}(?!\d))")
_PERCENT = re.compile(r"\\?%")


def _normalise(answer: str) -> str:
    """Fixes the forms math-verify misreads before it sees them (see the patterns above) and
    drops a sentence's final period (`73.`)."""
    return _SPACED_THOUSANDS.sub("", answer.strip()).removesuffix(".")


def _parse(answer: str) -> list:
    # Wrapping in \boxed makes math-verify read the whole string as one LaTeX answer instead of
    # searching it for the last expression. parsing_timeout=None: the pool enforces time.
    return parse(f"\\boxed{{{_normalise(answer)}}}", extraction_config=_PARSE_CONFIG, parsing_timeout=None)


_parse_ground_truth = functools.lru_cache(maxsize=4096)(_parse)  # GRPO repeats each ground truth


def _verify(prediction: str, ground_truth: str) -> bool:
    gold = _parse_ground_truth(ground_truth)
    predicted = _parse(prediction)
    # allow_set_relation_comp: `-1<x<1` answers `(-1,1)` (math-verify only allows it when the
    # prediction is the set).
    return bool(gold and predicted) and verify(
        gold, predicted, allow_set_relation_comp=True, timeout_seconds=None
    )


def is_equivalent(prediction: str, ground_truth: str) -> bool:
    """Whether `prediction` is mathematically equal to `ground_truth` (both LaTeX or plain text).

    A percent sign is optional (`12.5\\%` equals both `12.5` and `0.125`): math-verify accepts
    `50\\%` = `50` for integers only. No timeout here: call it through MathReward (or another
    KillablePool) on untrusted input."""
    if _verify(prediction, ground_truth):
        return True
    if _PERCENT.search(prediction) or _PERCENT.search(ground_truth):
        return _verify(_PERCENT.sub("", prediction), _PERCENT.sub("", ground_truth))
    return False


# --------------------------------------------------------------------------------------------------
# Reward



def _well_formatted(response: str) -> bool:
    """Whether the response ends with ORZ's `</think> <answer> X </answer>`, X not blank."""
    tail = response.rstrip()
    if not tail.endswith(ANSWER_CLOSE):
        return False
    answer_at = tail.rfind(ANSWER_OPEN)
    think_at = tail.rfind(THINK_CLOSE, 0, max(answer_at, 0))
    return (
        answer_at >= 0 and think_at >= 0
        and not tail[think_at + len(THINK_CLOSE) : answer_at].strip()
        and bool(tail[answer_at + len(ANSWER_OPEN) : -len(ANSWER_CLOSE)].strip())
    )


@dataclass(frozen=True)
class MathRewardConfig:
    extraction: tuple[str, ...] = DEFAULT_EXTRACTION  # answer forms, in order of preference
    # Added to a finished response that ends with `</think> <answer>...</answer>` (ORZ's template);
    # 0 turns the format bonus off, which is ORZ's choice.
    format_reward: float = 0.0
    num_workers: int = 2  # verifier processes; each verifies one item at a time
    timeout_s: float = 5.0  # hard wall-clock limit per response; its worker is killed past it
    chunk_size: int = 32  # items sent to a worker at once; amortises the pipe round trip
    memory_limit_mb: int | None = 4096  # per worker; sympy blow-ups fail with MemoryError instead


@dataclass(frozen=True)
class MathVerdict:
    answer: str | None  # the extracted answer
    correct: bool
    well_formatted: bool

    @property
    def extracted(self) -> bool:
        return self.answer is not None


def _judge(item: tuple[str, tuple[str, ...], tuple[str, ...]]) -> MathVerdict:
    """Worker side: extraction, format check and verification of one response against any of
    its acceptable answers."""
    response, ground_truths, extraction = item
    answer = extract_answer(response, extraction)
    return MathVerdict(
        answer=answer,
        correct=answer is not None and any(is_equivalent(answer, truth) for truth in ground_truths),
        well_formatted=_well_formatted(response),
    )


def _warm_up() -> None:
    """Runs the lazy parts of math-verify (ANTLR parser, sympy caches) before the first item."""
    is_equivalent("\\frac{1}{2}", "0.5")


class MathReward:
    """Scores batches of responses; holds a persistent verifier pool (call `close()` when done)."""

    def __init__(self, cfg: MathRewardConfig = MathRewardConfig()):
        for name in cfg.extraction:
            if name not in EXTRACTORS:
                raise ValueError(f"unknown answer form {name!r}; valid: {sorted(EXTRACTORS)}")
        self.cfg = cfg
        self.pool = KillablePool(
            _judge,
            cfg.num_workers,
            cfg.timeout_s,
            initializer=_warm_up,
            chunk_size=cfg.chunk_size,
            memory_limit_mb=cfg.memory_limit_mb,
        )

    def judge(self, responses: Sequence[str], ground_truths: Sequence[str | Sequence[str]],
              finish_reasons: Sequence[str | None] | None = None) -> list[ItemResult | None]:
        """The pool's result per response (its value a MathVerdict when ok); None for a truncated
        response, which is not verified. A ground truth is one answer or several acceptable ones."""
        if finish_reasons is None:
            finish_reasons = ["stop"] * len(responses)
        if not len(responses) == len(ground_truths) == len(finish_reasons):
            raise ValueError(
                f"batch sizes differ: {len(responses)} responses, {len(ground_truths)} ground "
                f"truths, {len(finish_reasons)} finish reasons"
            )
        finished = [i for i, reason in enumerate(finish_reasons) if reason == "stop"]
        truths = [(t,) if isinstance(t, str) else tuple(map(str, t)) for t in ground_truths]
        outcomes = self.pool.map([(responses[i], truths[i], self.cfg.extraction) for i in finished])
        results: list[ItemResult | None] = [None] * len(responses)
        for i, outcome in zip(finished, outcomes):
            results[i] = outcome
        return results

    def reward_of(self, outcome: ItemResult | None) -> float:
        """The reward of one judged response: 1 if right, plus the format bonus if well formed."""
        if outcome is None or outcome.status != "ok":
            return 0.0
        return float(outcome.value.correct) + self.cfg.format_reward * outcome.value.well_formatted

    def close(self) -> None:
        self.pool.close()

    def __enter__(self) -> MathReward:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
