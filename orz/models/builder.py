"""Megatron-core models from a ModelArch: the actor (a GPTModel) and a value model (same trunk,
scalar value head), following Megatron's config + layer spec -> module pattern.

    cfg = transformer_config(arch, ModelSpec(sizes=Sizes(tp=2)))
    actor = build_actor(arch, cfg)            # on each rank, after init_model_parallel
    value_model = build_value_model(arch, cfg)
"""
import importlib.util

import torch
import torch.nn.functional as F
from megatron.core import parallel_state
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import (
    get_gpt_layer_local_spec,
    get_gpt_layer_with_transformer_engine_spec,
)
from megatron.core.ssm.gated_delta_net import GatedDeltaNet, GatedDeltaNetSubmodules
from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
from megatron.core.transformer import TransformerConfig
from megatron.core.transformer.transformer_block import LayerNormImpl, TransformerBlockSubmodules
from megatron.core.transformer.spec_utils import ModuleSpec

from orz.models.arch import ModelArch
from orz.models.attention import SDPAttention
from orz.models.norms import PlainRMSNorm, RMSNorm
from orz.models.lora import adapted, freeze_base, init_adapters
from orz.models.spec import LoraSpec, ModelSpec


def use_transformer_engine() -> bool:
    """TE layers on GPU when TE is installed; Megatron's local layers otherwise (CPU)."""
    return torch.cuda.is_available() and importlib.util.find_spec("transformer_engine") is not None


def transformer_engine_layers(lora: LoraSpec | None) -> bool:
    """Whether a model's layers are TE's: where TE runs, unless it has LoRA adapters, which sit on
    Megatron's local layers (TE fuses the input norm into linear_qkv and linear_fc1, whose input an
    adapter needs; untested here: no GPU)."""
    return use_transformer_engine() and lora is None


def transformer_config(arch: ModelArch, spec: ModelSpec = ModelSpec()) -> TransformerConfig:
    """The TransformerConfig that reproduces `arch` exactly (no dropout: RL fine-tuning), split and
    computed as `spec` says. Its dtype "auto" is bfloat16 on GPU and float32 on CPU; its
    deterministic mode (GPU kernels that do not depend on the batch) is untested here, and on CPU a
    hybrid's is always on. A frozen spec's MoE has no load-balancing loss."""
    s = spec.sizes
    arch.check_parallel(s.tp, s.pp, s.ep, s.etp)
    on_gpu = torch.cuda.is_available()
    dtype = model_dtype(spec)
    aux_loss_coef = spec.moe_aux_loss_coef if spec.trained else 0.0
    return TransformerConfig(
        num_layers=arch.num_layers,
        hidden_size=arch.hidden_size,
        ffn_hidden_size=arch.intermediate_size,
        num_attention_heads=arch.num_heads,
        num_query_groups=arch.num_kv_heads,
        kv_channels=arch.head_dim,
        normalization="RMSNorm",
        layernorm_epsilon=arch.rms_norm_eps,
        gated_linear_unit=True,  # SwiGLU
        activation_func=F.silu,
        add_bias_linear=False,
        add_qkv_bias=arch.qkv_bias,
        qk_layernorm=arch.qk_norm,  # per-head RMSNorm of q and k (Qwen3); its eps is layernorm_epsilon
        hidden_dropout=0.0,
        attention_dropout=0.0,
        tensor_model_parallel_size=s.tp,
        pipeline_model_parallel_size=s.pp,
        context_parallel_size=s.cp,
        params_dtype=dtype,
        pipeline_dtype=dtype,
        bf16=dtype == torch.bfloat16,
        fp16=dtype == torch.float16,
        # Fused kernels exist only on GPU.
        use_cpu_initialization=not on_gpu,
        bias_dropout_fusion=on_gpu,
        masked_softmax_fusion=on_gpu,
        apply_rope_fusion=False,
        gradient_accumulation_fusion=False,
        batch_p2p_sync=on_gpu,  # the sync calls torch.cuda.synchronize
        recompute_granularity="full" if spec.recompute else None,
        recompute_method="uniform" if spec.recompute else None,
        recompute_num_layers=1 if spec.recompute else None,
        expert_model_parallel_size=s.ep,
        expert_tensor_parallel_size=s.etp,
        deterministic_mode=spec.deterministic or (arch.linear_attention is not None and not on_gpu),
        **(_moe_config(arch, aux_loss_coef, spec.moe_dispatcher) if arch.moe else {}),
        **(_hybrid_config(arch) if arch.linear_attention else {}),
    )


