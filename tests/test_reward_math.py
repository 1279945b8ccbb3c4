"""MathReward: ORZ's scoring rules, what it judged, pathological inputs, threads, Ray, real benchmark answers."""
import json
import os
import threading
import time

import pytest

from orz.reward.math import MathReward, MathRewardConfig

TIMEOUT_S = 2.0  # short, for the pathological inputs; `patient` is for right answers on a busy machine


def scores(reward, responses, truths, finish_reasons=None) -> list[float]:
    """The rewards of the responses, through the verifier's one entry point (judge), as the router scores them."""
    return [reward.reward_of(result) for result in reward.judge(responses, truths, finish_reasons)]


@pytest.fixture(scope="module")
def reward():
    with MathReward(MathRewardConfig(num_workers=2, timeout_s=TIMEOUT_S)) as reward:
        yield reward


@pytest.fixture(scope="module")
def patient():
    with MathReward(MathRewardConfig(num_workers=2, timeout_s=60.0)) as reward:
        yield reward


def test_right_and_finished_scores_one(patient):
    responses = [
        r"<think>half</think> <answer>\boxed{\frac{1}{2}}</answer>",
        r"<think>half</think> <answer>0.5</answer>",
        r"<think>wrong</think> <answer>0.6</answer>",
        r"no answer at all",
        r"<think>half</think> <answer>\boxed{\frac{1}{2}}</answer>",  # right but cut off
    ]
    results = patient.judge(responses, ["1/2"] * 5, ["stop"] * 4 + ["length"])
    assert [patient.reward_of(r) for r in results] == [1.0, 1.0, 0.0, 0.0, 0.0]
    assert results[4] is None  # truncated: not verified
    assert [r.status for r in results[:4]] == ["ok"] * 4
    assert [(r.value.correct, r.value.extracted) for r in results[:4]] == [(True, True), (True, True), (False, True),
                                                                          (False, False)]


def test_call_without_finish_reasons_means_all_finished(reward):
    assert scores(reward, [r"\boxed{3}", r"\boxed{4}"], ["3", "3"]) == [1.0, 0.0]


def test_mismatched_batch_is_an_error(reward):
    with pytest.raises(ValueError, match="2 responses, 1 ground truths"):
        reward.judge(["a", "b"], ["1"], ["stop", "stop"])


def test_format_reward_is_added_for_orz_template():
    cfg = MathRewardConfig(num_workers=1, timeout_s=TIMEOUT_S, format_reward=0.5)
    with MathReward(cfg) as reward:
        results = reward.judge(["x </think> <answer>7</answer>", "x </think> <answer>8</answer>", r"\boxed{7}"],
                               ["7"] * 3)
        assert [reward.reward_of(r) for r in results] == [1.5, 0.5, 1.0]
    assert [r.value.well_formatted for r in results] == [True, True, False]


def test_pathological_inputs_score_zero_within_the_timeout(reward):
    hostile = [
        r"\boxed{2^{2^{2^{100}}}}",
        r"\boxed{" + "{" * 20_000 + "1" + "}" * 20_000 + "}",
        "x" * 1_000_000 + r"\boxed{7}",
        r"\boxed{" + "9" * 200_000 + "}",
    ]
    start = time.monotonic()
    results = reward.judge(hostile + [r"\boxed{7}"], ["7"] * 5)
    elapsed = time.monotonic() - start
    assert [reward.reward_of(r) for r in results] == [0.0, 0.0, 1.0, 0.0, 1.0]
    # Each hostile item costs at most one timeout; two workers share them.
    assert elapsed < 2 * TIMEOUT_S + 6.0  # slack for a busy machine; unbounded without the pool
    assert sum(r.status in ("timeout", "error") for r in results) >= 1
    assert scores(reward, [r"\boxed{5}"], ["5"]) == [1.0]  # the pool keeps serving


def test_scores_from_many_threads(patient):
    results = {}

    def score(k):
        results[k] = scores(patient, [rf"\boxed{{{k}}}", rf"\boxed{{{k + 1}}}"], [str(k), str(k)])

    threads = [threading.Thread(target=score, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results == {k: [1.0, 0.0] for k in range(4)}


def test_real_benchmark_answers(patient, shared_data):
    """Every AIME answer and a sample of MATH500's score 1 against themselves, 0 when perturbed."""
    rows = []
    for name, stride in (("aime2024.json", 1), ("math500.json", 10)):
        with open(os.path.join(shared_data, name)) as f:
            rows += json.load(f)[::stride]
    truths = [row["final_answer"] for row in rows]
    right = scores(patient, [rf"<think>...</think> <answer>\boxed{{{t}}}</answer>" for t in truths], truths)
    assert sum(right) == len(truths), [t for t, s in zip(truths, right) if s != 1.0]
    aime = truths[:30]
    wrong = scores(patient, [rf"\boxed{{{int(t) + 1}}}" for t in aime], aime)
    assert sum(wrong) == 0


@pytest.mark.slow
def test_inside_a_ray_actor(ray_cluster):
    ray = ray_cluster

    @ray.remote(num_cpus=0)
    class Scorer:
        def __init__(self):
            self.reward = MathReward(MathRewardConfig(num_workers=1, timeout_s=1.0))

        def score(self, responses, truths):
            return [self.reward.reward_of(r) for r in self.reward.judge(responses, truths)]

    scorer = Scorer.remote()
    responses = [r"\boxed{\frac12}", r"\boxed{2^{2^{2^{100}}}}", r"\boxed{3}"]
    assert ray.get(scorer.score.remote(responses, ["0.5", "1", "3"])) == [1.0, 0.0, 1.0]
    ray.kill(scorer)
