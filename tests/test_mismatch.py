"""The engine's policy against the trainer's: the mismatch figures and corrections of
core_algos by hand, then end to end on a stale tiny run, recomputed from its own dumps."""
import json
import math

import pytest
import torch

from orz.ppo.core_algos import (
    actor_loss,
    mismatch_keep_mask,
    mismatch_metrics,
    sequence_is_weights,
    truncated_is_weights,
)

# r = π_old/π_engine of five response tokens: row 0 has three, row 1 two (and one pad).
RATIOS = torch.tensor([[2.0, 0.5, 1.0], [2.0, 2.0, 1.0]])
MASK = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
ENGINE = torch.log(torch.tensor([[0.2, 0.4, 0.3], [0.1, 0.25, 0.5]]))
OLD = ENGINE + torch.log(RATIOS)
LN2 = math.log(2.0)


def test_mismatch_figures_by_hand():
    m = {k: float(v) for k, v in mismatch_metrics(OLD, ENGINE, MASK).items()}
    # k3 = r − 1 − ln r: 2 → 1 − ln2, 0.5 → −0.5 + ln2, 1 → 0; their sum is 0.5 + 2(1 − ln2) over 5 tokens.
    assert m["mismatch/kl_k3"] == pytest.approx((0.5 + 2 * (1 - LN2)) / 5, abs=1e-6)
    assert m["mismatch/logp_abs_diff_mean"] == pytest.approx(4 * LN2 / 5, abs=1e-6)
    assert m["mismatch/logp_abs_diff_max"] == pytest.approx(LN2, abs=1e-6)
    assert (m["mismatch/ratio_min"], m["mismatch/ratio_max"]) == pytest.approx((0.5, 2.0), abs=1e-6)
    # sorted r = 0.5, 1, 2, 2, 2; linear interpolation at 0.05·4 = 0.2, 2 and 3.8
    assert m["mismatch/ratio_p05"] == pytest.approx(0.5 + 0.2 * 0.5, abs=1e-6)
    assert m["mismatch/ratio_p50"] == pytest.approx(2.0, abs=1e-6)
    assert m["mismatch/ratio_p95"] == pytest.approx(2.0, abs=1e-6)
    # geometric means: row 0 (2·0.5·1)^(1/3) = 1, row 1 (2·2)^(1/2) = 2
    assert m["mismatch/seq_ratio_geo_mean"] == pytest.approx(1.5, abs=1e-6)
    assert m["mismatch/seq_ratio_geo_std"] == pytest.approx(0.5, abs=1e-6)
    assert m["mismatch/masked_token_frac"] == 0.0 and m["mismatch/rejected_seq_frac"] == 0.0


def test_token_mask_and_geometric_rejection_by_hand():
    token = mismatch_keep_mask(OLD, ENGINE, MASK, token_band=[0.6, 1.5])
    assert token.tolist() == [[False, False, True], [False, False, False]]
    one_sided = mismatch_keep_mask(OLD, ENGINE, MASK, token_band=[None, 1.5])
    assert one_sided.tolist() == [[False, True, True], [False, False, False]]
    geo = mismatch_keep_mask(OLD, ENGINE, MASK, sequence_geo_band=[0.9, 1.1])
    assert geo.tolist() == [[True, True, True], [False, False, False]]
    m = mismatch_metrics(OLD, ENGINE, MASK, token)
    assert float(m["mismatch/masked_token_frac"]) == pytest.approx(4 / 5)
    assert float(m["mismatch/rejected_seq_frac"]) == pytest.approx(1 / 2)  # row 1 lost every token
    m = mismatch_metrics(OLD, ENGINE, MASK, geo)
    assert float(m["mismatch/masked_token_frac"]) == pytest.approx(2 / 5)
    assert float(m["mismatch/rejected_seq_frac"]) == pytest.approx(1 / 2)
    for band in ([1.0, 2.0], [0.5, 1.0], [None, None], [0.5]):
        with pytest.raises(ValueError, match="token_band"):
            mismatch_keep_mask(OLD, ENGINE, MASK, token_band=band)


