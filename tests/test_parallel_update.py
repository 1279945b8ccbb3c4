"""The actor's update is the same at every layout, and resume continues it exactly.

A MegatronWorker (the Ray actor's class, here in a plain torch.distributed world of spawned
processes) takes two optimizer steps on fixed mini-batches whose micro-batches have different row
counts and widths. Against DP=1: DP=2, PP=2, TP2×PP2, token-budget micro-batches and the
distributed optimizer give the same loss, gradient norm and weights (fp32, 1e-5 relative). Each
layout also saves after step 1, and a fresh worker loaded from that checkpoint takes step 2 to
bit-identical weights: the Adam moments (sharded over DP with ZeRO-1) and, in bf16, the fp32
master weights are restored exactly.
"""
import json
import math
import os
import shutil
from pathlib import Path
from dataclasses import replace

import pytest
import torch
import torch.distributed as dist

from orz.config import AlgorithmConfig, RoleConfig
from orz.models.checkpoint import recut_layout
from orz.models.local_world import run_world
from orz.models.tiny import make_tiny_hf
from orz.ppo.workers import ActorSettings, MegatronWorker, combine_metrics, rows_in_place
from orz.ppo.experience import MiniBatch, experience_from_rollouts
from adam_step import beyond_adam_steps
from worker_specs import worker_spec

ALGO = AlgorithmConfig(advantage="grpo", clip_low=0.2, clip_high=0.28)  # as tests/fixtures/checkpoint_* were made


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return str(make_tiny_hf(tmp_path_factory.mktemp("par"), vocab_size=64, hidden_size=64, intermediate_size=128,
                            num_heads=4, num_kv_heads=2, num_layers=2))


OLD_LOGPROB = -4.2  # every response token's log π_old


def _rollouts() -> tuple[list[list[int]], list[list[int]], torch.Tensor]:
    """16 rows: prompts of 3–6 and responses of 2–9 tokens, and one advantage per row."""
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(1, 64, (int(n),), generator=g).tolist() for n in torch.randint(3, 7, (16,), generator=g)]
    responses = [torch.randint(1, 64, (int(n),), generator=g).tolist() for n in torch.randint(2, 10, (16,), generator=g)]
    return prompts, responses, torch.randn(16, 1, generator=g)


def _minibatches() -> list[MiniBatch]:
    """The rollouts as two mini-batches of 8 rows."""
    prompts, responses, advantages = _rollouts()
    exp = experience_from_rollouts(prompts, responses, [[-4.0] * len(r) for r in responses], pad_id=0)
    mask = exp.response_mask
    exp = replace(exp, old_logprobs=torch.full(mask.shape, OLD_LOGPROB) * mask,
                  advantages=advantages.expand_as(mask) * mask)
    return [MiniBatch.of(exp.select(range(i, i + 8)).trim(), rows=torch.arange(i, i + 8)) for i in (0, 8)]


def _worker(rank, world, role, dtype, model):
    w = MegatronWorker(worker_spec(model, role, dtype=dtype, total_steps=2, seed=3),
                       rank, world)
    w.setup((os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])))
    return w


def _step(w, world, mb):
    """One optimizer step on `mb`; the metrics merged over the world's reporting ranks."""
    out = w.train_actor([mb], ActorSettings(ALGO, 1.0, 0.0, 0.0))
    parts = [None] * world
    dist.all_gather_object(parts, out and out.metrics)
    return combine_metrics([p for p in parts if p])


def _two_steps(rank, world, role, dtype, model, ckpt):
    first, second = _minibatches()
    w = _worker(rank, world, role, dtype, model)
    metrics = [_step(w, world, first)]
    w.save(ckpt)
    dist.barrier()
    metrics.append(_step(w, world, second))
    weights = dict(w.model.hf_tensors())
    resumed = _worker(rank, world, role, dtype, model)
    resumed.load(ckpt)
    resumed_metrics = _step(resumed, world, second)
    resumed_weights = dict(resumed.model.hf_tensors())
    if rank != 0:
        return None
    return {"metrics": metrics, "weights": weights, "resumed_metrics": resumed_metrics, "resumed_weights": resumed_weights}


LAYOUTS = {  # name: (workers, RoleConfig)
    "dp1": (1, RoleConfig(lr=1e-3, micro_batch_size=3)),
    "dp2": (2, RoleConfig(lr=1e-3, dp=2, micro_batch_size=3)),
    "pp2": (2, RoleConfig(lr=1e-3, pp=2, micro_batch_size=3)),
    "tp2pp2": (4, RoleConfig(lr=1e-3, tp=2, pp=2, micro_batch_size=3)),
    "pp2_tokens": (2, RoleConfig(lr=1e-3, pp=2, micro_batch_tokens=24)),
    "dp2_distributed_optimizer": (2, RoleConfig(lr=1e-3, dp=2, micro_batch_size=3, use_distributed_optimizer=True)),
    "dp1_distributed_optimizer": (1, RoleConfig(lr=1e-3, micro_batch_size=3, use_distributed_optimizer=True)),
    # rows packed (THD) into passes of at most 24 real tokens: attention and RoPE restart at each row
    "dp1_packed": (1, RoleConfig(lr=1e-3, micro_batch_tokens=24, pack=True)),
    "dp2_packed": (2, RoleConfig(lr=1e-3, dp=2, micro_batch_tokens=24, pack=True)),
    "pp2_packed": (2, RoleConfig(lr=1e-3, pp=2, micro_batch_tokens=24, pack=True)),
}


