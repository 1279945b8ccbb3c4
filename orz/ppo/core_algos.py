"""The mathematics of PPO/GRPO for LLM reasoners: advantages, losses, KL and entropy control.

Pure torch (no Ray, Megatron or vLLM), so every recipe can be checked number by number on a CPU.

Conventions, true of every function here:
- Per-token tensors are (B, T) over *response* tokens, right-padded; ``mask`` (B, T) is 1 on real
  response tokens. Per-sample tensors are (B,).
- Outputs are exactly 0 where ``mask`` is 0, and values at masked positions never reach an output:
  they are replaced by 0 with ``torch.where`` before any arithmetic, so even NaN there is harmless.
  Where a mask has holes (tool output inside a multi-turn response), recursions such as GAE skip
  the masked tokens, as if they had been cut out of the sequence.
- Inputs may be float32 or bfloat16 on any device; arithmetic and outputs are float32 on the
  inputs' device.
- Bad input raises ``ValueError`` naming the argument: a shape that does not match, a mask holding
  anything but 0 and 1, NaN or inf at a real token, an unknown kind, mode or estimator name.

Algorithms are picked by name from four registries, so the trainer never branches on names:
``ADVANTAGE_ESTIMATORS`` (via ``estimate_advantages``), ``POLICY_LOSSES``, ``AGGREGATIONS`` (loss
aggregation modes) and ``KL_PENALTIES`` (KL estimator kinds).

Losses return ``(loss, metrics)``. Metric values are 0-d detached float32 tensors on the loss's
device (no host sync per micro-batch; the trainer reduces them and calls ``.item()`` once). Keys
ending in ``_loss`` hold this call's loss, which sums over micro-batches when a mini-batch
``denominator`` is given; every other metric is a mean or extreme over this call's real tokens.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch
from torch import Tensor

from orz import algorithm_names as declared
from orz.algorithm_names import check_band

__all__ = [
    "Registry", "ADVANTAGE_ESTIMATORS", "POLICY_LOSSES", "AGGREGATIONS", "KL_PENALTIES",
    "compute_gae", "compute_grpo_advantages", "compute_orz_grpo_advantages", "compute_rloo_advantages",
    "compute_reinforce_pp_advantages", "whiten", "AdvantageInputs", "AdvantageEstimator",
    "register_advantage_estimator", "estimate_advantages", "reward_on_last_token", "kl_in_score", "kl_penalty",
    "aggregate", "aggregate_denominator", "ppo_policy_loss", "gspo_policy_loss", "cispo_policy_loss",
    "truncated_is_weights", "sequence_is_weights", "IS_LEVELS", "masked_mean", "check_band", "mismatch_keep_mask",
    "mismatch_metrics", "routing_agreement_counts", "actor_loss", "value_loss",
    "entropy_bonus", "overlong_penalty", "dynamic_sampling_filter", "FixedKLController",
    "AdaptiveKLController", "AdaptiveEntropyController",
]


class Registry:
    """Implementations of one kind of thing, by name; the config names one and the trainer looks it up."""

    def __init__(self, kind: str, declared: Sequence[str]):
        self.kind = kind  # what the entries are, for error messages: "advantage estimator"
        self.declared = tuple(declared)  # the names the config may give (orz/algorithm_names.py)
        self._entries: dict[str, Any] = {}

    def add(self, name: str, entry: Any) -> Any:
        if name in self._entries:
            raise ValueError(f"{self.kind} {name!r} is already registered")
        if name not in self.declared:
            raise ValueError(f"{self.kind} {name!r} is not declared in orz/algorithm_names.py")
        self._entries[name] = entry
        return entry

    def register(self, name: str) -> Callable[[Any], Any]:
        """Decorator form of ``add``."""
        return lambda entry: self.add(name, entry)

    def get(self, name: str) -> Any:
        if name not in self._entries:
            raise ValueError(f"unknown {self.kind} {name!r}; valid: {', '.join(self.names())}")
        return self._entries[name]

    def names(self) -> tuple[str, ...]:
        return tuple(sorted(self._entries))

    def __contains__(self, name: str) -> bool:
        return name in self._entries


ADVANTAGE_ESTIMATORS = Registry("advantage estimator", declared.ADVANTAGE_ESTIMATORS)
POLICY_LOSSES = Registry("policy loss", declared.POLICY_LOSSES)
AGGREGATIONS = Registry("aggregation mode", declared.AGGREGATIONS)
KL_PENALTIES = Registry("KL penalty kind", declared.KL_PENALTIES)


# ---------------------------------------------------------------------------------------------
# Input checks. Each returns what the math needs: a bool mask, float32 values with padding zeroed.


def _as_2d(name: str, x: Any) -> Tensor:
    if not isinstance(x, Tensor) or x.dim() != 2:
        raise ValueError(f"{name} must be a (B, T) tensor, got {_describe(x)}")
    return x


def _as_mask(mask: Any) -> Tensor:
    """A (B, T) mask of 0s and 1s (any dtype) as bool."""
    mask = _as_2d("mask", mask)
    if mask.dtype != torch.bool and not ((mask == 0) | (mask == 1)).all():
        raise ValueError("mask must hold only 0 and 1")
    return mask.bool()


def _real_mask(mask: Any, like: Any, like_name: str) -> Tensor:
    """(B, T) bool mask of real tokens, checked against the (B, T) tensor ``like``."""
    like = _as_2d(like_name, like)
    if isinstance(mask, Tensor) and mask.shape != like.shape:
        raise ValueError(f"mask must have the shape of {like_name} {tuple(like.shape)}, got {_describe(mask)}")
    return _as_mask(mask)


def _real_values(name: str, x: Tensor, real: Tensor) -> Tensor:
    """``x`` as float32 with masked positions set to 0; NaN or inf at a real position is an error."""
    if not isinstance(x, Tensor) or x.shape != real.shape:
        raise ValueError(f"{name} must have the shape of mask {tuple(real.shape)}, got {_describe(x)}")
    x = x.float()
    if not (torch.isfinite(x) | ~real).all():
        raise ValueError(f"{name} holds NaN or inf at a real (mask = 1) position")
    return torch.where(real, x, 0.0)


def _sample_values(name: str, x: Tensor) -> Tensor:
    """A (B,) per-sample tensor as finite float32."""
    if not isinstance(x, Tensor) or x.dim() != 1:
        raise ValueError(f"{name} must be a (B,) tensor, got {_describe(x)}")
    x = x.float()
    if not torch.isfinite(x).all():
        raise ValueError(f"{name} holds NaN or inf")
    return x


def _describe(x: Any) -> str:
    return f"shape {tuple(x.shape)}" if isinstance(x, Tensor) else type(x).__name__


def _check_range(name: str, value: float, low: float, high: float) -> None:
    if not low <= value <= high:
        raise ValueError(f"{name} must be in [{low}, {high}], got {value}")


def _masked_mean(x: Tensor, real: Tensor) -> Tensor:
    return torch.where(real, x, 0.0).sum() / real.sum().clamp_min(1)


def _masked_extreme(x: Tensor, real: Tensor, largest: bool) -> Tensor:
    """Max (or min) of ``x`` over real tokens; 0 when there are none."""
    fill = -math.inf if largest else math.inf
    candidates = torch.cat([torch.where(real, x, fill).flatten(), x.new_full((1,), fill)])
    extreme = candidates.max() if largest else candidates.min()
    return torch.where(real.any(), extreme, 0.0)


# ---------------------------------------------------------------------------------------------
# Groups: responses to the same prompt share a group_index.


@dataclass(frozen=True)
class _Groups:
    of_sample: Tensor  # (B,) group number 0..G-1 of each sample
    size: Tensor       # (B,) float number of samples in each sample's group
    count: int         # G

    def sum(self, x: Tensor) -> Tensor:
        """(B,) sum of ``x`` over each sample's group."""
        totals = x.new_zeros(self.count).index_add_(0, self.of_sample, x)  # (G,)
        return totals[self.of_sample]