def model_dtype(spec: ModelSpec) -> torch.dtype:
    """spec.dtype as a torch dtype: "auto" is bfloat16 on GPU and float32 on CPU."""
    if spec.dtype == "auto":
        return torch.bfloat16 if torch.cuda.is_available() else torch.float32
    return getattr(torch, spec.dtype)


def _hybrid_config(arch: ModelArch) -> dict:
    """Qwen3.5's fields: the Gated DeltaNet layers (`linear_attention_freq`, 1 = GDN) and their sizes,
    the gated attention output and the zero-centred norms. On CPU `deterministic_mode` selects the
    GDN's torch kernels (a chunked delta rule and F.conv1d); on GPU, fla's (untested here)."""
    gdn = arch.linear_attention
    return dict(
        experimental_attention_variant="gated_delta_net",
        linear_attention_freq=[int(arch.is_linear_attention_layer(i)) for i in range(arch.num_layers)],
        linear_conv_kernel_dim=gdn.conv_kernel,
        linear_key_head_dim=gdn.key_head_dim,
        linear_value_head_dim=gdn.value_head_dim,
        linear_num_key_heads=gdn.num_key_heads,
        linear_num_value_heads=gdn.num_value_heads,
        attention_output_gate=arch.attention_output_gate,
        layernorm_zero_centered_gamma=arch.zero_centred_norms,
    )


def _moe_config(arch: ModelArch, aux_loss_coef: float, dispatcher: str) -> dict:
    """Megatron's MoE fields for Qwen3-MoE's router and experts.

    Routing: norm_topk_prob (w = top-k of p, renormalised) is Megatron's softmax over the top-k
    logits (`moe_router_pre_softmax=False`); without it, w = top-k of softmax over all experts
    (`pre_softmax=True`). Dispatch (model.moe_dispatcher): `allgather` (every rank of the expert
    group gathers all tokens and keeps those routed to its experts) and `alltoall` (uneven
    all-to-alls, which gloo carries with one patch) both run here; `flex` (DeepEP/HybridEP
    kernels) is GPU only, untested. The router's loads are counted in fp32 as HF does.
    """
    moe = arch.moe
    return dict(
        num_moe_experts=moe.num_experts,
        moe_router_topk=moe.top_k,
        moe_ffn_hidden_size=moe.intermediate_size,
        moe_layer_freq=[int(arch.is_moe_layer(i)) for i in range(arch.num_layers)],
        moe_router_score_function="softmax",
        moe_router_pre_softmax=not moe.norm_topk_prob,
        moe_router_dtype="fp32",
        moe_token_dispatcher_type=dispatcher,
        moe_grouped_gemm=False,  # SequentialMLP: one SwiGLU per local expert (TE's grouped GEMM: GPU only)
        # HF's Switch-style aux loss E·Σ_e f_e·P_e is Megatron's "aux_loss"; 0 turns it off (RL default)
        moe_router_load_balancing_type="aux_loss" if aux_loss_coef else "none",
        moe_aux_loss_coeff=aux_loss_coef,
        # Qwen3.5-MoE's shared expert, σ(w·x)-gated: Megatron's SharedExpertMLP with its gate
        moe_shared_expert_intermediate_size=moe.shared_intermediate_size or None,
        moe_shared_expert_gate=bool(moe.shared_intermediate_size),
    )


