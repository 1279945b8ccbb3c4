"""orz.ppo.core_algos: hand-computed numbers, properties over random shapes and masks, bad input.

    .venv/bin/python -m pytest -q tests/test_core_algos.py
"""
import json
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from orz import algorithm_names as names
from orz.ppo import core_algos as ca

PROPERTY = settings(max_examples=40, deadline=None)
DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
AGG_MODES = ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"]


def close(actual, expected, atol=1e-5):
    expected = torch.as_tensor(expected, dtype=torch.float32)
    torch.testing.assert_close(actual.float().cpu(), expected, atol=atol, rtol=1e-5)


@st.composite
def padded_batch(draw, fields=1, max_b=5, max_t=7):
    """(mask, *fields): a random (B, T) 0/1 mask (holes allowed) and float fields of its shape."""
    b, t = draw(st.integers(1, max_b)), draw(st.integers(1, max_t))
    seed = draw(st.integers(0, 2**31 - 1))
    generator = torch.Generator().manual_seed(seed)
    mask = (torch.rand(b, t, generator=generator) < draw(st.sampled_from([0.3, 0.7, 1.0]))).float()
    values = [torch.randn(b, t, generator=generator) * 2 for _ in range(fields)]
    return (mask, *values)


def garbage_where_masked(x, mask, fill=float("nan")):
    """x with every masked position replaced by junk: it must not change any output."""
    return torch.where(mask.bool(), x, torch.full_like(x, fill))


# ---------------------------------------------------------------------------------------------
# GAE


def test_gae_by_hand():
    # γ = λ = 0.5, so γλ = 0.25; row 0 has three real tokens, row 1 two (its third is padding).
    # row 0: r = [1, 0, 2], V = [0.5, 1, 0.5]
    #   t=2: δ = 2 + 0.5·0 − 0.5 = 1.5;        A = 1.5
    #   t=1: δ = 0 + 0.5·0.5 − 1 = −0.75;      A = −0.75 + 0.25·1.5 = −0.375
    #   t=0: δ = 1 + 0.5·1 − 0.5 = 1;          A = 1 + 0.25·(−0.375) = 0.90625
    #   returns = A + V = [1.40625, 0.625, 2]
    # row 1: r = [0, 3, pad], V = [1, 2, pad]
    #   t=1: δ = 3 + 0 − 2 = 1;                A = 1
    #   t=0: δ = 0 + 0.5·2 − 1 = 0;            A = 0 + 0.25·1 = 0.25
    #   returns = [1.25, 3, 0]
    rewards = torch.tensor([[1.0, 0.0, 2.0], [0.0, 3.0, 99.0]])
    values = torch.tensor([[0.5, 1.0, 0.5], [1.0, 2.0, 99.0]])
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    advantages, returns = ca.compute_gae(rewards, values, mask, gamma=0.5, lam=0.5)
    close(advantages, [[0.90625, -0.375, 1.5], [0.25, 1.0, 0.0]])
    close(returns, [[1.40625, 0.625, 2.0], [1.25, 3.0, 0.0]])


def test_gae_orz_recipe_reward_on_last_token():
    # γ = λ = 1, reward 1 on the last token: Aₜ = 1 − Vₜ, returns 1 everywhere.
    advantages, returns = ca.compute_gae(torch.tensor([[0.0, 0.0, 1.0]]), torch.tensor([[0.2, 0.4, 0.6]]),
                                         torch.ones(1, 3))
    close(advantages, [[0.8, 0.6, 0.4]])
    close(returns, [[1.0, 1.0, 1.0]])


def test_gae_skips_a_hole_in_the_mask():
    # mask [1, 0, 1]: the masked middle token is cut out. γ = 0.5, λ = 0.5.
    #   t=2: δ = 1 − 0.25 = 0.75;                          A = 0.75
    #   t=0: next real token is t=2: δ = 0 + 0.5·0.25 − 0.5 = −0.375;  A = −0.375 + 0.25·0.75 = −0.1875
    advantages, returns = ca.compute_gae(torch.tensor([[0.0, 9.0, 1.0]]), torch.tensor([[0.5, 9.0, 0.25]]),
                                         torch.tensor([[1, 0, 1]]), gamma=0.5, lam=0.5)
    close(advantages, [[-0.1875, 0.0, 0.75]])
    close(returns, [[0.3125, 0.0, 1.0]])


@PROPERTY
@given(padded_batch(fields=2))
def test_gae_with_gamma_lambda_one_is_return_minus_value(batch):
    mask, rewards, values = batch
    advantages, returns = ca.compute_gae(rewards, values, mask)
    return_to_go = (rewards * mask).flip(1).cumsum(1).flip(1) * mask  # Σ_{s≥t} r_s over real tokens
    close(returns, return_to_go, atol=1e-4)
    close(advantages, (return_to_go - values) * mask, atol=1e-4)


@PROPERTY
@given(padded_batch(fields=2), st.floats(0, 1), st.floats(0, 1))
def test_gae_matches_the_recursion_on_real_tokens(batch, gamma, lam):
    mask, rewards, values = batch
    advantages, returns = ca.compute_gae(rewards, values, mask, gamma, lam)
    for row in range(mask.shape[0]):
        real = mask[row].bool()
        r, v = rewards[row][real].tolist(), values[row][real].tolist()
        expected, next_value, next_advantage = [], 0.0, 0.0
        for t in reversed(range(len(r))):
            next_advantage = r[t] + gamma * next_value - v[t] + gamma * lam * next_advantage
            next_value = v[t]
            expected.insert(0, next_advantage)
        close(advantages[row][real], expected, atol=1e-4)
        close(returns[row][real], [a + b for a, b in zip(expected, v)], atol=1e-4)
    assert (advantages[mask == 0] == 0).all() and (returns[mask == 0] == 0).all()


# ---------------------------------------------------------------------------------------------
# Group estimators

