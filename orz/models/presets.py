"""Published models as ModelArch presets (from their config.json files), for the planner: what
orz.models.arch would read from each model's directory."""
from orz.models.arch import GatedDeltaNetArch, Llama3Rope, ModelArch, MoeArch


def _qwen2(**numbers) -> ModelArch:
    shared = dict(family="qwen2", head_dim=128, rope_theta=1e6, rms_norm_eps=1e-6, max_position_embeddings=131072)
    return ModelArch(**(shared | numbers))


def _qwen3(**numbers) -> ModelArch:
    shared = dict(family="qwen3", head_dim=128, rope_theta=1e6, rms_norm_eps=1e-6, max_position_embeddings=40960,
                  vocab_size=151936, num_kv_heads=8, tie_word_embeddings=False)
    return ModelArch(**(shared | numbers))


def _qwen3_5(num_layers: int, **numbers) -> ModelArch:
    """Qwen3.5's text_config: every fourth layer gated full attention (head_dim 256, a quarter rotated),
    the others Gated DeltaNet with 16 key heads of 128 (value heads: `numbers`); zero-centred norms."""
    gdn = numbers.pop("linear_num_value_heads")
    shared = dict(family="qwen3_5", vocab_size=248320, head_dim=256, rope_theta=1e7, rms_norm_eps=1e-6,
                  max_position_embeddings=262144, tie_word_embeddings=False, num_layers=num_layers,
                  rotary_fraction=0.25, attention_output_gate=True, zero_centred_norms=True,
                  linear_attention=GatedDeltaNetArch(num_key_heads=16, num_value_heads=gdn, key_head_dim=128,
                                                     value_head_dim=128, conv_kernel=4,
                                                     layers=tuple(i for i in range(num_layers) if (i + 1) % 4)))
    return ModelArch(**(shared | numbers))


# From the published config.json files (Qwen3.5's text_config); `ModelArch.num_params` gives 7.62B,
# 32.76B, 1.54B, 0.49B, 8.03B, 8.19B, 32.76B, 30.53B, 26.90B, 34.66B (their vision towers and MTP
# layers, which RL does not train, left out).
MODELS = {
    "Qwen2.5-0.5B": _qwen2(vocab_size=151936, hidden_size=896, intermediate_size=4864, num_layers=24,
                           num_heads=14, num_kv_heads=2, tie_word_embeddings=True, head_dim=64,
                           max_position_embeddings=32768),
    "Qwen2.5-1.5B": _qwen2(vocab_size=151936, hidden_size=1536, intermediate_size=8960, num_layers=28,
                           num_heads=12, num_kv_heads=2, tie_word_embeddings=True),
    "Qwen2.5-7B": _qwen2(vocab_size=152064, hidden_size=3584, intermediate_size=18944, num_layers=28,
                         num_heads=28, num_kv_heads=4, tie_word_embeddings=False),
    "Qwen2.5-32B": _qwen2(vocab_size=152064, hidden_size=5120, intermediate_size=27648, num_layers=64,
                          num_heads=40, num_kv_heads=8, tie_word_embeddings=False, rms_norm_eps=1e-5),
    # Its llama3 RoPE scaling changes neither memory nor FLOPs; kept so that the preset equals what
    # the trainer reads from the model's config.json.
    "Llama-3.1-8B": ModelArch(family="llama", vocab_size=128256, hidden_size=4096, intermediate_size=14336,
                              num_layers=32, num_heads=32, num_kv_heads=8, head_dim=128, rope_theta=500000.0,
                              rms_norm_eps=1e-5, tie_word_embeddings=False, max_position_embeddings=131072,
                              rope_scaling=Llama3Rope(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                                                      original_max_position_embeddings=8192)),
    "Qwen3-8B": _qwen3(hidden_size=4096, intermediate_size=12288, num_layers=36, num_heads=32),
    "Qwen3-32B": _qwen3(hidden_size=5120, intermediate_size=25600, num_layers=64, num_heads=64),
    # 128 experts of width 768, 8 routed per token, in every one of its 48 layers (decoder_sparse_step 1,
    # no mlp_only_layers): 30.53B parameters, 3.35B active per token with the embedding.
    "Qwen3-30B-A3B": _qwen3(family="qwen3_moe", hidden_size=2048, intermediate_size=6144, num_layers=48,
                            num_heads=32, num_kv_heads=4,
                            moe=MoeArch(num_experts=128, top_k=8, intermediate_size=768, norm_topk_prob=True,
                                        layers=tuple(range(48)))),
    "Qwen3.5-27B": _qwen3_5(64, hidden_size=5120, intermediate_size=17408, num_heads=24, num_kv_heads=4,
                            linear_num_value_heads=48),
    # 256 experts of width 512, 8 routed, and a shared expert of 512 in each of its 40 layers
    "Qwen3.5-35B-A3B": _qwen3_5(40, family="qwen3_5_moe", hidden_size=2048, intermediate_size=512, num_heads=16,
                                num_kv_heads=2, linear_num_value_heads=32,
                                moe=MoeArch(num_experts=256, top_k=8, intermediate_size=512, norm_topk_prob=True,
                                            layers=tuple(range(40)), shared_intermediate_size=512)),
}
