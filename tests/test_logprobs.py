"""Log-probs and entropy from hidden states and the LM head, chunk by chunk, against torch's
log_softmax over the whole vocabulary (float64) and against the path from whole logits the trainer
used before: values and gradients, at TP 1 and 2, on a vocabulary TP does not divide, with chunks
that do and do not divide the tokens."""
import pytest
import torch

from orz.models.local_world import run_world
from orz.models.logprobs import default_chunk_tokens, logprobs_from_logits, token_and_top_k_logprobs, token_logprobs

N, H, V, PADDED = 13, 8, 11, 12  # V=11 padded to 12 for TP=2 (one padding row of the LM head)


def _inputs():
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(N, H, generator=g)
    weight = torch.randn(V, H, generator=g)
    tokens = torch.randint(0, V, (N,), generator=g)
    upstream = torch.randn(2, N, generator=g)  # ∂loss/∂log p and ∂loss/∂H
    return hidden, weight, tokens, upstream


def _reference(hidden, weight, tokens, upstream, temperature=1.0):
    """float64 log_softmax over the whole vocabulary; values and the gradients of Σ g·log p + g'·H."""
    hidden, weight = (t.double().requires_grad_(True) for t in (hidden, weight))
    logp = torch.log_softmax(hidden @ weight.t() / temperature, dim=-1)
    token_logp = logp.gather(-1, tokens[:, None])[:, 0]
    entropy = -(logp.exp() * logp).sum(-1)
    (token_logp * upstream[0] + entropy * upstream[1]).sum().backward()
    return token_logp.detach(), entropy.detach(), hidden.grad, weight.grad


def _chunked(hidden, weight, tokens, upstream, **kwargs):
    hidden, weight = (t.clone().requires_grad_(True) for t in (hidden, weight))
    logp, entropy = token_logprobs(hidden, weight, tokens, **kwargs)
    (logp * upstream[0] + entropy * upstream[1]).sum().backward()
    return logp.detach(), entropy.detach(), hidden.grad, weight.grad


@pytest.mark.parametrize("chunk", [1, 4, 13, 0])  # 4 leaves a last chunk of 1; 0: the default (one chunk here)
def test_single_rank_values_and_gradients_match_log_softmax(chunk):
    hidden, weight, tokens, upstream = _inputs()
    got = _chunked(hidden, weight, tokens, upstream, temperature=0.7, chunk_tokens=chunk)
    for mine, ref in zip(got, _reference(hidden, weight, tokens, upstream, temperature=0.7)):
        torch.testing.assert_close(mine.double(), ref, atol=1e-5, rtol=1e-5)