def _groups(group_index: Tensor | Sequence[int], scores: Tensor) -> _Groups:
    group_index = torch.as_tensor(group_index, device=scores.device)
    if group_index.shape != scores.shape or group_index.is_floating_point() or group_index.dtype == torch.bool:
        raise ValueError(f"group_index must be a (B,) integer tensor like scores {tuple(scores.shape)}, "
                         f"got shape {tuple(group_index.shape)} {group_index.dtype}")
    ids, of_sample, counts = torch.unique(group_index, return_inverse=True, return_counts=True)
    return _Groups(of_sample, counts.float()[of_sample], len(ids))


def _broadcast(per_sample: Tensor, real: Tensor) -> Tensor:
    """(B,) → (B, T): each sample's value on its real tokens."""
    if per_sample.shape != real.shape[:1]:
        raise ValueError(f"per-sample values have shape {tuple(per_sample.shape)}, mask has {tuple(real.shape)}")
    return torch.where(real, per_sample[:, None], 0.0)


# ---------------------------------------------------------------------------------------------
# Advantage estimators: explicit functions first, then one adapter per registered name.


@torch.no_grad()
def compute_gae(rewards: Tensor, values: Tensor, mask: Tensor, gamma: float = 1.0,
                lam: float = 1.0) -> tuple[Tensor, Tensor]:
    """Generalized advantage estimation (Schulman et al. 2015, arXiv:1506.02438).

        δₜ = rₜ + γ·Vₜ₊₁ − Vₜ,   Aₜ = δₜ + γλ·Aₜ₊₁,   returnsₜ = Aₜ + Vₜ,

    with V = A = 0 after a sequence's last real token; masked tokens are skipped (t + 1 means the
    next real token). With γ = λ = 1 (ORZ's recipe), Aₜ = Σ_{s≥t} r_s − Vₜ.

    rewards, values, mask: (B, T). Returns (advantages, returns), both (B, T).
    """
    real = _real_mask(mask, rewards, "rewards")
    rewards = _real_values("rewards", rewards, real)
    values = _real_values("values", values, real)
    _check_range("gamma", gamma, 0.0, 1.0)
    _check_range("lam", lam, 0.0, 1.0)
    advantages = torch.zeros_like(rewards)
    next_value = rewards.new_zeros(rewards.shape[0])      # (B,) V of the next real token
    next_advantage = rewards.new_zeros(rewards.shape[0])  # (B,) A of the next real token
    for t in reversed(range(rewards.shape[1])):
        is_real = real[:, t]
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        advantage = delta + gamma * lam * next_advantage
        advantages[:, t] = torch.where(is_real, advantage, 0.0)
        next_value = torch.where(is_real, values[:, t], next_value)
        next_advantage = torch.where(is_real, advantage, next_advantage)
    returns = torch.where(real, advantages + values, 0.0)
    return advantages, returns


@torch.no_grad()
def compute_grpo_advantages(scores: Tensor, group_index: Tensor, norm_by_std: bool = True,
                            eps: float = 1e-6) -> Tensor:
    """Group-relative advantages: GRPO (Shao et al. 2024, DeepSeekMath, arXiv:2402.03300).

        Aᵢ = (sᵢ − mean_g s) / (std_g s + eps)     std Bessel-corrected, exactly ``torch.std``
        Aᵢ = sᵢ − mean_g s                         norm_by_std=False: Dr.GRPO (Liu et al. 2025,
                                                   arXiv:2503.20783), no per-group scale bias

    g is the group of samples sharing sᵢ's ``group_index`` (responses to one prompt). A group of
    one sample gets 0. scores, group_index: (B,). Returns (B,).
    """
    scores = _sample_values("scores", scores)
    groups = _groups(group_index, scores)
    centered = scores - groups.sum(scores) / groups.size
    if norm_by_std:
        variance = groups.sum(centered.square()) / (groups.size - 1).clamp_min(1)
        centered = centered / (variance.sqrt() + eps)
    return torch.where(groups.size > 1, centered, 0.0)


@torch.no_grad()
def compute_rloo_advantages(scores: Tensor, group_index: Tensor) -> Tensor:
    """REINFORCE leave-one-out (Ahmadian et al. 2024, arXiv:2402.14740).

        Aᵢ = sᵢ − (Σ_{j∈g, j≠i} s_j) / (n_g − 1)

    A group of one sample gets 0. scores, group_index: (B,). Returns (B,).
    """
    scores = _sample_values("scores", scores)
    groups = _groups(group_index, scores)
    others_mean = (groups.sum(scores) - scores) / (groups.size - 1).clamp_min(1)
    return torch.where(groups.size > 1, scores - others_mean, 0.0)


@torch.no_grad()
def compute_reinforce_pp_advantages(rewards: Tensor, mask: Tensor, gamma: float = 1.0) -> tuple[Tensor, Tensor]:
    """REINFORCE++ (Hu 2025, arXiv:2501.03262): discounted return-to-go, whitened over the batch.

        Gₜ = Σ_{s≥t} γ^(s−t) r_s,   A = whiten(G) over every real token of the batch

    rewards, mask: (B, T); rewards usually hold the score on the last token minus β·KL per token.
    Returns (A, G), each (B, T): the registered "reinforce_pp" estimator.
    """
    returns_to_go = _returns_to_go(rewards, mask, gamma)
    return whiten(returns_to_go, mask), returns_to_go


def _returns_to_go(rewards: Tensor, mask: Tensor, gamma: float) -> Tensor:
    """Gₜ = Σ_{s≥t} γ^(s−t) r_s over real tokens: GAE with V = 0 and λ = 1."""
    returns_to_go, _ = compute_gae(rewards, torch.zeros_like(rewards), mask, gamma=gamma, lam=1.0)
    return returns_to_go


@torch.no_grad()
def compute_orz_grpo_advantages(scores: Tensor, group_index: Tensor, mask: Tensor) -> Tensor:
    """GRPO as Open-Reasoner-Zero's published code runs it (Hu et al. 2025, arXiv:2503.24290).

    ORZ's trainer subtracts the group mean, then means to divide by the group std but writes
    ``if std := np.std(...) > 0: score /= std``, which binds ``std`` to the boolean ``True``: the
    division is by 1. The centred score is the reward on the last token; with no critic and
    γ = λ = 1 every token of the response gets it as its advantage, and ORZ's advantage
    normalisation then whitens over all real tokens of the buffer. Reproduced here on purpose:

        Aᵢₜ = whiten(sᵢ − mean_g s) over the real tokens of the batch      (no per-group std)

    Use "grpo" for the textbook algorithm. scores, group_index: (B,); mask: (B, T). Returns (B, T).
    """
    real = _as_mask(mask)
    centered = compute_grpo_advantages(scores, group_index, norm_by_std=False)
    return whiten(_broadcast(centered, real), real)


