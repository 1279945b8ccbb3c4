"""Context parallelism (CP): each sequence of a micro-batch split over the CP ranks, the model's
output gathered back whole.

Megatron's zigzag cut: the sequence, right-padded to a multiple of 2·cp, is cut into 2·cp equal
chunks, and CP rank r holds chunks r and 2·cp − 1 − r, so that every rank has as much causal
attention to do. Attention passes keys and values round the CP ring (Transformer Engine's: GPU
only, refused on CPU); Megatron's RoPE takes each chunk's own positions.

    ids, positions, padding = split(inputs)   # (B, S'/cp) this rank's tokens, S' = S padded
    whole = gather(model(ids, positions, ...))  # (B, S', ...) on every CP rank, in sequence order

Every CP rank then computes the whole micro-batch's loss from the gathered output. The gather's
backward sums the CP ranks' gradients (a reduce-scatter), so each rank takes the loss 1/cp times,
and Megatron's DDP sums the parameters' gradients over DP × CP.
"""
import torch
from megatron.core import parallel_state as ps
from megatron.core.tensor_parallel import gather_from_sequence_parallel_region
from megatron.core.utils import get_batch_on_this_cp_rank

from orz.models.inputs import ModelInputs


def zigzag_order(cp: int) -> list[int]:
    """The sequence's chunks in the order the CP ranks hold them: r, 2·cp − 1 − r for r = 0, 1, ..."""
    return [chunk for r in range(cp) for chunk in (r, 2 * cp - 1 - r)]


def split(inputs: ModelInputs) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """This CP rank's (input_ids, position_ids, padding), each (B, S'/cp), by Megatron's cut."""
    cp = ps.get_context_parallel_world_size()
    b, s = inputs.input_ids.shape
    width = -(-s // (2 * cp)) * 2 * cp
    ids = inputs.input_ids.new_zeros(b, width)
    ids[:, :s] = inputs.input_ids
    padding = torch.ones(b, width, dtype=torch.bool, device=ids.device)
    padding[:, :s] = inputs.padding if inputs.padding is not None else False
    positions = torch.arange(width, device=ids.device).expand(b, width)
    local = get_batch_on_this_cp_rank({"ids": ids, "positions": positions, "padding": padding, "cu_seqlens": None},
                                      is_hybrid_cp=False, cp_group=ps.get_context_parallel_group())
    return local["ids"], local["positions"], local["padding"]


def gather(local: torch.Tensor) -> torch.Tensor:
    """(B, S'/cp, ...) this rank's outputs -> (B, S', ...) every rank's, in sequence order. The
    backward hands each rank the sum over CP ranks of its chunks' gradients."""
    cp = ps.get_context_parallel_world_size()
    held = gather_from_sequence_parallel_region(local.transpose(0, 1).contiguous(), tensor_parallel_output_grad=True,
                                                group=ps.get_context_parallel_group()).transpose(0, 1)
    chunks = held.chunk(2 * cp, dim=1)
    place = {chunk: i for i, chunk in enumerate(zigzag_order(cp))}
    return torch.cat([chunks[place[c]] for c in range(2 * cp)], dim=1)
