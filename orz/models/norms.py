"""The RMSNorm of Megatron's local (CPU) layer specs, built in the model's dtype.

Megatron's own local norm (`WrappedTorchNorm`) builds torch's RMSNorm in float32 whatever
`params_dtype` is, while Transformer Engine's (GPU) and transformers' follow the model's dtype.
A bf16 model with float32 norms then differs from the same model on GPU, and Megatron's mixed
precision optimizer cannot checkpoint it (its sharded state maps only the 16-bit parameters).

    norm = RMSNorm(config, hidden_size, eps)     # what ModuleSpec builds; y = x / rms(x) · w
"""
import torch


class RMSNorm:
    """Called like Megatron's norm classes; returns torch's RMSNorm in `config.params_dtype`."""

    def __new__(cls, config, hidden_size: int, eps: float = 1e-5, **_ignored) -> torch.nn.RMSNorm:
        return torch.nn.RMSNorm(hidden_size, eps=eps, dtype=config.params_dtype)
