"""Megatron actor/critic against transformers, for TP/PP in {1, 2}², every dense family in one world
per layout, and one training step."""
import copy

import pytest
import torch
from orz.models.local_world import run_world

from reference_models import reference_models

LAYOUTS = [(1, 1), (2, 1), (1, 2), (2, 2)]
# vocab 101 is not divisible by TP=2: exercises padding. Qwen2 and Qwen3 tie their embeddings:
# exercises the LM head copy on the last pipeline stage. Qwen3's head_dim 32 != 64 / 4 heads.
LLAMA3_ROPE = dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0)
MODELS = {
    "llama": dict(family="llama", vocab_size=101, tie_word_embeddings=False, rope_theta=500000.0),
    "qwen2": dict(family="qwen2", vocab_size=96, tie_word_embeddings=True),
    "qwen3": dict(family="qwen3", vocab_size=101, tie_word_embeddings=True, head_dim=32, num_layers=2),
    # An original length of 16 < SEQ: the scaling moves the logits by ~5e-3 (Megatron's fixed 8192
    # applied through its own `_apply_scaling` with this file's values) ...
    "llama31": dict(family="llama", vocab_size=101, num_layers=2, rope_theta=500000.0,
                    rope_scaling=LLAMA3_ROPE | dict(original_max_position_embeddings=16)),
    # ... and Llama 3.1's own values, Megatron's `rope_scaling=True`: ~2e-5 on the logits at this
    # length, so its inverse frequencies are compared instead.
    "llama31_8192": dict(family="llama", vocab_size=101, num_layers=2, rope_theta=500000.0,
                         max_position_embeddings=16384,
                         rope_scaling=LLAMA3_ROPE | dict(factor=32.0, original_max_position_embeddings=8192)),
}
SEQ = 20


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    tokens, models = reference_models(tmp_path_factory, MODELS, SEQ)
    return tokens, {name: (path, logits, model.model.rotary_emb.inv_freq)
                    for name, (path, model, logits) in models.items()}


def _forward_and_export(rank, world, tp, pp, tokens, checkpoints):
    from orz.models.checkpoint import HFCheckpoint
    from orz.models.megatron_model import MegatronModel, ModelInputs
    from orz.models.parallel import init_model_parallel
    from orz.models.spec import ModelSpec, Sizes

    sizes = Sizes(tp=tp, pp=pp)
    init_model_parallel(sizes)
    result = {}
    for name, (path, *_) in checkpoints.items():
        ckpt = HFCheckpoint(path)
        engine = MegatronModel(ckpt.arch, ModelSpec(sizes=sizes))
        engine.load_hf(ckpt)
        logits = engine.full_logits(tokens)
        exported = dict(engine.hf_tensors())
        critic = MegatronModel(ckpt.arch, ModelSpec(sizes=sizes, value_head=True))
        critic.load_hf(ckpt)
        values = critic.run([ModelInputs(tokens)], collect=lambda o, b: o)
        result[name] = {"logits": logits, "exported": exported, "values": values[0] if values else None,
                        "inv_freq": engine.module.rotary_pos_emb.inv_freq}
    return result


@pytest.mark.parametrize("tp,pp", LAYOUTS)
def test_logits_match_transformers_and_export_is_exact(tp, pp, checkpoints):
    from safetensors.torch import load_file

    tokens, ckpts = checkpoints
    ranks = run_world(_forward_and_export, tp * pp, tp, pp, tokens, ckpts)
    last_stage_rank0 = (pp - 1) * tp  # Megatron's rank order: TP fastest, then PP
    for name, (path, ref_logits, ref_inv_freq) in ckpts.items():
        for rank in ranks:
            assert torch.equal(rank[name]["inv_freq"], ref_inv_freq), name  # RoPE frequencies, bit for bit
        logits = ranks[last_stage_rank0][name]["logits"]
        assert logits.shape == ref_logits.shape
        assert (logits - ref_logits).abs().max() < 1e-4, name
        original = load_file(f"{path}/model.safetensors")
        exported = ranks[0][name]["exported"]
        assert exported.keys() == original.keys()
        for key, tensor in original.items():
            assert torch.equal(exported[key], tensor), key
        values = ranks[last_stage_rank0][name]["values"]
        assert values.shape == (*tokens.shape, 1)
        assert torch.count_nonzero(values) == 0  # the value head starts at zero
        for r in range(1, tp * pp):
            assert ranks[r][name]["exported"] == {}


def _train_one_step(rank, world, tp, tokens, path):
    from orz.models.checkpoint import HFCheckpoint
    from orz.models.megatron_model import MegatronModel, ModelInputs
    from orz.models.parallel import init_model_parallel
    from orz.models.spec import ModelSpec, OptimSpec, Sizes

    init_model_parallel(Sizes(tp=tp))
    ckpt = HFCheckpoint(path)
    # Adam's first step is lr·g/(|g|+eps): with eps=1e-8 an element whose gradient is ~1e-10
    # turns fp32 summation-order noise (TP reduces in another order) into a visible update;
    # eps=1e-6 keeps the comparison about the parallel math, not about that amplification.
    engine = MegatronModel(ckpt.arch, ModelSpec(sizes=Sizes(tp=tp), optim=OptimSpec(lr=1e-3, clip_grad=1.0, adam_eps=1e-6)))
    engine.load_hf(ckpt)
    initial_optimizer = copy.deepcopy(engine.optimizer.state_dict())
    total_tokens = tokens[:, 1:].numel()

    def nll(hidden, batch):
        logprobs = engine.next_token_logprobs(hidden, batch.input_ids)
        loss = -logprobs.sum() / total_tokens
        return loss, {"loss": loss.detach()}

    # Micro-batches of 2: the accumulated loss and gradient must equal those of the whole batch.
    whole = engine.train_step([ModelInputs(tokens)], nll)
    engine.load_hf(ckpt)
    engine.optimizer.load_state_dict(initial_optimizer)
    micro = [ModelInputs(t) for t in tokens.split(2)]
    out = engine.train_step(micro, nll)
    assert abs(whole["grad_norm"] - out["grad_norm"]) < 1e-6 * max(1.0, whole["grad_norm"])
    assert abs(whole["metrics"][0]["loss"].item() - sum(m["loss"] for m in out["metrics"]).item()) < 1e-6
    return {
        "loss": sum(m["loss"] for m in out["metrics"]).item(),
        "grad_norm": out["grad_norm"],
        "weights": dict(engine.hf_tensors()),
    }


def test_train_step_tp2_matches_tp1(checkpoints):
    tokens, ckpts = checkpoints
    path = ckpts["llama"][0]
    tokens = torch.cat([tokens, tokens.flip(0)])  # 6 sequences, 2 micro-batches of 2 + 1 of 2
    one = run_world(_train_one_step, 1, 1, tokens, path)[0]
    two = run_world(_train_one_step, 2, 2, tokens, path)[0]
    assert abs(one["loss"] - two["loss"]) < 1e-5
    assert abs(one["grad_norm"] - two["grad_norm"]) < 1e-4
    from safetensors.torch import load_file

    before = load_file(f"{path}/model.safetensors")
    for name, w in one["weights"].items():
        assert (w - two["weights"][name]).abs().max() < 1e-5, name
    assert any(not torch.equal(w, before[n]) for n, w in one["weights"].items())