@pytest.fixture(scope="module")
def reference_checkpoint(tmp_path_factory):
    return str(tmp_path_factory.mktemp("ck"))


@pytest.fixture(scope="module")
def reference(model, reference_checkpoint):
    return run_world(_two_steps, 1, LAYOUTS["dp1"][1], "float32", model, reference_checkpoint)[0]


# What each rank's passes looked like: its DP shard's micro-batches, so they follow the layout.
LAYOUT_METRICS = {"actor/micro_batches", "actor/pass_tokens_max", "perf/padding_frac"}


def _close(a: float, b: float, rel: float = 1e-5) -> bool:
    return abs(a - b) <= rel * max(abs(a), abs(b), 1e-3)


@pytest.mark.parametrize("layout", [name for name in LAYOUTS if name != "dp1"])
def test_layout_matches_dp1_and_resumes_exactly(layout, model, reference, tmp_path):
    workers, role = LAYOUTS[layout]
    out = run_world(_two_steps, workers, role, "float32", model, str(tmp_path / "ck"), timeout=300)[0]
    for mine, ref in zip(out["metrics"], reference["metrics"]):
        assert mine.keys() == ref.keys()
        for key in ref.keys() - LAYOUT_METRICS:
            assert _close(mine[key], ref[key]), (key, mine[key], ref[key])
    # Weights within 1e-5 absolute, ~lr: Adam's early steps are ~lr·sign(g), so an element whose
    # gradient is ~0 turns fp32 summation-order noise (another layout reduces in another order)
    # into an lr-sized difference; loss and gradient norm above carry the 1e-5 relative check.
    for name, w in reference["weights"].items():
        assert (out["weights"][name] - w).abs().max() <= 1e-5, name
    assert all(torch.equal(out["resumed_weights"][n], out["weights"][n]) for n in out["weights"])
    assert out["resumed_metrics"] == out["metrics"][1]
    # What the passes held: no slot of a packed one pads; rows by threes pad as derived from the lengths
    if role.pack:
        assert all(m["perf/padding_frac"] == 0 and m["actor/micro_batches"] >= 2 for m in out["metrics"])
    elif role.micro_batch_tokens == 0:
        expected = [_padding_of_threes(mb, role.dp) for mb in _minibatches()]
        assert [m["perf/padding_frac"] for m in out["metrics"]] == pytest.approx(expected, abs=1e-12)
        assert all(0 < e for e in expected)  # the premise: rows of unlike lengths


def _padding_of_threes(minibatch: MiniBatch, dp: int) -> float:
    """1 − real/slots over every DP rank's passes of three rows (shortest first), each padded to
    its longest row."""
    from orz.ppo.experience import balanced_shards

    lengths = minibatch.experience.sequence_lengths()
    real = slots = 0
    for rows in balanced_shards(lengths, dp):
        ordered = sorted(lengths[rows].tolist())
        for bin_ in (ordered[i:i + 3] for i in range(0, len(ordered), 3)):
            real, slots = real + sum(bin_), slots + len(bin_) * max(bin_)
    return 1 - real / slots


def test_bf16_trains_from_the_loaded_weights_reproducibly_and_resumes_its_fp32_masters_exactly(model, tmp_path):
    """A bf16 model's optimizer keeps fp32 masters: they must be the loaded HF weights, not the
    random initialisation the model was built with. Each Adam step moves a weight by about lr
    (|m̂/√v̂| ≤ 1 at the first step, a little more at the second): two steps at lr 1e-3 stay
    within 3·lr each of the start, plus bf16's rounding of the weight (2⁻⁸ relative); a random
    start is off by the weights' own size (~0.1), and differs from process to process: the same
    steps in another process must give the same bits."""
    from safetensors.torch import load_file

    lr = LAYOUTS["dp1"][1].lr
    out = run_world(_two_steps, 1, LAYOUTS["dp1"][1], "bfloat16", model, str(tmp_path / "ck"))[0]
    again = run_world(_two_steps, 1, LAYOUTS["dp1"][1], "bfloat16", model, str(tmp_path / "again"))[0]
    assert all(torch.equal(again["weights"][n], w) for n, w in out["weights"].items())
    assert out["weights"]["model.layers.0.self_attn.q_proj.weight"].dtype == torch.bfloat16
    initial = load_file(f"{model}/model.safetensors")
    moved = {n: (w.float() - initial[n]).abs() for n, w in out["weights"].items()}
    assert out["metrics"][0]["actor/grad_norm"] > 0 and max(d.max() for d in moved.values()) > lr / 2
    assert not beyond_adam_steps(out["weights"], initial, 2, lr)
    assert all(torch.equal(out["resumed_weights"][n], out["weights"][n]) for n in out["weights"])
    assert out["resumed_metrics"] == out["metrics"][1]


