"""Log-probabilities and entropy of given tokens, in memory bounded by a chunk of tokens.

The trainer reads log π(y) (and the entropy) at the positions its loss reads, from the final
hidden states h (N, H) and the LM head's weight W (V/TP, H), each TP rank holding a slice of the
vocabulary. The (tokens × vocabulary) logits are never held whole: they are computed a chunk of
tokens at a time, z = (h_c Wᵀ)/T (the matmul in the model's dtype, the rest in float32), and the
backward computes them again instead of keeping them. With m the max of z and Z its partition sum:

    log Z = m + log Σᵢ exp(zᵢ − m)           (all-reduces over TP: the max, then the partial sums)
    log p(y) = z_y − log Z                    (z_y lives on one rank: an all-reduce of a one-hot pick)
    H = log Z − E_p[z],  E_p[z] = Σᵢ pᵢ zᵢ      (an all-reduce of Σ exp(zᵢ − m)·zᵢ)
    ∂ log p(y)/∂zⱼ = 1[j = y] − pⱼ,   ∂H/∂zⱼ = −pⱼ (zⱼ − E_p[z])

so the backward needs only log Z and E_p[z] per token (N floats each). ∂/∂h sums over the TP
ranks' vocabulary slices (an all-reduce, as Megatron's column-parallel LM head does), and ∂/∂W
stays on each rank. Padded vocabulary rows (Megatron pads V to a multiple of TP) are left out.

    logprobs, entropy = token_logprobs(h, W, tokens, vocab_size, tp_group, temperature=0.6, chunk_tokens=1024)

`logprobs_from_logits` is the path from whole logits the trainer used before: the reference the
tests and bench/bench_long_logprobs.py compare against; the trainer never calls it.
"""
import torch
import torch.distributed as dist

# Finite, so that exp(padding − m)·padding is 0 rather than NaN (0·∞) in the entropy and its gradient.
_PADDING_LOGIT = -1e30
# The default chunk: its float32 logits stay within this many bytes on a rank, whatever the vocabulary.
# Smaller chunks cost time in narrow matmuls (measured at H 1024, V 152k: 64 MiB, 110 tokens, ran
# 1.18× the whole-logits path; 128 MiB ran 0.85×, as fast as 256 MiB).
CHUNK_BYTES = 128 << 20