def layer_spec(arch: ModelArch, moe: bool = False, linear_attention: bool = False,
               lora: LoraSpec | None = None) -> ModuleSpec:
    """TE's layers where TE runs; else Megatron's local layers with torch's fused attention.
    `moe`: the MLP is a router and experts, one SwiGLU per local expert (SequentialMLP) on both
    paths, as the config says (`moe_grouped_gemm=False`): TE's grouped GEMM keeps the experts'
    weights under other names (`weight0`…), which orz's conversion does not map.
    `linear_attention`: a Gated DeltaNet in place of self-attention (`gated_delta_net_spec`).
    `lora`: its targets (dense attention and MLP layers) carry adapters (transformer_engine_layers)."""
    experts = arch.moe.num_experts if moe else None
    te = transformer_engine_layers(lora)
    if te:  # untested here: no GPU
        spec = get_gpt_layer_with_transformer_engine_spec(experts, moe_grouped_gemm=False, qk_layernorm=arch.qk_norm)
    else:
        spec = get_gpt_layer_local_spec(experts, normalization="RMSNorm", qk_layernorm=arch.qk_norm)
        layer = spec.submodules
        layer.input_layernorm = layer.pre_mlp_layernorm = RMSNorm
        if arch.qk_norm:
            layer.self_attention.submodules.q_layernorm = layer.self_attention.submodules.k_layernorm = RMSNorm
        layer.self_attention.submodules.core_attention = SDPAttention
    if linear_attention:
        spec.submodules.input_layernorm, spec.submodules.self_attention = gated_delta_net_spec(te)
    if lora is not None:
        if moe or linear_attention:
            raise NotImplementedError("LoRA adapters are built on dense attention and MLP layers only")
        mlp = spec.submodules.mlp  # Megatron's dense MLP spec: partial(MLP.as_mlp_submodule, submodules=...)
        attention, mlp = spec.submodules.self_attention.submodules, mlp.keywords["submodules"]
        for target in lora.targets:
            setattr(attention if hasattr(attention, target) else mlp, target, adapted(target, lora))
    return spec


def gated_delta_net_spec(te: bool) -> tuple[type, ModuleSpec]:
    """The input norm and Megatron's GatedDeltaNet: the norm unfused (the layer's `input_layernorm` on
    both paths), the GDN's output norm plain. Qwen3.5 zero-centres every norm but that one, and TE's
    would follow the config's `layernorm_zero_centered_gamma`. (Megatron's own GDN spec needs TE.)"""
    if te:  # untested here: no GPU
        from megatron.core.extensions.transformer_engine import TEColumnParallelLinear, TENorm, TERowParallelLinear
        norm, column, row = TENorm, TEColumnParallelLinear, TERowParallelLinear
    else:
        norm, column, row = RMSNorm, ColumnParallelLinear, RowParallelLinear
    return norm, ModuleSpec(module=GatedDeltaNet, submodules=GatedDeltaNetSubmodules(
        in_proj=column, out_norm=PlainRMSNorm, out_proj=row))


