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


def _train_step(rank, world, skip, path):
    """Build, load, one forward/backward and Adam step: every patched code path."""
    megatron_patches.apply(skip=skip)
    from orz.models.checkpoint import HFCheckpoint
    from orz.models.megatron_engine import ModelEngine, ModelInputs, OptimConfig
    from orz.models.parallel import init_model_parallel

    init_model_parallel(tp=1, pp=world)
    ckpt = HFCheckpoint(path)
    engine = ModelEngine(ckpt.arch, optim=OptimConfig(lr=1e-3))
    engine.load_hf(ckpt)
    tokens = torch.randint(0, ckpt.arch.vocab_size, (2, 8))
    out = engine.train_step([ModelInputs(tokens)], lambda logits, b: (logits.float().mean(), {}))
    return out["update_ok"]


def test_all_patches_make_pp2_training_work(tied_model):
    assert run_world(_train_step, 2, (), tied_model) == [True, True]


@pytest.mark.parametrize("name", list(megatron_patches.PATCHES))
def test_patch_is_still_needed(name, tied_model):
    # Only PP hits these: the tied embedding's LM-head copy, and the shape exchange before p2p.
    world = 2 if name in ("tied_embedding_init", "variable_pipeline_shapes") else 1
    with pytest.raises(RuntimeError, match="(?i)cuda"):
        run_world(_train_step, world, (name,), tied_model)


def test_apply_is_a_no_op_with_cuda(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert megatron_patches.apply() == []