def whiten(x: Tensor, mask: Tensor, shift_mean: bool = True, eps: float = 1e-8) -> Tensor:
    """Masked whitening over every real token of the batch (ORZ whitens over the whole buffer).

        μ = mean of x over real tokens,  σ² = Σ (x − μ)² / (n − 1)   (Bessel, like torch.var)
        out = (x − μ) / √(σ² + eps)      shift_mean=False: out = (x − μ) / √(σ² + eps) + μ

    σ² is 0 when fewer than two tokens are real. x, mask: (B, T). Returns (B, T).
    """
    real = _real_mask(mask, x, "x")
    x = _real_values("x", x, real)
    count = real.sum()
    mean = x.sum() / count.clamp_min(1)
    centered = torch.where(real, x - mean, 0.0)
    variance = centered.square().sum() / (count - 1).clamp_min(1)
    whitened = centered * torch.rsqrt(variance + eps)
    if not shift_mean:
        whitened = whitened + mean
    return torch.where(real, whitened, 0.0)


@dataclass(frozen=True)
class AdvantageInputs:
    """Everything an estimator may read; each registered estimator takes only what it needs."""

    mask: Tensor                         # (B, T) 1 on real response tokens
    token_rewards: Tensor | None = None  # (B, T) per-token reward: score on the last token − β·kl
    scores: Tensor | None = None         # (B,) one verifier score per sample
    values: Tensor | None = None         # (B, T) critic's V(sₜ)
    group_index: Tensor | None = None    # (B,) prompt id; responses to one prompt share it
    gamma: float = 1.0                   # discount γ
    lam: float = 1.0                     # GAE λ

    def require(self, name: str, estimator: str) -> Tensor:
        value = getattr(self, name)
        if value is None:
            raise ValueError(f"advantage estimator {estimator!r} needs {name}")
        return value


@dataclass(frozen=True)
class AdvantageEstimator:
    compute: Callable[[AdvantageInputs], tuple[Tensor, Tensor]]  # inputs → (advantages, returns), (B, T) each
    needs: declared.EstimatorNeeds  # a critic, per-token rewards, whitening: declared with its name


def register_advantage_estimator(name: str):
    """Decorator: register ``compute(inputs) -> (advantages, returns)`` under ``name``, with the
    needs orz/algorithm_names.py declares for it."""
    return lambda compute: ADVANTAGE_ESTIMATORS.add(
        name, AdvantageEstimator(compute, declared.ADVANTAGE_ESTIMATORS.get(name, declared.EstimatorNeeds())))


def estimate_advantages(name: str, *, mask: Tensor, token_rewards: Tensor | None = None,
                        scores: Tensor | None = None, values: Tensor | None = None,
                        group_index: Tensor | None = None, gamma: float = 1.0,
                        lam: float = 1.0) -> tuple[Tensor, Tensor]:
    """The trainer's one call for every estimator. Returns (advantages, returns), (B, T) each.

    Per-sample advantages are broadcast over each sample's real response tokens. Estimators
    without a critic return ``returns = advantages``, except "reinforce_pp", which returns the
    discounted return-to-go it whitens.
    """
    estimator = ADVANTAGE_ESTIMATORS.get(name)
    inputs = AdvantageInputs(mask=mask, token_rewards=token_rewards, scores=scores, values=values,
                             group_index=group_index, gamma=gamma, lam=lam)
    return estimator.compute(inputs)


def _group_estimator(name: str, per_sample: Callable[[Tensor, Tensor], Tensor]) -> None:
    def compute(inputs: AdvantageInputs) -> tuple[Tensor, Tensor]:
        advantages = per_sample(inputs.require("scores", name), inputs.require("group_index", name))
        real = _as_mask(inputs.mask)
        advantages = _broadcast(advantages, real)
        return advantages, advantages

    register_advantage_estimator(name)(compute)


@register_advantage_estimator("gae")
def _gae(inputs: AdvantageInputs) -> tuple[Tensor, Tensor]:
    return compute_gae(inputs.require("token_rewards", "gae"), inputs.require("values", "gae"),
                       inputs.mask, inputs.gamma, inputs.lam)


@register_advantage_estimator("reinforce_pp")
def _reinforce_pp(inputs: AdvantageInputs) -> tuple[Tensor, Tensor]:
    return compute_reinforce_pp_advantages(inputs.require("token_rewards", "reinforce_pp"), inputs.mask, inputs.gamma)


@register_advantage_estimator("orz_grpo")
def _orz_grpo(inputs: AdvantageInputs) -> tuple[Tensor, Tensor]:
    advantages = compute_orz_grpo_advantages(inputs.require("scores", "orz_grpo"),
                                             inputs.require("group_index", "orz_grpo"), inputs.mask)
    return advantages, advantages


_group_estimator("grpo", compute_grpo_advantages)
_group_estimator("dr_grpo", lambda scores, group_index: compute_grpo_advantages(scores, group_index, norm_by_std=False))
_group_estimator("rloo", compute_rloo_advantages)


# ---------------------------------------------------------------------------------------------
# Rewards.


@torch.no_grad()
def reward_on_last_token(scores: Tensor, mask: Tensor, kl: Tensor | None = None,
                         kl_coef: float = 0.0) -> Tensor:
    """Per-token rewards from per-sample scores (ORZ's "reward on the last token").

        rₜ = s·[t is the last real token] − β·klₜ

    scores: (B,); mask, kl: (B, T), kl e.g. ``kl_penalty(logprob, ref_logprob, "k1", mask)``.
    A row without real tokens gets no reward. Returns (B, T).
    """
    scores = _sample_values("scores", scores)
    real = _as_mask(mask)
    if scores.shape != real.shape[:1]:
        raise ValueError(f"scores must have shape ({real.shape[0]},) like mask's rows, got {tuple(scores.shape)}")
    positions = torch.arange(real.shape[1], device=real.device)                # (T,)
    last = torch.where(real, positions, -1).amax(dim=1, keepdim=True)         # (B, 1), -1 if empty
    rewards = torch.where(positions == last, scores[:, None], 0.0)            # (B, T)
    if kl is not None:
        rewards = rewards - kl_coef * _real_values("kl", kl, real)
    return rewards


def kl_in_score(scores: Tensor, kl: Tensor, mask: Tensor, kl_coef: float) -> Tensor:
    """The KL penalty of a group estimator, which reads one score per sample (verl's choice):

        s'ᵢ = sᵢ − β·Σₜ klᵢₜ      over the real tokens of response i

    Summed, not averaged, so that it is exactly the return Σₜ rₜ that ``reward_on_last_token``
    gives a per-token estimator. scores: (B,); kl, mask: (B, T). Returns (B,).
    """
    scores = _sample_values("scores", scores)
    real = _real_mask(mask, kl, "kl")
    return scores - kl_coef * _real_values("kl", kl, real).sum(dim=1)