# Samples interleave three groups by id: group 10 = rows 0, 2, 3, 5 with scores 1, 0, 1, 0;
# group 3 = rows 1, 4 with scores 2, 4; group 5 = row 6 alone.
SCORES = torch.tensor([1.0, 2.0, 0.0, 1.0, 4.0, 0.0, 7.0])
GROUPS = torch.tensor([10, 3, 10, 10, 3, 10, 5])


def test_grpo_by_hand():
    # group 10: mean 0.5, deviations ±0.5, Bessel variance 4·0.25/3 = 1/3, std √(1/3)
    # group 3: mean 3, deviations ∓1, variance (1 + 1)/1 = 2, std √2
    # group 5: one sample → 0
    g10 = 0.5 / (math.sqrt(1 / 3) + 1e-6)
    g3 = 1 / (math.sqrt(2) + 1e-6)
    close(ca.compute_grpo_advantages(SCORES, GROUPS), [g10, -g3, -g10, g10, g3, -g10, 0.0])


def test_dr_grpo_by_hand():
    # only the group mean is subtracted: 10 → ±0.5, 3 → ∓1, 5 → 0
    close(ca.compute_grpo_advantages(SCORES, GROUPS, norm_by_std=False), [0.5, -1, -0.5, 0.5, 1, -0.5, 0])


def test_rloo_by_hand():
    # group 10: a 1 is compared with the mean of (0, 1, 0) = 1/3 → 2/3; a 0 with (1, 1, 0) → −2/3
    # group 3: 2 − 4 = −2 and 4 − 2 = 2; group 5 alone → 0
    close(ca.compute_rloo_advantages(SCORES, GROUPS), [2 / 3, -2, -2 / 3, 2 / 3, 2, -2 / 3, 0])


def test_orz_grpo_by_hand():
    # scores [1, 0] in one group, [1, 1] in another; row lengths 2, 1, 1, 1 tokens.
    # centred: [0.5, −0.5, 0, 0] → tokens [0.5, 0.5, −0.5, 0, 0]: mean 0.1,
    # deviations [0.4, 0.4, −0.6, −0.1, −0.1], Σdev² = 0.16+0.16+0.36+0.01+0.01 = 0.7, variance 0.7/4 = 0.175
    mask = torch.tensor([[1, 1], [1, 0], [1, 0], [1, 0]])
    advantages = ca.compute_orz_grpo_advantages(torch.tensor([1.0, 0, 1, 1]), torch.tensor([0, 0, 1, 1]), mask)
    scale = 1 / math.sqrt(0.175 + 1e-8)
    close(advantages, [[0.4 * scale, 0.4 * scale], [-0.6 * scale, 0], [-0.1 * scale, 0], [-0.1 * scale, 0]])


def test_reinforce_pp_by_hand():
    # γ = 0.5. row 0: r = [0, 1] → G = [0 + 0.5·1, 1] = [0.5, 1]; row 1: r = [2, pad] → G = [2]
    # tokens 0.5, 1, 2: mean 7/6; deviations −2/3, −1/6, 5/6; Σdev² = 7/6; Bessel variance 7/12
    rewards = torch.tensor([[0.0, 1.0], [2.0, -50.0]])
    mask = torch.tensor([[1, 1], [1, 0]])
    scale = 1 / math.sqrt(7 / 12 + 1e-8)
    advantages, returns = ca.compute_reinforce_pp_advantages(rewards, mask, gamma=0.5)
    close(advantages, [[-2 / 3 * scale, -1 / 6 * scale], [5 / 6 * scale, 0.0]])
    close(returns, [[0.5, 1.0], [2.0, 0.0]])


@st.composite
def grouped_scores(draw):
    groups = draw(st.lists(st.integers(0, 4), min_size=1, max_size=12))
    scores = draw(st.lists(st.sampled_from([0.0, 0.5, 1.0, -1.0, 3.0]) | st.floats(-5, 5),
                           min_size=len(groups), max_size=len(groups)))
    return torch.tensor(scores), torch.tensor(groups)


@PROPERTY
@given(grouped_scores())
def test_group_advantages_sum_to_zero_and_match_torch_std(batch):
    scores, groups = batch
    grpo = ca.compute_grpo_advantages(scores, groups)
    for estimator in (grpo, ca.compute_grpo_advantages(scores, groups, norm_by_std=False),
                      ca.compute_rloo_advantages(scores, groups)):
        for group in groups.unique():
            assert abs(float(estimator[groups == group].sum())) < 1e-3
    for group in groups.unique():
        members = scores[groups == group]
        expected = (members - members.mean()) / (members.std() + 1e-6) if len(members) > 1 else torch.zeros(1)
        close(grpo[groups == group], expected, atol=1e-4)


@PROPERTY
@given(grouped_scores())
def test_rloo_is_a_rescaled_dr_grpo(batch):
    # sᵢ − (Σ − sᵢ)/(n − 1) = n/(n − 1)·(sᵢ − mean)
    scores, groups = batch
    sizes = (groups[:, None] == groups[None, :]).sum(1).float()
    expected = torch.where(sizes > 1, sizes / (sizes - 1).clamp_min(1), 0.0) * ca.compute_grpo_advantages(
        scores, groups, norm_by_std=False)
    close(ca.compute_rloo_advantages(scores, groups), expected, atol=1e-4)


@pytest.mark.parametrize("name", ["gae", "grpo", "dr_grpo", "orz_grpo", "rloo", "reinforce_pp"])
def test_every_estimator_has_the_trainers_call_shape(name):
    mask = torch.tensor([[1, 1, 0], [1, 1, 1], [1, 0, 0], [1, 1, 0]])
    scores = torch.tensor([1.0, 0.0, 1.0, 1.0])
    token_rewards = ca.reward_on_last_token(scores, mask)
    groups = torch.tensor([0, 0, 1, 1])
    advantages, returns = ca.estimate_advantages(name, mask=mask, token_rewards=token_rewards, scores=scores,
                                                 values=torch.full((4, 3), 0.25), group_index=groups)
    assert advantages.shape == returns.shape == (4, 3) and advantages.dtype == torch.float32
    assert (advantages[mask == 0] == 0).all() and (returns[mask == 0] == 0).all()
    if name == "grpo":  # per-sample values broadcast over each row's real tokens
        per_sample = ca.compute_grpo_advantages(scores, groups)
        close(advantages, per_sample[:, None] * mask)
    assert ca.ADVANTAGE_ESTIMATORS.get(name).needs.needs_critic == (name == "gae")