def test_is_weights_per_token_and_per_sequence_by_hand():
    torch.testing.assert_close(truncated_is_weights(OLD, ENGINE, MASK, cap=1.5),
                               torch.tensor([[1.5, 0.5, 1.0], [1.5, 1.5, 0.0]]))
    # Π r: row 0 2·0.5·1 = 1, row 1 2·2 = 4, capped at 2
    torch.testing.assert_close(sequence_is_weights(OLD, ENGINE, MASK, cap=2.0),
                               torch.tensor([[1.0, 1.0, 1.0], [2.0, 2.0, 0.0]]))
    assert sequence_is_weights(OLD, ENGINE, MASK, cap=8.0)[1, :2].tolist() == pytest.approx([4.0, 4.0])


# At logprob = old every ratio is 1 (no clip), so each token's policy loss is −A·w.
ADVANTAGES = torch.tensor([[1.0, 1.0, 1.0], [-2.0, -2.0, 0.0]])
# token IS at cap 1.5: w = [1.5, 0.5, 1], [1.5, 1.5]; −A·w = [−1.5, −0.5, −1], [3, 3]
FULL = {"token-mean": 3 / 5, "seq-mean-token-mean": (-3 / 3 + 6 / 2) / 2, "seq-mean-token-sum": (-3 + 6) / 2,
        "seq-mean-token-sum-norm": 3 / (2 * 3)}
# token band [0.6, 1.5] keeps row 0's last token alone (w = 1, −A·w = −1): one token, one sequence
MASKED = {"token-mean": -1.0, "seq-mean-token-mean": -1.0, "seq-mean-token-sum": -1.0,
          "seq-mean-token-sum-norm": -1 / 3}


@pytest.mark.parametrize("agg", sorted(FULL))
def test_actor_loss_with_is_weights_and_masking_by_hand(agg):
    logprob = OLD.clone().requires_grad_()
    loss, metrics = actor_loss(logprob, OLD, ADVANTAGES, MASK, agg=agg, rollout_logprob=ENGINE, is_level="token",
                               is_cap=1.5)
    assert float(loss.detach()) == pytest.approx(FULL[agg], abs=1e-6)
    keep = mismatch_keep_mask(OLD, ENGINE, MASK, token_band=[0.6, 1.5])
    loss, _ = actor_loss(logprob, OLD, ADVANTAGES, keep, agg=agg, rollout_logprob=ENGINE, is_level="token", is_cap=1.5)
    assert float(loss.detach()) == pytest.approx(MASKED[agg], abs=1e-6)
    loss.backward()
    assert logprob.grad[keep.logical_not()].abs().max() == 0  # a dropped token gets no gradient
    assert logprob.grad[0, 2] != 0


def test_the_whole_actor_objective_by_hand():
    """L = pg − c·mean H + β·mean KL, and its gradient (−A·w + β)/Σm per token (H does not depend on logprob)."""
    logprob = OLD.clone().requires_grad_()
    entropy = torch.full_like(OLD, 2.0)
    loss, metrics = actor_loss(logprob, OLD, ADVANTAGES, MASK, rollout_logprob=ENGINE, is_level="token", is_cap=1.5,
                               entropy=entropy, entropy_coef=0.1, ref_logprob=OLD - 0.3, kl_coef=0.5, kl_kind="k1")
    assert float(loss.detach()) == pytest.approx(0.6 - 0.1 * 2.0 + 0.5 * 0.3, abs=1e-6)
    assert float(metrics["actor/kl_loss"]) == pytest.approx(0.3, abs=1e-6)
    assert float(metrics["actor/entropy"]) == pytest.approx(2.0)
    assert float(metrics["tokens"]) == 5
    loss.backward()
    w = torch.tensor([[1.5, 0.5, 1.0], [1.5, 1.5, 0.0]])
    expected = (-ADVANTAGES * w + 0.5) / 5 * MASK
    torch.testing.assert_close(logprob.grad, expected, atol=1e-6, rtol=0)
    # sequence-level IS instead: w = 1 on row 0, min(4, 1.5) = 1.5 on row 1
    loss, _ = actor_loss(logprob, OLD, ADVANTAGES, MASK, rollout_logprob=ENGINE, is_level="sequence", is_cap=1.5)
    assert float(loss.detach()) == pytest.approx((-3 + 2 * 2 * 1.5) / 5, abs=1e-6)