def overlong_penalty(lengths: Tensor, max_len: int | Tensor, buffer_len: int, factor: float = 1.0) -> Tensor:
    """DAPO's soft overlong punishment (Yu et al. 2025, arXiv:2503.14476).

        R(L) = min(−(L − (max_len − buffer_len)) / buffer_len · factor, 0)

    0 up to max_len − buffer_len, then falling linearly to −factor at max_len; clamped at −factor
    beyond max_len, as in the paper (generation stops at max_len, so this rarely matters).
    lengths: (B,) response lengths; max_len: one for all, or (B,) each sample's own (a multi-turn
    sample's budget). Returns (B,) float32, to add to the scores.
    """
    lengths = _sample_values("lengths", lengths)
    max_len = torch.as_tensor(max_len, dtype=lengths.dtype)
    if not (0 < buffer_len and bool((buffer_len <= max_len).all())):
        raise ValueError(f"buffer_len must be in (0, max_len={max_len.min().item():g}], got {buffer_len}")
    if factor < 0:
        raise ValueError(f"factor must be >= 0, got {factor}")
    penalty = -(lengths - (max_len - buffer_len)) / buffer_len * factor
    return penalty.clamp(min=-factor, max=0.0)


def dynamic_sampling_filter(scores: Tensor, group_index: Tensor) -> tuple[Tensor, int]:
    """DAPO's dynamic sampling, the pure part (Yu et al. 2025, arXiv:2503.14476).

    A group whose scores are all equal (all right, all wrong, or a single sample) has zero
    group-relative advantage and only dilutes the batch: drop it. The trainer draws more prompts,
    up to a limit, and logs the count dropped.

    scores, group_index: (B,). Returns (keep (B,) bool, number of groups dropped).
    """
    scores = _sample_values("scores", scores)
    groups = _groups(group_index, scores)
    highest = scores.new_zeros(groups.count).scatter_reduce(0, groups.of_sample, scores, "amax", include_self=False)
    lowest = scores.new_zeros(groups.count).scatter_reduce(0, groups.of_sample, scores, "amin", include_self=False)
    keep_group = highest > lowest  # (G,)
    return keep_group[groups.of_sample], int((~keep_group).sum())


# ---------------------------------------------------------------------------------------------
# KL estimators (Schulman 2020, "Approximating KL divergence"), Δ = log π − log π_ref.


@KL_PENALTIES.register("k1")
def _kl_k1(delta: Tensor) -> Tensor:
    return delta


@KL_PENALTIES.register("k2")
def _kl_k2(delta: Tensor) -> Tensor:
    return 0.5 * delta.square()


@KL_PENALTIES.register("k3")
def _kl_k3(delta: Tensor) -> Tensor:
    # Clamping Δ to ±20 first changes no value (|k3| > 10 there anyway) but keeps exp finite, so
    # the backward pass through the outer clamp stays 0 instead of 0·inf = NaN.
    delta = delta.clamp(-20.0, 20.0)
    return (torch.expm1(-delta) + delta).clamp(-10.0, 10.0)


@KL_PENALTIES.register("k3+")
def _kl_k3_plus(delta: Tensor) -> Tensor:
    k2 = _kl_k2(delta)
    return k2 + (_kl_k3(delta) - k2).detach()


def kl_penalty(logprob: Tensor, ref_logprob: Tensor, kind: str, mask: Tensor | None = None) -> Tensor:
    """Per-token KL(π‖π_ref) estimate from sampled tokens, Δ = logprob − ref_logprob.

        "k1":  Δ                      unbiased, high variance; the classic reward penalty
        "k2":  ½Δ²                    its gradient is Δ·∇logπ
        "k3":  e^(−Δ) + Δ − 1          unbiased, ≥ 0, low variance (GRPO's loss), clamped to [−10, 10]
        "k3+": the k3 value with the k2 gradient (straight-through), an unbiased gradient in the loss

    Use it in the reward (``reward_on_last_token(..., kl=...)``) or in the loss
    (``aggregate(kl_penalty(...), mask, agg)``). logprob, ref_logprob, mask: (B, T); without a mask
    every token is real. Returns (B, T).
    """
    estimator = KL_PENALTIES.get(kind)
    if mask is None:
        mask = torch.ones_like(_as_2d("logprob", logprob), dtype=torch.bool)
    real = _real_mask(mask, logprob, "logprob")
    delta = _real_values("logprob", logprob, real) - _real_values("ref_logprob", ref_logprob, real)
    return torch.where(real, estimator(delta), 0.0)


# ---------------------------------------------------------------------------------------------
# Loss aggregation: loss = Σ lₜ·mₜ·wₜ / D, with a per-token weight w and a normaliser D per mode.
# D is additive over any split of the rows, so a micro-batch (or data-parallel rank) that divides
# its own Σ lₜ·mₜ·wₜ by the whole mini-batch's D contributes exactly its share: the sum over
# micro-batches equals the mini-batch loss, for values and gradients alike.


@dataclass(frozen=True)
class _Aggregation:
    token_weight: Callable[[Tensor], Tensor]        # real (B, T) bool → w (B, T)
    denominator: Callable[[Tensor, int], Tensor]    # (real, norm_len) → D, 0-d


def _every_token(real: Tensor) -> Tensor:
    return real.float()


def _per_sequence_mean_weight(real: Tensor) -> Tensor:
    return real / real.sum(dim=1, keepdim=True).clamp_min(1)


def _num_tokens(real: Tensor, norm_len: int) -> Tensor:
    return real.sum().float()


def _num_sequences(real: Tensor, norm_len: int) -> Tensor:
    return real.any(dim=1).sum().float()


def _num_sequences_times_norm_len(real: Tensor, norm_len: int) -> Tensor:
    return _num_sequences(real, norm_len) * norm_len


AGGREGATIONS.add("token-mean", _Aggregation(_every_token, _num_tokens))
AGGREGATIONS.add("seq-mean-token-mean", _Aggregation(_per_sequence_mean_weight, _num_sequences))
AGGREGATIONS.add("seq-mean-token-sum", _Aggregation(_every_token, _num_sequences))
AGGREGATIONS.add("seq-mean-token-sum-norm", _Aggregation(_every_token, _num_sequences_times_norm_len))


def aggregate_denominator(mask: Tensor, mode: str, norm_len: int | None = None) -> Tensor:
    """The normaliser D of ``mode`` for the rows of ``mask`` (B, T): a 0-d float32 tensor.

        "token-mean": Σm   "seq-mean-token-mean", "seq-mean-token-sum": B   "seq-mean-token-sum-norm": B·norm_len

    B counts rows with at least one real token: a row with none is padding and counts nowhere.
    D is additive over rows, so the D of a mini-batch is the sum of its micro-batches' (or
    data-parallel ranks') D. Compute it over the whole mini-batch, pass it to every micro-batch's
    ``aggregate(..., denominator=D)`` and sum their losses: you get the mini-batch loss.
    """
    spec = AGGREGATIONS.get(mode)
    real = _as_mask(mask)
    return spec.denominator(real, _norm_len(norm_len, real))


