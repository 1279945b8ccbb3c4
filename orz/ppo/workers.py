"""Ray worker groups around Megatron models: the actor, the critic, the reference and the reward model.

Each role is a group of tp·pp·dp Ray actors (MegatronWorker) that together form one
torch.distributed world with Megatron's TP/PP/DP groups (gloo on CPU, NCCL on GPU). The trainer
talks to a role through its WorkerGroup: every worker receives the same Experience (one object in
Ray's store), takes its data-parallel share, and the last pipeline stage's TP-rank-0 worker of
each DP replica reports results, which the group puts back in row order.

Methods ending in `_async` return at once: a Pending* that gathers the result in row order, or,
for save_async and load_async, the workers' Ray refs; the others wait for their result.
"""
from __future__ import annotations

import contextlib
import io
import os
import sys
import warnings
from dataclasses import asdict, dataclass, replace

import ray
import torch
import torch.nn.functional as F

from orz.bundles import Bundles
from orz.config import AlgorithmConfig, RoleConfig
from orz.faults import FaultSite
from orz.models.inputs import ModelInputs
from orz.ppo.core_algos import actor_loss, routing_agreement_counts, value_loss
from orz.ppo.distillation import NO_TEACHER, topk_forward_kl
from orz.ppo.experience import Experience, MicroBatch, MiniBatch
from orz.run.role_spec import RoleSpec
from orz.timeline.record import RECORDER


def load_storage(data: bytes):
    """The loader a worker's pickled tensors name (`setup` installs it): torch.load(weights_only=True),
    as megatron.core's own, which `import megatron.core` puts in torch.storage and would make every
    process that receives a worker's tensor (the trainer) import megatron.core, ~5 s of CPU."""
    return torch.load(io.BytesIO(data), weights_only=True)


def reset_peak_memory() -> None:
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    else:
        with open("/proc/self/clear_refs", "w") as refs:
            refs.write("5")  # VmHWM := the resident set now


def peak_memory_gib() -> float:
    if torch.cuda.is_available():
        return torch.cuda.max_memory_allocated() / 2**30
    with open("/proc/self/status") as status:
        return int(next(line for line in status if line.startswith("VmHWM")).split()[1]) / 2**20


def combine_metrics(parts: list[dict]) -> dict[str, float]:
    """Merges per-micro-batch (or per-replica) metrics: losses, which are already normalised by
    the whole mini-batch, add up; `_min`/`_max` extremes stay extremes; everything else is a mean
    weighted by `tokens`. So the result does not depend on how the batch was split."""
    parts = [p for p in parts if p]
    total = sum(float(p["tokens"]) for p in parts) or 1.0
    out = {"tokens": total}
    for key in {k for p in parts for k in p if k != "tokens"}:
        values = [(float(p[key]), float(p["tokens"])) for p in parts if key in p]
        if key.endswith("loss"):
            out[key] = sum(v for v, _ in values)
        elif key.endswith(("_min", "_max")):
            out[key] = (min if key.endswith("_min") else max)(v for v, _ in values)
        else:
            out[key] = sum(v * w for v, w in values) / max(sum(w for _, w in values), 1e-9)
    return out


def _shift_right(per_position: torch.Tensor) -> torch.Tensor:
    """(B, S-1) results computed at positions 0..S-2 for tokens 1..S-1 -> (B, S), the value at s
    belonging to token s (Experience.gather_response's convention)."""
    return F.pad(per_position, (1, 0))


def _token_values(values: torch.Tensor, exp: Experience) -> torch.Tensor:
    """The value head's (B, S, 1) output -> (B, T) V(sₜ) at the position before each response token."""
    return exp.gather_response(_shift_right(values[:, :-1, 0].float())[:, : exp.sequences.shape[1]])


def _last_token_values(values: torch.Tensor, exp: Experience) -> torch.Tensor:
    """The head's (B, S, 1) output -> (B, T) holding its value at each sequence's last token (a
    reward model's score, as HF's sequence classifiers read it), on that token; 0 elsewhere."""
    per_token = exp.gather_response(values[:, : exp.sequences.shape[1], 0].float())
    last = (exp.response_mask.long().sum(1) - 1).clamp(min=0)
    rows = torch.arange(per_token.shape[0])
    out = torch.zeros_like(per_token)
    out[rows, last] = per_token[rows, last]
    return out