def test_estimator_errors_name_what_is_missing_or_unknown():
    with pytest.raises(ValueError, match="values"):
        ca.estimate_advantages("gae", mask=torch.ones(1, 2), token_rewards=torch.zeros(1, 2))
    with pytest.raises(ValueError, match="group_index"):
        ca.estimate_advantages("grpo", mask=torch.ones(1, 2), scores=torch.zeros(1))
    with pytest.raises(ValueError, match="dr_grpo.*gae.*grpo.*orz_grpo.*reinforce_pp.*rloo"):
        ca.estimate_advantages("ppo2", mask=torch.ones(1, 2))


def test_registries_refuse_a_second_registration():
    with pytest.raises(ValueError, match="already registered"):
        ca.register_advantage_estimator("gae")(lambda inputs: None)
    with pytest.raises(ValueError, match="already registered"):
        ca.POLICY_LOSSES.add("ppo", ca.ppo_policy_loss)
    registry = ca.Registry("widget", declared=("a", "b"))
    registry.add("a", 1)
    assert registry.get("a") == 1 and "a" in registry and registry.names() == ("a",)
    with pytest.raises(ValueError, match="widget 'c' is not declared in orz/algorithm_names.py"):
        registry.add("c", 3)


def test_every_declared_name_has_an_implementation_and_no_other():
    """orz/algorithm_names.py declares what the config may name (read without torch by the run
    rules and the placement); core_algos implements exactly those."""
    assert set(ca.ADVANTAGE_ESTIMATORS.names()) == set(names.ADVANTAGE_ESTIMATORS)
    assert ca.POLICY_LOSSES.names() == tuple(sorted(names.POLICY_LOSSES))
    assert ca.AGGREGATIONS.names() == tuple(sorted(names.AGGREGATIONS))
    assert ca.KL_PENALTIES.names() == tuple(sorted(names.KL_PENALTIES))
    assert tuple(ca.IS_LEVELS) == names.IS_LEVELS


# ---------------------------------------------------------------------------------------------
# Whitening, rewards, KL


def test_whiten_by_hand():
    # real x = 1, 2, 3: mean 2, Bessel variance (1 + 0 + 1)/2 = 1
    x, mask = torch.tensor([[1.0, 2.0, 3.0, 50.0]]), torch.tensor([[1, 1, 1, 0]])
    scale = 1 / math.sqrt(1 + 1e-8)
    close(ca.whiten(x, mask), [[-scale, 0.0, scale, 0.0]])
    close(ca.whiten(x, mask, shift_mean=False), [[2 - scale, 2.0, 2 + scale, 0.0]])


@PROPERTY
@given(padded_batch())
def test_whiten_gives_zero_mean_unit_variance_on_real_tokens(batch):
    mask, x = batch
    real = mask.bool()
    whitened = ca.whiten(x, mask)
    if real.sum() >= 2 and x[real].std() > 1e-2:
        assert abs(float(whitened[real].mean())) < 1e-4
        assert abs(float(whitened[real].std()) - 1) < 1e-3
    assert (whitened[~real] == 0).all()


def test_reward_on_last_token_by_hand():
    # last real token: row 0 → t=1, row 1 → t=2 (the hole at t=1 does not matter); row 2 has none.
    # with kl and β = 0.5: every real token also gets −0.5·kl
    mask = torch.tensor([[1, 1, 0], [1, 0, 1], [0, 0, 0]])
    scores = torch.tensor([1.0, -1.0, 5.0])
    close(ca.reward_on_last_token(scores, mask), [[0, 1, 0], [0, 0, -1], [0, 0, 0]])
    kl = torch.tensor([[0.1, 0.2, 9.0], [0.3, 9.0, 0.4], [9.0, 9.0, 9.0]])
    close(ca.reward_on_last_token(scores, mask, kl, kl_coef=0.5),
          [[-0.05, 1 - 0.1, 0], [-0.15, 0, -1 - 0.2], [0, 0, 0]])


def test_kl_penalty_by_hand():
    # Δ = logprob − ref = [0.5, −1, −5]
    # k1 = Δ; k2 = ½Δ² = [0.125, 0.5, 12.5]
    # k3 = e^(−Δ) + Δ − 1 = [e^−0.5 − 0.5, e − 2, e^5 − 6 = 142.4 → clamped to 10]
    logprob = torch.tensor([[-1.0, -2.0, -6.0]])
    ref = torch.tensor([[-1.5, -1.0, -1.0]])
    close(ca.kl_penalty(logprob, ref, "k1"), [[0.5, -1.0, -5.0]])
    close(ca.kl_penalty(logprob, ref, "k2"), [[0.125, 0.5, 12.5]])
    close(ca.kl_penalty(logprob, ref, "k3"), [[math.exp(-0.5) - 0.5, math.e - 2, 10.0]])
    close(ca.kl_penalty(logprob, ref, "k3+"), [[math.exp(-0.5) - 0.5, math.e - 2, 10.0]])
    close(ca.kl_penalty(logprob, ref, "k2", mask=torch.tensor([[1, 0, 1]])), [[0.125, 0.0, 12.5]])


def test_k3_plus_has_the_k2_gradient_and_k3_a_finite_one():
    # d(½Δ²)/d logprob = Δ; k3's gradient is 1 − e^(−Δ), and 0 where clamped (Δ = −30)
    logprob = torch.tensor([[-1.0, -2.0, -31.0]], requires_grad=True)
    ref = torch.tensor([[-1.5, -1.0, -1.0]])
    ca.kl_penalty(logprob, ref, "k3+").sum().backward()
    close(logprob.grad, [[0.5, -1.0, -30.0]])
    logprob.grad = None
    ca.kl_penalty(logprob, ref, "k3").sum().backward()
    close(logprob.grad, [[1 - math.exp(-0.5), 1 - math.e, 0.0]], atol=1e-4)


