"""Tiny random Llama/Qwen2/Qwen3/Qwen3-MoE checkpoints, made locally (nothing can be downloaded): for tests,
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
    **special_tokens: int,
) -> Path:
    """Writes a randomly initialised HF model (config.json + model.safetensors) to `out_dir`.

    head_dim: per head (default hidden_size / num_heads); rope_scaling: e.g. {"rope_type": "llama3",
    "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 32};
    moe (family qwen3_moe): Qwen3MoeConfig's expert fields, e.g. {"num_experts": 4, "num_experts_per_tok": 2,
    "moe_intermediate_size": 32, "norm_topk_prob": True, "mlp_only_layers": [1]}.
    """
    import transformers

    prefix = {"llama": "Llama", "qwen2": "Qwen2", "qwen3": "Qwen3", "qwen3_moe": "Qwen3Moe"}[family]
    config_cls, model_cls = getattr(transformers, f"{prefix}Config"), getattr(transformers, f"{prefix}ForCausalLM")
    config = config_cls(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        head_dim=head_dim or hidden_size // num_heads,
        tie_word_embeddings=tie_word_embeddings,
        rope_parameters={"rope_type": "default", "rope_theta": rope_theta, **(rope_scaling or {})},
        max_position_embeddings=max_position_embeddings,
        torch_dtype=dtype,
        **(moe or {}),
        **special_tokens,
    )
    torch.manual_seed(seed)
    model = model_cls(config).to(dtype)
    with torch.no_grad():
        for layer in model.model.layers:
            attn = layer.self_attn
            if family == "qwen2":  # random, not zero, QKV biases so that the tests see them
                for proj in (attn.q_proj, attn.k_proj, attn.v_proj):
                    proj.bias.normal_(0, 0.02)
            if family in ("qwen3", "qwen3_moe"):  # and q/k norm weights other than ones
                for norm in (attn.q_norm, attn.k_norm):
                    norm.weight.normal_(1.0, 0.2)
            if family == "qwen3_moe" and hasattr(layer.mlp, "gate"):
                # A router far from uniform (clear top-k margins, no near-ties that fp32 noise could
                # flip) and experts large enough that a misplaced one moves the logits visibly.
                layer.mlp.gate.weight.normal_(0, 1.0)
                for weight in (layer.mlp.experts.gate_up_proj, layer.mlp.experts.down_proj):
                    weight.normal_(0, 0.2)
    model.save_pretrained(out_dir, safe_serialization=True)
    return Path(out_dir)