def test_reference_moves_the_weights(model, reference):
    from safetensors.torch import load_file

    initial = load_file(f"{model}/model.safetensors")
    assert any(not torch.equal(initial[n], w) for n, w in reference["weights"].items())
    assert reference["metrics"][0]["actor/grad_norm"] > 0


def test_dp1_steps_equal_transformers_with_the_clipped_loss_written_out(model, reference):
    """The reference layout itself against an independent computation: transformers' forward,
    PPO's clipped surrogate written out per token, its mean over each mini-batch's response
    tokens, global-norm clipping and torch's Adam, two steps."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32)
    role = LAYOUTS["dp1"][1]
    adam = torch.optim.Adam(hf.parameters(), lr=role.lr, betas=role.adam_betas, eps=1e-8)
    prompts, responses, advantages = _rollouts()
    for step, rows in enumerate((range(0, 8), range(8, 16))):
        token_losses = []
        for row in rows:
            ids = torch.tensor([prompts[row] + responses[row]])
            logp = torch.log_softmax(hf(ids).logits[0, :-1], -1).gather(-1, ids[0, 1:, None])[:, 0]
            ratio = torch.exp(logp[len(prompts[row]) - 1:] - OLD_LOGPROB)
            a = advantages[row]
            token_losses.append(torch.maximum(-a * ratio, -a * ratio.clamp(1 - ALGO.clip_low, 1 + ALGO.clip_high)))
        loss = torch.cat(token_losses).mean()
        adam.zero_grad()
        loss.backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(hf.parameters(), role.clip_grad)
        adam.step()
        metrics = reference["metrics"][step]
        assert _close(metrics["actor/pg_loss"], loss.item()), (step, metrics["actor/pg_loss"], loss.item())
        assert _close(metrics["actor/grad_norm"], grad_norm.item()), (step, metrics["actor/grad_norm"], grad_norm)
    expected = hf.state_dict()
    assert reference["weights"].keys() <= expected.keys()
    for name, w in reference["weights"].items():
        assert (expected[name] - w).abs().max() <= 1e-5, (name, (expected[name] - w).abs().max())


def _first_step_at_clip_low(rank, world, model, clip_low):
    """The actor's log-probs of the first mini-batch, then its step's metrics at that clip_low."""
    w = _worker(rank, world, LAYOUTS["dp1"][1], "float32", model)
    first = _minibatches()[0]
    _, logprobs = w.logprobs(first.experience)
    algo = AlgorithmConfig(advantage="grpo", clip_low=clip_low, clip_high=ALGO.clip_high)
    return logprobs, w.train_actor([first], ActorSettings(algo, 1.0, 0.0, 0.0)).metrics


def test_the_ratios_floor_is_algorithm_clip_low(model):
    """algorithm.clip_low = 0.1, off its default 0.2: PPO's loss token by token from the actor's own
    log-probs, max(−A·r, −A·clip(r, 1 − 0.1, 1 + clip_high)), r = π/π_old, its mean over the
    response tokens; some tokens of a negative advantage lie between the two floors (the premise),
    where the default's floor would give another loss."""
    clip_low = 0.1
    logprobs, metrics = run_world(_first_step_at_clip_low, 1, model, clip_low)[0]
    exp = _minibatches()[0].experience
    mask, advantages = exp.response_mask.bool(), exp.advantages
    ratio = torch.exp(logprobs - OLD_LOGPROB)
    between = mask & (advantages < 0) & (ratio > 1 - AlgorithmConfig().clip_low) & (ratio < 1 - clip_low)
    assert between.any()  # the premise
    per_token = torch.maximum(-advantages * ratio, -advantages * ratio.clamp(1 - clip_low, 1 + ALGO.clip_high))
    assert metrics["actor/pg_loss"] == pytest.approx(per_token[mask].mean().item(), rel=1e-5)


def _schedule_and_decay(rank, world, model):
    """The lr each of five steps ran at (warm-up 2, cosine to min_lr over 5 steps); the weights
    after one step at lr 1e-3 without and with weight decay 0.5, and before it."""
    spec = worker_spec(model, RoleConfig(lr=1e-3, min_lr=1e-4, warmup_steps=2, lr_decay="cosine", micro_batch_size=3),
                       total_steps=5, seed=3)
    w = MegatronWorker(spec, rank, world)
    w.setup((os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])))
    minibatches, lrs = _minibatches(), []
    for step in range(5):
        lrs.append({group["lr"] for group in w.model.optimizer.param_groups})
        _step(w, world, minibatches[step % 2])
    weights = {}
    for decay in (0.0, 0.5):
        w = _worker(rank, world, RoleConfig(lr=1e-3, weight_decay=decay, micro_batch_size=3), "float32", model)
        weights["initial"] = dict(w.model.hf_tensors())
        _step(w, world, minibatches[0])
        weights[decay] = dict(w.model.hf_tensors())
    return lrs, weights


