"""Log-probabilities and entropy of given tokens from vocab-parallel logits.

Each TP rank holds a slice of the vocabulary, logits (B, S, V/TP); no rank ever holds the full
vocabulary. With z the logits over the (unpadded) vocabulary and m their max:

    log Z = m + log Σᵢ exp(zᵢ − m)          (one all-reduce of the partial sums, one of the max)
    log p(y) = z_y − log Z                   (z_y lives on one rank: all-reduce of a one-hot pick)
    H = log Z − Σᵢ pᵢ zᵢ                     (one all-reduce of Σ exp(zᵢ − m)·zᵢ)

Padded vocabulary columns (Megatron pads V to a multiple of TP) are excluded.
Gradients flow through the all-reduces as Megatron's TP mappings define (sum forward,
identity backward: every TP rank computes the same loss).
"""
import torch
import torch.distributed as dist

# Finite, so that exp(padding − m)·padding is 0 rather than NaN (0·∞) in entropy and its gradient.
_PADDING_LOGIT = -1e30


def _all_reduce_sum(x: torch.Tensor, group) -> torch.Tensor:
    if group is None or dist.get_world_size(group) == 1:
        return x
    from megatron.core.tensor_parallel.mappings import reduce_from_tensor_model_parallel_region

    return reduce_from_tensor_model_parallel_region(x, group=group)


def _all_reduce_max(x: torch.Tensor, group) -> torch.Tensor:
    if group is not None and dist.get_world_size(group) > 1:
        dist.all_reduce(x, op=dist.ReduceOp.MAX, group=group)
    return x


def logprobs_and_entropy(
    logits: torch.Tensor,
    tokens: torch.Tensor,
    vocab_size: int | None = None,
    group=None,
    temperature: float = 1.0,
    with_entropy: bool = True,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """log π(tokens) and the entropy of π at each position, computed in float32.

    logits: (B, S, V_local), this rank's vocabulary slice; tokens: (B, S) global token ids.
    vocab_size: the real vocabulary (columns at or beyond it are padding); default: all columns.
    group: the tensor-parallel process group, or None when the logits hold the full vocabulary.
    Returns logprobs (B, S) and entropy (B, S) (None unless `with_entropy`).
    """
    if logits.shape[:-1] != tokens.shape:
        raise ValueError(f"logits {tuple(logits.shape)} and tokens {tuple(tokens.shape)} disagree on (B, S)")
    tp_rank = dist.get_rank(group) if group is not None else 0
    local_vocab = logits.shape[-1]
    vocab_start = tp_rank * local_vocab
    logits = logits.float() / temperature  # (B, S, V_local)
    if vocab_size is not None and vocab_start + local_vocab > vocab_size:
        real = torch.arange(vocab_start, vocab_start + local_vocab, device=logits.device) < vocab_size
        logits = logits.masked_fill(~real, _PADDING_LOGIT)

    max_logit = _all_reduce_max(logits.detach().amax(dim=-1), group)  # (B, S)
    shifted = logits - max_logit.unsqueeze(-1)
    exp = shifted.exp()  # (B, S, V_local); 0 on padding
    sum_exp = _all_reduce_sum(exp.sum(dim=-1), group)  # (B, S)
    log_z = max_logit + sum_exp.log()

    local_ids = tokens - vocab_start
    owned = (local_ids >= 0) & (local_ids < local_vocab)
    picked = logits.gather(-1, local_ids.clamp(0, local_vocab - 1).unsqueeze(-1)).squeeze(-1)
    token_logit = _all_reduce_sum(torch.where(owned, picked, torch.zeros_like(picked)), group)
    logprobs = token_logit - log_z

    entropy = None
    if with_entropy:
        weighted = (exp * logits).sum(dim=-1)
        entropy = log_z - _all_reduce_sum(weighted, group) / sum_exp
    return logprobs, entropy