class MegatronWorker(FaultSite):
    """One rank of a role. Created by WorkerGroup; `setup` joins the role's world."""

    def __init__(self, spec: RoleSpec, rank: int, world_size: int):
        from orz.logs import to_log_file

        self.spec, self.rank, self.world_size = spec, rank, world_size
        to_log_file(spec.log_dir, f"{spec.name}-{rank}")
        # Megatron announces at import that TE/Apex are absent (expected on CPU), once per worker.
        warnings.filterwarnings("ignore", message=r".*(Transformer Engine|Apex) .*not installed.*")
        # Megatron's timers import wandb where it is installed, 0.6 s of CPU per worker; orz logs to
        # W&B from the trainer's process only, so a worker's `import wandb` finds nothing.
        sys.modules.setdefault("wandb", None)
        self._threads = spec.cfg.threads
        torch.set_num_threads(self._threads)
        self._world_store = None  # rank 0's, once host_world has run
        self._peaks: dict[str, float] = {}  # phase -> peak GiB since peak_memory_gib last ran
        self._saves = None  # asynchronous saves in flight (dist_checkpoint.PendingSaves; GPU)

    def __repr__(self) -> str:  # Ray names the actor by it in the tracebacks it sends back; = its log's name
        return f"{self.spec.name}-{self.rank}"

    @ray.method(concurrency_group="control")
    def use_threads(self, threads: int) -> None:
        """Torch threads from the next micro-batch on (runs beside a pass in progress)."""
        self._threads = threads

    def _take_threads(self) -> None:
        if torch.get_num_threads() != self._threads:
            torch.set_num_threads(self._threads)

    def host_world(self) -> tuple[str, int]:
        """Rank 0: starts the role world's rendezvous; where the others join it."""
        from orz.models.parallel import host_store

        ip = ray.util.get_node_ip_address()
        self._world_store = host_store(ip)
        return ip, self._world_store.port

    def setup(self, world: tuple[str, int]) -> None:
        """Joins the role's world at rank 0's (address, port) and loads the model."""
        master_addr, master_port = world
        # On GPU, Ray gives each worker its own device (CUDA_VISIBLE_DEVICES): local rank 0.
        os.environ.update(MASTER_ADDR=master_addr, MASTER_PORT=str(master_port), RANK=str(self.rank),
                          WORLD_SIZE=str(self.world_size), LOCAL_RANK="0")
        from megatron.core import parallel_state as ps

        torch.storage._load_from_bytes = load_storage

        from orz.models.checkpoint import HFCheckpoint
        from orz.models.megatron_model import MegatronModel
        from orz.models.parallel import init_model_parallel, join_store

        store = self._world_store or join_store(master_addr, master_port)
        init_model_parallel(self.spec.model.sizes, seed=self.spec.seed, store=store)
        self.ps = ps
        ckpt = HFCheckpoint(self.spec.model_path)
        self.hf_config = ckpt.config  # names the synced weights as the checkpoint does (a wrapper's)
        self.model = MegatronModel(ckpt.arch, self.spec.model)
        if ckpt.arch.moe is not None:  # in the worker's log: what Megatron built
            sizes = self.spec.model.sizes
            print(f"{self.spec.name} rank {self.rank}: experts over EP {sizes.ep} × ETP {sizes.etp}, token dispatcher "
                  f"{self.model.config.moe_token_dispatcher_type}", flush=True)
        self.model.load_hf(ckpt)
        self.model.lane = self._lane
        self.scheduler = None
        if self.spec.train:
            self.configure(self.spec.cfg)

    def configure(self, cfg: RoleConfig) -> None:
        """A stage's settings for this role: micro-batching, and LR, schedule and optimizer
        hyper-parameters from the next step on. The schedule keeps its step count and spans the
        whole run (a stage's lr is the schedule's peak from then on). Layouts cannot change."""
        from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

        old = self.spec.cfg
        layout = ("tp", "pp", "cp", "dp", "ep", "etp", "use_distributed_optimizer")
        if any(getattr(cfg, key) != getattr(old, key) for key in layout):
            raise ValueError(f"{self.spec.name}: a stage cannot change the parallel layout")
        self.spec = replace(self.spec, cfg=cfg)
        if not self.spec.train:
            return
        steps_done = self.scheduler.num_steps if self.scheduler is not None else 0
        total = max(self.spec.total_steps, cfg.warmup_steps + 1)
        for group in self.model.optimizer.param_groups:  # the groups' own max/min_lr win over the scheduler's
            group.update(betas=tuple(cfg.adam_betas), max_lr=cfg.lr, min_lr=cfg.min_lr)
        self.model.optimizer.config.clip_grad = cfg.clip_grad
        self.scheduler = OptimizerParamScheduler(
            self.model.optimizer, init_lr=0.0 if cfg.warmup_steps else cfg.lr, max_lr=cfg.lr,
            min_lr=cfg.min_lr, lr_warmup_steps=cfg.warmup_steps, lr_decay_steps=total,
            lr_decay_style=cfg.lr_decay, start_wd=cfg.weight_decay, end_wd=cfg.weight_decay,
            wd_incr_steps=total, wd_incr_style="constant",
        )
        self.scheduler.step(increment=steps_done)

    # ---- the timeline (orz/timeline) ---------------------------------------------------------
    @property
    def _lane(self) -> str:
        return f"{self.spec.name}/rank {self.rank}"

    def clock(self) -> float:
        """This process's timeline clock now (the trainer measures its offset: trace.offset_s)."""
        return RECORDER.now()

    def timeline_events(self) -> list[tuple]:
        """The spans recorded since the last call (trainer.timeline)."""
        return RECORDER.drain()

    def record_timeline(self, on: bool) -> None:
        RECORDER.on = on

    # ---- where this rank sits ----------------------------------------------------------------
    @property
    def _dp(self) -> tuple[int, int]:
        return self.ps.get_data_parallel_rank(), self.ps.get_data_parallel_world_size()

    @property
    def _reports(self) -> bool:
        """Last pipeline stage, TP and CP rank 0: the rank whose results the group keeps."""
        return (self.ps.is_pipeline_last_stage(ignore_virtual=True) and self.ps.get_tensor_model_parallel_rank() == 0
                and self.ps.get_context_parallel_rank() == 0)

    def _micro_batches(self, shard: MiniBatch) -> list:
        """This DP rank's share, by the role's token budget (of real tokens when packed) or row count."""
        cfg = self.spec.cfg
        if cfg.micro_batch_tokens > 0:
            return shard.micro_batches(max_tokens=cfg.micro_batch_tokens, packed=cfg.pack)
        return shard.micro_batches(size=cfg.micro_batch_size)

    def _inputs(self, micro_batches: list[MicroBatch]) -> list[ModelInputs]:
        """Megatron inputs, each micro-batch at its own width (PP exchanges shapes), with the routes
        to replay when the engine replays them (-1 on padding) and, for a MoE, where the padding is;
        with <role>.pack, its rows packed (their lengths)."""
        moe = self.model.arch.moe is not None
        return [ModelInputs(mb.experience.sequences, mb, self._routes(mb.experience),
                            ~mb.experience.attention_mask.bool() if moe else None,
                            mb.experience.sequence_lengths() if self.spec.cfg.pack else None)
                for mb in micro_batches]

    def _routes(self, exp: Experience) -> torch.Tensor | None:
        """(B, S, L, K) the recorded routes to replay, -1 on padding; None: the routers choose."""
        if self.model.routes is None or exp.routed_experts is None:
            return None
        return exp.routed_experts.masked_fill(~exp.attention_mask.bool()[:, :, None, None], -1)

    def _routing_agreement(self, micro_batches: list[MicroBatch]) -> float:
        """mismatch/routing_agreement (core_algos.routing_agreement_counts) of the last run's forwards:
        same / total over real tokens and MoE layers, each stage counting its own (a collective)."""
        counts = sum(routing_agreement_counts(mb.experience.routed_experts, chosen,  # this stage's layers, real tokens
                                              (chosen >= 0).all(-1) & mb.experience.attention_mask.bool()[:, :, None])
                     for mb, chosen in zip(micro_batches, self.model.chosen_routes))
        torch.distributed.all_reduce(counts, group=self.ps.get_pipeline_model_parallel_group())
        return float(counts[0] / counts[1].clamp_min(1))

    def _token_logprobs(self, hidden: torch.Tensor, batch: ModelInputs, temperature: float, with_entropy: bool,
                        teacher_topk: bool = False):
        """(B, T) log π and entropy of the response tokens in the loss, 0 elsewhere, from the last
        stage's (B, S, H) hidden states: at those positions only (no prompt and no environment
        token), in chunks of model.logprob_chunk_tokens (orz/models/logprobs.py). teacher_topk: also
        (B, T, J) log π of the teacher's top-k tokens at each position, from the same chunks."""
        from orz.models.logprobs import token_logprobs

        exp: Experience = batch.micro.experience
        rows, cols, at_hidden, tokens = self._response_positions(hidden, exp)
        if teacher_topk:
            tokens = torch.cat([tokens[:, None], exp.teacher_topk_ids[rows, cols]], dim=1)
        logprobs, entropy = token_logprobs(at_hidden, self.model.lm_head_weight(), tokens, self.model.arch.vocab_size,
                                           self.ps.get_tensor_model_parallel_group(), temperature,
                                           self.spec.model.logprob_chunk_tokens, with_entropy)
        topk = None
        if teacher_topk:
            logprobs, topk = logprobs[:, 0], logprobs[:, 1:]
        shape = exp.response_mask.shape
        return tuple(torch.zeros(*shape, *v.shape[1:]).index_put((rows, cols), v) if v is not None else None
                     for v in (logprobs, entropy, topk))

    def _response_positions(self, hidden: torch.Tensor, exp: Experience):
        """(rows, cols) of the loss tokens, the (N, H) hidden states one position earlier (which
        predict them) and their (N,) ids."""
        rows, cols = exp.response_mask.bool().nonzero(as_tuple=True)
        at = exp.response_positions()[rows, cols]  # (N,) where each response token sits
        return rows, cols, hidden[rows, at - 1], exp.sequences[rows, at]

    def _teacher_figures(self, hidden: torch.Tensor, batch: ModelInputs, temperature: float, k: int,
                         vocab_size: int) -> torch.Tensor:
        """(B, T, 1 + 2k): log π of each response token in the loss, then the k most likely tokens'
        log-probs and ids (in float32: exact below 2²⁴) at its position; π over the first vocab_size
        ids (the student's vocabulary: a teacher's extra rows are padding to it)."""
        from orz.models.logprobs import token_and_top_k_logprobs

        exp: Experience = batch.micro.experience
        rows, cols, at_hidden, tokens = self._response_positions(hidden, exp)
        weight, group, chunk = (self.model.lm_head_weight(), self.ps.get_tensor_model_parallel_group(),
                                self.spec.model.logprob_chunk_tokens)
        vocab = min(self.model.arch.vocab_size, vocab_size)
        logprobs, top, ids = token_and_top_k_logprobs(at_hidden, weight, tokens, k, vocab, group, temperature, chunk)
        figures = torch.cat([logprobs[:, None], top, ids.float()], dim=1)
        return torch.zeros(*exp.response_mask.shape, 1 + 2 * k).index_put((rows, cols), figures)

    # ---- forward passes ----------------------------------------------------------------------
    @contextlib.contextmanager
    def _phase_memory(self, phase: str):
        """The peak memory of this process while the phase runs, kept for peak_memory_gib: on GPU
        the allocator's peak, on CPU the peak resident set (VmHWM, reset through /proc/self/clear_refs)."""
        reset_peak_memory()
        try:
            yield
        finally:
            self._peaks[phase] = max(self._peaks.get(phase, 0.0), peak_memory_gib())

    def peak_memory_gib(self) -> dict[str, float]:
        """{phase: GiB} since the last call: "forward" (log-probs, values, scores), "update"."""
        peaks, self._peaks = self._peaks, {}
        return peaks

    def _no_grad(self, shard: MiniBatch, per_micro_batch, what: str) -> torch.Tensor | None:
        """(B_shard, T) per_micro_batch(output, batch) in row order on the last stage, else None;
        `what` names the pass on the timeline."""
        tokens = int(shard.experience.sequence_lengths().sum())
        with self._phase_memory("forward"), RECORDER.span(self._lane, what, tokens=tokens):
            return self._no_grad_passes(shard, per_micro_batch)

    def _no_grad_passes(self, shard: MiniBatch, per_micro_batch) -> torch.Tensor | None:
        micro = self._micro_batches(shard)
        self.model.model.eval()

        def collect(output, batch):
            self._take_threads()
            return per_micro_batch(output, batch)

        self._take_threads()
        with torch.no_grad():
            outputs = self.model.run(self._inputs(micro), collect=collect)
        return shard.in_row_order(micro, outputs) if outputs else None

    def _forward(self, experience: Experience, per_micro_batch, what: str) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(which rows of `experience` this DP rank had, their (B_shard, T) results) on reporting ranks."""
        shard = MiniBatch.of(experience).shard(*self._dp)
        rows = self._no_grad(shard, per_micro_batch, what)
        return (shard.source_rows, rows) if self._reports else None

    def logprobs(self, experience: Experience, temperature: float = 1.0, adapters: bool = True):
        """(dp_rank, (B_shard, T) log π of the response tokens) on reporting ranks, else None.
        adapters=False: a LoRA actor's base model (the reference of a LoRA run)."""
        from orz.models.lora import adapters_off

        with contextlib.nullcontext() if adapters else adapters_off(self.model.module):
            return self._forward(experience, lambda hidden, b: self._token_logprobs(hidden, b, temperature, False)[0],
                                 "log-probs")

    def teacher_logprobs(self, experience: Experience, temperature: float, k: int, vocab_size: int):
        """(dp_rank, (B_shard, T, 1 + 2k) _teacher_figures) on reporting ranks, else None."""
        return self._forward(experience, lambda hidden, b: self._teacher_figures(hidden, b, temperature, k, vocab_size),
                             "teacher log-probs")

    def values(self, experience: Experience):
        """(dp_rank, (B_shard, T) V(sₜ)): the value head at the position before each response token."""

        return self._forward(experience, lambda values, batch: _token_values(values, batch.micro.experience), "values")

    def scores(self, experience: Experience):
        """(dp_rank, (B_shard, T)): a reward model's score on each sequence's last token."""
        return self._forward(experience, lambda values, batch: _last_token_values(values, batch.micro.experience),
                             "scores")

    # ---- updates -----------------------------------------------------------------------------
    def _train(self, shards: list[MiniBatch], loss_fn) -> dict | None:
        """One optimizer step per mini-batch, given as this DP rank's shards."""
        tokens = sum(int(shard.experience.sequence_lengths().sum()) for shard in shards)
        with self._phase_memory("update"), RECORDER.span(self._lane, "update", tokens=tokens):
            return self._steps(shards, loss_fn)

    def _steps(self, shards: list[MiniBatch], loss_fn) -> dict | None:

        def threaded_loss(output, batch):
            self._take_threads()
            return loss_fn(output, batch)

        steps = []
        for shard in shards:
            self._take_threads()
            micro = self._micro_batches(shard)
            inputs = self._inputs(micro)
            out = self.model.train_step(inputs, threaded_loss)
            self.scheduler.step(increment=1)
            agreement = self._routing_agreement(micro) if inputs[0].routes is not None else None
            real = [int(mb.experience.sequence_lengths().sum()) for mb in micro]
            slots = real if self.spec.cfg.pack else [mb.experience.sequences.numel() for mb in micro]
            tokens = torch.tensor([sum(real), sum(slots)], dtype=torch.float64)  # over every DP rank
            torch.distributed.all_reduce(tokens, group=self.ps.get_data_parallel_group())
            step = combine_metrics(out["metrics"]) if self._reports else {}
            if self._reports and agreement is not None:
                step["mismatch/routing_agreement"] = agreement
            if self._reports:
                step[f"{self.spec.name}/grad_norm"] = out["grad_norm"]
                if "moe_aux_loss" in out:  # model.moe_aux_loss_coef > 0
                    step[f"{self.spec.name}/moe_aux_loss"] = out["moe_aux_loss"]
                # Megatron skips a step whose gradients hold inf/NaN (or overflow an fp16 scale).
                step[f"{self.spec.name}/skipped_step_frac"] = 0.0 if out["update_ok"] else 1.0
                step[f"{self.spec.name}/lr"] = self.model.optimizer.param_groups[0]["lr"]
                step[f"{self.spec.name}/threads"] = float(torch.get_num_threads())  # at the step's end
                # What the token budget (or row count) made of the shard: passes, the largest one's token
                # slots (rows × width; packed: its real tokens), and the share of every DP rank's slots that pad.
                step[f"{self.spec.name}/micro_batches"] = float(len(micro))
                step[f"{self.spec.name}/pass_tokens_max"] = float(max(slots))
                padding = "perf/padding_frac" if self.spec.name == "actor" else f"perf/{self.spec.name}_padding_frac"
                step[padding] = float(1.0 - tokens[0] / tokens[1])
            steps.append(step)
        if not self._reports:
            return None
        # Mean over optimizer steps, extremes kept; the group then merges replicas by tokens.
        merged = {}
        for key in steps[0]:
            values = [s[key] for s in steps]
            extreme = max if key.endswith("_max") else min if key.endswith("_min") else None
            merged[key] = extreme(values) if extreme else sum(values) / len(values)
        merged["tokens"] = sum(s["tokens"] for s in steps)
        return merged

    def train_actor(self, minibatches: list[MiniBatch], settings: ActorSettings) -> ActorUpdate | None:
        """Without old_logprobs, π_old is this actor's weights before the update: the first
        mini-batch reads it from its own forward (detached; the weights have not moved yet), the
        others from one no-grad pass before the first step. One pass fewer than a separate one.
        The objective is core_algos.actor_loss; the π_old read here goes back with the metrics."""
        self._raise_armed_fault()
        algo, temperature = settings.algo, settings.temperature
        shards = [minibatch.shard(*self._dp) for minibatch in minibatches]
        reads_old = shards[0].experience.old_logprobs is None
        first_old = torch.zeros(shards[0].experience.response_mask.shape)  # (B_shard, T) π_old of shard 0
        if reads_old:
            shards[1:] = [self._with_old_logprobs(shard, temperature) for shard in shards[1:]]

        def loss_fn(hidden, batch):
            mb = batch.micro
            exp = mb.experience
            distills = settings.distill_coef > 0  # the top-k forward KL (distill.objective=topk_forward_kl)
            logprob, entropy, student_topk = self._token_logprobs(hidden, batch, temperature, True, distills)
            teacher_kl = None
            if distills:  # rows without a teacher have none
                has_teacher = (exp.info["teacher"] != NO_TEACHER).to(logprob.dtype)[:, None]
                teacher_kl = topk_forward_kl(student_topk, exp.teacher_topk_logprobs) * has_teacher
            old = exp.old_logprobs
            if old is None:  # shard 0's own forward, before any step
                old = logprob.detach()
                first_old[mb.rows, : old.shape[1]] = old
            loss, metrics = actor_loss(
                logprob, old, exp.advantages, exp.response_mask, policy_loss=algo.policy_loss,
                clip_low=algo.clip_low, clip_high=algo.clip_high, dual_clip=algo.dual_clip, agg=algo.loss_agg,
                denominator=mb.denominator(algo.loss_agg), rollout_logprob=exp.rollout_logprobs,
                is_level=algo.is_level if algo.is_correction else None, is_cap=algo.is_cap,
                entropy=entropy, entropy_coef=settings.entropy_coef,
                ref_logprob=exp.ref_logprobs, kl_coef=settings.kl_coef, kl_kind=algo.kl_kind,
                teacher_kl=teacher_kl, distill_coef=settings.distill_coef)
            return loss, {k: float(v) for k, v in metrics.items()}

        metrics = self._train(shards, loss_fn)
        if metrics is None:
            return None
        old = [(shard.rows, shard.experience.old_logprobs) for shard in shards[1:]] if reads_old else []
        return ActorUpdate(metrics, [(shards[0].rows, first_old), *old] if reads_old else [])

    def _with_old_logprobs(self, shard: MiniBatch, temperature: float) -> MiniBatch:
        """The shard with log π of the current weights, on every last-stage rank (all compute the loss)."""
        old = self._no_grad(shard, lambda hidden, b: self._token_logprobs(hidden, b, temperature, False)[0],
                            "log-probs")
        return shard if old is None else replace(shard, experience=replace(shard.experience, old_logprobs=old))

    def train_critic(self, minibatches: list[MiniBatch], algo: AlgorithmConfig) -> dict | None:
        def loss_fn(values, batch):
            mb = batch.micro
            exp = mb.experience
            new_values = _token_values(values, exp)
            loss, metrics = value_loss(new_values, exp.values, exp.returns, exp.response_mask, algo.value_clip,
                                       algo.loss_agg, denominator=mb.denominator(algo.loss_agg))
            metrics["tokens"] = exp.response_mask.sum()
            return loss, {k: float(v) for k, v in metrics.items()}

        return self._train([minibatch.shard(*self._dp) for minibatch in minibatches], loss_fn)

    def offload(self) -> None:
        self.model.offload()

    def onload(self) -> None:
        self.model.onload()

    # ---- weights out -------------------------------------------------------------------------
    def _with_hf_tensors(self, use, tensors=None):
        """use(stream of HF tensors: `tensors`, or the model's) on rank 0; the other ranks only take
        part in the gather. If `use` fails part-way, rank 0 still drains the stream, so no rank is
        left in a gather."""
        tensors = self.model.hf_tensors() if tensors is None else tensors
        try:
            return use(tensors) if self.rank == 0 else None
        finally:
            for _ in tensors:
                pass

    def host_weight_group(self) -> tuple[str, int]:
        """Rank 0: starts the rendezvous of a new weight group with the engines; where it is."""
        from orz.rollout.weight_sync import BroadcastSender, new_staging

        if not hasattr(self, "_sender"):  # both kept across syncs
            self._staging = new_staging("cuda" if torch.cuda.is_available() else "cpu")
            self._sender = BroadcastSender()
        return self._sender.host()

    def send_weights(self, spec, bucket_bytes: int, with_digests: bool) -> dict[str, str] | None:
        """Rank 0 joins the engines' weight group (hosted above) and broadcasts; the others help
        gather."""
        return self._with_hf_tensors(lambda tensors: self._sender.send(
            spec, self._as_engines_hold(tensors), bucket_bytes, self._staging, with_digests), self._synced())

    def put_weights(self, bucket_bytes: int, with_digests: bool):
        from orz.rollout.weight_sync import to_object_store_buckets

        return self._with_hf_tensors(lambda tensors: to_object_store_buckets(
            self._as_engines_hold(tensors), bucket_bytes, with_digests), self._synced())

    def _synced(self):
        """What a sync sends: the weights; a LoRA actor's adapter alone, or its merged weights."""
        if self.spec.lora_sync == "adapter":
            return self.model.adapter_tensors()
        return self.model.hf_tensors(merged=self.spec.lora_sync == "merged")

    def _as_engines_hold(self, tensors):
        """The stream as the engines load it: the checkpoint's names (`model.language_model.*` in a
        vision-language wrapper, which vLLM serves as its ForConditionalGeneration class), in their dtype."""
        from orz.models.checkpoint import saved_name
        from orz.rollout.weight_sync import as_engines_hold

        named = ((saved_name(name, self.hf_config), tensor) for name, tensor in tensors)
        return as_engines_hold(named, self.spec.engine_dtype) if self.spec.engine_dtype else named

    def export_hf(self, out_dir: str, merged: bool = False) -> str | None:
        """The model as an HF directory; `merged`: a LoRA actor's, with its adapters merged in."""
        from orz.models.checkpoint import save_hf, with_untrained

        source = self.spec.model_path
        return self._with_hf_tensors(lambda tensors: str(save_hf(
            out_dir, with_untrained(tensors, self.hf_config, source), self.hf_config, extra_files_from=source)),
            self.model.hf_tensors(merged=merged))

    def export_adapter(self, out_dir: str) -> str | None:
        """A LoRA actor's adapter as a PEFT directory (orz/models/peft_format.py) for its base model."""
        from orz.models.peft_format import adapter_config, write_adapter

        config = adapter_config(self.spec.model.lora, self.spec.model_path)
        return self._with_hf_tensors(lambda tensors: str(write_adapter(out_dir, tensors, config)),
                                     self.model.adapter_tensors())

    # ---- checkpoints -------------------------------------------------------------------------
    def save(self, root: str, asynchronous: bool = False) -> None:
        """The role's checkpoint in Megatron's format (orz/models/dist_checkpoint.py): weights, the
        optimizer's fp32 masters, moments and param groups, each rank's RNG, and the scheduler's
        step count (its settings come from the stage's config: `configure`). asynchronous (GPU,
        trainer.async_save): the files are written in the background until `finish_saves`."""
        from orz.models import dist_checkpoint
        from orz.models.checkpoint import HFCheckpoint, weights_fingerprint

        meta = {"role": self.spec.name} | ({"scheduler_steps": self.scheduler.num_steps} if self.spec.train else {})
        if self.spec.model.lora is not None:  # the adapters' base: loaded from its HF directory on resume
            if not hasattr(self, "_base_fingerprint"):
                self._base_fingerprint = weights_fingerprint(self.spec.model_path)
            meta["lora_base"] = {"path": self.spec.model_path, "fingerprint": self._base_fingerprint}
            meta["lora"] = asdict(self.spec.model.lora)
        with RECORDER.span(self._lane, "save"):
            request = dist_checkpoint.save(self.model, root, meta, HFCheckpoint(self.spec.model_path).config,
                                           asynchronous=asynchronous)
        if request is not None:
            self._saves = self._saves or dist_checkpoint.PendingSaves()
            self._saves.add(request)

    def finish_saves(self) -> None:
        """Waits for this rank's asynchronous saves (none: returns at once)."""
        if self._saves is not None:
            self._saves.finish()

    def load(self, root: str) -> None:
        """The inverse of `save`, exactly at the saved layout, and re-sharded by Megatron at another
        (orz/models/dist_checkpoint.py says which cut loads where). The fp32 masters of a bf16 model
        come from the optimizer's state, never from the bf16 weights."""
        from orz.models import dist_checkpoint

        # A checkpoint at a stage boundary holds the previous stage's LR in its param groups, by which
        # Megatron matches them to the live ones: give them this stage's (configure sets the rest).
        meta = dist_checkpoint.load(self.model, root, with_optimizer=self.spec.train,
                                    adjust_optimizer=lambda state: _set_group_lr(state, self.spec.cfg))
        if self.spec.train:
            self.scheduler.num_steps = meta["scheduler_steps"]
            self.configure(self.spec.cfg)

    def recut(self, source: str) -> None:
        """On workers of the saved layout: `source` re-saved beside it in the cut that loads at any layout."""
        from orz.models import dist_checkpoint

        dist_checkpoint.recut(self.model, source)


