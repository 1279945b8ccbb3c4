"""The RMSNorms of Megatron's local (CPU) layer specs, built in the model's dtype.

Megatron's own local norm (`WrappedTorchNorm`) builds torch's RMSNorm in float32 whatever
`params_dtype` is, while Transformer Engine's (GPU) and transformers' follow the model's dtype.
A bf16 model with float32 norms then differs from the same model on GPU, and Megatron's mixed
precision optimizer cannot checkpoint it (its sharded state maps only the 16-bit parameters).
Nor has it a zero-centred RMSNorm (Qwen3.5's; TE's `zero_centered_gamma` on GPU).

    norm = RMSNorm(config, hidden_size, eps)     # what ModuleSpec builds; y = x / rms(x) · w
"""
import torch


class ZeroCentredRMSNorm(torch.nn.Module):
    """y = x / rms(x) · (1 + w), in float32 and then cast back (transformers' Qwen3.5 order). The
    weight is the checkpoint's w itself: storing 1 + w instead would round it in bf16, so that an
    HF → Megatron → HF round trip were no longer exact."""

    def __init__(self, hidden_size: int, eps: float, dtype: torch.dtype):
        super().__init__()
        self.eps = eps
        self.weight = torch.nn.Parameter(torch.zeros(hidden_size, dtype=dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        normed = torch.nn.functional.rms_norm(x.float(), (x.shape[-1],), eps=self.eps)
        return (normed * (1.0 + self.weight.float())).to(x.dtype)


class RMSNorm:
    """Called like Megatron's norm classes; zero-centred where `config.layernorm_zero_centered_gamma`."""

    def __new__(cls, config, hidden_size: int, eps: float = 1e-5, **_ignored) -> torch.nn.Module:
        if config.layernorm_zero_centered_gamma:
            return ZeroCentredRMSNorm(hidden_size, eps, config.params_dtype)
        return PlainRMSNorm(config, hidden_size, eps)


class PlainRMSNorm:
    """y = x / rms(x) · w whatever the config says: the Gated DeltaNet's output norm, which Qwen3.5
    keeps plain beside its zero-centred ones (on GPU too, where TE's norm would follow the config)."""

    def __new__(cls, config, hidden_size: int, eps: float = 1e-5, **_ignored) -> torch.nn.RMSNorm:
        return torch.nn.RMSNorm(hidden_size, eps=eps, dtype=config.params_dtype)