# ---- end to end: four stages of two stale iterations each (max_staleness=1: the second
# iteration of a stage trains on samples of the weights before the last update).
STAGES = ("[{iterations: 2, overrides: {algorithm.is_cap: 1.0}}, "
          "{iterations: 2, overrides: {algorithm.mismatch_mask: [0.9, 1.1]}}, "
          "{iterations: 2, overrides: {algorithm.mismatch_reject_geo: [0.95, 1.05]}}, "
          "{iterations: 2, overrides: {algorithm.is_level: sequence}}]")


@pytest.fixture(scope="module")
def stale_run(ray_cluster, tiny_run, tmp_path_factory):
    from orz.config import load_config
    from orz.train import run as train
    from run_history import history

    out = tmp_path_factory.mktemp("stale")
    train(load_config(None, [*tiny_run(out, "grpo"), "trainer.max_staleness=1", "trainer.dump_per_token=true",
                             f"stages={STAGES}", "reward.custom={spaces: 'shaped_reward:space_share'}",
                             "reward.weights={spaces: 1.0}", "trainer.save_every=0", "trainer.export_hf=false"]))
    assert (out / "checkpoints").is_dir() and not (out / "hf").exists()  # trainer.export_hf=false
    dumps = [[json.loads(line) for line in (out / "samples" / f"iter_{i:06d}.jsonl").read_text().splitlines()]
             for i in range(1, 9)]
    return history(out)[1:], dumps


def _ratios(sample) -> torch.Tensor:
    return (torch.tensor(sample["old_logprobs"]) - torch.tensor(sample["rollout_logprobs"])).exp()


def _pg_loss(samples, keep, level="token", cap=2.0) -> float:
    """token-mean of −A·w over the kept tokens, w = min(r, cap) per token, or min(Π r, cap) over the
    sequence's kept tokens: the policy loss at ratio π/π_old = 1, which the first (here the only)
    mini-batch has."""
    def weights(s, k):
        r = _ratios(s)
        return r.clamp(max=cap) if level == "token" else (r.log() * k).sum().exp().clamp(max=cap).expand_as(r)

    numerator = sum(float((-torch.tensor(s["advantages"]) * weights(s, k) * k).sum()) for s, k in zip(samples, keep))
    return numerator / sum(float(k.sum()) for k in keep)