def _set_group_lr(optimizer_state, cfg: RoleConfig) -> None:
    """max_lr/min_lr := the role's in every param group of a (possibly nested) optimizer state dict."""
    if isinstance(optimizer_state, dict):
        for group in optimizer_state.get("param_groups", []):
            if "max_lr" in group:
                group.update(max_lr=cfg.lr, min_lr=cfg.min_lr)
        for key, value in optimizer_state.items():
            if key != "param_groups":
                _set_group_lr(value, cfg)
    elif isinstance(optimizer_state, (list, tuple)):
        for value in optimizer_state:
            _set_group_lr(value, cfg)


@dataclass(frozen=True)
class ActorSettings:
    """What an actor update needs beside its mini-batches."""

    algo: AlgorithmConfig  # the stage's algorithm settings, defaults decided (run_rules.algorithm)
    temperature: float  # the rollout's: log π is computed from logits / temperature, as the engine sampled
    entropy_coef: float  # fixed, or the adaptive controller's current value
    kl_coef: float  # β of a KL term in the loss; 0 when the KL is in the reward or absent
    distill_coef: float = 0.0  # the teachers' top-k forward KL's weight in the loss; 0: none (or reverse_kl)


@dataclass(frozen=True)
class ActorUpdate:
    """What a reporting rank's actor update gives back."""

    metrics: dict[str, float]  # its actor/* metrics, merged over its optimizer steps
    # π_old it read itself, by shard: (rows of the Experience the mini-batch was cut from, (B_shard, T));
    # empty when π_old came with the mini-batches
    old_logprobs: list[tuple[torch.Tensor | None, torch.Tensor]]


