"""The names a run's algorithm settings choose among, and what each advantage estimator asks of
the run: declared here, below the run rules, the placement and the planner, which read them
without torch. `orz/ppo/core_algos.py` registers an implementation under each name, and refuses a
name not declared here (tests/test_core_algos.py checks that every name has one).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence


@dataclass(frozen=True)
class EstimatorNeeds:
    needs_critic: bool = False  # whether the trainer must run a critic to fill the values
    # Whether it reads per-token rewards; if not (group estimators read one score per sample), a
    # KL penalty "in the reward" must enter the score instead (core_algos.kl_in_score).
    reads_token_rewards: bool = False
    # Batch whitening on top, in the estimator's published form: PPO's GAE and REINFORCE++ whiten;
    # GRPO, Dr.GRPO and RLOO do not (it would undo Dr.GRPO's "no std"); ORZ's GRPO whitens inside.
    whitens: bool = False


ADVANTAGE_ESTIMATORS = {  # algorithm.advantage
    "gae": EstimatorNeeds(needs_critic=True, reads_token_rewards=True, whitens=True),
    "reinforce_pp": EstimatorNeeds(reads_token_rewards=True, whitens=True),
    "orz_grpo": EstimatorNeeds(), "grpo": EstimatorNeeds(), "dr_grpo": EstimatorNeeds(), "rloo": EstimatorNeeds(),
}
POLICY_LOSSES = ("cispo", "gspo", "ppo")  # algorithm.policy_loss
AGGREGATIONS = ("seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm", "token-mean")  # algorithm.loss_agg
KL_PENALTIES = ("k1", "k2", "k3", "k3+")  # algorithm.kl_kind
IS_LEVELS = ("token", "sequence")  # algorithm.is_level


def check_band(name: str, band: Sequence[float | None] | None) -> None:
    """A band [low, high] around 1 (either end None: open): low < 1 < high, else ValueError naming it."""
    if band is None:
        return
    if len(band) != 2 or all(end is None for end in band):
        raise ValueError(f"{name} must be [low, high] with at least one end set (null: open), got {list(band)}")
    low, high = band
    if low is not None and not 0 <= low < 1:
        raise ValueError(f"{name}: its low end {low} must lie in [0, 1): a ratio of 1 (no mismatch) must stay inside")
    if high is not None and not high > 1:
        raise ValueError(f"{name}: its high end {high} must be above 1: a ratio of 1 (no mismatch) must stay inside")