# ---------------------------------------------------------------------------------------------
# Aggregation and gradient accumulation

LOSS = torch.tensor([[1.0, 2.0, 3.0], [4.0, 70.0, 80.0]])
LOSS_MASK = torch.tensor([[1, 1, 1], [1, 0, 0]])


@pytest.mark.parametrize("mode, norm_len, expected", [
    ("token-mean", None, (1 + 2 + 3 + 4) / 4),             # 2.5
    ("seq-mean-token-mean", None, ((1 + 2 + 3) / 3 + 4) / 2),  # (2 + 4)/2 = 3
    ("seq-mean-token-sum", None, (6 + 4) / 2),             # 5
    ("seq-mean-token-sum-norm", None, 10 / (2 * 3)),       # norm_len = T = 3
    ("seq-mean-token-sum-norm", 5, 10 / (2 * 5)),          # 1
])
def test_aggregate_by_hand(mode, norm_len, expected):
    close(ca.aggregate(LOSS, LOSS_MASK, mode, norm_len), expected)


def test_aggregate_ignores_rows_without_real_tokens():
    # a fully masked row is padding (e.g. a data-parallel filler row): it is not a sequence
    padded_loss, padded_mask = torch.cat([LOSS, torch.ones(1, 3)]), torch.cat([LOSS_MASK, torch.zeros(1, 3)])
    for mode in AGG_MODES:
        close(ca.aggregate(padded_loss, padded_mask, mode), ca.aggregate(LOSS, LOSS_MASK, mode))
    close(ca.aggregate(LOSS, torch.zeros(2, 3), "token-mean"), 0.0)


@PROPERTY
@given(padded_batch(), st.integers(1, 12))
def test_aggregation_identities(batch, norm_len):
    mask, loss = batch
    real = mask.bool()
    rows = real.any(1)
    token_sum = float((loss * mask).sum())
    if not real.any():
        return
    close(ca.aggregate(loss, mask, "token-mean"), float(loss[real].mean()), atol=1e-4)
    row_means = [float(loss[b][real[b]].mean()) for b in range(len(real)) if rows[b]]
    close(ca.aggregate(loss, mask, "seq-mean-token-mean"), sum(row_means) / len(row_means), atol=1e-4)
    close(ca.aggregate(loss, mask, "seq-mean-token-sum") * rows.sum(), token_sum, atol=1e-4)
    close(ca.aggregate(loss, mask, "seq-mean-token-sum-norm", norm_len) * rows.sum() * norm_len, token_sum, atol=1e-3)
    constant = torch.full_like(loss, 0.75)
    for mode in ("token-mean", "seq-mean-token-mean"):  # the mean of a constant is that constant
        close(ca.aggregate(constant, mask, mode), 0.75)


@PROPERTY
@given(padded_batch(), st.integers(1, 4), st.integers(1, 8))
def test_accumulated_micro_batch_losses_and_gradients_equal_the_full_batch(batch, num_micro, norm_len):
    # Split the rows into micro-batches; each divides its own sum by the whole batch's denominator.
    mask, features = batch
    for mode in AGG_MODES:
        weight = torch.tensor(0.7, requires_grad=True)
        full = ca.aggregate((weight * features).square(), mask, mode, norm_len)
        full_gradient, = torch.autograd.grad(full, weight)
        denominator = ca.aggregate_denominator(mask, mode, norm_len)
        parts = torch.arange(len(mask)).tensor_split(num_micro)
        assert float(sum(ca.aggregate_denominator(mask[rows], mode, norm_len) for rows in parts)) == float(denominator)
        accumulated = sum(ca.aggregate((weight * features[rows]).square(), mask[rows], mode, denominator=denominator)
                          for rows in parts if len(rows) and denominator > 0)
        if isinstance(accumulated, int):  # nothing real: the loss is 0 either way
            assert float(full.detach()) == 0
            continue
        close(accumulated, full.detach(), atol=1e-4)
        close(torch.autograd.grad(accumulated, weight)[0], full_gradient, atol=1e-3)


def test_aggregate_denominator_and_norm_len_exclude_each_other():
    with pytest.raises(ValueError, match="norm_len or denominator"):
        ca.aggregate(LOSS, LOSS_MASK, "seq-mean-token-sum-norm", norm_len=4, denominator=8.0)
    with pytest.raises(ValueError, match="denominator"):
        ca.aggregate(LOSS, LOSS_MASK, "token-mean", denominator=0.0)


# ---------------------------------------------------------------------------------------------
# Losses


def ratios_as_logprobs(ratios):
    return torch.log(torch.tensor(ratios))


def test_policy_loss_by_hand():
    # old log-prob 0, so r = exp(logprob); clip 0.2 → [0.8, 1.2]
    #   r=1.5, A=1:  max(−1.5, −1.2) = −1.2   clipped
    #   r=0.5, A=1:  max(−0.5, −0.8) = −0.5
    #   r=1.1, A=−2: max(2.2, 2.2)   = 2.2
    #   r=0.7, A=−2: max(1.4, 1.6)   = 1.6    clipped
    # token-mean (−1.2 − 0.5 + 2.2 + 1.6)/4 = 0.525; the padded fifth token counts nowhere
    ratios = [[1.5, 0.5, 1.1, 0.7, 3.0]]
    logprob = ratios_as_logprobs(ratios)
    advantages = torch.tensor([[1.0, 1.0, -2.0, -2.0, 5.0]])
    mask = torch.tensor([[1, 1, 1, 1, 0]])
    loss, metrics = ca.ppo_policy_loss(torch.zeros(1, 5), logprob, advantages, mask)
    close(loss, 0.525)
    close(metrics["actor/pg_loss"], 0.525)
    close(metrics["actor/clip_frac"], 0.5)
    close(metrics["actor/ratio_mean"], (1.5 + 0.5 + 1.1 + 0.7) / 4)
    close(metrics["actor/ratio_max"], 1.5)
    close(metrics["actor/ratio_min"], 0.5)
    # approx KL: mean of r − 1 − log r
    close(metrics["actor/approx_kl"], sum(r - 1 - math.log(r) for r in ratios[0][:4]) / 4)
    assert all(value.dim() == 0 and not value.requires_grad for value in metrics.values())