def default_chunk_tokens(local_vocab: int) -> int:
    """Tokens per chunk when none is set: CHUNK_BYTES of float32 logits (220 tokens at V = 152k)."""
    return max(1, CHUNK_BYTES // (4 * local_vocab))


def _tp(group) -> tuple[int, int]:
    return (dist.get_rank(group), dist.get_world_size(group)) if group is not None else (0, 1)


def _all_reduce(x: torch.Tensor, group, op=dist.ReduceOp.SUM) -> torch.Tensor:
    if group is not None and dist.get_world_size(group) > 1:
        dist.all_reduce(x, op=op, group=group)
    return x


def _scaled_logits(h: torch.Tensor, weight: torch.Tensor, vocab_start: int, vocab_size: int | None,
                   temperature: float) -> torch.Tensor:
    """(n, V_local) z = (h Wᵀ)/T, a new tensor: the matmul in the weight's dtype, then float32;
    padding rows masked."""
    z = (h.to(weight.dtype) @ weight.t()).float()
    if temperature != 1.0:
        z.div_(temperature)
    local_vocab = weight.shape[0]
    if vocab_size is not None and vocab_start + local_vocab > vocab_size:
        z[:, vocab_size - vocab_start:] = _PADDING_LOGIT
    return z


class _ChunkedLogprobs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, tokens, vocab_size, group, temperature, chunk, with_entropy):
        rank, _ = _tp(group)
        local_vocab = weight.shape[0]
        vocab_start = rank * local_vocab
        n = hidden.shape[0]
        log_z, mean_z = (torch.empty(n, dtype=torch.float32, device=hidden.device) for _ in range(2))
        token_z = torch.empty(tokens.shape, dtype=torch.float32, device=hidden.device)  # (n, K)
        for start in range(0, n, chunk):
            end = min(start + chunk, n)
            z = _scaled_logits(hidden[start:end], weight, vocab_start, vocab_size, temperature)  # (c, V_local)
            m = _all_reduce(z.amax(dim=-1), group, dist.ReduceOp.MAX)
            exp = (z - m[:, None]).exp_()
            sums = torch.stack([exp.sum(-1), (exp * z).sum(-1)])  # one all-reduce for both partial sums
            local = tokens[start:end] - vocab_start  # (c, K)
            owned = (local >= 0) & (local < local_vocab)
            picked = z.gather(-1, local.clamp(0, local_vocab - 1))
            sums = _all_reduce(torch.cat([sums, torch.where(owned, picked, 0.0).t()]), group)
            log_z[start:end] = m + sums[0].log()
            mean_z[start:end] = sums[1] / sums[0]
            token_z[start:end] = sums[2:].t()
        ctx.save_for_backward(hidden, weight, tokens, log_z, mean_z)
        ctx.settings = vocab_size, group, temperature, chunk
        logprobs = token_z - log_z[:, None]
        entropy = log_z - mean_z if with_entropy else torch.zeros_like(log_z)
        return logprobs, entropy

    @staticmethod
    def backward(ctx, grad_logprobs, grad_entropy):
        hidden, weight, tokens, log_z, mean_z = ctx.saved_tensors
        vocab_size, group, temperature, chunk = ctx.settings
        rank, _ = _tp(group)
        local_vocab = weight.shape[0]
        vocab_start = rank * local_vocab
        grad_hidden = torch.zeros(hidden.shape, dtype=torch.float32, device=hidden.device)
        grad_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device)
        for start in range(0, hidden.shape[0], chunk):
            end = min(start + chunk, hidden.shape[0])
            h = hidden[start:end]
            z = _scaled_logits(h, weight, vocab_start, vocab_size, temperature)  # recomputed, not kept
            p = (z - log_z[start:end, None]).exp_()  # (c, V_local), 0 on padding
            # −p·(Σₖ g_logp,k + g_H·(z − E_p[z])) + Σₖ g_logp,k·1[j = yₖ], in place in z's memory
            g = grad_logprobs[start:end]  # (c, K)
            grad_z = z.sub_(mean_z[start:end, None]).mul_(grad_entropy[start:end, None])
            grad_z = grad_z.add_(g.sum(-1, keepdim=True)).mul_(p).neg_()
            local = tokens[start:end] - vocab_start
            owned = (local >= 0) & (local < local_vocab)
            grad_z.scatter_add_(-1, local.clamp(0, local_vocab - 1), torch.where(owned, g, 0.0))
            if temperature != 1.0:  # back through z = (h Wᵀ)/T
                grad_z.div_(temperature)
            grad_z = grad_z.to(weight.dtype)  # the matmuls in the model's dtype
            grad_hidden[start:end] = (grad_z @ weight).float()
            grad_weight += (grad_z.t() @ h.to(weight.dtype)).float()
        _all_reduce(grad_hidden, group)  # each rank's slice of the vocabulary contributed its part
        return grad_hidden.to(hidden.dtype), grad_weight.to(weight.dtype), None, None, None, None, None, None


def token_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    tokens: torch.Tensor,
    vocab_size: int | None = None,
    group=None,
    temperature: float = 1.0,
    chunk_tokens: int = 0,
    with_entropy: bool = True,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """log π(tokens) (N,) or (N, K) and the entropy of π (N,) (None unless `with_entropy`), float32.

    hidden: (N, H) the final hidden states at the positions that predict `tokens`, global ids: (N,)
    one per position, or (N, K) several (a teacher's top-k), their log-probs from one pass.
    weight: (V_local, H) this rank's slice of the LM head. vocab_size: the real vocabulary (rows at
    or beyond it are padding; default: none). group: the tensor-parallel group, or None when
    `weight` holds the whole vocabulary. chunk_tokens: tokens per chunk (0: default_chunk_tokens).
    Every rank of `group` calls it with the same hidden states and tokens.
    """
    if hidden.dim() != 2 or tokens.dim() not in (1, 2) or hidden.shape[0] != tokens.shape[0]:
        raise ValueError(f"hidden {tuple(hidden.shape)} must be (N, H) for tokens {tuple(tokens.shape)} (N,) or (N, K)")
    chunk = chunk_tokens if chunk_tokens > 0 else default_chunk_tokens(weight.shape[0])
    logprobs, entropy = _ChunkedLogprobs.apply(hidden, weight, tokens.reshape(len(tokens), -1), vocab_size, group,
                                               temperature, chunk, with_entropy)
    return logprobs.reshape(tokens.shape), entropy if with_entropy else None