def test_the_lr_warms_up_decays_to_min_lr_and_weight_decay_shrinks_the_matrices_only(model):
    """actor.warmup_steps, lr_decay, min_lr and weight_decay as Megatron's schedule and AdamW
    define them, written out: lr_s = lr·s/warmup up to the warm-up (the first step at 0), then
    min_lr + (lr − min_lr)·½(1 + cos(π·(s − warmup)/(steps − warmup))); decoupled decay moves each
    matrix by −lr·wd·θ beside the same Adam step, and leaves the norms' vectors alone."""
    lrs, weights = run_world(_schedule_and_decay, 1, model)[0]
    lr, floor, warmup, steps = 1e-3, 1e-4, 2, 5
    expected = [lr * s / warmup if s <= warmup else
                floor + (lr - floor) * 0.5 * (1 + math.cos(math.pi * (s - warmup) / (steps - warmup)))
                for s in range(steps)]
    assert [len(at) for at in lrs] == [1] * steps  # every param group at one lr
    assert [at.pop() for at in lrs] == pytest.approx(expected, rel=1e-9, abs=1e-12)
    initial, plain, decayed = weights["initial"], weights[0.0], weights[0.5]
    assert any(not torch.equal(initial[n], plain[n]) for n in plain)  # the premise: the step moved them
    for name, theta in initial.items():
        moved_by_decay = decayed[name] - plain[name]
        if theta.dim() == 2:
            torch.testing.assert_close(moved_by_decay, -lr * 0.5 * theta, atol=1e-7, rtol=0)
        else:
            assert torch.equal(moved_by_decay, torch.zeros_like(theta)), name


def _critic_step(rank, world, model):
    """The critic's values V on the first mini-batch, then its step with V_old = V − 0.15 on the
    even rows and V − 0.05 on the odd ones, the returns V + 1, at algorithm.value_clip=0.1."""
    w = MegatronWorker(worker_spec(model, RoleConfig(lr=1e-3, micro_batch_size=3), name="critic", seed=3), rank, world)
    w.setup((os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])))
    first = _minibatches()[0]
    exp = first.experience
    _, values = w.values(exp)
    mask = exp.response_mask
    offsets = torch.tensor([0.15 if row % 2 == 0 else 0.05 for row in range(len(mask))])[:, None] * mask
    exp = replace(exp, values=(values - offsets) * mask, returns=(values + 1.0) * mask)
    return mask, w.train_critic([MiniBatch.of(exp, rows=first.rows)], AlgorithmConfig(value_clip=0.1))


def test_the_critic_clips_its_values_at_algorithm_value_clip(model):
    """PPO's clipped value loss at c = 0.1 (algorithm.value_clip off its default, 0.2), by hand:
    ½·max((V − R)², (V_old + clip(V − V_old, ±c) − R)²) with R − V = 1: on the rows whose V moved
    0.15 from V_old the clipped error (1 + 0.05)² wins, on the rows that moved 0.05 (V − R)² = 1;
    the token mean of those. At c = 0.2 no token would be clipped."""
    mask, metrics = run_world(_critic_step, 1, model)[0]
    clipped = mask[0::2].sum().item()
    expected = 0.5 * (clipped * 1.05 ** 2 + (mask.sum().item() - clipped) * 1.0) / mask.sum().item()
    assert metrics["critic/vf_clip_frac"] == pytest.approx(clipped / mask.sum().item(), abs=1e-6)  # the premise
    assert metrics["critic/vf_loss"] == pytest.approx(expected, rel=1e-5)


def _load(rank, world, role, model, ckpt):
    w = MegatronWorker(worker_spec(model, role, total_steps=2), rank, world)
    w.setup((os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])))
    w.load(ckpt)


def test_a_checkpoint_without_the_distributed_optimizer_is_refused_with_it(model, reference, reference_checkpoint):
    workers, role = LAYOUTS["dp2_distributed_optimizer"]
    with pytest.raises(RuntimeError, match=r"saved with the plain optimizer, this run has the distributed one"):
        run_world(_load, workers, role, model, reference_checkpoint)


def _first_step_saved(rank, world, role, model, ckpt):
    w = _worker(rank, world, role, "float32", model)
    _step(w, world, _minibatches()[0])
    w.save(ckpt)


def _second_step_from(rank, world, role, model, ckpt):
    """A worker at `role`'s layout loads the checkpoint another layout saved after step 1, and takes step 2."""
    w = _worker(rank, world, role, "float32", model)
    w.load(ckpt)
    metrics = _step(w, world, _minibatches()[1])
    weights = dict(w.model.hf_tensors())
    return (metrics, weights) if rank == 0 else None