def test_policy_loss_clip_higher_dual_clip_and_is_weights_by_hand():
    # clip_high 0.28: r=1.5, A=1 → max(−1.5, −1.28) = −1.28
    # dual clip c=3, A=−2: r=2 → max(4, 2.4) = 4 < 6 kept; r=4 → max(8, 2.4) = 8 → capped at −A·c = 6
    # is_weights [0.5, 1, 2]: (−1.28·0.5 + 4·1 + 6·2)/3 = (−0.64 + 4 + 12)/3
    logprob = ratios_as_logprobs([[1.5, 2.0, 4.0]])
    advantages = torch.tensor([[1.0, -2.0, -2.0]])
    loss, metrics = ca.ppo_policy_loss(torch.zeros(1, 3), logprob, advantages, torch.ones(1, 3), clip_low=0.2,
                                   clip_high=0.28, dual_clip=3.0, is_weights=torch.tensor([[0.5, 1.0, 2.0]]))
    close(loss, (-0.64 + 4 + 12) / 3)
    close(metrics["actor/dual_clip_frac"], 1 / 3)
    close(metrics["actor/is_weight_mean"], 3.5 / 3)


def test_truncated_is_weights_by_hand():
    # w = min(exp(old − rollout), 2): exp(0.5), exp(−1), exp(3) → 2
    weights = ca.truncated_is_weights(torch.tensor([[0.0, -1.0, 0.0, 7.0]]), torch.tensor([[-0.5, 0.0, -3.0, 0.0]]),
                                      torch.tensor([[1, 1, 1, 0]]))
    close(weights, [[math.exp(0.5), math.exp(-1), 2.0, 0.0]])


@settings(max_examples=80, deadline=None)
@given(st.floats(-3, 3), st.floats(-4, 4), st.floats(0, 0.5), st.floats(0, 0.5), st.floats(1.5, 5))
def test_policy_loss_clipping_bounds_and_zero_gradient_outside_the_trust_region(log_ratio, advantage, low, high, c):
    logprob = torch.tensor([[log_ratio]], requires_grad=True)
    advantages = torch.tensor([[advantage]])
    loss, _ = ca.ppo_policy_loss(torch.zeros(1, 1), logprob, advantages, torch.ones(1, 1), low, high, dual_clip=c)
    gradient, = torch.autograd.grad(loss, logprob)
    loss, ratio = float(loss.detach()), math.exp(log_ratio)
    if advantage > 0:
        assert loss >= -advantage * (1 + high) - 1e-5  # the gain per token is bounded
        if ratio > 1 + high + 1e-6:
            assert float(gradient) == 0
    if advantage < 0:
        assert loss <= -advantage * c + 1e-5  # dual clip caps the loss
        if ratio < 1 - low - 1e-6 or ratio > c + 1e-6:
            assert float(gradient) == 0
    if abs(advantage) > 1e-3 and 1 - low + 1e-6 < ratio < 1 + high - 1e-6:
        assert float(gradient) != 0  # inside the trust region the plain policy gradient flows


def test_value_loss_by_hand():
    # clip 0.2:
    #   V=1, V_old=0.5, R=2: (V−R)² = 1; clipped V = 0.5 + 0.2 = 0.7 → (0.7−2)² = 1.69; ½·1.69 = 0.845
    #   V=2, V_old=2,   R=1: both 1 → 0.5
    #   V=0.6, V_old=0.5, R=2: inside the clip, (1.4)² = 1.96 → 0.98
    # token-mean (0.845 + 0.5 + 0.98)/3; clipped error larger on 1 of 3 tokens
    loss, metrics = ca.value_loss(torch.tensor([[1.0, 2.0, 0.6]]), torch.tensor([[0.5, 2.0, 0.5]]),
                                  torch.tensor([[2.0, 1.0, 2.0]]), torch.ones(1, 3), clip=0.2)
    close(loss, (0.845 + 0.5 + 0.98) / 3)
    close(metrics["critic/vf_loss"], (0.845 + 0.5 + 0.98) / 3)
    close(metrics["critic/vf_clip_frac"], 1 / 3)
    close(metrics["critic/vpred_mean"], 3.6 / 3)
    unclipped, _ = ca.value_loss(torch.tensor([[1.0]]), torch.tensor([[0.5]]), torch.tensor([[2.0]]),
                                 torch.ones(1, 1), clip=None)
    close(unclipped, 0.5)


def test_value_loss_counts_no_clip_where_the_clamp_was_inactive_but_rounds():
    # V = 2⁻³⁰, V_old = −0.125, R = 2⁻²⁹, clip 0.2, float32.
    # V − V_old = 0.125 + 2⁻³⁰ rounds to 0.125 (ulp(0.125) = 2⁻²⁶), |0.125| < 0.2: the clamp is inactive.
    # Yet V_old + 0.125 = 0 ≠ V, and (0 − R)² = 2⁻⁵⁸ > (V − R)² = 2⁻⁶⁰: a naive count calls it clipped.
    # Nothing was clipped: lₜ = ½(V − R)² = 2⁻⁶¹ and the clip fraction is 0.
    # The second token is clipped for real: V = 1, V_old = 0.5, R = 2: ½(0.7 − 2)² = 0.845 > ½(1 − 2)².
    values = torch.tensor([[2.0**-30, 1.0]])
    old_values = torch.tensor([[-0.125, 0.5]])
    returns = torch.tensor([[2.0**-29, 2.0]])
    assert float(old_values[0, 0] + (values[0, 0] - old_values[0, 0])) == 0.0  # the premise: it rounds
    loss, metrics = ca.value_loss(values, old_values, returns, torch.ones(1, 2), clip=0.2, agg="seq-mean-token-sum")
    assert float(metrics["critic/vf_clip_frac"]) == 0.5
    close(loss, 2.0**-61 + 0.845)
    first_token_loss, metrics = ca.value_loss(values[:, :1], old_values[:, :1], returns[:, :1], torch.ones(1, 1),
                                              clip=0.2)
    assert float(first_token_loss) == 2.0**-61
    assert float(metrics["critic/vf_clip_frac"]) == 0.0


