"""What a Megatron model reads for one micro-batch (free of Megatron, so that the driver can import it)."""
from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True)
class ModelInputs:
    """One micro-batch as the model reads it. Rows are right-padded, so every row's positions
    are 0, 1, 2, ...; `micro` is the caller's own micro-batch, handed back to its loss."""

    input_ids: torch.Tensor  # (B, S)
    micro: Any = None
    # (B, S, L, K) experts to route token (b, s) to in each of the L MoE layers (routing replay); -1 on
    # padding; None: the routers choose
    routes: torch.Tensor | None = None
    # (B, S) True on padding positions: a MoE's routers leave them out of the load-balancing
    # loss's statistics (Megatron's padding_mask); None: the routers count every position
    padding: torch.Tensor | None = None

    @property
    def position_ids(self) -> torch.Tensor:
        return torch.arange(self.input_ids.shape[1], device=self.input_ids.device).expand_as(self.input_ids)
