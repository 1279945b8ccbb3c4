"""A Megatron model on this rank: HF weights in and out, pipelined forward, optimizer steps.

Knows nothing of RL: callers pass micro-batches and a per-micro-batch loss. Every rank of the
role's world calls the same methods with the same micro-batches (TP/PP ranks need the token
positions; the last stage computes the loss).

Loss convention: `calculate_per_token_loss` is on and the caller's loss for a micro-batch is
already divided by the global normaliser of its mini-batch (e.g. its real tokens across all
micro-batches and DP ranks). Megatron then neither divides by the number of micro-batches nor
averages over DP (it sums), so accumulated gradients are exactly those of the whole mini-batch.
"""
import contextlib
from dataclasses import replace
from functools import partial
from typing import Callable, Iterator, Mapping

import torch
import torch.distributed as dist
from megatron.core import parallel_state as ps
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.pipeline_parallel import get_forward_backward_func
from megatron.core.transformer.moe.moe_logging import get_moe_metrics_tracker

from orz.models import context_parallel
from orz.models.arch import ModelArch, ModelConfigError
from orz.models.builder import (
    build_actor,
    build_value_model,
    lm_head_weight,
    transformer_config,
    transformer_engine_layers,
    use_transformer_engine,
)
from orz.models.checkpoint import HFCheckpoint
from orz.models.convert import (
    HF_SCORE,
    OUTPUT,
    VALUE_HEAD,
    Layout,
    hf_shape,
    hf_to_megatron,
    param_rules,
    to_hf,
    to_megatron,
)
from orz.models.inputs import ModelInputs
from orz.models.lora import ADAPTER_NAMES, LoraColumnParallelLinear, adapter_layers
from orz.models.peft_format import peft_name
from orz.models.routing import MoeRoutes
from orz.models.spec import ModelSpec, Sizes
from orz.timeline.record import RECORDER

_PADDING = object()  # the result of a micro-batch that only pads (see MegatronModel._even_shapes)
# A per-micro-batch loss: (model output of the last stage, its inputs) -> (loss, metrics)
LossFn = Callable[[torch.Tensor, ModelInputs], tuple[torch.Tensor, dict]]


def _dense_source() -> bool:
    """Whether this rank gives its replica's dense weights: DP and CP replicas hold the same ones."""
    return ps.get_data_parallel_rank() == 0 and ps.get_context_parallel_rank() == 0


def rank_layout(arch: ModelArch, value_head: bool, padded_vocab: int, te: bool) -> Layout:
    return Layout(
        tp=ps.get_tensor_model_parallel_world_size(),
        pp=ps.get_pipeline_model_parallel_world_size(),
        tp_rank=ps.get_tensor_model_parallel_rank(),
        pp_rank=ps.get_pipeline_model_parallel_rank(),
        padded_vocab=padded_vocab,
        te=te,
        value_head=value_head,
        ep=ps.get_expert_model_parallel_world_size(),
        etp=ps.get_expert_tensor_parallel_world_size(),
        ep_rank=ps.get_expert_model_parallel_rank(),
        etp_rank=ps.get_expert_tensor_parallel_rank(),
    )


