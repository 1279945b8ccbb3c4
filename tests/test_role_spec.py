"""`role_spec(cfg, name)`, the one builder of a Megatron role: each role's ModelSpec from the run's
config, and a model that refuses a spec whose sizes are not its world's.

    .venv/bin/python -m pytest -q tests/test_role_spec.py
"""
import pytest

from orz.config import load_config
from orz.models.local_world import run_world
from orz.models.spec import ModelSpec, Sizes
from orz.run.role_spec import role_spec


def test_each_role_is_built_from_its_own_section_and_the_models_settings():
    cfg = load_config(None, [
        "algorithm.advantage=gae", "algorithm.kl_coef=0.01", "reward.model.path=/rm", "model.path=/actor",
        "model.critic_path=/critic", "model.dtype=bfloat16", "model.recompute=true", "model.vocab_divisible_by=64",
        "model.moe_aux_loss_coef=0.01", "model.moe_dispatcher=alltoall", "model.logprob_chunk_tokens=256",
        "rollout.routing_replay=true", "trainer.iterations=5", "actor.steps_per_iteration=2", "actor.tp=2", "actor.dp=4",
        "actor.ep=2", "actor.lr=3e-6", "actor.adam_betas=[0.9, 0.99]", "actor.use_distributed_optimizer=true",
        "critic.pp=2", "critic.lr=5e-6", "ref.cp=2", "reward.model.tp=4", "trainer.seed=7"])
    specs = {name: role_spec(cfg, name, log_dir="/logs", engine_dtype="bfloat16")
             for name in ("actor", "critic", "ref", "reward_model")}
    actor, critic, ref, rm = specs.values()
    assert actor.model.sizes == Sizes(tp=2, dp=4, ep=2) and actor.model_path == "/actor"
    assert (actor.model.optim.lr, actor.model.optim.adam_beta2, actor.model.optim.use_distributed_optimizer) == (3e-6, 0.99, True)
    assert actor.model.routing_replay and actor.engine_dtype == "bfloat16" and actor.total_steps == 5 * 2
    assert critic.model.sizes == Sizes(pp=2) and critic.model_path == "/critic" and critic.model.value_head
    assert critic.model.optim.lr == 5e-6 and not critic.model.routing_replay and critic.engine_dtype == ""
    assert ref.model.sizes == Sizes(cp=2) and ref.model.optim is None and not ref.train and not ref.model.value_head
    assert rm.model.sizes == Sizes(tp=4) and rm.model_path == "/rm" and rm.model.value_head and not rm.train
    for spec in specs.values():  # the model's settings reach every role alike
        m = spec.model
        assert (m.dtype, m.recompute, m.vocab_divisible_by, m.moe_aux_loss_coef, m.moe_dispatcher,
                m.logprob_chunk_tokens) == ("bfloat16", True, 64, 0.01, "alltoall", 256)
        assert (spec.seed, spec.log_dir) == (7, "/logs")
    moved = actor.at(Sizes(tp=1, dp=2, ep=2))  # a re-cut's workers: the model's sizes and the role's alike
    assert moved.model.sizes == Sizes(dp=2, ep=2) and (moved.cfg.tp, moved.cfg.dp) == (1, 2)
    assert moved.model.optim == actor.model.optim


def test_the_labels_of_a_layout():
    assert Sizes(tp=2, pp=1, dp=4).label() == "TP2 PP1 DP4"
    assert Sizes(tp=1, pp=2, cp=2, dp=2, ep=4, etp=2).label() == "TP1 PP2 CP2 DP2 EP4 ETP2"


def _build(rank, world, path, spec):
    from orz.models.checkpoint import HFCheckpoint
    from orz.models.megatron_model import MegatronModel
    from orz.models.parallel import init_model_parallel

    init_model_parallel(Sizes(tp=2))
    model = MegatronModel(HFCheckpoint(path).arch, spec)
    return model.sizes, model.config.tensor_model_parallel_size


def test_a_model_takes_its_worlds_sizes_and_refuses_others(tiny_model):
    assert run_world(_build, 2, tiny_model, ModelSpec(sizes=Sizes(tp=2))) == [(Sizes(tp=2), 2)] * 2
    with pytest.raises(RuntimeError, match=r"the model spec's sizes TP1 PP1 DP1 are not the parallel groups' TP2 PP1 DP1"):
        run_world(_build, 2, tiny_model, ModelSpec())
