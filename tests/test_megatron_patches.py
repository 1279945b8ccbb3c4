"""Each CPU patch is still needed (Megatron fails without it) and still works (with it).

When an upgrade of megatron-core makes a patch unnecessary, its "still needed" case fails:
delete the patch. When an upgrade breaks a patch, the "works" case fails.
"""
import pytest
import torch
from orz.models.local_world import run_world

import megatron_patches
from orz.models.tiny import make_tiny_hf


@pytest.fixture(scope="module")
def tied_model(tmp_path_factory):
    return str(make_tiny_hf(tmp_path_factory.mktemp("tied"), num_layers=2, tie_word_embeddings=True))


def _train_step(rank, world, skip, path, ckpt_dir):
    """Build, load, an Adam step (with the distributed optimizer), a checkpoint in the cut that loads
    anywhere, a fresh model loading it and a second step: every patched code path. Returns whether
    both steps were taken, and the Adam step counts the second left (each parameter's own)."""
    megatron_patches.apply(skip=skip)
    from orz.models import dist_checkpoint
    from orz.models.checkpoint import RESHARDABLE, HFCheckpoint
    from orz.models.megatron_model import MegatronModel, ModelInputs
    from orz.models.parallel import init_model_parallel
    from orz.models.spec import ModelSpec, OptimSpec, Sizes

    init_model_parallel(Sizes(pp=world))
    ckpt = HFCheckpoint(path)
    tokens = torch.randint(0, ckpt.arch.vocab_size, (2, 8))
    ok = []
    for step in range(2):
        engine = MegatronModel(ckpt.arch, ModelSpec(sizes=Sizes(pp=world),
                                                    optim=OptimSpec(lr=1e-3, use_distributed_optimizer=True)))
        engine.load_hf(ckpt)
        if step:
            dist_checkpoint.load(engine, ckpt_dir)
        ok.append(engine.train_step([ModelInputs(tokens)], lambda hidden, b: (engine.next_token_logprobs(
            hidden, b.input_ids).mean(), {}))["update_ok"])
        if not step:
            dist_checkpoint.save(engine, ckpt_dir, {}, ckpt.config, RESHARDABLE)
    steps = {float(s["step"]) for one in dist_checkpoint.chain(engine.optimizer) for s in one.optimizer.state.values()}
    return all(ok), steps


def _alltoall_step(rank, world, skip, path):
    """A MoE built with the all-to-all dispatcher, at EP 1 (its split sizes are made at any EP);
    that the patched dispatcher works at EP 2 is test_models_moe's."""
    megatron_patches.apply(skip=skip)
    from orz.models.checkpoint import HFCheckpoint
    from orz.models.megatron_model import MegatronModel, ModelInputs
    from orz.models.parallel import init_model_parallel
    from orz.models.spec import ModelSpec, OptimSpec

    init_model_parallel()
    ckpt = HFCheckpoint(path)
    engine = MegatronModel(ckpt.arch, ModelSpec(optim=OptimSpec(lr=1e-3), moe_dispatcher="alltoall"))
    engine.load_hf(ckpt)
    tokens = torch.randint(0, ckpt.arch.vocab_size, (2, 8))
    return engine.train_step([ModelInputs(tokens)], lambda hidden, b: (engine.next_token_logprobs(
        hidden, b.input_ids).mean(), {}))["update_ok"]


def test_all_patches_make_pp2_training_and_checkpoints_work(tied_model, tmp_path):
    assert run_world(_train_step, 2, (), tied_model, str(tmp_path)) == [(True, {2.0})] * 2


# What Megatron does without each patch: the error it raises, or None where it runs and counts
# Adam's steps wrong. Only PP hits the tied embedding's LM-head copy and the shape exchange before p2p.
WITHOUT = dict.fromkeys(megatron_patches.PATCHES, "(?i)cuda") | {
    "optimizer_state_before_first_step": r"assert len\(steps\) == 1", "optimizer_step_kept_aside": "KeyError: 'step'",
    "optimizer_step_per_parameter": None, "alltoall_dispatcher": "torch.cuda.Stream requires CUDA",
    "gated_delta_net_in_torch": "FLA is not installed", "eager_fusions": None}


def _hybrid_step(rank, world, skip, path):
    """A Qwen3.5 hybrid's Gated DeltaNet layer, forward and backward on Megatron's torch path: whether
    the step was taken, and how many graphs torch.compile built on the way (Megatron's jit_fuser)."""
    from torch._dynamo.utils import counters

    megatron_patches.apply(skip=skip)
    from orz.models.checkpoint import HFCheckpoint
    from orz.models.megatron_model import MegatronModel, ModelInputs
    from orz.models.parallel import init_model_parallel
    from orz.models.spec import ModelSpec, OptimSpec

    init_model_parallel()
    ckpt = HFCheckpoint(path)
    engine = MegatronModel(ckpt.arch, ModelSpec(optim=OptimSpec(lr=1e-3)))
    engine.load_hf(ckpt)
    tokens = torch.randint(0, ckpt.arch.vocab_size, (2, 8))
    ok = engine.train_step([ModelInputs(tokens)], lambda hidden, b: (engine.next_token_logprobs(
        hidden, b.input_ids).mean(), {}))["update_ok"]
    return ok, counters["stats"]["unique_graphs"]


@pytest.mark.parametrize("name", list(megatron_patches.PATCHES))
def test_patch_is_still_needed(name, tied_model, tmp_path):
    if name in ("gated_delta_net_in_torch", "eager_fusions"):  # a hybrid's: the tied model has no GDN layer
        hybrid = make_tiny_hf(tmp_path / "hybrid", family="qwen3_5", num_layers=1, head_dim=16, hybrid=dict(
            layer_types=["linear_attention"], linear_num_key_heads=1, linear_num_value_heads=2,
            linear_key_head_dim=16, linear_value_head_dim=16))
        assert run_world(_hybrid_step, 1, (), str(hybrid)) == [(True, 0)]
        if WITHOUT[name] is None:  # it runs, compiling the GDN's gates and norm
            assert run_world(_hybrid_step, 1, (name,), str(hybrid))[0][1] > 0
            return
        with pytest.raises(RuntimeError, match=WITHOUT[name]):
            run_world(_hybrid_step, 1, (name,), str(hybrid))
        return
    if name == "alltoall_dispatcher":  # a MoE's: the tied model has no experts
        moe = make_tiny_hf(tmp_path / "moe", family="qwen3_moe", num_layers=1,
                           moe=dict(num_experts=2, num_experts_per_tok=1, moe_intermediate_size=16))
        assert run_world(_alltoall_step, 1, (), str(moe)) == [True]
        with pytest.raises(RuntimeError, match=WITHOUT[name]):
            run_world(_alltoall_step, 1, (name,), str(moe))
        return
    world = 2 if name in ("tied_embedding_init", "variable_pipeline_shapes") else 1
    if WITHOUT[name] is None:
        assert run_world(_train_step, world, (name,), tied_model, str(tmp_path))[0][1] != {2.0}
        return
    with pytest.raises(RuntimeError, match=WITHOUT[name]):
        run_world(_train_step, world, (name,), tied_model, str(tmp_path))


def test_apply_is_a_no_op_with_cuda(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert megatron_patches.apply() == []