class MegatronModel:
    """One rank's stage of a model (an LM head, or a value head), wrapped in Megatron DDP, with its optimizer."""

    def __init__(self, arch: ModelArch, spec: ModelSpec = ModelSpec()):
        """Built as `spec` says, in the parallel groups set up at `spec.sizes` (init_model_parallel).
        With spec.routing_replay the MoE routers take the routes of `ModelInputs.routes` when given,
        and `chosen_routes` holds what they chose (or would have) in the last `run` (orz/models/routing.py)."""
        # The groups' sizes (the world decides DP), what checkpoints record.
        self.sizes = world = Sizes(
            tp=ps.get_tensor_model_parallel_world_size(), pp=ps.get_pipeline_model_parallel_world_size(),
            cp=ps.get_context_parallel_world_size(), dp=ps.get_data_parallel_world_size(),
            ep=ps.get_expert_model_parallel_world_size(), etp=ps.get_expert_tensor_parallel_world_size())
        if replace(world, dp=spec.sizes.dp) != spec.sizes:
            raise ValueError(f"the model spec's sizes {spec.sizes.label()} are not the parallel groups' {world.label()}")
        tp, pp, cp = world.tp, world.pp, world.cp
        if cp > 1 and not use_transformer_engine():
            raise ModelConfigError(f"context parallelism (CP {cp}) runs in Transformer Engine's attention (GPU only)")
        self.arch, self.spec = arch, spec
        self.config = transformer_config(arch, spec)
        self.config.calculate_per_token_loss = True
        # Micro-batches differ in rows and width (token budgets, the last row split): with PP the
        # stages exchange each activation's shape before sending it (cheap: 3 integers).
        self.config.variable_seq_lengths = pp > 1
        if spec.value_head:
            module = build_value_model(arch, self.config, spec.vocab_divisible_by)
        else:
            module = build_actor(arch, self.config, spec.vocab_divisible_by, spec.lora)
        self.padded_vocab = arch.padded_vocab_size(tp, spec.vocab_divisible_by)
        self.layout = rank_layout(arch, spec.value_head, self.padded_vocab, transformer_engine_layers(spec.lora))
        self.module = module
        self.routes = MoeRoutes(module, arch) if spec.routing_replay else None
        self.chosen_routes: list[torch.Tensor] = []  # (B, S, L, K) per real micro-batch of the last run
        self.lane = ""  # the timeline lane its passes are recorded in (orz/timeline); "": none
        self.optimizer = None
        if (optim := spec.optim) is not None:
            ddp_config = DistributedDataParallelConfig(
                grad_reduce_in_fp32=True,
                overlap_grad_reduce=False,
                use_distributed_optimizer=optim.use_distributed_optimizer,
            )
            self.model = DistributedDataParallel(self.config, ddp_config, module)
            self.config.no_sync_func = self.model.no_sync
            self.config.finalize_model_grads_func = _finalize_without_token_scaling
            self.optimizer = get_megatron_optimizer(
                OptimizerConfig(
                    optimizer="adam",
                    lr=optim.lr,
                    min_lr=optim.min_lr,
                    weight_decay=optim.weight_decay,
                    adam_beta1=optim.adam_beta1,
                    adam_beta2=optim.adam_beta2,
                    adam_eps=optim.adam_eps,
                    clip_grad=optim.clip_grad,
                    bf16=self.config.bf16,
                    params_dtype=self.config.params_dtype,
                    use_distributed_optimizer=optim.use_distributed_optimizer,
                ),
                [self.model],
            )
        else:
            self.model = module

    # ---- weights -------------------------------------------------------------------------
    def local_state(self) -> dict[str, torch.Tensor]:
        """This rank's parameters by Megatron name (no TE `_extra_state`)."""
        return {k: v for k, v in self.module.state_dict().items() if not k.endswith("_extra_state")}

    def load_hf(self, ckpt: HFCheckpoint) -> None:
        """Copies this rank's shard of an HF checkpoint into the model. A value head takes a
        sequence-classification checkpoint's scalar `score` head (a reward model; OpenRLHF also
        starts value models from one), and keeps its zero initialisation otherwise."""
        own = self.local_state()
        rules = param_rules(self.arch, self.layout)
        missing = {r.megatron for r in rules} - own.keys()
        if missing:
            raise ModelConfigError(f"{ckpt.dir}: model has no parameters {sorted(missing)[:3]}")
        with torch.no_grad():
            for name, tensor in hf_to_megatron(ckpt.get, self.arch, self.layout):  # one at a time: never a 2nd copy
                if own[name].shape != tensor.shape:
                    raise ModelConfigError(
                        f"{ckpt.dir}: {name} has shape {tuple(tensor.shape)} for this rank, "
                        f"model expects {tuple(own[name].shape)}"
                    )
                own[name].copy_(tensor)
            if self.layout.value_head and self.layout.last_stage and HF_SCORE in ckpt.keys():
                score = ckpt.get(HF_SCORE)
                if tuple(score.shape) != (1, self.arch.hidden_size):
                    raise ModelConfigError(f"{ckpt.dir}: {HF_SCORE} has shape {tuple(score.shape)}; a reward "
                                           f"model's head must be scalar: (1, {self.arch.hidden_size}), num_labels=1")
                own[VALUE_HEAD + ".weight"].copy_(score)
                own[VALUE_HEAD + ".bias"].zero_()  # HF's score head has no bias
        self.refresh_masters()

    def load_adapter(self, peft: Mapping[str, torch.Tensor]) -> None:
        """Sets this rank's adapters from PEFT-named tensors (those `adapter_tensors` yields): a fused
        layer's A from its first HF module's (all must be equal: one A is shared), B cut as the weight is."""
        layers = dict(adapter_layers(self.module))
        with torch.no_grad():
            for rule in param_rules(self.arch, self.layout):
                layer = layers.get(rule.megatron.removesuffix(".weight"))
                if layer is None or not rule.megatron.endswith(".weight"):
                    continue
                a, b = ([peft[peft_name(hf, m)] for hf in rule.hf] for m in ADAPTER_NAMES)
                if isinstance(layer, LoraColumnParallelLinear):
                    if any(not torch.equal(other, a[0]) for other in a[1:]):
                        raise ModelConfigError(f"{rule.hf}: one Megatron layer holds these HF modules, whose "
                                               "adapters must share one lora_A")
                    layer.lora_A.copy_(a[0])
                    layer.lora_B.copy_(to_megatron(rule, b, self.arch, self.layout))
                else:
                    layer.lora_A.copy_(to_megatron(rule, a, self.arch, self.layout))
                    layer.lora_B.copy_(b[0])
        self.refresh_masters()

    def refresh_masters(self) -> None:
        """A bf16 model's optimizer keeps fp32 master copies, made when it was built, from the
        random initialisation: weights loaded since must become the masters too, or the first
        step would write the random init (plus the update) back into the model."""
        if self.optimizer is not None:
            self.optimizer.reload_model_params()

    def hf_tensors(self, merged: bool = False) -> Iterator[tuple[str, torch.Tensor]]:
        """All HF tensors of the model, gathered over TP, EP, ETP and PP, yielded on the role's
        first rank. `merged`: each adapted layer's weight with its LoRA adapter merged in,
        W + (alpha/r)·B·A, summed in fp32 and cast once to W's dtype (without it: the base's).

        A collective: every rank of the role must exhaust the generator (the others yield
        nothing). Streams parameter by parameter, so the full model is never held twice. DP
        replicas hold the same dense weights and sit out their gathers; the experts are spread
        over ranks of several DP replicas (EP is carved out of TP × DP), so every rank of a stage
        joins their gathers.
        """
        tp_group = ps.get_tensor_model_parallel_group()
        dense_source = _dense_source()
        own = self.local_state()
        for name, layer in adapter_layers(self.module) if merged else ():
            weight = own[f"{name}.weight"]  # this rank's shard: B's rows (column) or A's columns (row) match it
            delta = layer.lora_scaling * (layer.lora_B.detach().float() @ layer.lora_A.detach().float())
            own[f"{name}.weight"] = (weight.float() + delta).to(weight.dtype)
        for stage in range(self.layout.pp):
            stage_layout = replace(self.layout, tp_rank=0, pp_rank=stage, ep_rank=0, etp_rank=0)
            experts_of = [{r.megatron: r for r in param_rules(self.arch, replace(stage_layout, ep_rank=e)) if r.expert}
                          for e in range(self.layout.ep)]
            for rule in param_rules(self.arch, stage_layout):
                if rule.megatron == OUTPUT and self.arch.tie_word_embeddings:
                    continue  # the last stage's copy of the tied embedding
                here = self.layout.pp_rank == stage
                if rule.expert:
                    shards = self._gather(own[rule.megatron], ps.get_expert_tensor_and_model_parallel_group()) if here else None
                    etp = self.layout.etp
                    for e, experts in enumerate(experts_of):  # EP rank e's shards: group ranks e·etp + etp_rank
                        ep_rule = experts[rule.megatron]
                        hf = to_hf(ep_rule, shards[e * etp:(e + 1) * etp], self.arch) if here else None
                        yield from self._hf_tensors_to_first_rank(ep_rule.hf, hf, stage, dense_source)
                elif dense_source:
                    hf = to_hf(rule, self._gather(own[rule.megatron], tp_group), self.arch) if here else None
                    yield from self._hf_tensors_to_first_rank(rule.hf, hf, stage, dense_source)

    def adapter_tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        """The LoRA adapters under PEFT's names (`base_model.model.<HF module>.lora_A.weight`, (r, in);
        `lora_B`, (out, r)), gathered over TP and PP, yielded on the role's first rank: a collective,
        as `hf_tensors`. A fused layer's one A is every HF module's A, its B cut into theirs."""
        tp_group = ps.get_tensor_model_parallel_group()
        source = _dense_source()
        layers = dict(adapter_layers(self.module))
        r = self.spec.lora.rank
        for stage in range(self.layout.pp):
            for rule in param_rules(self.arch, replace(self.layout, tp_rank=0, pp_rank=stage)):
                module_name = rule.megatron.removesuffix(".weight")
                if not (source and rule.megatron.endswith(".weight")
                        and module_name.rsplit(".", 1)[-1] in self.spec.lora.targets):
                    continue
                tensors = None
                if self.layout.pp_rank == stage:
                    layer = layers[module_name]
                    a, b = (self._gather(m.detach(), tp_group) for m in (layer.lora_A, layer.lora_B))
                    if isinstance(layer, LoraColumnParallelLinear):  # A replicated, B split like the weight
                        pairs = zip([a[0]] * len(rule.hf), to_hf(rule, b, self.arch))
                    else:  # A split like the weight (by input), B replicated
                        pairs = zip(to_hf(rule, a, self.arch), [b[0]])
                    tensors = [t for pair in pairs for t in pair]
                names = [peft_name(hf, m) for hf in rule.hf for m in ADAPTER_NAMES]
                shapes = [shape for out, into in (hf_shape(hf, self.arch) for hf in rule.hf)
                          for shape in ((r, into), (out, r))]
                yield from self._to_first_rank(names, shapes, tensors, stage, source)

    @staticmethod
    def _gather(local: torch.Tensor, group) -> list[torch.Tensor]:
        """Every member's `local`, in group rank order."""
        local = local.contiguous()
        if dist.get_world_size(group) == 1:
            return [local]
        shards = [torch.empty_like(local) for _ in range(dist.get_world_size(group))]
        dist.all_gather(shards, local, group=group)
        return shards

    def _hf_tensors_to_first_rank(self, names: tuple[str, ...], hf: list[torch.Tensor] | None, stage: int,
                                  source: bool) -> Iterator[tuple[str, torch.Tensor]]:
        shapes = [hf_shape(name, self.arch) for name in names]
        return self._to_first_rank(names, shapes, hf, stage, source)

    def _to_first_rank(self, names: list[str], shapes: list[tuple[int, ...]], tensors: list[torch.Tensor] | None,
                       stage: int, source: bool) -> Iterator[tuple[str, torch.Tensor]]:
        """Moves `stage`'s tensors `names` (of `shapes`, held by the stage's first rank) to the
        role's first rank (stage 0), and yields them there by name."""
        first = source and self.layout.tp_rank == 0
        if stage > 0 and first:
            pp_group = ps.get_pipeline_model_parallel_group()
            if self.layout.pp_rank == stage:
                for tensor in tensors:
                    dist.send(tensor.contiguous(), group_dst=0, group=pp_group)
            elif self.layout.pp_rank == 0:
                tensors = [torch.empty(shape, dtype=self.config.params_dtype) for shape in shapes]
                for tensor in tensors:
                    dist.recv(tensor, group_src=stage, group=pp_group)
        if first and self.layout.pp_rank == 0:
            yield from zip(names, tensors)

    # ---- GPU memory between phases (untested here: no GPU) ----------------------------------
    def offload(self) -> None:
        """Frees the gradient buffers and moves the optimizer states to CPU, so that colocated
        roles and vLLM fit beside an idle trainer (Megatron's own offload calls). No-op on CPU."""
        if torch.cuda.is_available() and self.optimizer is not None:
            self.model.offload_grad_buffers()
            self.optimizer.offload_to_cpu()

    def onload(self) -> None:
        if torch.cuda.is_available() and self.optimizer is not None:
            self.optimizer.restore_from_cpu()
            self.model.restore_grad_buffers()

    # ---- compute -------------------------------------------------------------------------
    def run(
        self,
        microbatches: list[ModelInputs],
        loss_fn: LossFn | None = None,
        forward_only: bool = True,
        collect: Callable[[torch.Tensor, ModelInputs], object] | None = None,
    ) -> list:
        """Runs micro-batches through the pipeline, each at its own (B, S). With `collect`, returns
        collect(output, micro-batch) per micro-batch on the last stage ([] elsewhere); with
        `loss_fn`, returns its metrics dicts (last stage) and, unless forward_only, accumulates
        gradients.

        With a `lane`, each micro-batch's passes are timeline spans:
        "forward" (the model), "loss" (what the last stage computes from its output: log-probs, the
        loss) and, training, "backward": from there to the next micro-batch's forward or the end
        (with PP it holds the waits for the other stages too).
        """
        pairs = self._even_shapes(microbatches) if self.layout.ep > 1 else [(mb, mb) for mb in microbatches]

        self.chosen_routes = []
        cp = ps.get_context_parallel_world_size()
        backward_from = None  # when the last micro-batch's forward (and loss) ended, training

        def timed(forward_step):
            """forward_step, its output's function and the backward after them as spans of `lane`."""
            def step(data_iterator, model):
                nonlocal backward_from
                start = RECORDER.now()
                if backward_from is not None:
                    RECORDER.add(self.lane, "backward", backward_from, start)
                output, then = forward_step(data_iterator, model)
                RECORDER.add(self.lane, "forward", start, RECORDER.now())
                backward_from = None if forward_only else RECORDER.now()

                def after(*args, **kwargs):
                    nonlocal backward_from
                    begun = RECORDER.now()
                    try:
                        return then(*args, **kwargs)
                    finally:
                        RECORDER.add(self.lane, "loss", begun, RECORDER.now())
                        backward_from = None if forward_only else RECORDER.now()
                return output, after
            return step

        def forward_step(data_iterator, model):
            padded, batch = next(data_iterator)
            if self.routes is not None and padded.routes is not None:
                self.routes.replay(padded.routes)
            elif self.routes is not None:
                self.routes.record()
            ids, positions, padding = (context_parallel.split(padded) if cp > 1 else
                                       (padded.input_ids, padded.position_ids, padded.padding))
            if batch is None:  # another replica's extra micro-batch: run for the experts' collectives only,
                with _load_balancing_off(self.config):  # and out of the load-balancing loss (all padding)
                    output = model(ids, positions, None)
                return output, partial(_padding_only, collect is not None)
            if padded.lengths is None:  # padded rows; with CP this rank's share of each (GPU only)
                output = model(ids, positions, None, padding_mask=padding)
                rows_of = context_parallel.gather if cp > 1 else lambda out: out
            else:  # packed (THD): one sequence of every row's real tokens
                output = model(padded.packed(padded.input_ids), padded.packed(padded.position_ids), None,
                               packed_seq_params=_packed_seq_params(padded),
                               padding_mask=None if padded.padding is None else padded.packed(padded.padding))
                rows_of = padded.unpack
            b, s = batch.input_ids.shape  # the last stage's (B, S, H) (or (B, S, 1)) cut back to this micro-batch
            if self.routes is not None:
                self.chosen_routes.append(self.routes.chosen(tuple(padded.input_ids.shape), b, s))
            if collect is not None:
                return output, lambda out, non_loss_data=False: collect(rows_of(out)[:b, :s], batch)
            return output, lambda out: _loss_with_count(loss_fn, batch, rows_of(out)[:b, :s], 1 / cp)

        seq_length = pairs[0][0].input_ids.shape[1]  # ignored with PP: shapes travel (variable_seq_lengths)
        out = get_forward_backward_func()(
            forward_step_func=timed(forward_step) if self.lane else forward_step,
            data_iterator=iter(pairs),
            model=[self.model],
            num_microbatches=len(pairs),
            seq_length=seq_length,
            micro_batch_size=pairs[0][0].input_ids.shape[0],
            forward_only=forward_only,
            collect_non_loss_data=collect is not None,
        )
        if backward_from is not None:
            RECORDER.add(self.lane, "backward", backward_from, RECORDER.now())
        return [x for x in out if x is not _PADDING]

    @staticmethod
    def _even_shapes(microbatches: list[ModelInputs]) -> list[tuple[ModelInputs, ModelInputs | None]]:
        """(padded, own) per micro-batch, padded to the largest (B, S) that any DP replica has at that
        index, and as many as the replica with the most (own None beyond this one's). The experts'
        all-gather dispatcher exchanges every micro-batch's tokens with ranks of other replicas at
        equal sizes. Extra rows and right-padded columns change no real token's output (causal
        attention; routing without capacity limits), and are marked padding, which the load-balancing
        loss leaves out: it is the same at any EP. Packed micro-batches are evened in tokens: (1, T)
        each, T the most any replica packs at that index, a row of padding added to make it up."""
        group = ps.get_data_parallel_group()
        count = torch.tensor([len(microbatches)])
        dist.all_reduce(count, op=dist.ReduceOp.MAX, group=group)
        shapes = torch.zeros(int(count), 2, dtype=torch.long)
        for i, mb in enumerate(microbatches):
            shapes[i] = torch.tensor(mb.input_ids.shape if mb.lengths is None else (1, int(mb.lengths.sum())))
        dist.all_reduce(shapes, op=dist.ReduceOp.MAX, group=group)
        pairs = []
        for i, (rows, width) in enumerate(shapes.tolist()):
            own = microbatches[i] if i < len(microbatches) else None
            if own is not None and own.lengths is not None:
                pairs.append((_packed_to(own, width), own))
                continue
            ids = torch.zeros(rows, width, dtype=torch.long)
            routes = padding = None
            if own is not None and own.routes is not None:
                routes = own.routes.new_full((rows, width, *own.routes.shape[2:]), -1)
                routes[: own.routes.shape[0], : own.routes.shape[1]] = own.routes
            if own is not None:
                b, s = own.input_ids.shape
                ids[:b, :s] = own.input_ids
                padding = torch.ones(rows, width, dtype=torch.bool)
                padding[:b, :s] = own.padding if own.padding is not None else False
            pairs.append((ModelInputs(ids, routes=routes, padding=padding), own))
        return pairs

    def lm_head_weight(self) -> torch.Tensor:
        """(V/TP, H) the LM head's weight on the last stage (the actor returns hidden states)."""
        return lm_head_weight(self.module)

    def next_token_logprobs(self, hidden: torch.Tensor, input_ids: torch.Tensor, temperature: float = 1.0,
                            chunk_tokens: int = 0) -> torch.Tensor:
        """(B, S−1) log p(input_ids[:, s+1]) at every position s, from the last stage's (B, S, H)
        hidden states (orz/models/logprobs.py: in chunks, differentiable)."""
        from orz.models.logprobs import token_logprobs

        b, s, h = hidden.shape
        logprobs, _ = token_logprobs(hidden[:, :-1].reshape(-1, h), self.lm_head_weight(), input_ids[:, 1:].reshape(-1),
                                     self.arch.vocab_size, ps.get_tensor_model_parallel_group(), temperature,
                                     chunk_tokens, with_entropy=False)
        return logprobs.view(b, s - 1)

    def full_logits(self, input_ids: torch.Tensor) -> torch.Tensor | None:
        """Logits over the whole (unpadded) vocabulary, (B, S, V), gathered over TP, on the last
        stage's TP rank 0; None on every other rank. For checks, not training (V on one rank)."""
        def gather(hidden, batch):
            output = hidden @ self.lm_head_weight().t()  # (B, S, V/TP), as the LM head would compute it
            shards = [torch.empty_like(output) for _ in range(self.layout.tp)]
            dist.all_gather(shards, output.contiguous(), group=ps.get_tensor_model_parallel_group())
            return torch.cat(shards, dim=-1)[..., : self.arch.vocab_size]

        self.model.eval()
        out = self.run([ModelInputs(input_ids)], collect=gather)
        return out[0] if out and self.layout.tp_rank == 0 else None

    def train_step(self, microbatches: list[ModelInputs], loss_fn: LossFn) -> dict:
        """One optimizer step over a mini-batch given as micro-batches (gradient accumulation).
        With a MoE's load-balancing loss on, also returns `moe_aux_loss` (see _start_aux_loss)."""
        self.model.zero_grad_buffer()
        self.optimizer.zero_grad()
        self.model.train()
        aux_on = self.arch.moe is not None and self.config.moe_aux_loss_coeff > 0
        if aux_on:
            self._start_aux_loss(microbatches)
        metrics = self.run(microbatches, loss_fn, forward_only=False)
        with RECORDER.span(self.lane, "optimizer step") if self.lane else contextlib.nullcontext():
            ok, grad_norm, _ = self.optimizer.step()
        out = {"metrics": metrics, "grad_norm": float(grad_norm or 0.0), "update_ok": bool(ok)}
        if aux_on:
            out["moe_aux_loss"] = self._aux_loss(len(microbatches))
        return out

    def _start_aux_loss(self, microbatches: list[ModelInputs]) -> None:
        """The router adds c·n_m·aux_m to micro-batch m's objective (c: moe_aux_loss_coef, n_m its
        tokens, padding left out, aux_m = (E/k)·Σ_e f_e·P̄_e its Switch loss, f_e the share of top-k picks:
        transformers' value / k); scaled by 1/N, N = Σ n_m over the mini-batch on every DP rank, the
        objective gains c·Σ_m n_m·aux_m / N per sparse layer, a token-weighted mean: Megatron's own
        per-token scaling, whose division by N our finalisation skips."""
        tokens = torch.tensor(float(sum(mb.input_ids.numel() if mb.padding is None else int((~mb.padding).sum())
                                        for mb in microbatches)))
        dist.all_reduce(tokens, group=ps.get_data_parallel_group())
        scale = 1.0 / tokens.item()
        self.config.moe_grad_scale_func = lambda: scale
        get_moe_metrics_tracker().clear()

    def _aux_loss(self, num_microbatches: int) -> float:
        """The load-balancing loss (without its coefficient), averaged over sparse layers,
        micro-batches and DP replicas."""
        tracker = get_moe_metrics_tracker()
        entry = tracker.metrics.get("load_balancing_loss")  # none on a stage without sparse layers
        values = entry.values.clone() if entry else torch.zeros(self.arch.num_layers)  # (L,) summed over micro-batches
        tracker.clear()
        dist.all_reduce(values, group=ps.get_pipeline_model_parallel_group())  # each stage holds its layers
        mean = values.sum() / (len(self.arch.moe.layers) * num_microbatches)
        dist.all_reduce(mean, group=ps.get_data_parallel_group())
        return mean.item() / ps.get_data_parallel_world_size()