def test_entropy_bonus_by_hand():
    # token-mean entropy (1 + 3 + 2)/3 = 2; the loss term is −0.1·2
    loss, metrics = ca.entropy_bonus(torch.tensor([[1.0, 3.0], [2.0, 40.0]]), torch.tensor([[1, 1], [1, 0]]), 0.1)
    close(loss, -0.2)
    close(metrics["actor/entropy"], 2.0)
    close(metrics["actor/entropy_coef"], 0.1)


# ---------------------------------------------------------------------------------------------
# Masked positions never leak; devices and dtypes


def every_masked_function(mask, a, b, c):
    """Each public per-token function on (mask, a, b, c), as a flat dict of output tensors."""
    outputs = {}
    outputs["gae_advantages"], outputs["gae_returns"] = ca.compute_gae(a, b, mask, 0.9, 0.8)
    outputs["reinforce_pp"], outputs["reinforce_pp_returns"] = ca.compute_reinforce_pp_advantages(a, mask, 0.9)
    outputs["whiten"] = ca.whiten(a, mask)
    outputs["reward"] = ca.reward_on_last_token(torch.arange(len(mask), device=mask.device).float(), mask, a, 0.3)
    for kind in ("k1", "k2", "k3", "k3+"):
        outputs[kind] = ca.kl_penalty(a, b, kind, mask)
    for mode in AGG_MODES:
        outputs[mode] = ca.aggregate(a, mask, mode)
    loss, metrics = ca.ppo_policy_loss(b, a, c, mask, dual_clip=3.0, is_weights=torch.sigmoid(b.float()))
    outputs |= {"policy": loss, **metrics}
    loss, metrics = ca.value_loss(a, b, c, mask)
    outputs |= {"value": loss, **metrics}
    loss, metrics = ca.entropy_bonus(a.abs(), mask, 0.01)
    outputs |= {"entropy": loss, **metrics}
    scores = torch.arange(len(mask), device=mask.device).float() % 3
    outputs["orz_grpo"] = ca.compute_orz_grpo_advantages(scores, torch.arange(len(mask), device=mask.device) // 2, mask)
    outputs["is_weights"] = ca.truncated_is_weights(a, b, mask)
    return outputs


@PROPERTY
@given(padded_batch(fields=3), st.sampled_from([float("nan"), float("inf"), -1e30, 123.0]))
def test_masked_inputs_never_reach_any_output(batch, junk):
    mask, a, b, c = batch
    clean = every_masked_function(mask, a, b, c)
    dirty = every_masked_function(mask, *(garbage_where_masked(x, mask, junk) for x in (a, b, c)))
    for name, value in clean.items():
        assert torch.equal(value, dirty[name]), name
        if value.dim() == 2:
            assert (value[mask == 0] == 0).all(), name


@pytest.mark.parametrize("device", DEVICES)
def test_bfloat16_inputs_are_computed_in_float32_on_their_device(device):
    generator = torch.Generator().manual_seed(0)
    mask = (torch.rand(3, 5, generator=generator) < 0.8).to(device)
    a, b, c = (torch.randn(3, 5, generator=generator).to(device, torch.bfloat16) for _ in range(3))
    low_precision = every_masked_function(mask, a, b, c)
    full_precision = every_masked_function(mask.float(), a.float(), b.float(), c.float())
    for name, value in low_precision.items():
        assert value.dtype == torch.float32 and value.device.type == device, name
        assert torch.equal(value, full_precision[name]), name


@pytest.mark.parametrize("device", DEVICES)
def test_group_functions_run_on_the_scores_device(device):
    scores, groups = SCORES.to(device), GROUPS.to(device)
    for advantages in (ca.compute_grpo_advantages(scores, groups), ca.compute_rloo_advantages(scores, groups),
                       ca.overlong_penalty(scores, 10, 5)):
        assert advantages.device.type == device
    keep, dropped = ca.dynamic_sampling_filter(scores, groups)
    assert keep.device.type == device and dropped == 1


# ---------------------------------------------------------------------------------------------
# DAPO helpers


def test_overlong_penalty_by_hand():
    # max_len 100, buffer 20: 0 up to 80, then −(L − 80)/20: 90 → −0.5, 100 → −1; factor 2 doubles it
    lengths = torch.tensor([50, 80, 90, 100, 120])
    close(ca.overlong_penalty(lengths, 100, 20), [0, 0, -0.5, -1, -1])
    close(ca.overlong_penalty(lengths, 100, 20, factor=2.0), [0, 0, -1, -2, -2])
    # each its own budget (a multi-turn sample's): 50 of 60 → −(50 − 40)/20 = −0.5; 80 of 110: 0; 90 of 100: −0.5
    budgets = torch.tensor([60, 110, 100, 130, 120])
    close(ca.overlong_penalty(lengths, budgets, 20), [-0.5, 0, -0.5, 0, -1])


def test_dynamic_sampling_drops_groups_with_equal_scores():
    # group 0 all right, group 2 all wrong, group 3 a single sample: dropped; group 1 mixed: kept
    keep, dropped = ca.dynamic_sampling_filter(torch.tensor([1.0, 1, 0, 1, 0, 0, 1]),
                                               torch.tensor([0, 0, 1, 1, 2, 2, 3]))
    assert keep.tolist() == [False, False, True, True, False, False, False] and dropped == 3


# ---------------------------------------------------------------------------------------------
# Controllers


def test_adaptive_kl_controller_by_hand():
    # error = clip(9/6 − 1 = 0.5 → 0.2): β = 0.1·(1 + 0.2·256/10000) = 0.100512
    # then clip(6.6/6 − 1 = 0.1): β ← β·(1 + 0.1·100/10000) = 0.100512·1.001
    # then KL 0 → error −1 clipped to −0.2: β ← β·(1 − 0.2·500/10000) = β·0.99
    controller = ca.AdaptiveKLController(init=0.1, target=6.0, horizon=10000)
    controller.update(9.0, 256)
    assert controller.value == pytest.approx(0.100512, rel=1e-12)
    controller.update(6.6, 100)
    assert controller.value == pytest.approx(0.100512 * 1.001, rel=1e-12)
    controller.update(0.0, 500)
    assert controller.value == pytest.approx(0.100512 * 1.001 * 0.99, rel=1e-12)
    fixed = ca.FixedKLController(0.05)
    fixed.update(100.0, 1000)
    assert fixed.value == 0.05


def test_adaptive_entropy_controller_by_hand():
    # target 0.5, step 0.01, max 0.02: low, low, low (clamped at 0.02), high, equal (falls), high (clamped at 0)
    controller = ca.AdaptiveEntropyController(target=0.5, step=0.01, max_coef=0.02)
    seen = []
    for entropy in (0.3, 0.3, 0.3, 0.7, 0.5, 0.9):
        controller.update(entropy)
        seen.append(controller.value)
    assert seen == pytest.approx([0.01, 0.02, 0.02, 0.01, 0.0, 0.0])


@PROPERTY
@given(st.lists(st.floats(0, 20), min_size=2, max_size=20), st.integers(1, 19))
def test_controllers_resume_identically_from_state_dict(measurements, stop):
    stop = min(stop, len(measurements) - 1)

    def make():
        return [ca.FixedKLController(0.1), ca.AdaptiveKLController(0.1, 6.0, 1000.0),
                ca.AdaptiveEntropyController(5.0, 0.001, 0.01, init=0.002)]

    def step(controller, x):
        controller.update(x) if isinstance(controller, ca.AdaptiveEntropyController) else controller.update(x, 64)

    uninterrupted, first_half = make(), make()
    for x in measurements[:stop]:
        for controller in first_half:
            step(controller, x)
    resumed = make()
    for controller, saved in zip(resumed, first_half):
        controller.load_state_dict(json.loads(json.dumps(saved.state_dict())))
    for x in measurements:
        for controller in uninterrupted:
            step(controller, x)
    for x in measurements[stop:]:
        for controller in resumed:
            step(controller, x)
    assert [c.value for c in resumed] == [c.value for c in uninterrupted]
    kl = uninterrupted[1]
    assert kl.value > 0
    entropy = uninterrupted[2]
    assert 0 <= entropy.value <= 0.01


@PROPERTY
@given(st.floats(0, 50), st.floats(0.01, 10), st.integers(1, 1000))
def test_adaptive_kl_moves_beta_towards_the_target(kl, target, n_steps):
    controller = ca.AdaptiveKLController(0.2, target, 1000.0)
    controller.update(kl, n_steps)
    error = min(max(kl / target - 1, -0.2), 0.2)
    assert controller.value == pytest.approx(0.2 * (1 + error * n_steps / 1000))
    assert (controller.value > 0.2) == (error > 0)


# ---------------------------------------------------------------------------------------------
# Bad input


@pytest.mark.parametrize("call, argument", [
    (lambda: ca.compute_gae(torch.zeros(2, 3), torch.zeros(2, 4), torch.ones(2, 3)), "values"),
    (lambda: ca.compute_gae(torch.zeros(2, 3), torch.zeros(2, 3), torch.ones(3, 2)), "mask"),
    (lambda: ca.compute_gae(torch.zeros(3), torch.zeros(3), torch.ones(3)), "rewards"),
    (lambda: ca.compute_gae(torch.zeros(1, 2), torch.zeros(1, 2), torch.tensor([[1.0, 0.5]])), "mask"),
    (lambda: ca.compute_gae(torch.tensor([[0.0, math.nan]]), torch.zeros(1, 2), torch.ones(1, 2)), "rewards"),
    (lambda: ca.compute_gae(torch.zeros(1, 2), torch.zeros(1, 2), torch.ones(1, 2), gamma=1.5), "gamma"),
    (lambda: ca.whiten(torch.zeros(1, 2), torch.tensor([[2, 0]])), "mask"),
    (lambda: ca.kl_penalty(torch.zeros(1, 2), torch.zeros(1, 2), "k4"), "k1, k2, k3, k3\\+"),
    (lambda: ca.kl_penalty(torch.zeros(1, 2), torch.zeros(2, 1), "k1"), "ref_logprob"),
    (lambda: ca.aggregate(torch.zeros(1, 2), torch.ones(1, 2), "mean"), "seq-mean-token-mean"),
    (lambda: ca.aggregate(torch.zeros(1, 2), torch.ones(1, 2), "seq-mean-token-sum-norm", norm_len=0), "norm_len"),
    (lambda: ca.ppo_policy_loss(torch.zeros(1, 2), torch.zeros(1, 2), torch.zeros(1, 3), torch.ones(1, 2)), "advantages"),
    (lambda: ca.ppo_policy_loss(torch.tensor([[math.inf, 0]]), torch.zeros(1, 2), torch.zeros(1, 2), torch.ones(1, 2)),
     "old_logprob"),
    (lambda: ca.ppo_policy_loss(*[torch.zeros(1, 2)] * 3, torch.ones(1, 2), dual_clip=0.5), "dual_clip"),
    (lambda: ca.ppo_policy_loss(*[torch.zeros(1, 2)] * 3, torch.ones(1, 2), is_weights=-torch.ones(1, 2)), "is_weights"),
    (lambda: ca.value_loss(torch.zeros(1, 2), torch.zeros(1, 2), torch.zeros(2), torch.ones(1, 2)), "returns"),
    (lambda: ca.compute_grpo_advantages(torch.zeros(3), torch.zeros(4, dtype=torch.long)), "group_index"),
    (lambda: ca.compute_grpo_advantages(torch.zeros(3), torch.zeros(3)), "group_index"),
    (lambda: ca.compute_rloo_advantages(torch.tensor([0.0, math.nan]), torch.zeros(2, dtype=torch.long)), "scores"),
    (lambda: ca.reward_on_last_token(torch.zeros(3), torch.ones(2, 4)), "scores"),
    (lambda: ca.overlong_penalty(torch.tensor([5]), 10, 20), "buffer_len"),
    (lambda: ca.AdaptiveKLController(0.1, 0.0, 10), "target"),
    (lambda: ca.AdaptiveEntropyController(1.0, 0.1, 0.5, init=0.9), "init"),
])
def test_bad_input_raises_value_error_naming_the_argument(call, argument):
    with pytest.raises(ValueError, match=argument):
        call()


def test_kl_in_score_by_hand():
    """s' = s − β·Σₜ klₜ over real tokens: 1 − 0.5·(0.2 + 0.4) = 0.7; 0 − 0.5·0.1 = −0.05."""
    scores = torch.tensor([1.0, 0.0])
    kl = torch.tensor([[0.2, 0.4, 9.0], [0.1, 9.0, 9.0]])
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    assert torch.allclose(ca.kl_in_score(scores, kl, mask, 0.5), torch.tensor([0.7, -0.05]))
    # The same total as the per-token penalty a per-token estimator sums into its return.
    rewards = ca.reward_on_last_token(scores, mask, kl * mask, 0.5)
    assert torch.allclose(rewards.sum(1), ca.kl_in_score(scores, kl, mask, 0.5))


def test_estimators_declare_what_they_read_and_their_published_whitening():
    read = {name: ca.ADVANTAGE_ESTIMATORS.get(name) for name in ca.ADVANTAGE_ESTIMATORS.names()}
    assert {n for n, e in read.items() if e.needs.reads_token_rewards} == {"gae", "reinforce_pp"}
    assert {n for n, e in read.items() if e.needs.whitens} == {"gae", "reinforce_pp"}
    assert {n for n, e in read.items() if e.needs.needs_critic} == {"gae"}


def test_gspo_by_hand():
    """Log-ratios 0.2 and −0.1: s = e^0.05 = 1.051271 for both tokens; A = 1. Inside the clip
    range the loss is −s and each token's gradient (token-mean over 2) is −s/2; outside
    (ranges 0.01) the whole sequence takes the clipped branch, −1.01, with no gradient."""
    old = torch.tensor([[0.0, 0.0, 0.0]])
    mask = torch.tensor([[1, 1, 0]])
    adv = torch.ones(1, 3)
    new = torch.tensor([[0.2, -0.1, 5.0]], requires_grad=True)
    loss, metrics = ca.gspo_policy_loss(old, new, adv, mask, 0.2, 0.2, agg="token-mean")
    s = math.exp(0.05)
    assert loss.item() == pytest.approx(-s, abs=1e-6)
    loss.backward()
    assert torch.allclose(new.grad, torch.tensor([[-s / 2, -s / 2, 0.0]]), atol=1e-6)
    assert metrics["actor/ratio_mean"].item() == pytest.approx(s, abs=1e-6)
    new.grad = None
    loss, metrics = ca.gspo_policy_loss(old, new, adv, mask, 0.01, 0.01, agg="token-mean")
    loss.backward()
    assert loss.item() == pytest.approx(-1.01, abs=1e-6) and metrics["actor/clip_frac"].item() == 1.0
    assert torch.count_nonzero(new.grad) == 0


def test_gspo_with_seq_mean_is_the_papers_sequence_objective():
    """Two sequences of lengths 1 and 3: seq-mean-token-mean gives −mean_i(sᵢ·Aᵢ)."""
    old = torch.zeros(2, 3)
    new = torch.tensor([[0.3, 0.0, 0.0], [0.1, 0.2, -0.3]])
    mask = torch.tensor([[1, 0, 0], [1, 1, 1]])
    adv = torch.tensor([[2.0], [-1.0]]).expand(2, 3)
    loss, _ = ca.gspo_policy_loss(old, new, adv, mask, 0.5, 0.5, agg="seq-mean-token-mean")
    assert loss.item() == pytest.approx(-(2 * math.exp(0.3) + -1 * math.exp(0.0)) / 2, abs=1e-6)


def test_cispo_by_hand():
    """Ratios e^0.5 = 1.6487 (weight clipped to 1.2) and e^−0.1 = 0.9048 (kept); A = 1;
    lₜ = −w·A·log π: 0.6 and 0.99532, token mean 0.79766; gradients −w/2, none dropped."""
    old = torch.tensor([[-1.0, -1.0]])
    new = torch.tensor([[-0.5, -1.1]], requires_grad=True)
    mask, adv = torch.ones(1, 2), torch.ones(1, 2)
    loss, metrics = ca.cispo_policy_loss(old, new, adv, mask, 1.0, 0.2)
    w = math.exp(-0.1)
    assert loss.item() == pytest.approx((1.2 * 0.5 + w * 1.1) / 2, abs=1e-6)
    loss.backward()
    assert torch.allclose(new.grad, torch.tensor([[-0.6, -w / 2]]), atol=1e-6)
    assert metrics["actor/clip_frac"].item() == 0.5


def test_policy_losses_are_registered_and_refuse_dual_clip():
    assert ca.POLICY_LOSSES.names() == ("cispo", "gspo", "ppo")
    x = torch.zeros(1, 2)
    for name in ("gspo", "cispo"):
        with pytest.raises(ValueError, match="dual_clip has no meaning"):
            ca.POLICY_LOSSES.get(name)(x, x, x, torch.ones(1, 2), 0.2, 0.2, 3.0)