def test_padding_rows_of_the_lm_head_take_no_probability_and_no_gradient():
    hidden, weight, tokens, upstream = _inputs()
    padded = torch.cat([weight, hidden.abs().sum(0, keepdim=True)])  # a padding row with a huge logit
    logp, entropy, grad_hidden, grad_weight = _chunked(hidden, padded, tokens, upstream, vocab_size=V, chunk_tokens=5)
    ref = _reference(hidden, weight, tokens, upstream)
    torch.testing.assert_close(logp.double(), ref[0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(entropy.double(), ref[1], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(grad_hidden.double(), ref[2], atol=1e-5, rtol=1e-5)
    assert not grad_weight[V:].any()


def test_the_chunks_equal_the_path_from_whole_logits_in_float32():
    """Today's numbers: the same fp32 matmul and softmax. Log-probs and entropy within 1e-6 (+1e-6 relative), the
    gradients' norms within 1e-6 relative (elementwise they differ by float32 rounding, ~1e-6)."""
    hidden, weight, tokens, upstream = _inputs()
    h, w = (t.clone().requires_grad_(True) for t in (hidden, weight))
    logp, entropy = logprobs_from_logits((h @ w.t())[None], tokens[None], temperature=0.7)
    (logp[0] * upstream[0] + entropy[0] * upstream[1]).sum().backward()
    got = _chunked(hidden, weight, tokens, upstream, temperature=0.7, chunk_tokens=3)
    torch.testing.assert_close(got[0], logp[0].detach(), atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(got[1], entropy[0].detach(), atol=1e-6, rtol=1e-6)
    for mine, ref in zip(got[2:], (h.grad, w.grad)):
        assert abs(mine.norm() - ref.norm()) <= 1e-6 * ref.norm()


def _tp2(rank, world, hidden, weight, tokens, upstream, chunk):
    from megatron.core import parallel_state as ps

    from orz.models.parallel import init_model_parallel
    from orz.models.spec import Sizes

    init_model_parallel(Sizes(tp=2))
    padded = torch.cat([weight, torch.zeros(PADDED - V, H)])
    shard = padded.chunk(2)[rank].clone()
    return _chunked(hidden, shard, tokens, upstream, vocab_size=V, group=ps.get_tensor_model_parallel_group(),
                    chunk_tokens=chunk)


@pytest.mark.parametrize("chunk", [4, 13])
def test_tp2_values_and_gradients_match_the_whole_vocabulary(chunk):
    """Each rank holds half the LM head: the max and the sums cross it, ∂/∂h sums both halves."""
    hidden, weight, tokens, upstream = _inputs()
    ranks = run_world(_tp2, 2, hidden, weight, tokens, upstream, chunk)
    logp, entropy, grad_hidden, grad_weight = _reference(hidden, weight, tokens, upstream)
    for mine in ranks:
        torch.testing.assert_close(mine[0].double(), logp, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(mine[1].double(), entropy, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(mine[2].double(), grad_hidden, atol=1e-5, rtol=1e-5)
    whole = torch.cat([ranks[0][3], ranks[1][3]])
    torch.testing.assert_close(whole[:V].double(), grad_weight, atol=1e-5, rtol=1e-5)
    assert not whole[V:].any()  # no gradient into padding


def test_the_default_chunk_holds_its_float32_logits_within_128_mib():
    assert default_chunk_tokens(151936) == 220 and default_chunk_tokens(64) == 524288


K = 3  # a teacher's top-k: several tokens per position, read in one pass


def _several(hidden, weight, ids, upstream, **kwargs):
    """(N, K) log-probs of ids (N, K) and the gradients of Σ g·log p, from the chunks."""
    hidden, weight = (t.clone().requires_grad_(True) for t in (hidden, weight))
    logp, _ = token_logprobs(hidden, weight, ids, with_entropy=False, **kwargs)
    (logp * upstream).sum().backward()
    return logp.detach(), hidden.grad, weight.grad


def _several_reference(hidden, weight, ids, upstream):
    hidden, weight = (t.double().requires_grad_(True) for t in (hidden, weight))
    logp = torch.log_softmax(hidden @ weight.t(), dim=-1).gather(-1, ids)
    (logp * upstream).sum().backward()
    return logp.detach(), hidden.grad, weight.grad


def _ids_and_upstream():
    g = torch.Generator().manual_seed(1)
    return torch.randint(0, V, (N, K), generator=g), torch.randn(N, K, generator=g)


def test_several_tokens_per_position_match_log_softmax_values_and_gradients():
    hidden, weight, _, _ = _inputs()
    ids, upstream = _ids_and_upstream()
    got = _several(hidden, weight, ids, upstream, chunk_tokens=4)
    for mine, ref in zip(got, _several_reference(hidden, weight, ids, upstream)):
        torch.testing.assert_close(mine.double(), ref, atol=1e-6, rtol=1e-6)


def _tp2_several(rank, world, hidden, weight, tokens, ids, upstream):
    from megatron.core import parallel_state as ps

    from orz.models.parallel import init_model_parallel
    from orz.models.spec import Sizes

    init_model_parallel(Sizes(tp=2))
    group = ps.get_tensor_model_parallel_group()
    shard = torch.cat([weight, torch.zeros(PADDED - V, H)]).chunk(2)[rank].clone()
    several = _several(hidden, shard, ids, upstream, vocab_size=V, group=group, chunk_tokens=4)
    return several, token_and_top_k_logprobs(hidden, shard, tokens, K, vocab_size=V, group=group, chunk_tokens=4)


def test_tp2_several_tokens_and_the_top_k_match_the_whole_vocabulary():
    """V = 11 over TP 2 (one padding row): the K ids' log-probs and gradients, the top-k the ranks
    agree on (each rank's candidates gathered) and the teacher's log-probs of the tokens (each on the
    rank that holds its row), against log_softmax and topk of the whole."""
    hidden, weight, tokens, _ = _inputs()
    assert (tokens < PADDED // 2).any() and (tokens >= PADDED // 2).any()  # both ranks hold some
    ids, upstream = _ids_and_upstream()
    ranks = run_world(_tp2_several, 2, hidden, weight, tokens, ids, upstream)
    logp, grad_hidden, grad_weight = _several_reference(hidden, weight, ids, upstream)
    whole_logp = torch.log_softmax(hidden.double() @ weight.double().t(), dim=-1)
    top, top_ids = whole_logp.topk(K, dim=-1)
    for (values, g_hidden, _), (got_token, got_top, got_ids) in ranks:
        torch.testing.assert_close(values.double(), logp, atol=1e-6, rtol=1e-6)
        torch.testing.assert_close(g_hidden.double(), grad_hidden, atol=1e-6, rtol=1e-6)
        torch.testing.assert_close(got_token.double(), whole_logp.gather(-1, tokens[:, None])[:, 0], atol=1e-6, rtol=1e-6)
        torch.testing.assert_close(got_top.double(), top, atol=1e-6, rtol=1e-6)
        assert torch.equal(got_ids, top_ids)
    whole = torch.cat([ranks[0][0][2], ranks[1][0][2]])
    torch.testing.assert_close(whole[:V].double(), grad_weight, atol=1e-6, rtol=1e-6)


def test_the_token_and_top_k_log_probs_at_one_rank_leave_padding_rows_out():
    hidden, weight, tokens, _ = _inputs()
    padded = torch.cat([weight, hidden.abs().sum(0, keepdim=True)])  # a padding row with the largest logit
    token, top, ids = token_and_top_k_logprobs(hidden, padded, tokens, K, vocab_size=V, temperature=0.7, chunk_tokens=5)
    want = torch.log_softmax(hidden.double() @ weight.double().t() / 0.7, dim=-1)
    want_top, want_ids = want.topk(K, dim=-1)
    torch.testing.assert_close(token.double(), want.gather(-1, tokens[:, None])[:, 0], atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(top.double(), want_top, atol=1e-6, rtol=1e-6)
    assert torch.equal(ids, want_ids)
