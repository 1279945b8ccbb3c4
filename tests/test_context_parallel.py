"""Context parallelism's cut and gather (orz/models/context_parallel.py) in a 2-rank gloo world
with Megatron's CP groups; the attention ring itself is Transformer Engine's (GPU: tests/gpu)."""
import torch

from orz.models.context_parallel import zigzag_order
from orz.models.inputs import ModelInputs
from orz.models.local_world import run_world


def _cut_and_gather(rank, world, ids, upstream):
    from megatron.core import parallel_state as ps

    from orz.models import context_parallel
    from orz.models.parallel import init_model_parallel
    from orz.models.spec import Sizes

    init_model_parallel(Sizes(cp=2))
    assert ps.get_context_parallel_world_size() == 2 and ps.get_data_parallel_world_size() == 1
    local_ids, positions, padding = context_parallel.split(ModelInputs(ids))
    local = local_ids.double().requires_grad_(True)
    whole = context_parallel.gather(local[..., None] * 10)[..., 0]  # (B, S') from both ranks
    ((whole * upstream).sum() / 2).backward()  # each CP rank takes the whole loss 1/cp times
    return local_ids, positions, padding, whole.detach(), local.grad


def test_zigzag_order_by_hand():
    assert zigzag_order(1) == [0, 1] and zigzag_order(2) == [0, 3, 1, 2] and zigzag_order(3) == [0, 5, 1, 4, 2, 3]


def test_each_rank_holds_its_zigzag_chunks_and_the_gather_puts_them_back():
    """S = 6 padded to 8 (a multiple of 2·cp), cut into 4 chunks of 2: rank 0 holds positions 0, 1,
    6, 7 (the last two padding), rank 1 positions 2..5. The gather rebuilds the sequence on both
    ranks, and its backward hands each rank exactly the whole loss's gradient at its positions."""
    ids = torch.arange(1, 13).view(2, 6)
    upstream = torch.randn(2, 8, dtype=torch.float64)
    ranks = run_world(_cut_and_gather, 2, ids, upstream)
    held = {0: [0, 1, 6, 7], 1: [2, 3, 4, 5]}
    padded = torch.cat([ids, torch.zeros(2, 2, dtype=ids.dtype)], dim=1)
    for rank, (local_ids, positions, padding, whole, grad) in enumerate(ranks):
        assert positions.tolist() == [held[rank]] * 2
        assert torch.equal(local_ids, padded[:, held[rank]])
        assert padding.tolist() == [[p >= 6 for p in held[rank]]] * 2
        assert torch.equal(whole, padded.double() * 10)
        torch.testing.assert_close(grad, upstream[:, held[rank]] * 10, rtol=0, atol=1e-12)