@dataclass(frozen=True)
class PendingRows:
    """Refs to the reporting ranks' (row indices, rows); `.get()` puts every rank's rows in place."""

    refs: list

    def get(self) -> torch.Tensor:
        return rows_in_place(ray.get(self.refs))


def rows_in_place(parts: list) -> torch.Tensor:
    """The (row indices, rows) each reporting rank gave (None elsewhere), as one (B, T, ...) tensor."""
    parts = [part for part in parts if part is not None]
    out = parts[0][1].new_zeros((sum(len(index) for index, _ in parts), *parts[0][1].shape[1:]))
    for index, rows in parts:
        out[index] = rows
    return out


@dataclass(frozen=True)
class PendingUpdate:
    """Refs to the reporting ranks' ActorUpdates; `.get()` merges their metrics (combine_metrics)
    and puts the π_old they read into a (B, T) tensor like ``like``, None when they read none."""

    refs: list

    def get(self, like: torch.Tensor) -> tuple[dict[str, float], torch.Tensor | None]:
        updates = [u for u in ray.get(self.refs) if u is not None]
        pieces = [piece for u in updates for piece in u.old_logprobs]
        old = torch.zeros(like.shape) if pieces else None
        for rows, values in pieces:
            old[rows, : values.shape[1]] = values
        return combine_metrics([u.metrics for u in updates]), old