@pytest.mark.slow
def test_a_stale_run_measures_masks_and_rejects_as_its_dumps_say(stale_run):
    rows, dumps = stale_run
    assert all(row["actor/grad_norm"] > 0 for row in rows)  # the premise: a reward that varies, tokens kept
    for row, samples in zip(rows, dumps):
        ratios = torch.cat([_ratios(s) for s in samples])
        assert row["mismatch/kl_k3"] == pytest.approx(float((ratios - 1 - ratios.log()).mean()), rel=1e-4, abs=1e-9)
        assert row["mismatch/logp_abs_diff_max"] == pytest.approx(float(ratios.log().abs().max()), rel=1e-4)
    for stale in (1, 3, 5, 7):  # the second iteration of each stage trains on the previous weights' samples
        assert rows[stale]["mismatch/kl_k3"] > max(10 * rows[stale - 1]["mismatch/kl_k3"], 1e-4)

    # Stage 1, no mask, algorithm.is_cap=1: IS weights min(r, 1) weigh the loss the actor reports.
    for row, samples in zip(rows[:2], dumps[:2]):
        assert row["mismatch/masked_token_frac"] == 0 and row["mismatch/rejected_seq_frac"] == 0
        full = [torch.ones(len(s["advantages"])) for s in samples]
        assert row["actor/pg_loss"] == pytest.approx(_pg_loss(samples, full, cap=1.0), abs=1e-5)
        for s in samples:
            torch.testing.assert_close(torch.tensor(s["info/is_weights"]), _ratios(s).clamp(max=1.0))
    assert sum(int((_ratios(s) > 1.0).sum()) for s in dumps[1]) > 0  # the premise: the cap bound
    assert max(max(s["info/is_weights"]) for s in dumps[1]) == 1.0
    assert abs(_pg_loss(dumps[1], full, cap=2.0) - rows[1]["actor/pg_loss"]) > 1e-5  # the actor applied it
    without_weights = [{**s, "rollout_logprobs": s["old_logprobs"]} for s in dumps[1]]
    assert abs(_pg_loss(without_weights, full) - rows[1]["actor/pg_loss"]) > 1e-4  # the weights mattered

    # Stage 2: tokens with r outside [0.9, 1.1] leave the loss and its token count.
    stage = list(zip(rows[2:4], dumps[2:4]))
    for row, samples in stage:
        keep = [((r >= 0.9) & (r <= 1.1)).float() for r in map(_ratios, samples)]
        assert [k.tolist() for k in keep] == [s["info/loss_mask"] for s in samples]
        assert row["mismatch/masked_token_frac"] == pytest.approx(1 - float(torch.cat(keep).mean()), abs=1e-6)
        if any(k.any() for k in keep):
            assert row["actor/pg_loss"] == pytest.approx(_pg_loss(samples, keep), abs=1e-5)
    row, samples = stage[1]
    assert any(k.any() for k in keep)  # its loss was checked above: some token kept
    assert row["mismatch/masked_token_frac"] > 0
    unmasked = _pg_loss(samples, [torch.ones(len(s["advantages"])) for s in samples])
    assert abs(unmasked - row["actor/pg_loss"]) > 1e-4  # the mask changed the update

    # Stage 3: sequences whose geometric-mean ratio leaves [0.95, 1.05] are dropped whole.
    for row, samples in zip(rows[4:6], dumps[4:6]):
        geo = torch.stack([_ratios(s).log().mean().exp() for s in samples])
        rejected = (geo < 0.95) | (geo > 1.05)
        for s, out in zip(samples, rejected.tolist()):
            assert s["info/loss_mask"] == [0.0 if out else 1.0] * len(s["advantages"])
        assert row["mismatch/rejected_seq_frac"] == pytest.approx(float(rejected.float().mean()), abs=1e-6)
        keep = [torch.full((len(s["advantages"]),), 0.0 if out else 1.0) for s, out in zip(samples, rejected.tolist())]
        assert row["actor/pg_loss"] == pytest.approx(_pg_loss(samples, keep), abs=1e-5)
    assert 0 < rows[5]["mismatch/rejected_seq_frac"] < 1
    unrejected = _pg_loss(dumps[5], [torch.ones(len(s["advantages"])) for s in dumps[5]])
    assert abs(unrejected - rows[5]["actor/pg_loss"]) > 1e-4  # the rejection changed the update

    # Stage 4: sequence-level IS, w = min(Πₜ rₜ, 2) on every token of the sequence.
    for row, samples in zip(rows[6:8], dumps[6:8]):
        full = [torch.ones(len(s["advantages"])) for s in samples]
        assert row["actor/pg_loss"] == pytest.approx(_pg_loss(samples, full, "sequence"), abs=1e-5)
    assert abs(_pg_loss(dumps[7], full, "token") - rows[7]["actor/pg_loss"]) > 1e-4  # not the token-level loss