RESHARD_LAYOUTS = {  # name: (workers, RoleConfig), with the distributed optimizer unless "plain"
    "tp2_plain": (2, RoleConfig(lr=1e-3, tp=2, micro_batch_size=3)),
    "pp2_plain": (2, RoleConfig(lr=1e-3, pp=2, micro_batch_size=3)),
    "dp1": (1, RoleConfig(lr=1e-3, micro_batch_size=3, use_distributed_optimizer=True)),
    "dp2": (2, RoleConfig(lr=1e-3, dp=2, micro_batch_size=3, use_distributed_optimizer=True)),
    "tp2pp2": (4, RoleConfig(lr=1e-3, tp=2, pp=2, micro_batch_size=3, use_distributed_optimizer=True)),
    "tp2dp2": (4, RoleConfig(lr=1e-3, tp=2, dp=2, micro_batch_size=3, use_distributed_optimizer=True)),
}


def _recut(rank, world, role, model, ckpt):
    _worker(rank, world, role, "float32", model).recut(ckpt)


def _recut_for(role: RoleConfig, model, ckpt) -> bool:
    """What the trainer does before a resume: re-cut the checkpoint on workers of its saved layout
    when `role`'s layout cannot load it as it is; whether it had to."""
    sizes = {k: getattr(role, k) for k in ("tp", "pp", "dp", "ep", "etp")}
    at = recut_layout(ckpt, sizes, role.use_distributed_optimizer)
    if at is not None:
        run_world(_recut, at["tp"] * at["pp"] * at["dp"], replace(role, **at), model, ckpt, timeout=300)
    return at is not None


@pytest.mark.parametrize("saved,resumed,recut", [("dp2", "dp1", False), ("dp2", "tp2pp2", True),
                                                  ("tp2dp2", "dp1", True), ("tp2_plain", "pp2_plain", False)])
def test_a_run_resumes_at_another_layout_with_its_adam_moments_resharded(saved, resumed, recut, model, reference,
                                                                          tmp_path):
    """Going from 4 nodes to 8: Megatron re-shards the checkpoint. The distributed optimizer's
    fast cut (each DP rank's flat shard) loads at another DP; at another TP/PP it is re-cut first,
    on workers of the saved layout, into the model-shaped cut; without the distributed optimizer
    the states are model-shaped already. Step 2 is the uninterrupted run's (the DP=1 reference,
    within the layouts' 1e-5)."""
    run_world(_first_step_saved, *RESHARD_LAYOUTS[saved], model, str(tmp_path / "ck"), timeout=300)
    assert _recut_for(RESHARD_LAYOUTS[resumed][1], model, str(tmp_path / "ck")) == recut
    metrics, weights = run_world(_second_step_from, *RESHARD_LAYOUTS[resumed], model, str(tmp_path / "ck"),
                                 timeout=300)[0]
    assert _unlike_step_two(metrics, weights, reference) == []


def test_a_checkpoint_in_the_fast_cut_is_refused_at_another_tp_until_re_cut(model, tmp_path):
    run_world(_first_step_saved, *RESHARD_LAYOUTS["dp2"], model, str(tmp_path / "ck"), timeout=300)
    with pytest.raises(RuntimeError, match=r"saved at TP1 PP1 DP2 in Megatron's dp_reshardable cut.*this run has "
                                           r"TP2 PP1 DP2"):
        run_world(_load, *RESHARD_LAYOUTS["tp2dp2"], model, str(tmp_path / "ck"))


def _unlike_step_two(metrics, weights, reference) -> list:
    """What differs from the uninterrupted run's step 2: metrics beyond 1e-5 relative, weights beyond 1e-5."""
    ref_metrics = reference["metrics"][1]
    return ([(key, metrics[key], ref_metrics[key]) for key in ref_metrics.keys() - LAYOUT_METRICS
             if not _close(metrics[key], ref_metrics[key])]
            + [name for name, w in reference["weights"].items() if (weights[name] - w).abs().max() > 1e-5])


def _second_step_with_zeroed_moments(rank, world, role, model, ckpt):
    """_second_step_from, resumed by a loader that loses the Adam moments (a mutation)."""
    from orz.models import dist_checkpoint

    load = dist_checkpoint.load

    def without_moments(engine, *args, **kwargs):
        meta = load(engine, *args, **kwargs)
        for optimizer in getattr(engine.optimizer, "chained_optimizers", [engine.optimizer]):
            for state in optimizer.optimizer.state.values():
                state["exp_avg"].zero_(), state["exp_avg_sq"].zero_()
        return meta

    dist_checkpoint.load = without_moments
    return _second_step_from(rank, world, role, model, ckpt)


def test_the_resharded_resume_check_fails_when_the_moments_are_lost(model, reference, tmp_path):
    """The check above, on a TP2 → PP2 resume whose loader zeroes the moments: it must see it."""
    run_world(_first_step_saved, *RESHARD_LAYOUTS["tp2_plain"], model, str(tmp_path / "ck"), timeout=300)
    metrics, weights = run_world(_second_step_with_zeroed_moments, *RESHARD_LAYOUTS["pp2_plain"], model,
                                 str(tmp_path / "ck"), timeout=300)[0]
    assert _unlike_step_two(metrics, weights, reference) != []