@dataclass(frozen=True)
class PendingMetrics:
    """Refs to the reporting ranks' metrics; `.get()` merges them (combine_metrics)."""

    refs: list

    def get(self) -> dict[str, float]:
        return combine_metrics([m for m in ray.get(self.refs) if m is not None])


class WorkerGroup:
    """A role's workers: placed with a Ray placement group, joined into one torch world. The
    trainer calls the role through the typed methods below, never by method name."""

    def __init__(self, spec: RoleSpec, shared: Bundles | None = None, wait: bool = True):
        """shared: colocated placement, worker r on bundle r; None: a placement group of its own.
        wait=False returns once the workers are launched; `wait_started()` waits for their models."""
        cfg = spec.cfg
        self.spec = spec
        self.world_size = spec.model.sizes.workers
        self.bundles, self._own_bundles = shared or Bundles.create(self.world_size, cfg.cpus_per_worker), shared is None
        cls = ray.remote(concurrency_groups={"control": 1})(MegatronWorker)  # use_threads, beside a pass
        self.workers = [
            cls.options(**self.bundles.options(r, cfg.cpus_per_worker, {"OMP_NUM_THREADS": str(cfg.threads)}))
            .remote(spec, r, self.world_size)
            for r in range(self.world_size)
        ]
        world = self.workers[0].host_world.remote()  # (address, port): Ray resolves it for each setup
        self._started = [w.setup.remote(world) for w in self.workers]
        if wait:
            self.wait_started()

    def wait_started(self) -> None:
        ray.get(self._started)

    # ---- the role's calls: `*_async` return at once (a Pending*, or refs), the others wait ----
    def logprobs_async(self, experience: ray.ObjectRef, temperature: float, adapters: bool = True) -> PendingRows:
        """(B, T) log π of the response tokens, in row order, once `.get()`; adapters=False: a LoRA
        actor's base model."""
        return PendingRows(self._call("logprobs", experience, temperature, adapters))

    def teacher_logprobs_async(self, experience: ray.ObjectRef, temperature: float, k: int,
                               vocab_size: int) -> PendingRows:
        """(B, T, 1 + 2k) MegatronWorker._teacher_figures, in row order, once `.get()`."""
        return PendingRows(self._call("teacher_logprobs", experience, temperature, k, vocab_size))

    def values_async(self, experience: ray.ObjectRef) -> PendingRows:
        """(B, T) V(sₜ) of the critic, in row order, once `.get()`."""
        return PendingRows(self._call("values", experience))

    def scores_async(self, experience: ray.ObjectRef) -> PendingRows:
        """(B, T) a reward model's score on each row's last response token, once `.get()`."""
        return PendingRows(self._call("scores", experience))

    def train_actor_async(self, minibatches: list[MiniBatch], settings: ActorSettings) -> PendingUpdate:
        """One optimizer step per mini-batch; the merged `actor/*` metrics and the π_old the
        actor read (rows in the mini-batches' source Experience) once `.get(like)`."""
        return PendingUpdate(self._call("train_actor", minibatches, settings))

    def train_critic_async(self, minibatches: list[MiniBatch], algo: AlgorithmConfig) -> PendingMetrics:
        return PendingMetrics(self._call("train_critic", minibatches, algo))

    def configure(self, cfg: RoleConfig) -> None:
        ray.get(self._call("configure", cfg))

    def use_threads(self, threads: int) -> None:
        """Every worker takes `threads` torch threads from its next micro-batch on (not waited for)."""
        self._call("use_threads", threads)

    def save_async(self, root: str, asynchronous: bool = False) -> list[ray.ObjectRef]:
        """Every worker's part of the checkpoint; asynchronous: written in the background until finish_saves."""
        return self._call("save", root, asynchronous)

    def finish_saves(self) -> None:
        ray.get(self._call("finish_saves"))

    def load_async(self, root: str) -> list[ray.ObjectRef]:
        return self._call("load", root)

    def recut(self, source: str) -> None:
        ray.get(self._call("recut", source))

    def offload(self) -> None:
        ray.get(self._call("offload"))

    def peak_memory_gib(self) -> dict[str, float]:
        """`perf/peak_memory_gib/<role>_<phase>`: the largest of the workers' peaks in each phase
        since the last call."""
        peaks = {}
        for worker in ray.get(self._call("peak_memory_gib")):
            for phase, gib in worker.items():
                key = f"perf/peak_memory_gib/{self.spec.name}_{phase}"
                peaks[key] = max(peaks.get(key, 0.0), gib)
        return peaks

    def arm_fault(self, message: str) -> None:
        """trainer.fault: every worker raises at the start of its next update (orz/faults.py)."""
        ray.get(self._call("arm_fault", message))

    def onload(self) -> None:
        ray.get(self._call("onload"))

    def export_hf(self, out_dir: str, merged: bool = False) -> None:
        ray.get(self._call("export_hf", out_dir, merged))

    def export_adapter(self, out_dir: str) -> None:
        ray.get(self._call("export_adapter", out_dir))

    def send_weights(self, spec, bucket_bytes: int, with_digests: bool) -> dict[str, str]:
        """Every rank gathers its shards; rank 0 broadcasts to the engines' group: its digests."""
        return ray.get(self._call("send_weights", spec, bucket_bytes, with_digests))[0]

    def put_weights(self, bucket_bytes: int, with_digests: bool):
        """Rank 0's buckets in Ray's object store (the other transport)."""
        return ray.get(self._call("put_weights", bucket_bytes, with_digests))[0]

    def timeline_events_async(self) -> list[ray.ObjectRef]:
        """Each rank's spans since the last call (MegatronWorker.timeline_events), in rank order."""
        return self._call("timeline_events")

    def host_weight_group(self) -> tuple[str, int]:
        """Where rank 0 hosts a new weight group's rendezvous."""
        return ray.get(self.workers[0].host_weight_group.remote())

    def _call(self, method: str, *args) -> list[ray.ObjectRef]:
        return [getattr(w, method).remote(*args) for w in self.workers]

    def dead_ranks(self, timeout_s: float = 10.0) -> list[int]:
        """Ranks whose process is gone. A rank still busy (or hung in a collective with a dead
        peer) after timeout_s counts as alive."""
        pings = [w.__ray_ready__.remote() for w in self.workers]
        ready, _ = ray.wait(pings, num_returns=len(pings), timeout=timeout_s)
        dead = []
        for rank, ping in enumerate(pings):
            try:
                if ping in ready:
                    ray.get(ping)
            except ray.exceptions.RayActorError:
                dead.append(rank)
        return dead

    def shutdown(self) -> None:
        for w in self.workers:
            ray.kill(w)
        if self._own_bundles:
            self.bundles.remove()