def first_layer(arch: ModelArch, cfg: TransformerConfig) -> int:
    """The global index of this pipeline stage's first layer."""
    return parallel_state.get_pipeline_model_parallel_rank() * (arch.num_layers // cfg.pipeline_model_parallel_size)


def block_spec(arch: ModelArch, cfg: TransformerConfig, lora: LoraSpec | None = None) -> TransformerBlockSubmodules:
    """This stage's layers (for a MoE each dense or sparse; for a hybrid each GDN or attention) and the final norm."""
    first = first_layer(arch, cfg)
    layers = [layer_spec(arch, arch.is_moe_layer(i), arch.is_linear_attention_layer(i), lora)
              for i in range(first, first + arch.num_layers // cfg.pipeline_model_parallel_size)]
    return TransformerBlockSubmodules(layer_specs=layers,
                                      layer_norm=LayerNormImpl if transformer_engine_layers(lora) else RMSNorm)


def _stage_flags() -> dict:
    return dict(
        pre_process=parallel_state.is_pipeline_first_stage(ignore_virtual=True),
        post_process=parallel_state.is_pipeline_last_stage(ignore_virtual=True),
    )


def _gpt(arch: ModelArch, cfg: TransformerConfig, make_vocab_size_divisible_by: int, tied: bool,
         lora: LoraSpec | None = None) -> GPTModel:
    scaling = arch.rope_scaling
    model = GPTModel(
        config=cfg,
        transformer_layer_spec=block_spec(arch, cfg, lora),
        vocab_size=arch.padded_vocab_size(cfg.tensor_model_parallel_size, make_vocab_size_divisible_by),
        max_sequence_length=arch.max_position_embeddings,
        parallel_output=True,
        share_embeddings_and_output_weights=tied,
        position_embedding_type="rope",
        rotary_base=arch.rope_theta,
        rotary_percent=arch.rotary_fraction,
        # llama3 scaling: Megatron's own, whose frequency factors and original length are fixed
        # at 1, 4 and 8192 (Llama 3.1/3.2); other values are applied below with the same formula.
        rope_scaling=scaling is not None and scaling.megatron_defaults,
        rope_scaling_factor=scaling.factor if scaling else 8.0,
        **_stage_flags(),
    )
    if scaling is not None and not scaling.megatron_defaults:
        rotary = model.rotary_pos_emb  # its inv_freq is still the unscaled θᵢ here
        rotary.inv_freq = rotary._apply_scaling(
            rotary.inv_freq, factor=scaling.factor, low_freq_factor=scaling.low_freq_factor,
            high_freq_factor=scaling.high_freq_factor,
            original_max_position_embeddings=scaling.original_max_position_embeddings,
        )
    return model


def build_actor(arch: ModelArch, cfg: TransformerConfig, make_vocab_size_divisible_by: int = 1,
                lora: LoraSpec | None = None) -> GPTModel:
    """This rank's stage of the policy: a GPTModel whose last stage returns its final hidden states
    (B, S, H), not logits. The LM head keeps its weight (`lm_head_weight`), from which log-probs
    are taken in chunks of tokens (orz/models/logprobs.py): the (B, S, V/TP) logits never exist.
    With `lora`, only its adapters take gradients (orz/models/lora.py)."""
    model = _gpt(arch, cfg, make_vocab_size_divisible_by, tied=arch.tie_word_embeddings, lora=lora)
    if lora is not None:
        freeze_base(model)
        init_adapters(model, first_layer(arch, cfg))
    if model.post_process:
        if model.output_layer.sequence_parallel:  # it would all-gather the sequence first (GPU; not built)
            raise NotImplementedError("the deferred LM head takes hidden states without sequence parallelism")
        # Its forward returns its input; the module and its parameter stay, as Megatron names them.
        model.output_layer.forward = lambda hidden_states, weight=None, runtime_gather_output=None: (hidden_states, None)
    return model


def lm_head_weight(model: GPTModel) -> torch.Tensor:
    """(V/TP, H) the actor's LM head on its last stage: the embedding's copy when they are tied."""
    if model.share_embeddings_and_output_weights:
        return model.shared_embedding_or_output_weight()
    return model.output_layer.weight


class ValueHead(torch.nn.Module):
    """V(s) = w·h + b, replicated on every TP rank; called like Megatron's output layer, and named
    like it (`output_layer.weight`, `.bias`), so that the model's checkpoint finds it there."""

    def __init__(self, hidden_size: int, dtype: torch.dtype):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(1, hidden_size, dtype=dtype))  # V = 0 at the start:
        self.bias = torch.nn.Parameter(torch.zeros(1, dtype=dtype))  # no arbitrary baseline

    def forward(self, hidden_states, weight=None, runtime_gather_output=None):
        return F.linear(hidden_states, self.weight, self.bias), None  # (S, B, 1)


def build_value_model(arch: ModelArch, cfg: TransformerConfig, make_vocab_size_divisible_by: int = 1) -> GPTModel:
    """The actor's trunk with its LM head replaced by a ValueHead: forward gives (B, S, 1).

    The head is never tied to the embeddings, whatever the checkpoint says.
    """
    model = _gpt(arch, cfg, make_vocab_size_divisible_by, tied=False)
    if model.post_process:
        model.output_layer = ValueHead(arch.hidden_size, cfg.params_dtype)
    return model