def _norm_len(norm_len: int | None, real: Tensor) -> int:
    if norm_len is None:
        return real.shape[1]
    if norm_len <= 0:
        raise ValueError(f"norm_len must be positive, got {norm_len}")
    return norm_len


def aggregate(loss: Tensor, mask: Tensor, mode: str, norm_len: int | None = None,
              denominator: Tensor | float | None = None) -> Tensor:
    """Reduce a per-token loss (B, T) to a scalar.

        "token-mean":              Σ(l·m) / Σm
        "seq-mean-token-mean":     mean over sequences of Σₜ(l·m) / Σₜm
        "seq-mean-token-sum":      mean over sequences of Σₜ(l·m)
        "seq-mean-token-sum-norm": Σ(l·m) / (B·norm_len), norm_len defaulting to T (Dr.GRPO,
                                   Liu et al. 2025: a constant normaliser, no length bias)

    Rows without real tokens are padding and do not count as sequences. ``denominator`` replaces
    the normaliser computed from this call's rows (see ``aggregate_denominator``); pass it for
    gradient accumulation and data parallelism. With data-parallel gradient *averaging* (DDP's
    default) also multiply the loss by the DP size, since each rank already holds a share.
    """
    spec = AGGREGATIONS.get(mode)
    real = _real_mask(mask, loss, "loss")
    loss = _real_values("loss", loss, real)
    if denominator is None:
        denominator = spec.denominator(real, _norm_len(norm_len, real)).clamp_min(1)
    elif norm_len is not None:
        raise ValueError("pass norm_len or denominator, not both: norm_len is already inside denominator")
    else:
        denominator = torch.as_tensor(denominator, dtype=torch.float32, device=loss.device)
        if denominator.dim() != 0 or not float(denominator) > 0:
            raise ValueError(f"denominator must be a positive scalar, got {denominator}")
    return (loss * spec.token_weight(real)).sum() / denominator


# ---------------------------------------------------------------------------------------------
# Losses.


@POLICY_LOSSES.register("ppo")
def ppo_policy_loss(old_logprob: Tensor, logprob: Tensor, advantages: Tensor, mask: Tensor,
                clip_low: float = 0.2, clip_high: float = 0.2, dual_clip: float | None = None,
                agg: str = "token-mean", is_weights: Tensor | None = None, *,
                norm_len: int | None = None, denominator: Tensor | float | None = None,
                ) -> tuple[Tensor, dict[str, Tensor]]:
    """PPO's clipped surrogate (Schulman et al. 2017, arXiv:1707.06347), per token:

        r = exp(logprob − old_logprob)
        lₜ = max(−A·r, −A·clip(r, 1 − clip_low, 1 + clip_high))     clip_high > clip_low: DAPO's clip-higher
        lₜ = min(lₜ, −A·c) where A < 0                              dual_clip = c > 1 (Ye et al. 2020)
        lₜ = wₜ·lₜ                                                  is_weights w, e.g. truncated_is_weights

    then ``aggregate(l, mask, agg, norm_len, denominator)``. log r is clamped to ±20 so exp stays
    finite. All per-token inputs (B, T). Metrics: actor/pg_loss, actor/clip_frac (tokens whose
    clipped branch is taken), actor/dual_clip_frac, actor/approx_kl (k3 estimate of KL(π_old‖π)),
    actor/ratio_mean, actor/ratio_min, actor/ratio_max, actor/is_weight_mean.
    """
    real, old_logprob, logprob, advantages = _surrogate_inputs(old_logprob, logprob, advantages, mask, clip_low,
                                                               clip_high, dual_clip, "ppo")
    log_ratio = (logprob - old_logprob).clamp(-20.0, 20.0)
    ratio = log_ratio.exp()
    per_token, metrics = _clipped_surrogate(ratio, advantages, real, clip_low, clip_high)
    if dual_clip is not None:
        capped = (advantages < 0) & (per_token > -advantages * dual_clip)
        per_token = torch.where(capped, -advantages * dual_clip, per_token)
        metrics["actor/dual_clip_frac"] = _masked_mean(capped.float(), real)
    return _weighted_and_aggregated(per_token, ratio, log_ratio, real, agg, is_weights, norm_len, denominator, metrics)


def _surrogate_inputs(old_logprob, logprob, advantages, mask, clip_low, clip_high, dual_clip, name):
    """The checks every policy loss makes; (real, old_logprob, logprob, advantages) as float32."""
    real = _real_mask(mask, logprob, "logprob")
    _check_range("clip_low", clip_low, 0.0, 1.0)
    if clip_high < 0:
        raise ValueError(f"clip_high must be >= 0, got {clip_high}")
    if dual_clip is not None and name != "ppo":
        raise ValueError(f"dual_clip has no meaning for the {name} loss (it caps PPO's per-token surrogate); unset it")
    if dual_clip is not None and not dual_clip > 1:
        raise ValueError(f"dual_clip must be > 1, got {dual_clip}")
    return (real, _real_values("old_logprob", old_logprob, real), _real_values("logprob", logprob, real),
            _real_values("advantages", advantages, real))


def _clipped_surrogate(ratio, advantages, real, clip_low, clip_high) -> tuple[Tensor, dict[str, Tensor]]:
    """PPO's lₜ = max(−A·r, −A·clip(r, 1 − clip_low, 1 + clip_high)) and the fraction of real
    tokens whose clipped branch is taken (actor/clip_frac)."""
    unclipped = -advantages * ratio
    clipped = -advantages * ratio.clamp(1 - clip_low, 1 + clip_high)
    return torch.maximum(unclipped, clipped), {"actor/clip_frac": _masked_mean((clipped > unclipped).float(), real)}


def _weighted_and_aggregated(per_token, ratio, log_ratio, real, agg, is_weights, norm_len, denominator, metrics):
    """lₜ·wₜ with the IS weights, then ``aggregate``; the metrics every policy loss reports."""
    if is_weights is not None:
        is_weights = _real_values("is_weights", is_weights, real)
        if (is_weights < 0).any():
            raise ValueError("is_weights must be >= 0")
        per_token = per_token * is_weights
        metrics["actor/is_weight_mean"] = _masked_mean(is_weights, real)
    loss = aggregate(per_token, real, agg, norm_len, denominator)
    metrics |= {
        "actor/pg_loss": loss,
        "actor/approx_kl": _masked_mean(ratio - 1 - log_ratio, real),
        "actor/ratio_mean": _masked_mean(ratio, real),
        "actor/ratio_min": _masked_extreme(ratio, real, largest=False),
        "actor/ratio_max": _masked_extreme(ratio, real, largest=True),
    }
    return loss, {key: value.detach() for key, value in metrics.items()}


