"""Tiny random Llama/Qwen2/Qwen3/Qwen3-MoE/Qwen3.5/Qwen3-Next checkpoints, made locally (nothing can be downloaded): for tests,
benchmarks and the CPU demo."""
from pathlib import Path

import torch


def make_tiny_hf(
    out_dir: str | Path,
    family: str = "llama",
    vocab_size: int = 128,
    hidden_size: int = 64,
    intermediate_size: int = 128,
    num_layers: int = 4,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    tie_word_embeddings: bool = False,
    rope_theta: float = 10000.0,
    max_position_embeddings: int = 2048,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    head_dim: int | None = None,
    rope_scaling: dict | None = None,
    moe: dict | None = None,
    hybrid: dict | None = None,
    vision: dict | None = None,
    **special_tokens: int,
) -> Path:
    """Writes a randomly initialised HF model (config.json + model.safetensors) to `out_dir`.

    head_dim: per head (default hidden_size / num_heads); rope_scaling: e.g. {"rope_type": "llama3",
    "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 32};
    moe (family qwen3_moe, qwen3_5_moe, qwen3_next): the config's expert fields, e.g. {"num_experts": 4, "num_experts_per_tok": 2,
    "moe_intermediate_size": 32, "norm_topk_prob": True, "mlp_only_layers": [1]}.
    hybrid (family qwen3_5, qwen3_5_moe, qwen3_next): the text config's fields, e.g. {"layer_types": [...], "linear_num_key_heads": 2,
    "linear_num_value_heads": 4, "linear_key_head_dim": 64, "linear_value_head_dim": 64,
    "partial_rotary_factor": 0.5}: its RMSNorm and GDN weights are drawn away from their neutral values,
    so that a norm whose zero-centring or a decay whose A_log were lost shows in the logits.
    vision (family qwen3_5, qwen3_5_moe): the vision config's fields; the checkpoint is then the
    vision-language wrapper Qwen3_5(Moe)ForConditionalGeneration, its language model the text config above.
    """
    import transformers

    prefix = {"llama": "Llama", "qwen2": "Qwen2", "qwen3": "Qwen3", "qwen3_moe": "Qwen3Moe", "qwen3_5": "Qwen3_5",
              "qwen3_5_moe": "Qwen3_5Moe", "qwen3_next": "Qwen3Next"}[family]
    hybrid_family = family.startswith("qwen3_5") or family == "qwen3_next"
    config_cls = getattr(transformers, f"{prefix}TextConfig" if family.startswith("qwen3_5") else f"{prefix}Config")
    model_cls = getattr(transformers, f"{prefix}ForCausalLM")
    hybrid = dict(hybrid or {})
    rotary = {"partial_rotary_factor": hybrid.pop("partial_rotary_factor")} if "partial_rotary_factor" in hybrid else {}
    config = config_cls(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        head_dim=head_dim or hidden_size // num_heads,
        tie_word_embeddings=tie_word_embeddings,
        rope_parameters={"rope_type": "default", "rope_theta": rope_theta, **rotary, **(rope_scaling or {})},
        max_position_embeddings=max_position_embeddings,
        torch_dtype=dtype,
        **(moe or {}),
        **hybrid,
        **special_tokens,
    )
    if vision is not None:
        config = getattr(transformers, f"{prefix}Config")(text_config=config.to_dict(), vision_config=vision,
                                                          tie_word_embeddings=tie_word_embeddings)
        model_cls = getattr(transformers, f"{prefix}ForConditionalGeneration")
    torch.manual_seed(seed)
    model = model_cls(config).to(dtype)
    with torch.no_grad():
        _visible(family, (model.model.language_model if vision is not None else model.model).layers)
        if hybrid_family:
            _away_from_neutral(model)
    model.save_pretrained(out_dir, safe_serialization=True)
    return Path(out_dir)


def _visible(family: str, layers) -> None:
    """Draws the weights a family initialises to neutral values (zero biases, unit norms, a uniform
    router) away from them, so that a converter that lost one shows in the logits."""
    for layer in layers:
        attn = getattr(layer, "self_attn", None)
        if family == "qwen2":  # random, not zero, QKV biases so that the tests see them
            for proj in (attn.q_proj, attn.k_proj, attn.v_proj):
                proj.bias.normal_(0, 0.02)
        if family in ("qwen3", "qwen3_moe"):  # and q/k norm weights other than ones
            for norm in (attn.q_norm, attn.k_norm):
                norm.weight.normal_(1.0, 0.2)
        if family in ("qwen3_moe", "qwen3_5_moe", "qwen3_next") and hasattr(layer.mlp, "gate"):
            # A router far from uniform (clear top-k margins, no near-ties that fp32 noise could
            # flip) and experts large enough that a misplaced one moves the logits visibly.
            layer.mlp.gate.weight.normal_(0, 1.0)
            for weight in (layer.mlp.experts.gate_up_proj, layer.mlp.experts.down_proj):
                weight.normal_(0, 0.2)


def _away_from_neutral(model) -> None:
    """Qwen3.5's init leaves its zero-centred norms at 0 (a gain of 1), the GDN's output norm at 1 and
    dt_bias at 1: draw them, and the GDN's convolution and gates, so that each one shows."""
    for name, param in model.named_parameters():
        if name.endswith("norm.weight"):
            param.normal_(1.0 if ".linear_attn.norm." in name else 0.0, 0.2)
        elif name.endswith(("dt_bias", "conv1d.weight", "shared_expert_gate.weight")):
            param.normal_(0.0, 0.5)
