"""What a Megatron model reads for one micro-batch (free of Megatron, so that the driver can import it)."""
from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True)
class ModelInputs:
    """One micro-batch as the model reads it. Rows are right-padded, so every row's positions
    are 0, 1, 2, ...; `micro` is the caller's own micro-batch, handed back to its loss.

    With `lengths`, the model reads the rows packed (THD): one sequence of Σ lengths tokens, no
    padding between rows, attention and RoPE positions restarting at each (`cu_seqlens`); its
    output comes back unpacked to (B, S, ...) for the loss (`unpack`)."""

    input_ids: torch.Tensor  # (B, S)
    micro: Any = None
    # (B, S, L, K) experts to route token (b, s) to in each of the L MoE layers (routing replay); -1 on
    # padding; None: the routers choose
    routes: torch.Tensor | None = None
    # (B, S) True on padding positions: a MoE's routers leave them out of the load-balancing
    # loss's statistics (Megatron's padding_mask); None: the routers count every position
    padding: torch.Tensor | None = None
    lengths: torch.Tensor | None = None  # (B,) real tokens of each row: packed; None: padded rows

    @property
    def position_ids(self) -> torch.Tensor:
        return torch.arange(self.input_ids.shape[1], device=self.input_ids.device).expand_as(self.input_ids)

    @property
    def cu_seqlens(self) -> torch.Tensor:
        """(B + 1,) int32: where each packed row starts, and the end."""
        return torch.nn.functional.pad(self.lengths.cumsum(0), (1, 0)).to(torch.int32)

    def packed(self, per_token: torch.Tensor) -> torch.Tensor:
        """(B, S, ...) -> (1, Σ lengths, ...): each row's real tokens, one after another."""
        real = torch.arange(per_token.shape[1])[None, :] < self.lengths[:, None]  # (B, S)
        return per_token[real][None]

    def unpack(self, output: torch.Tensor) -> torch.Tensor:
        """(1, Σ lengths, ...) -> (B, S, ...): each row's outputs back in place, 0 on padding."""
        b, s = self.input_ids.shape
        real = torch.arange(s)[None, :] < self.lengths[:, None]
        out = output.new_zeros((b, s, *output.shape[2:]))
        return out.index_put(tuple(real.nonzero(as_tuple=True)), output[0, : int(self.lengths.sum())])