@POLICY_LOSSES.register("gspo")
def gspo_policy_loss(old_logprob: Tensor, logprob: Tensor, advantages: Tensor, mask: Tensor,
                     clip_low: float = 3e-4, clip_high: float = 4e-4, dual_clip: float | None = None,
                     agg: str = "seq-mean-token-mean", is_weights: Tensor | None = None, *,
                     norm_len: int | None = None, denominator: Tensor | float | None = None,
                     ) -> tuple[Tensor, dict[str, Tensor]]:
    """GSPO (Zheng et al. 2025, arXiv:2507.18071): PPO's clip on the sequence-level ratio.

        sᵢ = exp((1/|yᵢ|)·Σₜ (logprob − old_logprob))                  the length-normalised ratio
        sᵢₜ = sg[sᵢ]·π(yᵢₜ)/sg[π(yᵢₜ)]                                GSPO-token: value sᵢ, gradient sᵢ·∇log π(yᵢₜ)
        lᵢₜ = max(−A·sᵢₜ, −A·clip(sᵢₜ, 1 − clip_low, 1 + clip_high)),  lᵢₜ·wᵢₜ with is_weights

    A whole sequence clips or none of it. With ``agg="seq-mean-token-mean"`` and one advantage
    per sequence this is the paper's GSPO exactly; other aggregations weight sequences by their
    length as they do for PPO. The paper's clip ranges are ~1e-4 (its defaults here); the
    trainer passes the config's. dual_clip has no meaning here. Inputs (B, T) each.
    """
    real, old_logprob, logprob, advantages = _surrogate_inputs(old_logprob, logprob, advantages, mask, clip_low,
                                                               clip_high, dual_clip, "gspo")
    token_log_ratio = torch.where(real, (logprob - old_logprob).clamp(-20.0, 20.0), 0.0)
    lengths = real.sum(dim=1, keepdim=True).clamp_min(1)                                   # (B, 1)
    seq_log_ratio = (token_log_ratio.sum(dim=1, keepdim=True) / lengths).expand_as(logprob)  # (B, T)
    ratio = (seq_log_ratio.detach() + logprob - logprob.detach()).exp()
    per_token, metrics = _clipped_surrogate(ratio, advantages, real, clip_low, clip_high)
    return _weighted_and_aggregated(per_token, ratio, seq_log_ratio, real, agg, is_weights, norm_len, denominator,
                                    metrics)


@POLICY_LOSSES.register("cispo")
def cispo_policy_loss(old_logprob: Tensor, logprob: Tensor, advantages: Tensor, mask: Tensor,
                      clip_low: float = 1.0, clip_high: float = 0.28, dual_clip: float | None = None,
                      agg: str = "token-mean", is_weights: Tensor | None = None, *,
                      norm_len: int | None = None, denominator: Tensor | float | None = None,
                      ) -> tuple[Tensor, dict[str, Tensor]]:
    """CISPO (MiniMax-M1, arXiv:2506.13585): clip the importance weight, never the gradient.

        rₜ = exp(logprob − old_logprob)
        lₜ = −sg[clip(rₜ, 1 − clip_low, 1 + clip_high)]·A·log π(aₜ),   lₜ·wₜ with is_weights

    Every token keeps a gradient (PPO drops the clipped ones), scaled by its bounded weight. The
    paper clips only from above (clip_low = 1, its default here); the value of the loss itself
    has no meaning, its gradient −r̂·A·∇log π does. dual_clip has no meaning here.
    """
    real, old_logprob, logprob, advantages = _surrogate_inputs(old_logprob, logprob, advantages, mask, clip_low,
                                                               clip_high, dual_clip, "cispo")
    log_ratio = (logprob - old_logprob).clamp(-20.0, 20.0)
    ratio = log_ratio.exp()
    weight = ratio.clamp(1 - clip_low, 1 + clip_high).detach()
    per_token = -weight * advantages * logprob
    metrics = {"actor/clip_frac": _masked_mean((weight != ratio.detach()).float(), real)}
    return _weighted_and_aggregated(per_token, ratio, log_ratio, real, agg, is_weights, norm_len, denominator,
                                    metrics)


def value_loss(values: Tensor, old_values: Tensor, returns: Tensor, mask: Tensor, clip: float | None = 0.2,
               agg: str = "token-mean", *, norm_len: int | None = None,
               denominator: Tensor | float | None = None) -> tuple[Tensor, dict[str, Tensor]]:
    """Clipped value loss (PPO2, as in OpenAI baselines), per token:

        lₜ = ½·max((V − R)², (clip(V, V_old − c, V_old + c) − R)²)      clip=None: ½(V − R)²

    then ``aggregate``. values, old_values, returns, mask: (B, T). Metrics: critic/vf_loss,
    critic/vf_clip_frac (tokens where |V − V_old| > c and the clipped error is the larger), critic/vpred_mean.
    """
    real = _real_mask(mask, values, "values")
    values = _real_values("values", values, real)
    old_values = _real_values("old_values", old_values, real)
    returns = _real_values("returns", returns, real)
    squared_error = (values - returns).square()
    clipped_squared_error = squared_error
    if clip is not None:
        if clip < 0:
            raise ValueError(f"clip must be >= 0, got {clip}")
        # V itself where the clamp is inactive: V_old + (V − V_old) can round one ulp away from V
        # (when V_old and V differ by more than a factor 2), and that must count as no clipping
        step = values - old_values
        clamped = step.abs() > clip
        clipped_values = torch.where(clamped, old_values + step.clamp(-clip, clip), values)
        clipped_squared_error = (clipped_values - returns).square()
    per_token = 0.5 * torch.maximum(squared_error, clipped_squared_error)
    loss = aggregate(per_token, real, agg, norm_len, denominator)
    metrics = {
        "critic/vf_loss": loss,
        "critic/vf_clip_frac": _masked_mean((clipped_squared_error > squared_error).float(), real),
        "critic/vpred_mean": _masked_mean(values, real),
    }
    return loss, {key: value.detach() for key, value in metrics.items()}


def entropy_bonus(entropy: Tensor, mask: Tensor, coef: float, agg: str = "token-mean", *,
                  norm_len: int | None = None, denominator: Tensor | float | None = None,
                  ) -> tuple[Tensor, dict[str, Tensor]]:
    """The entropy term of the actor loss: −coef·aggregate(H), to add to the policy loss.

    entropy: (B, T) per-token entropy of π (``orz.models`` computes it from the logits); coef from
    a fixed setting or ``AdaptiveEntropyController``. Metrics: actor/entropy_loss, actor/entropy
    (token mean), actor/entropy_coef.
    """
    real = _real_mask(mask, entropy, "entropy")
    loss = -coef * aggregate(entropy, real, agg, norm_len, denominator)
    metrics = {
        "actor/entropy_loss": loss,
        "actor/entropy": _masked_mean(_real_values("entropy", entropy, real), real),
        "actor/entropy_coef": torch.tensor(float(coef), device=entropy.device),
    }
    return loss, {key: value.detach() for key, value in metrics.items()}


# ---------------------------------------------------------------------------------------------
# The engine's policy against the trainer's: measuring and correcting the mismatch.
#
# With r = π_old/π_engine per response token (π_engine: the vLLM engine that sampled it; π_old:
# the trainer's actor before the update), the samples come from π_engine while PPO's ratio is
# taken against π_old. Three corrections (each in the actor's objective, all detached):
#   truncated IS, per token    wₜ = min(rₜ, cap)                     (TIS, Yao et al. 2025)
#   truncated IS, per sequence wᵢ = min(Πₜ rᵢₜ, cap) on every token   (verl's sequence-level IS)
#   masking (MIS / IcePop)     tokens with rₜ outside [low, high] leave the actor's loss
#   rejection (Geo-RS)         sequences with exp(mean log r) outside [low, high] leave it whole
# A dropped token leaves every normaliser too (verl's choice: its rejection mask replaces the
# response mask before the update), so token-mean divides by the kept tokens and the seq-mean
# modes count the sequences that keep at least one.