def _logprobs(rank, world, role, model, experience):
    w = MegatronWorker(worker_spec(model, role, total_steps=1), rank, world)
    w.setup((os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])))
    parts = [None] * world
    dist.all_gather_object(parts, w.logprobs(experience, temperature=0.7))
    return rows_in_place(parts) if rank == 0 else None


@pytest.mark.parametrize("layout", ["dp1", "dp2", "pp2_tokens"])
def test_the_logprob_pass_returns_rows_in_their_order(layout, model):
    """Micro-batches sorted by length (cut by rows or by a token budget) reorder
    the rows; the pass puts them back: each row's log π equals transformers' log_softmax."""
    from transformers import AutoModelForCausalLM

    experience = _minibatches()[0].experience
    workers, role = LAYOUTS[layout]
    got = run_world(_logprobs, workers, role, model, experience, timeout=300)[0]
    hf = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = hf(experience.sequences, attention_mask=experience.attention_mask).logits / 0.7
    token_logprobs = torch.log_softmax(logits[:, :-1], -1).gather(-1, experience.sequences[:, 1:, None])[..., 0]
    for row, start in enumerate(experience.prompt_lengths.tolist()):
        n = int(experience.response_mask[row].sum())
        torch.testing.assert_close(got[row, :n], token_logprobs[row, start - 1:start - 1 + n], atol=1e-4, rtol=1e-4)
        assert not got[row, n:].any()


def _update_with_and_without_old(rank, world, role, model):
    """Two optimizer steps from the same weights: once with π_old from a separate pass, once
    with none given (the actor reads it in its update); metrics and weights of both."""
    def worker():
        w = MegatronWorker(worker_spec(model, role, total_steps=2, seed=3), rank, world)
        w.setup((os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])))
        return w

    def train(w, minibatches):
        out = w.train_actor(minibatches, ActorSettings(ALGO, 0.7, 0.0, 0.0))
        parts = [None] * world
        dist.all_gather_object(parts, out)
        read_old = torch.zeros(16, max(mb.experience.response_mask.shape[1] for mb in minibatches))
        for rows, values in (piece for p in parts if p for piece in p.old_logprobs):
            read_old[rows, : values.shape[1]] = values
        return combine_metrics([p.metrics for p in parts if p]), dict(w.model.hf_tensors()), read_old

    minibatches = [replace(mb, experience=replace(mb.experience, old_logprobs=None)) for mb in _minibatches()]
    separate = worker()
    parts = [None] * world
    dist.all_gather_object(parts, separate.logprobs(_whole(minibatches), temperature=0.7))
    old = rows_in_place(parts)
    given = [replace(mb, experience=replace(mb.experience, old_logprobs=rows[:, :mb.experience.response_mask.shape[1]]))
             for mb, rows in zip(minibatches, old.split(8))]
    with_pass = train(separate, given)
    in_update = train(worker(), minibatches)
    return (with_pass, in_update, old) if rank == 0 else None


def _whole(minibatches: list[MiniBatch]):
    from orz.ppo.experience import Experience

    return Experience.concat([mb.experience for mb in minibatches])


@pytest.mark.parametrize("layout", ["dp1", "dp2", "pp2_tokens", "tp2pp2"])
def test_pi_old_read_in_the_update_equals_a_separate_pass(layout, model):
    workers, role = LAYOUTS[layout]
    (pass_metrics, pass_weights, none_read), (metrics, weights, read_old), old = run_world(
        _update_with_and_without_old, workers, role, model, timeout=300)[0]
    # The π_old the update read comes back by row, as the separate pass gave it (given: none read).
    assert not none_read.any()
    torch.testing.assert_close(read_old, old[:, : read_old.shape[1]] * (read_old != 0), atol=1e-5, rtol=0)
    assert (read_old != 0).sum() == sum(len(r) for r in _rollouts()[1])
    assert metrics.keys() == pass_metrics.keys()
    for key in pass_metrics:
        assert _close(metrics[key], pass_metrics[key]), (key, metrics[key], pass_metrics[key])
    assert pass_metrics["actor/clip_frac"] > 0 or pass_metrics["actor/approx_kl"] > 0  # step 2 is off-policy
    for name, w in pass_weights.items():  # 1e-5: the separate pass cuts other micro-batches
        assert (weights[name] - w).abs().max() <= 1e-5, name


def _threads(rank, world, role, model):
    w = _worker(rank, world, role, "float32", model)
    at_start = torch.get_num_threads()
    w.use_threads(1)  # what the trainer sends while engines generate beside the worker
    first = _step(w, world, _minibatches()[0])["actor/threads"]
    return at_start, first


def test_each_phase_reports_its_own_peak_memory():
    """`perf/peak_memory_gib/<role>_<phase>`: a phase that allocates less than the one before it
    reports less, since each phase's peak is reset at its start (on CPU the resident set's
    high-water mark, through /proc/self/clear_refs)."""
    worker = object.__new__(MegatronWorker)  # the bookkeeping alone; no model
    worker._peaks = {}
    with worker._phase_memory("update"):
        torch.ones(2**27).add_(1)  # 512 MiB, returned to the system when freed
    with worker._phase_memory("forward"):
        torch.ones(2**22).add_(1)  # 16 MiB
    peaks = worker.peak_memory_gib()
    assert peaks["update"] - peaks["forward"] > 0.4, peaks
    assert worker.peak_memory_gib() == {}  # read once


