"""Tiny random Llama/Qwen2 checkpoints, made locally (nothing can be downloaded): for tests,
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
    **special_tokens: int,
) -> Path:
    """Writes a randomly initialised HF model (config.json + model.safetensors) to `out_dir`."""
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    config_cls, model_cls = {"llama": (LlamaConfig, LlamaForCausalLM), "qwen2": (Qwen2Config, Qwen2ForCausalLM)}[family]
    config = config_cls(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        tie_word_embeddings=tie_word_embeddings,
        rope_theta=rope_theta,
        max_position_embeddings=max_position_embeddings,
        torch_dtype=dtype,
        **special_tokens,
    )
    torch.manual_seed(seed)
    model = model_cls(config).to(dtype)
    if family == "qwen2":  # random, not zero, QKV biases so that the tests see them
        with torch.no_grad():
            for layer in model.model.layers:
                for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                    proj.bias.normal_(0, 0.02)
    model.save_pretrained(out_dir, safe_serialization=True)
    return Path(out_dir)