@torch.no_grad()
def token_and_top_k_logprobs(hidden: torch.Tensor, weight: torch.Tensor, tokens: torch.Tensor, k: int,
                             vocab_size: int | None = None, group=None, temperature: float = 1.0,
                             chunk_tokens: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """What a teacher gives, from one pass over the logits in chunks as token_logprobs (no gradient):
    (N,) log π(tokens), and the k most likely tokens of π at each position, (N, k) log-probs, highest
    first, and (N, k) global ids. Each TP rank takes the top k of its vocabulary slice; the k·TP
    candidates are gathered and the top k of them kept."""
    rank, world = _tp(group)
    local_vocab = weight.shape[0]
    vocab_start = rank * local_vocab
    chunk = chunk_tokens if chunk_tokens > 0 else default_chunk_tokens(local_vocab)
    picked, values, ids = [], [], []
    for start in range(0, hidden.shape[0], chunk):
        z = _scaled_logits(hidden[start:start + chunk], weight, vocab_start, vocab_size, temperature)
        m = _all_reduce(z.amax(dim=-1), group, dist.ReduceOp.MAX)
        log_z = m + _all_reduce((z - m[:, None]).exp_().sum(-1), group).log()
        local = tokens[start:start + chunk] - vocab_start
        owned = (local >= 0) & (local < local_vocab)
        token_z = z.gather(-1, local.clamp(0, local_vocab - 1)[:, None])[:, 0]
        picked.append(_all_reduce(torch.where(owned, token_z, 0.0), group) - log_z)
        top, index = z.topk(min(k, local_vocab), dim=-1)
        candidates = torch.stack([top, (index + vocab_start).float()])  # (2, c, k): ids < 2²⁴ are exact in float32
        if world > 1:
            gathered = [torch.empty_like(candidates) for _ in range(world)]
            dist.all_gather(gathered, candidates, group=group)
            candidates = torch.cat(gathered, dim=-1)
        top, index = candidates[0].topk(k, dim=-1)
        values.append(top - log_z[:, None])
        ids.append(candidates[1].gather(-1, index).long())
    return torch.cat(picked), torch.cat(values), torch.cat(ids)


def logprobs_from_logits(
    logits: torch.Tensor,
    tokens: torch.Tensor,
    vocab_size: int | None = None,
    group=None,
    temperature: float = 1.0,
    with_entropy: bool = True,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The reference: log π(tokens) and the entropy from whole vocab-parallel logits (B, S, V_local),
    in float32, differentiable through autograd (the sums over TP with Megatron's mapping: sum
    forward, identity backward)."""
    from megatron.core.tensor_parallel.mappings import reduce_from_tensor_model_parallel_region

    def all_reduce_sum(x):
        return x if group is None or dist.get_world_size(group) == 1 else reduce_from_tensor_model_parallel_region(x, group=group)

    rank, _ = _tp(group)
    local_vocab = logits.shape[-1]
    vocab_start = rank * local_vocab
    logits = logits.float() / temperature
    if vocab_size is not None and vocab_start + local_vocab > vocab_size:
        real = torch.arange(vocab_start, vocab_start + local_vocab, device=logits.device) < vocab_size
        logits = logits.masked_fill(~real, _PADDING_LOGIT)
    max_logit = _all_reduce(logits.detach().amax(dim=-1), group, dist.ReduceOp.MAX)
    exp = (logits - max_logit.unsqueeze(-1)).exp()
    sum_exp = all_reduce_sum(exp.sum(dim=-1))
    log_z = max_logit + sum_exp.log()
    local = tokens - vocab_start
    owned = (local >= 0) & (local < local_vocab)
    picked = logits.gather(-1, local.clamp(0, local_vocab - 1).unsqueeze(-1)).squeeze(-1)
    logprobs = all_reduce_sum(torch.where(owned, picked, torch.zeros_like(picked))) - log_z
    entropy = log_z - all_reduce_sum((exp * logits).sum(dim=-1)) / sum_exp if with_entropy else None
    return logprobs, entropy