def masked_mean(x: Tensor, mask: Tensor) -> Tensor:
    """Σ(x·m) / Σm over the tokens of ``mask``; 0 when there are none. (B, T) each; 0-d float32."""
    real = _real_mask(mask, x, "x")
    return _masked_mean(_real_values("x", x, real), real)


def _log_ratio(old_logprob: Tensor, rollout_logprob: Tensor, mask: Tensor) -> tuple[Tensor, Tensor]:
    """(real, log rₜ = log π_old − log π_engine, 0 off the mask)."""
    real = _real_mask(mask, old_logprob, "old_logprob")
    log_ratio = _real_values("old_logprob", old_logprob, real) - _real_values("rollout_logprob", rollout_logprob, real)
    return real, log_ratio


def _check_cap(cap: float) -> None:
    if not cap > 0:
        raise ValueError(f"cap must be positive, got {cap}")


def truncated_is_weights(old_logprob: Tensor, rollout_logprob: Tensor, mask: Tensor, cap: float = 2.0) -> Tensor:
    """Truncated token-level IS weights (Yao et al. 2025, TIS), detached:

        wₜ = min(π_old(aₜ)/π_engine(aₜ), cap)

    (B, T) each; returns (B, T), 0 off the mask."""
    _check_cap(cap)
    real, log_ratio = _log_ratio(old_logprob, rollout_logprob, mask)
    return torch.where(real, log_ratio.clamp(max=math.log(cap)).exp(), 0.0).detach()


def sequence_is_weights(old_logprob: Tensor, rollout_logprob: Tensor, mask: Tensor, cap: float = 2.0) -> Tensor:
    """Truncated sequence-level IS weights, the same on every token of a sequence:

        wᵢ = min(Πₜ π_old(aᵢₜ)/π_engine(aᵢₜ), cap) = exp(min(Σₜ log rᵢₜ, log cap))

    Detached. (B, T) each; returns (B, T), 0 off the mask."""
    _check_cap(cap)
    real, log_ratio = _log_ratio(old_logprob, rollout_logprob, mask)
    per_sequence = log_ratio.sum(dim=1).clamp(max=math.log(cap)).exp()  # (B,)
    return _broadcast(per_sequence, real).detach()


def _outside(x: Tensor, band: Sequence[float | None]) -> Tensor:
    """x < low or x > high; a None end is open."""
    low, high = band
    out = torch.zeros_like(x, dtype=torch.bool)
    if low is not None:
        out |= x < low
    if high is not None:
        out |= x > high
    return out


def mismatch_keep_mask(old_logprob: Tensor, rollout_logprob: Tensor, mask: Tensor,
                       token_band: Sequence[float | None] | None = None,
                       sequence_geo_band: Sequence[float | None] | None = None) -> Tensor:
    """(B, T) bool: the tokens of ``mask`` that stay in the actor's loss.

        token_band [l, h]:         drop token t when rₜ ∉ [l, h]                       (MIS; IcePop when two-sided)
        sequence_geo_band [l, h]:  drop sequence i when exp((1/|yᵢ|)·Σₜ log rᵢₜ) ∉ [l, h]  (Geo-RS)

    None: that correction is off. r = π_old/π_engine."""
    check_band("token_band", token_band)
    check_band("sequence_geo_band", sequence_geo_band)
    real, log_ratio = _log_ratio(old_logprob, rollout_logprob, mask)
    keep = real.clone()
    if token_band is not None:
        keep &= ~_outside(log_ratio.exp(), token_band)
    if sequence_geo_band is not None:
        geo = (log_ratio.sum(dim=1) / real.sum(dim=1).clamp_min(1)).exp()  # (B,)
        keep &= ~_outside(geo, sequence_geo_band)[:, None]
    return keep


def mismatch_metrics(old_logprob: Tensor, rollout_logprob: Tensor, mask: Tensor,
                     keep: Tensor | None = None) -> dict[str, Tensor]:
    """How far the engine's policy is from the trainer's, over the tokens of ``mask``:

        mismatch/kl_k3                  mean of rₜ − 1 − log rₜ (k3 estimate of KL(π_engine‖π_old))
        mismatch/logp_abs_diff_mean|max |log π_old − log π_engine|
        mismatch/ratio_p05|p50|p95, ratio_min|max   quantiles and extremes of rₜ
        mismatch/seq_ratio_geo_mean|std mean and standard deviation over sequences of exp(mean log r)
        mismatch/masked_token_frac      share of tokens ``keep`` drops (0 without it)
        mismatch/rejected_seq_frac      share of sequences ``keep`` drops whole

    Whole-batch figures: quantiles do not add over micro-batches, so call it on the whole batch."""
    real, log_ratio = _log_ratio(old_logprob, rollout_logprob, mask)
    ratio = log_ratio.exp()
    tokens = ratio[real]
    if not len(tokens):
        tokens = ratio.new_ones(1)
    p05, p50, p95 = torch.quantile(tokens, tokens.new_tensor([0.05, 0.5, 0.95]))
    sequences = real.any(dim=1)
    geo = (log_ratio.sum(dim=1) / real.sum(dim=1).clamp_min(1)).exp()[sequences]
    keep = real if keep is None else keep.bool() & real
    dropped_whole = sequences & ~keep.any(dim=1)
    metrics = {
        "mismatch/kl_k3": _masked_mean(ratio - 1 - log_ratio, real),
        "mismatch/logp_abs_diff_mean": _masked_mean(log_ratio.abs(), real),
        "mismatch/logp_abs_diff_max": _masked_extreme(log_ratio.abs(), real, largest=True),
        "mismatch/ratio_min": _masked_extreme(ratio, real, largest=False),
        "mismatch/ratio_max": _masked_extreme(ratio, real, largest=True),
        "mismatch/ratio_p05": p05, "mismatch/ratio_p50": p50, "mismatch/ratio_p95": p95,
        "mismatch/seq_ratio_geo_mean": geo.mean() if len(geo) else ratio.new_tensor(1.0),
        "mismatch/seq_ratio_geo_std": geo.std(correction=0) if len(geo) else ratio.new_tensor(0.0),
        "mismatch/masked_token_frac": _masked_mean((real & ~keep).float(), real),
        "mismatch/rejected_seq_frac": dropped_whole.sum() / sequences.sum().clamp_min(1),
    }
    return {key: value.detach().float() for key, value in metrics.items()}


