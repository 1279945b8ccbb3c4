"""Vocab-parallel log-probs and entropy against a plain log_softmax over the full vocabulary."""
import torch
from orz.models.local_world import run_world

from orz.models.logprobs import logprobs_and_entropy

B, S, V, PADDED = 3, 5, 11, 12  # V=11 padded to 12 for TP=2 (one padding column)


def _reference(logits, tokens):
    logp = torch.log_softmax(logits.double(), dim=-1)
    token_logp = logp.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
    entropy = -(logp.exp() * logp).sum(-1)
    return token_logp, entropy


def _inputs():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(B, S, V, generator=g) * 3
    tokens = torch.randint(0, V, (B, S), generator=g)
    upstream = torch.randn(B, S, generator=g)
    return logits, tokens, upstream


def test_single_rank_matches_log_softmax():
    logits, tokens, _ = _inputs()
    logp, entropy = logprobs_and_entropy(logits, tokens)
    ref_logp, ref_entropy = _reference(logits, tokens)
    assert torch.allclose(logp.double(), ref_logp, atol=1e-5)
    assert torch.allclose(entropy.double(), ref_entropy, atol=1e-5)


def test_temperature_and_padding_columns():
    logits, tokens, _ = _inputs()
    padded = torch.cat([logits, torch.full((B, S, 1), 50.0)], dim=-1)  # a huge padding logit
    logp, entropy = logprobs_and_entropy(padded, tokens, vocab_size=V, temperature=0.7)
    ref_logp, ref_entropy = _reference(logits / 0.7, tokens)
    assert torch.allclose(logp.double(), ref_logp, atol=1e-5)
    assert torch.allclose(entropy.double(), ref_entropy, atol=1e-5)


def _tp2(rank, world, logits, tokens, upstream):
    from megatron.core import parallel_state as ps

    from orz.models.parallel import init_model_parallel

    init_model_parallel(tp=2)
    padded = torch.cat([logits, torch.zeros(B, S, PADDED - V)], dim=-1)
    shard = padded.chunk(2, dim=-1)[rank].clone().requires_grad_(True)
    logp, entropy = logprobs_and_entropy(shard, tokens, V, ps.get_tensor_model_parallel_group())
    (logp * upstream + entropy * upstream.flip(0)).sum().backward()
    return logp.detach(), entropy.detach(), shard.grad


def test_tp2_values_and_gradients_match_full_vocabulary():
    logits, tokens, upstream = _inputs()
    ranks = run_world(_tp2, 2, logits, tokens, upstream)
    ref_logp, ref_entropy = _reference(logits, tokens)
    full = logits.double().requires_grad_(True)
    r_logp, r_entropy = _reference(full, tokens)
    (r_logp * upstream + r_entropy * upstream.flip(0)).sum().backward()
    grad = torch.cat([ranks[0][2], ranks[1][2]], dim=-1)
    for logp, entropy, _ in ranks:
        assert torch.allclose(logp.double(), ref_logp, atol=1e-5)
        assert torch.allclose(entropy.double(), ref_entropy, atol=1e-5)
    assert torch.allclose(grad[..., :V].double(), full.grad, atol=1e-5)
    assert torch.count_nonzero(grad[..., V:]) == 0  # no gradient into padding