def test_a_worker_trains_with_its_roles_threads_and_takes_what_it_is_given(model):
    assert run_world(_threads, 1, replace(LAYOUTS["dp1"][1], threads=2), model) == [(2, 1.0)]


# Checkpoints of the format orz wrote until 2026-12-05, each written by that commit's own code: step 1
# of a layout above on the same tiny model, saved by its MegatronWorker.save (tests/fixtures/*/make.py,
# run with the commit checked out). f06bde6 (the last before optimizer state went by name) kept a
# non-distributed optimizer's whole Megatron state_dict in optim.pt; 4e53ded (the last of that format)
# each DP rank's flat range of the distributed optimizer's masters and moments, by name.
EARLIER_CHECKPOINTS = {"f06bde6": "dp1", "4e53ded": "dp2_distributed_optimizer"}


@pytest.mark.parametrize("commit", EARLIER_CHECKPOINTS)
def test_a_checkpoint_of_the_earlier_format_is_refused_then_resumes_after_orz_convert_upgrade(commit, model,
                                                                                              reference, tmp_path):
    from orz import convert
    from orz.config import ExperimentConfig, ModelConfig, to_dict

    workers, role = LAYOUTS[EARLIER_CHECKPOINTS[commit]]
    iteration = tmp_path / "checkpoints" / "iter_000001"
    shutil.copytree(Path(__file__).parent / "fixtures" / f"checkpoint_{commit}", iteration / "actor",
                    ignore=shutil.ignore_patterns("*.py"))
    config = replace(ExperimentConfig(), model=ModelConfig(path=model), actor=role)
    (iteration / "trainer_state.json").write_text(json.dumps({"config": to_dict(config)}))
    with pytest.raises(RuntimeError, match=r"format orz wrote until 2026-12-05.*`orz convert upgrade <run>/checkpoints/"):
        run_world(_load, workers, role, model, str(iteration / "actor"))
    assert convert.main(["upgrade", str(iteration)]) == 0
    metrics, weights = run_world(_second_step_from, workers, role, model, str(iteration / "actor"))[0]
    if commit == "4e53ded":  # written on this kind of machine: the uninterrupted run's step 2, as any resume
        assert _unlike_step_two(metrics, weights, reference) == []
        return
    # Step 1 ran on the CPU that wrote the fixture, whose float32 rounding may differ from this one's
    # (an AMD EPYC's against an Intel Xeon's: metrics 6e-7 apart, weights after step 2 by an RMS of
    # 3e-9). Step 2 from an optimizer state not restored moves the weights by an RMS of ~lr (7e-4).
    expected, lr = reference["metrics"][1], role.lr
    assert metrics.keys() == expected.keys() and all(_close(metrics[k], v) for k, v in expected.items()), metrics
    rms = torch.cat([(weights[n] - w).flatten() for n, w in reference["weights"].items()]).square().mean().sqrt()
    assert rms <= 1e-2 * lr, rms


@pytest.fixture(scope="module")
def moe(tmp_path_factory):
    """A tiny Qwen3-MoE: 4 experts, top-2, both layers sparse."""
    return str(make_tiny_hf(tmp_path_factory.mktemp("moe"), family="qwen3_moe", vocab_size=64, hidden_size=64,
                            head_dim=32, intermediate_size=128, num_heads=4, num_kv_heads=2, num_layers=2,
                            moe=dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32)))


def _resume_step_two(rank, world, role, model, ckpt, resave):
    """Loads `ckpt` (saved after step 1 at another layout) and takes step 2; with `resave`, saves
    it again at this layout there and a fresh worker loads that (the same layout) first."""
    w = _worker(rank, world, role, "float32", model)
    w.load(ckpt)
    if resave:
        w.save(resave)
        dist.barrier()
        w = _worker(rank, world, role, "float32", model)
        w.load(resave)
    metrics = _step(w, world, _minibatches()[1])
    weights = dict(w.model.hf_tensors())
    return (metrics, weights) if rank == 0 else None


MOE_LAYOUTS = {  # with the distributed optimizer: its shards of the experts and of the dense weights
    "dp2_ep1": RoleConfig(lr=1e-3, dp=2, micro_batch_size=3, use_distributed_optimizer=True),
    "dp2_ep2": RoleConfig(lr=1e-3, dp=2, ep=2, micro_batch_size=3, use_distributed_optimizer=True),
    "dp4_ep2": RoleConfig(lr=1e-3, dp=4, ep=2, micro_batch_size=3, use_distributed_optimizer=True),
}