def routing_agreement_counts(recorded: Tensor, chosen: Tensor, mask: Tensor) -> Tensor:
    """How often a router chose the experts that were recorded (MoE routing replay, R3):

        same  = Σ_{b,s,l} m_bsl · [set(chosen_bsl) = set(recorded_bsl)]
        total = Σ_{b,s,l} m_bsl

    recorded, chosen: (B, S, L, K) expert ids of each token's top-k in each MoE layer (order
    within the k does not matter); mask: (B, S, L) 1 on the (token, layer) routes that count.
    Returns float32 [same, total]: counts add over micro-batches, pipeline stages and replicas,
    and mismatch/routing_agreement = same / total."""
    if recorded.shape != chosen.shape or recorded.dim() != 4:
        raise ValueError(f"recorded {tuple(recorded.shape)} and chosen {tuple(chosen.shape)} must both be (B, S, L, K)")
    if mask.shape != recorded.shape[:3]:
        raise ValueError(f"mask {tuple(mask.shape)} must be (B, S, L) = {tuple(recorded.shape[:3])}")
    same = (recorded.sort(dim=-1).values == chosen.sort(dim=-1).values).all(dim=-1)  # (B, S, L)
    real = mask.bool()
    return torch.stack([(same & real).sum(), real.sum()]).float()


IS_LEVELS = {"token": truncated_is_weights, "sequence": sequence_is_weights}


def actor_loss(logprob: Tensor, old_logprob: Tensor, advantages: Tensor, mask: Tensor, *,
               policy_loss: str = "ppo", clip_low: float = 0.2, clip_high: float = 0.2,
               dual_clip: float | None = None, agg: str = "token-mean",
               denominator: Tensor | float | None = None,
               rollout_logprob: Tensor | None = None, is_level: str | None = None, is_cap: float = 2.0,
               entropy: Tensor | None = None, entropy_coef: float = 0.0,
               ref_logprob: Tensor | None = None, kl_coef: float = 0.0, kl_kind: str = "k1",
               teacher_kl: Tensor | None = None, distill_coef: float = 0.0,
               ) -> tuple[Tensor, dict[str, Tensor]]:
    """The whole objective the actor minimises on one micro-batch:

        L = policy_loss(old, logprob, A, m; w)        w: IS weights of ``is_level`` (None: w = 1)
            − entropy_coef·aggregate(H)               when entropy_coef ≠ 0
            + kl_coef·aggregate(KL_kind(logprob ‖ ref))  when kl_coef ≠ 0 (KL in the loss)
            + distill_coef·aggregate(teacher_kl)      when distill_coef ≠ 0 (a teacher's top-k
                                                      forward KL per token, orz/ppo/distillation.py)

    every term aggregated by ``agg`` over ``mask`` with the mini-batch's ``denominator``. ``mask``
    is the response mask after any mismatch masking (``mismatch_keep_mask``), so a dropped token
    is in no term. Metrics: the policy loss's, actor/entropy (always, when ``entropy`` is given),
    the entropy bonus's, actor/kl_loss, and ``tokens`` (Σm, the weight ``combine_metrics`` uses).
    """
    is_weights = None
    if is_level is not None:
        if is_level not in IS_LEVELS:
            raise ValueError(f"is_level must be one of {sorted(IS_LEVELS)} or None, got {is_level!r}")
        if rollout_logprob is None:
            raise ValueError("is_level needs rollout_logprob, the engine's log-probs")
        is_weights = IS_LEVELS[is_level](old_logprob, rollout_logprob, mask, is_cap)
    loss, metrics = POLICY_LOSSES.get(policy_loss)(old_logprob, logprob, advantages, mask, clip_low, clip_high,
                                                    dual_clip, agg, is_weights, denominator=denominator)
    if entropy is not None and entropy_coef:
        bonus, entropy_metrics = entropy_bonus(entropy, mask, entropy_coef, agg, denominator=denominator)
        loss = loss + bonus
        metrics |= entropy_metrics
    elif entropy is not None:
        metrics["actor/entropy"] = masked_mean(entropy.detach(), mask)
    if kl_coef:
        if ref_logprob is None:
            raise ValueError("kl_coef > 0 needs ref_logprob")
        kl_loss = aggregate(kl_penalty(logprob, ref_logprob, kl_kind, mask), mask, agg, denominator=denominator)
        loss = loss + kl_coef * kl_loss
        metrics["actor/kl_loss"] = kl_loss.detach()
    if distill_coef:
        if teacher_kl is None:
            raise ValueError("distill_coef > 0 needs teacher_kl")
        distill_loss = aggregate(teacher_kl, mask, agg, denominator=denominator)
        loss = loss + distill_coef * distill_loss
        metrics["actor/distill_loss"] = distill_loss.detach()
    metrics["tokens"] = _as_mask(mask).sum().float()
    return loss, metrics


# ---------------------------------------------------------------------------------------------
# Controllers: plain python floats, so a state_dict round trip resumes bit for bit.


class _ScalarController:
    """A coefficient the trainer reads as ``.value``; its whole state is that float."""

    value: float

    def state_dict(self) -> dict[str, float]:
        return {"value": self.value}

    def load_state_dict(self, state: dict[str, float]) -> None:
        self.value = float(state["value"])


class FixedKLController(_ScalarController):
    """β that never changes."""

    def __init__(self, kl_coef: float):
        if kl_coef < 0:
            raise ValueError(f"kl_coef must be >= 0, got {kl_coef}")
        self.value = float(kl_coef)

    def update(self, current_kl: float, n_steps: int) -> None:
        """Same call as AdaptiveKLController's, so the trainer need not know which it holds."""


class AdaptiveKLController(_ScalarController):
    """β that steers the measured KL towards a target (Ziegler et al. 2019, arXiv:1909.08593):

        β ← β·(1 + clip(KL/target − 1, −0.2, 0.2)·n/horizon)

    n is the number of samples since the last update.
    """

    def __init__(self, init: float, target: float, horizon: float):
        if init < 0 or target <= 0 or horizon <= 0:
            raise ValueError(f"need init >= 0, target > 0, horizon > 0; got init={init}, target={target}, "
                             f"horizon={horizon}")
        self.value = float(init)
        self.target = float(target)
        self.horizon = float(horizon)

    def update(self, current_kl: float, n_steps: int) -> None:
        current_kl = float(current_kl)
        if not math.isfinite(current_kl):
            raise ValueError(f"current_kl must be finite, got {current_kl}")
        error = min(max(current_kl / self.target - 1.0, -0.2), 0.2)
        self.value *= 1.0 + error * n_steps / self.horizon


class AdaptiveEntropyController(_ScalarController):
    """Entropy coefficient that holds entropy near a target (Skywork-OR1, He et al. 2025, arXiv:2505.22312):

        c ← clamp(c + step, 0, max_coef)   if entropy < target
        c ← clamp(c − step, 0, max_coef)   otherwise
    """

    def __init__(self, target: float, step: float, max_coef: float, init: float = 0.0):
        if step < 0 or max_coef < 0:
            raise ValueError(f"step and max_coef must be >= 0, got step={step}, max_coef={max_coef}")
        _check_range("init", init, 0.0, max_coef)
        self.target = float(target)
        self.step = float(step)
        self.max_coef = float(max_coef)
        self.value = float(init)

    def update(self, entropy: float) -> None:
        entropy = float(entropy)
        if not math.isfinite(entropy):
            raise ValueError(f"entropy must be finite, got {entropy}")
        change = self.step if entropy < self.target else -self.step
        self.value = min(max(self.value + change, 0.0), self.max_coef)