@contextlib.contextmanager
def _load_balancing_off(config):
    """No load-balancing loss in the forwards inside (Megatron's routers read the coefficient there)."""
    coefficient, config.moe_aux_loss_coeff = config.moe_aux_loss_coeff, 0.0
    try:
        yield
    finally:
        config.moe_aux_loss_coeff = coefficient


def _packed_to(inputs: ModelInputs, tokens: int) -> ModelInputs:
    """Packed `inputs` made up to `tokens` real and padding tokens: a last row of padding (zeros,
    marked padding), as long as the difference, when there is one."""
    short = tokens - int(inputs.lengths.sum())
    b, s = inputs.input_ids.shape
    rows, width = b + (short > 0), max(s, short)
    ids = inputs.input_ids.new_zeros(rows, width)
    ids[:b, :s] = inputs.input_ids
    padding = torch.ones(rows, width, dtype=torch.bool)
    padding[:b, :s] = inputs.padding if inputs.padding is not None else False
    lengths = torch.cat([inputs.lengths, inputs.lengths.new_tensor([short])]) if short > 0 else inputs.lengths
    return ModelInputs(ids, padding=padding, lengths=lengths)


def _packed_seq_params(inputs: ModelInputs) -> PackedSeqParams:
    """Megatron's description of packed rows: each attends, and counts its RoPE positions, on its own."""
    cu_seqlens, longest = inputs.cu_seqlens, int(inputs.lengths.max())
    return PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu_seqlens, cu_seqlens_kv=cu_seqlens,
                           max_seqlen_q=longest, max_seqlen_kv=longest)