def test_a_moe_resumes_at_another_ep_and_another_dp_with_its_experts_resharded(moe, tmp_path):
    """Experts and their Adam moments follow EP ranks, the dense ones TP ranks: DP=2 at EP=1 saves
    after step 1 and takes step 2 (the reference); DP=2 at EP=2 resumes from it (EP 1 → 2),
    saves again, resumes from that at its own layout (each rank's own shard, found in its EP
    rank's directory), and takes step 2; DP=4 at EP=2 resumes from that (DP 2 → 4 at the same EP, each
    dense weight's moments gathered from both EP ranks' directories). Each step 2 is the
    reference's within 1e-5. (TP=2 with experts trains only with sequence parallelism: GPU.)"""
    out = run_world(_two_steps, 2, MOE_LAYOUTS["dp2_ep1"], "float32", moe, str(tmp_path / "ep1"), timeout=300)[0]
    reference = {"metrics": out["metrics"], "weights": out["weights"]}
    for layout, ckpt, resave in (("dp2_ep2", "ep1", "ep2"), ("dp4_ep2", "ep2", "")):
        role = MOE_LAYOUTS[layout]
        assert _recut_for(role, moe, str(tmp_path / ckpt)) == (layout == "dp2_ep2")  # EP 1 → 2; then DP only
        metrics, weights = run_world(_resume_step_two, role.dp, role, moe, str(tmp_path / ckpt),
                                     resave and str(tmp_path / resave), timeout=300)[0]
        assert _unlike_step_two(metrics, weights, reference) == [], layout


def _multi_turn_update(rank, world, role, model, from_whole_logits):
    """One update on rows whose responses hold environment tokens (loss mask 0 on every third),
    log-probs in chunks of 3 tokens; or (from_whole_logits) by the path from whole logits the
    trainer used before, the reference. Its metrics, and how many positions reached the LM head."""
    from orz.models import logprobs as lp
    from orz.ppo import workers

    prompts, responses, advantages = _rollouts()
    masks = [[int(t % 3 != 1) for t in range(len(r))] for r in responses]
    exp = experience_from_rollouts(prompts, responses, [[-4.0] * len(r) for r in responses], pad_id=0, loss_masks=masks)
    exp = replace(exp, old_logprobs=torch.full(exp.response_mask.shape, OLD_LOGPROB) * exp.response_mask,
                  advantages=advantages.expand_as(exp.response_mask) * exp.response_mask)
    w = MegatronWorker(worker_spec(model, role, total_steps=1, logprob_chunk_tokens=3),
                       rank, world)
    w.setup((os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])))
    positions = []
    chunked = lp.token_logprobs

    def counting(hidden, *args, **kwargs):
        positions.append(hidden.shape[0])
        return chunked(hidden, *args, **kwargs)

    lp.token_logprobs = counting

    def whole_logits(self, hidden, batch, temperature, with_entropy, teacher_topk=False):
        from megatron.core.tensor_parallel.mappings import copy_to_tensor_model_parallel_region

        e = batch.micro.experience  # (B, S, V/TP) as Megatron's column-parallel LM head made them
        group = self.ps.get_tensor_model_parallel_group()
        logits = copy_to_tensor_model_parallel_region(hidden, group=group) @ self.model.lm_head_weight().t()
        logprobs, entropy = lp.logprobs_from_logits(logits[:, :-1], e.sequences[:, 1:], self.model.arch.vocab_size,
                                                    group, temperature, with_entropy)
        return (e.gather_response(torch.nn.functional.pad(v, (1, 0))) if v is not None else None
                for v in (logprobs, entropy, None))  # no teacher top-k here

    if from_whole_logits:
        workers.MegatronWorker._token_logprobs = lambda self, *args: tuple(whole_logits(self, *args))
    metrics = _step(w, world, MiniBatch.of(exp, rows=torch.arange(16)))
    return metrics, positions, int(exp.response_mask.sum()), int(exp.attention_mask.sum())


@pytest.mark.parametrize("layout", ["dp1", "tp2pp2"])
def test_chunked_logprobs_equal_the_whole_logits_path_on_multi_turn_rows(layout, model):
    """The update's loss, entropy and gradient norm from log-probs taken in chunks at the loss's
    positions only (environment tokens and prompts never reach the LM head) equal today's path from
    whole logits: within 1e-6 relative, at TP 1 and at TP 2 × PP 2 (a vocabulary of 64, padded
    neither way; test_logprobs pads one)."""
    workers, role = LAYOUTS[layout]
    ranks = run_world(_multi_turn_update, workers, role, model, False)
    (chunked, _, loss_tokens, real_tokens), positions = ranks[0], next(r[1] for r in ranks if r[1])  # the last stage's
    reference = run_world(_multi_turn_update, workers, role, model, True)[0][0]
    assert sum(positions) == loss_tokens < real_tokens  # the premise: env tokens were skipped
    assert chunked["actor/grad_norm"] > 0
    for key in ("actor/pg_loss", "actor/entropy", "actor/grad_norm", "actor/approx_kl"):
        assert abs(chunked[key] - reference[key]) <= 1e-6 * abs(reference[key]), (key, chunked[key], reference[key])
