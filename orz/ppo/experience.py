"""The replay buffer: Experience, the batch an iteration's updates replay (what ORZ and OpenRLHF
call the replay buffer; parts join with ``Experience.concat``), and how it is cut for an update:
shuffled mini-batches (``Experience.minibatches``), each step's, and micro-batches.

One token layout, everywhere:

    sequences       p p p r r r r 0 0    (B, S) prompt + response token ids, right-padded
    attention_mask  1 1 1 1 1 1 1 0 0    (B, S) 1 on prompt and response tokens
    prompt_lengths  3                    (B,)   the response starts at this position
    response_mask         1 1 1 1 0 0    (B, T) 1 on response tokens that count in the loss

Response token t of row b is ``sequences[b, prompt_lengths[b] + t]``; every (B, T) field is indexed
like ``response_mask``. A response token may be attended but masked out of the loss (tool output in
a multi-turn response). A Megatron worker feeds ``sequences`` (positions 0, 1, 2, ... on every row), computes
per-token results over (B, S) — the value at s
belongs to token s, e.g. its log-prob from the logits at s − 1 — and reads the response part back
with ``gather_response``.

Gradient accumulation does not change the loss: every micro-batch carries its mini-batch's loss
normalisers (``MicroBatch.loss_denominators``), so summing ``aggregate(..., denominator=...)`` over
micro-batches and data-parallel ranks gives the loss of the whole mini-batch for every mode.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field, fields, replace
from typing import Any, Callable, Iterator, Mapping, Sequence

import torch
from torch import Tensor

from orz.ppo.core_algos import AGGREGATIONS, aggregate_denominator

__all__ = ["Experience", "MiniBatch", "MicroBatch", "experience_from_rollouts"]


def _tensor(dims: str, required: bool = False) -> Any:
    """A tensor field whose dimensions are the letters of ``dims``: B batch, S sequence, T response
    (J: a teacher's top-k tokens at a position; L, K: MoE layers and the experts of a token)."""
    if required:
        return field(metadata={"dims": dims})
    return field(default=None, metadata={"dims": dims})


@dataclass(frozen=True, kw_only=True)
class Experience:
    """A batch of rollouts with everything the update needs. Optional fields are None until filled."""

    # tokens
    sequences: Tensor = _tensor("BS", required=True)       # (B, S) int64 prompt + response ids, right-padded
    attention_mask: Tensor = _tensor("BS", required=True)  # (B, S) 1 on prompt and response tokens
    prompt_lengths: Tensor = _tensor("B", required=True)   # (B,) int64 prompt tokens; the response starts here
    response_mask: Tensor = _tensor("BT", required=True)   # (B, T) 1 on response tokens in the loss
    # log-probs of the response tokens
    old_logprobs: Tensor | None = _tensor("BT")      # (B, T) log π_old(a|s), the trainer's actor before the update
    ref_logprobs: Tensor | None = _tensor("BT")      # (B, T) log π_ref(a|s), the frozen reference model
    rollout_logprobs: Tensor | None = _tensor("BT")  # (B, T) log π_rollout(a|s) as reported by the vLLM engine
    # critic
    values: Tensor | None = _tensor("BT")            # (B, T) V(sₜ) of the critic before the update
    # rewards and advantages
    scores: Tensor | None = _tensor("B")             # (B,) verifier score of each response
    rewards: Tensor | None = _tensor("BT")           # (B, T) per-token reward: score on the last token − β·kl
    advantages: Tensor | None = _tensor("BT")        # (B, T) Aₜ
    returns: Tensor | None = _tensor("BT")           # (B, T) the critic's targets
    group_index: Tensor | None = _tensor("B")        # (B,) int64 prompt id; responses to one prompt share it
    # on-policy distillation (docs/distillation.md), of each row's own teacher; 0 on rows without one
    teacher_logprobs: Tensor | None = _tensor("BT")  # (B, T) log π_teacher(a|s) of the response tokens
    teacher_topk_ids: Tensor | None = _tensor("BTJ")  # (B, T, J) int64 the teacher's J = distill.top_k most likely tokens ...
    teacher_topk_logprobs: Tensor | None = _tensor("BTJ")  # (B, T, J) ... and their log-probs (objective topk_forward_kl)
    # MoE routing replay: the experts each token went to in each MoE layer when it was sampled
    routed_experts: Tensor | None = _tensor("BSLK")  # (B, S, L, K) int64 expert ids, the K of each of L MoE layers
    # per-sample extras for metrics and inspection: name → (B,) tensor (response length, truncated, ...)
    info: dict[str, Tensor] = field(default_factory=dict)

    def __post_init__(self) -> None:
        sizes: dict[str, int] = {}
        for name, dims, value in self.tensor_fields():
            if not isinstance(value, Tensor) or value.dim() != len(dims):
                raise ValueError(f"{name} must be a tensor with dims ({', '.join(dims)}), got {_describe(value)}")
            for letter, size in zip(dims, value.shape):
                if sizes.setdefault(letter, size) != size:
                    raise ValueError(f"{name} has {letter} = {size}, other fields have {letter} = {sizes[letter]}")
        for name, value in self.info.items():
            if not isinstance(value, Tensor) or value.dim() == 0 or value.shape[0] != sizes["B"]:
                raise ValueError(f"info[{name!r}] must be a tensor with B = {sizes['B']} rows, got {_describe(value)}")
        _check_right_padded(self.attention_mask)
        _check_response_inside_sequence(self)

    # -- looping over fields ------------------------------------------------------------------

    def tensor_fields(self) -> Iterator[tuple[str, str, Tensor]]:
        """(name, dims, tensor) of every tensor field that is set; ``info`` is not among them."""
        for f in fields(self):
            value = getattr(self, f.name)
            if "dims" in f.metadata and value is not None:
                yield f.name, f.metadata["dims"], value

    def _map(self, fn: Callable[[str, Tensor], Tensor]) -> Experience:
        """A new Experience with ``fn(dims, tensor)`` applied to every tensor, info included."""
        changes = {name: fn(dims, value) for name, dims, value in self.tensor_fields()}
        return replace(self, **changes, info={name: fn("B", value) for name, value in self.info.items()})

    @property
    def batch_size(self) -> int:
        return self.sequences.shape[0]

    def to(self, device: torch.device | str) -> Experience:
        return self._map(lambda dims, value: value.to(device))

    def select(self, rows: Tensor | Sequence[int]) -> Experience:
        """The rows ``rows`` (int indices or a (B,) bool mask), in that order."""
        rows = torch.as_tensor(rows, device=self.sequences.device)
        return self._map(lambda dims, value: value[rows])

    def minibatches(self, mini_batch_size: int, *, seed: int | None = None,
                    norm_len: int | None = None) -> list[MiniBatch]:
        """Rows shuffled by ``seed`` (None keeps the order), cut into mini-batches of
        ``mini_batch_size`` rows (the last may be smaller). ``norm_len`` for "seq-mean-token-sum-norm"
        defaults to T; recipes should set it to the generation limit."""
        if mini_batch_size <= 0:
            raise ValueError(f"mini_batch_size must be positive, got {mini_batch_size}")
        if seed is None:
            order = torch.arange(self.batch_size)
        else:
            order = torch.randperm(self.batch_size, generator=torch.Generator().manual_seed(seed))
        norm_len = self.response_mask.shape[1] if norm_len is None else norm_len
        return [MiniBatch.of(self.select(rows), norm_len, rows) for rows in order.split(mini_batch_size)]

    def dump_jsonl(self, path: str, tokenizer: Any = None, per_token: bool = False) -> None:
        """One JSON line per sample: prompt and response (text with ``tokenizer``, else token ids),
        per-sample fields, info, and each (B, T) field's mean over loss tokens (``per_token``: the
        list of its values there)."""
        experience = self.to("cpu")
        with open(path, "w") as out:
            for row in range(experience.batch_size):
                out.write(json.dumps(_sample_record(experience, row, tokenizer, per_token)) + "\n")

    @classmethod
    def concat(cls, parts: Sequence[Experience]) -> Experience:
        """Rows of all ``parts`` in order; (B, S) and (B, T) fields are right-padded to the widest with 0.
        The trainer builds one Experience per batch; the tests join batches with it (a buffer of two)."""
        if not parts:
            raise ValueError("concat needs at least one Experience")
        columns: dict[str, Any] = {}
        for f in fields(cls):
            if "dims" not in f.metadata:
                continue
            column = [getattr(part, f.name) for part in parts]
            if any(value is None for value in column) and any(value is not None for value in column):
                raise ValueError(f"{f.name} is set in some experiences and None in others")
            if column[0] is not None:
                columns[f.name] = _cat_padded(column)
        keys = set(parts[0].info)
        if any(set(part.info) != keys for part in parts):
            raise ValueError(f"info keys differ between experiences: {[sorted(part.info) for part in parts]}")
        return cls(**columns, info={key: _cat_padded([part.info[key] for part in parts]) for key in keys})

    def trim(self) -> Experience:
        """Drop padding columns: S down to the longest sequence, T down to the last loss token."""
        sequence_width = max(self.sequence_lengths().tolist(), default=1)
        positions = torch.arange(1, self.response_mask.shape[1] + 1, device=self.response_mask.device)
        response_width = max((positions * self.response_mask.bool()).amax(dim=1).tolist(), default=1)
        widths = {"S": sequence_width, "T": response_width}
        return self._map(lambda dims, value: value[:, :widths[dims[1]]] if dims[1:2] in widths else value)

    # -- what a model worker needs ------------------------------------------------------------

    def sequence_lengths(self) -> Tensor:
        """(B,) int64 prompt + response tokens of each row: its forward cost."""
        return self.attention_mask.long().sum(dim=1)

    def response_positions(self) -> Tensor:
        """(B, T) int64 position in ``sequences`` of each response token (clamped to S − 1 on padding)."""
        offsets = torch.arange(self.response_mask.shape[1], device=self.sequences.device)
        return (self.prompt_lengths[:, None] + offsets).clamp(max=self.sequences.shape[1] - 1)

    def gather_response(self, token_values: Tensor) -> Tensor:
        """(B, S) per-token results (the value at s belongs to token s) → (B, T), 0 off the response mask."""
        if token_values.shape != self.sequences.shape:
            raise ValueError(f"token_values must have the shape of sequences {tuple(self.sequences.shape)}, "
                             f"got {tuple(token_values.shape)}")
        picked = token_values.gather(1, self.response_positions())
        return torch.where(self.response_mask.bool(), picked, torch.zeros_like(picked))


def _describe(value: Any) -> str:
    return f"shape {tuple(value.shape)}" if isinstance(value, Tensor) else type(value).__name__


def _check_right_padded(attention_mask: Tensor) -> None:
    if attention_mask.dtype != torch.bool and not ((attention_mask == 0) | (attention_mask == 1)).all():
        raise ValueError("attention_mask must hold only 0 and 1")
    attended = attention_mask.long()
    if not torch.equal(attended.cummin(dim=1).values, attended):
        raise ValueError("attention_mask must be right-padded: 1s, then 0s, on every row")


def _check_response_inside_sequence(experience: Experience) -> None:
    response_mask = experience.response_mask
    if response_mask.dtype != torch.bool and not ((response_mask == 0) | (response_mask == 1)).all():
        raise ValueError("response_mask must hold only 0 and 1")
    if experience.prompt_lengths.is_floating_point() or (experience.prompt_lengths < 1).any():
        raise ValueError("prompt_lengths must be integers >= 1")
    width = experience.sequences.shape[1]
    offsets = torch.arange(response_mask.shape[1], device=response_mask.device)
    positions = experience.prompt_lengths[:, None] + offsets  # (B, T)
    inside = (positions < width) & experience.attention_mask.bool().gather(1, positions.clamp(max=width - 1))
    if (response_mask.bool() & ~inside).any():
        raise ValueError("response_mask marks tokens that are not attended tokens of sequences at "
                         "prompt_lengths + t; check prompt_lengths and the padding side")


def _pad_to(value: Tensor, width: int) -> Tensor:
    padded = value.new_zeros((value.shape[0], width, *value.shape[2:]))
    padded[:, :value.shape[1]] = value
    return padded


def _cat_padded(values: Sequence[Tensor]) -> Tensor:
    if values[0].dim() >= 2:
        width = max(value.shape[1] for value in values)
        values = [_pad_to(value, width) for value in values]
    return torch.cat(list(values))


# ---------------------------------------------------------------------------------------------
# Token budgets: a padded micro-batch computes and holds rows × its longest row; a packed one
# (<role>.pack, THD) its real tokens only.


def _padded_bins(lengths: Tensor, capacity: int) -> list[Tensor]:
    """Row indices sorted by length and cut so that each bin's rows × its longest length ≤
    capacity: the padded micro-batch stays within the budget, and rows of like lengths share one."""
    if capacity <= 0:
        raise ValueError(f"max_tokens must be positive, got {capacity}")
    order = torch.argsort(lengths, stable=True)
    bins, start = [], 0
    for end, index in enumerate(order.tolist(), start=1):
        length = int(lengths[index])
        if length > capacity:
            raise ValueError(f"row {index} has {length} tokens, more than max_tokens={capacity}")
        if (end - start) * length > capacity:  # sorted: the new row is the bin's longest
            bins.append(order[start:end - 1])
            start = end - 1
    return bins + [order[start:]]


def _packed_bins(lengths: Tensor, capacity: int) -> list[Tensor]:
    """Row indices in bins of at most `capacity` real tokens each (first fit, longest rows first:
    packed rows waste no slot on padding, so the fewest bins is what counts)."""
    if capacity <= 0:
        raise ValueError(f"max_tokens must be positive, got {capacity}")
    bins, room = [], []
    for index in torch.argsort(lengths, descending=True, stable=True).tolist():
        length = int(lengths[index])
        if length > capacity:
            raise ValueError(f"row {index} has {length} tokens, more than max_tokens={capacity}")
        fit = next((b for b, left in enumerate(room) if left >= length), None)
        if fit is None:
            bins.append([])
            room.append(capacity)
            fit = len(bins) - 1
        bins[fit].append(index)
        room[fit] -= length
    return [torch.tensor(sorted(b)) for b in bins]


def balanced_shards(lengths: Tensor, world_size: int) -> list[Tensor]:
    """Row indices for each of `world_size` data-parallel ranks, their tokens as even as a greedy
    cut makes them: longest rows first, each to the rank with the fewest tokens so far (then the
    fewest rows, then the lowest rank). Contiguous shards give one rank the long tail's rows while
    the others wait."""
    tokens, shards = [0] * world_size, [[] for _ in range(world_size)]
    for index in torch.argsort(lengths, descending=True, stable=True).tolist():
        rank = min(range(world_size), key=lambda r: (tokens[r], len(shards[r]), r))
        shards[rank].append(index)
        tokens[rank] += int(lengths[index])
    return [torch.tensor(sorted(s), dtype=torch.long) for s in shards]


# ---------------------------------------------------------------------------------------------
# Mini-batches and micro-batches.


@dataclass(frozen=True)
class MicroBatch:
    """What one forward/backward pass sees, with the loss normalisers of its whole mini-batch."""

    experience: Experience
    loss_denominators: Mapping[str, Tensor]  # aggregation mode → 0-d normaliser D of the mini-batch
    rows: Tensor  # (B_micro,) int64: where its rows sit in the (sharded) mini-batch it was cut from

    def denominator(self, mode: str) -> Tensor:
        """D for ``aggregate(..., mode, denominator=D)``; the sum over micro-batches is the mini-batch loss."""
        if mode not in self.loss_denominators:
            raise ValueError(f"unknown aggregation mode {mode!r}; valid: {', '.join(sorted(self.loss_denominators))}")
        return self.loss_denominators[mode]


@dataclass(frozen=True)
class MiniBatch:
    """One optimizer step's worth of experience."""

    experience: Experience
    loss_denominators: Mapping[str, Tensor]  # aggregation mode → 0-d normaliser D over all of it
    rows: Tensor | None = None  # (B_mini,) int64: where its rows sit in the Experience it was cut from

    @property
    def source_rows(self) -> Tensor:
        """Where each row sits in the Experience it was first cut from (itself, when not cut)."""
        return torch.arange(self.experience.batch_size) if self.rows is None else self.rows

    @classmethod
    def of(cls, experience: Experience, norm_len: int | None = None, rows: Tensor | None = None) -> MiniBatch:
        """``norm_len`` is for "seq-mean-token-sum-norm"; None means T of ``experience``. A
        mini-batch without a loss token (every one masked out) has D = 1 and a loss of 0."""
        denominators = {mode: aggregate_denominator(experience.response_mask, mode, norm_len).clamp_min(1)
                        for mode in AGGREGATIONS.names()}
        return cls(experience, denominators, rows)

    def shard(self, rank: int, world_size: int) -> MiniBatch:
        """Data-parallel rank ``rank``'s share of the rows, its tokens balanced against the other
        ranks' (balanced_shards), keeping the global normalisers."""
        if not 0 <= rank < world_size:
            raise ValueError(f"rank must be in [0, world_size={world_size}), got {rank}")
        rows = balanced_shards(self.experience.sequence_lengths(), world_size)[rank]
        return MiniBatch(self.experience.select(rows), self.loss_denominators, self.source_rows[rows])

    def micro_batches(self, *, size: int | None = None, max_tokens: int | None = None,
                      packed: bool = False) -> list[MicroBatch]:
        """Rows sorted by prompt + response length, so that each micro-batch pads to lengths like
        its own, then split by row count (``size``) or by a token budget (``max_tokens``: as many
        rows as fit with rows × the longest ≤ max_tokens, dynamic batching). ``packed``: the model
        reads each micro-batch's rows packed, so the budget counts real tokens (_packed_bins).
        Padding columns are trimmed; each micro-batch's ``rows`` say where its results go back
        (``in_row_order``)."""
        if (size is None) == (max_tokens is None):
            raise ValueError("pass exactly one of size or max_tokens")
        lengths = self.experience.sequence_lengths()
        if size is not None:
            if size <= 0:
                raise ValueError(f"size must be positive, got {size}")
            bins = torch.argsort(lengths, stable=True).split(size)
        else:
            bins = (_packed_bins if packed else _padded_bins)(lengths, max_tokens)
        return [MicroBatch(self.experience.select(rows).trim(), self.loss_denominators, rows)
                for rows in bins if len(rows)]

    def in_row_order(self, micro_batches: list[MicroBatch], results: list[Tensor]) -> Tensor:
        """(B, T, ...) from each micro-batch's (B_micro, ≤ T, ...) results: rows back in place, 0-padded."""
        width = self.experience.response_mask.shape[1]
        out = results[0].new_zeros((self.experience.batch_size, width, *results[0].shape[2:]))
        for micro, result in zip(micro_batches, results):
            out[micro.rows, : result.shape[1]] = result
        return out


def _sample_record(experience: Experience, row: int, tokenizer: Any, per_token: bool) -> dict[str, Any]:
    start, end = int(experience.prompt_lengths[row]), int(experience.attention_mask[row].sum())
    prompt, response = experience.sequences[row, :start].tolist(), experience.sequences[row, start:end].tolist()
    if tokenizer is not None:
        prompt, response = tokenizer.decode(prompt), tokenizer.decode(response)
    loss_tokens = experience.response_mask[row].bool()
    record: dict[str, Any] = {"row": row, "prompt": prompt, "response": response,
                              "num_loss_tokens": int(loss_tokens.sum())}
    if per_token:  # the trained ids, and which of them are loss tokens (multi-turn: not an observation's)
        record["prompt_ids"] = experience.sequences[row, :start].tolist()
        record["response_ids"] = experience.sequences[row, start:end].tolist()
        record["response_mask"] = experience.response_mask[row, : end - start].tolist()
    for name, dims, value in experience.tensor_fields():
        if dims == "B" and name != "prompt_lengths":
            record[name] = value[row].item()
        elif dims == "BT" and name != "response_mask":
            on_loss_tokens = value[row][loss_tokens].float()
            if per_token:
                record[name] = on_loss_tokens.tolist()
            else:
                record[f"{name}_mean"] = on_loss_tokens.mean().item() if len(on_loss_tokens) else 0.0
    for name, value in experience.info.items():
        if value.dim() == 2 and per_token:  # a (B, T) figure: on the response tokens, like the fields above
            record[f"info/{name}"] = value[row][loss_tokens].float().tolist()
        elif value.dim() == 2:
            record[f"info/{name}_mean"] = value[row][loss_tokens].float().mean().item() if loss_tokens.any() else 0.0
        else:
            record[f"info/{name}"] = value[row].tolist()
    return record


def experience_from_rollouts(prompt_ids: Sequence[Sequence[int]], response_ids: Sequence[Sequence[int]],
                             rollout_logprobs: Sequence[Sequence[float]] | None = None,
                             pad_id: int = 0, loss_masks: Sequence[Sequence[int]] | None = None,
                             routed_experts: Sequence[Any] | None = None,
                             moe_layers: Sequence[int] = ()) -> Experience:
    """An Experience with the token fields (and the engine's log-probs) of B rollouts, in the
    module's layout: ``sequences`` = prompt + response right-padded, ``response_mask`` over T: 1 on
    every response token, or ``loss_masks`` (multi-turn: 0 on an environment's observation tokens).
    ``routed_experts``: each row's (tokens, layers, K) expert ids from the engine, of which the
    ``moe_layers`` columns are kept; positions it does not cover (the last token, never fed back)
    hold -1, which replay leaves to the trainer's router (no token reads a last token's output)."""
    if len(prompt_ids) != len(response_ids):
        raise ValueError(f"{len(prompt_ids)} prompts but {len(response_ids)} responses")
    width = max(len(p) + len(r) for p, r in zip(prompt_ids, response_ids))
    resp_width = max(max((len(r) for r in response_ids), default=0), 1)
    batch = len(prompt_ids)
    sequences = torch.full((batch, width), pad_id, dtype=torch.long)
    attention_mask = torch.zeros(batch, width, dtype=torch.long)
    response_mask = torch.zeros(batch, resp_width)
    for row, (prompt, response) in enumerate(zip(prompt_ids, response_ids)):
        tokens = list(prompt) + list(response)
        sequences[row, : len(tokens)] = torch.tensor(tokens)
        attention_mask[row, : len(tokens)] = 1
        response_mask[row, : len(response)] = 1 if loss_masks is None else torch.tensor(loss_masks[row], dtype=torch.float)
    logprobs = None
    if rollout_logprobs is not None:
        logprobs = torch.zeros(batch, resp_width)
        for row, values in enumerate(rollout_logprobs):
            logprobs[row, : len(values)] = torch.tensor(values, dtype=torch.float32)
    routes = None
    if routed_experts is not None:
        k = routed_experts[0].shape[-1]
        routes = torch.full((batch, width, len(moe_layers), k), -1, dtype=torch.long)
        for row, values in enumerate(routed_experts):
            kept = torch.as_tensor(values)[:width, list(moe_layers)].long()  # (tokens, L, K)
            routes[row, : len(kept)] = kept
    return Experience(sequences=sequences, attention_mask=attention_mask,
                      prompt_lengths=torch.tensor([len(p) for p in prompt_ids]),
                      response_mask=response_mask, rollout_logprobs=logprobs, routed_experts=routes)