def _padding_only(collecting: bool, output: torch.Tensor, non_loss_data: bool = False):
    """A padding micro-batch's result: nothing to collect, or a zero loss whose backward still
    joins the experts' collectives."""
    return _PADDING if collecting else (0.0 * output.sum(), torch.tensor(1, dtype=torch.int), _PADDING)


def _loss_with_count(loss_fn: LossFn, batch: ModelInputs, output: torch.Tensor, share: float):
    """The loss this rank backpropagates: `share` of the micro-batch's (1/CP: every CP rank computes
    the whole of it from the gathered output)."""
    loss, metrics = loss_fn(output, batch)
    # Returning a count makes Megatron skip its division by the number of micro-batches; the
    # count itself is ignored (see _finalize_without_token_scaling).
    return loss * share, torch.tensor(1, dtype=torch.int), metrics


def _finalize_without_token_scaling(model, num_tokens=None, *args, **kwargs):
    """Megatron's gradient finalisation (DP and embedding all-reduces) without its division by
    the token count: our losses are already normalised by their mini-batch."""
    finalize_model_grads(model, None, *args, **kwargs)
    _sum_gated_delta_net_norm_grads(model)


def _sum_gated_delta_net_norm_grads(model) -> None:
    """A Gated DeltaNet's output norm is one weight shared by all its value heads, which TP splits:
    each rank's gradient covers its own heads only. Megatron sums the like q/k norms' gradients over
    TP (by name), but not this one: summed here (without, TP 2's gradient norm is 5e-4 off TP 1's)."""
    if ps.get_tensor_model_parallel_world_size() == 1:
        return
    grads = [param.main_grad for chunk in model for name, param in chunk.named_parameters()
             if name.endswith("self_attention.out_norm.weight")]
    for grad in grads:
        dist.all_reduce(grad, group=ps.get_tensor_model_parallel_group())
