"""EngineFleet: N vLLM engines as Ray actors in a placement group, fed with the actor's weights.

    fleet = EngineFleet(model_dir, FleetConfig(num_engines=2))
    fleet.sync(source, version=1)                   # every engine now holds version 1
    samples = driver.generate(fleet, prompt_ids, SamplingConfig(n=8), min_version=1)
    fleet.interrupt()   # partial rollout: interruptible sessions pause, and after the next sync go on

The fleet keeps the engines' life (start, restart, sleep and wake-up, weight sync) and opens
their rollout sessions; orz.rollout.driver drives them.

Weights come from a WeightSource (orz.rollout.weight_sync: the actor's GroupSource, or a
TensorSource in tests and benchmarks): something that can join a process group as its rank 0 and
broadcast, or put the same buckets into the Ray object store. The fleet remembers the last source
and version, so an engine that dies or hangs is restarted and re-synced to the current version
(the driver then asks the new one for what the old one held).
"""
from __future__ import annotations

import itertools
import logging
import os
import threading
import time
from dataclasses import asdict, dataclass, field
import ray
import torch
from ray.exceptions import GetTimeoutError, RayActorError

from orz.bundles import Bundles
from orz.config import LOGPROBS_MODES, RolloutConfig
from orz.rollout.engine import Request, SamplingConfig, VLLMEngine
from orz.rollout.weight_sync import DEFAULT_BUCKET_BYTES, GroupSpec, WeightSource
from orz.timeline.record import RECORDER

log = logging.getLogger(__name__)


@dataclass
class FleetConfig:
    num_engines: int = 1
    engine_tp: int = 1  # GPUs per engine (vLLM's tensor_parallel_size); 1 on CPU
    cpus_per_engine: float = 1.0
    engine_args: dict = field(default_factory=dict)  # passed to vllm.LLM (max_model_len, gpu_memory_utilization, ...)
    kv_cache_gib: int = 2  # VLLM_CPU_KVCACHE_SPACE on CPU
    transport: str = "collective"  # "collective" (gloo/NCCL broadcast) | "object_store"
    bucket_bytes: int = DEFAULT_BUCKET_BYTES
    sync_check: str = "received"  # digest check after each sync: "off" | "received" | "held" (reads weights back)
    request_timeout_s: float = 1800.0  # no batch back from any engine for this long: declared hung, restarted
    sync_timeout_s: float = 600.0  # a weight broadcast not done by then fails; the hung engine is restarted
    max_restarts: int = 3  # per rollout (orz.rollout.driver)
    log_dir: str = ""  # each engine's stdout/stderr go to log_dir/engine-<seed>.log; "" keeps them
    sleep_mode: bool = False  # colocated: engines can sleep between rollouts (vLLM's sleep mode, GPU only)
    batch_invariant: bool = False  # vLLM's batch-invariant kernels (GPU only; untested here)
    adapter: dict | None = None  # the syncs carry this LoRA adapter (its PEFT config), served as one

    @classmethod
    def from_config(cls, rollout: RolloutConfig, max_model_len: int, *, sleep_mode: bool = False,
                    log_dir: str = "", batch_invariant: bool = False, adapter: dict | None = None) -> FleetConfig:
        """The fleet of a run's `rollout` section. max_model_len: what its context must hold when
        rollout.max_model_len is 0 (the longest prompt + response of any stage). adapter: the PEFT
        config of a LoRA actor's adapter, which the engines serve (rollout.lora_sync=adapter)."""
        r = rollout
        engine_args = {"max_model_len": r.max_model_len or max_model_len, "max_num_seqs": r.max_num_seqs,
                       "logprobs_mode": LOGPROBS_MODES[r.logprobs_mode]}
        if torch.cuda.is_available():
            engine_args["gpu_memory_utilization"] = r.gpu_memory_utilization
        if r.routing_replay:  # GPU only (run_rules refuses it on CPU); untested here
            engine_args["enable_return_routed_experts"] = True
        if r.engine_dtype != "auto":  # auto: the engine's own choice (engine_dtype)
            engine_args["dtype"] = r.engine_dtype
        return cls(num_engines=r.num_engines, engine_tp=r.engine_tp, cpus_per_engine=r.cpus_per_engine,
                   engine_args=engine_args, kv_cache_gib=r.kv_cache_gib, transport=r.transport, sync_check=r.sync_check,
                   request_timeout_s=r.request_timeout_s, sync_timeout_s=r.sync_timeout_s, log_dir=log_dir,
                   sleep_mode=sleep_mode, batch_invariant=batch_invariant, adapter=adapter)


class WeightSyncError(RuntimeError):
    pass


def _timed_out(err: Exception) -> bool:
    """Whether a failed broadcast timed out (gloo: "Timed out ..."; NCCL: "... timeout ...")."""
    return "timed out" in str(err).lower() or "timeout" in str(err).lower()


def _get_timed(refs: list, ids: list[int], began: float, version: int, timeout_s: float | None) -> list:
    """ray.get(refs, timeout_s), each engine's part a timeline span "weight sync" (receive and
    load) on its lane, from `began` to when its call returned."""
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    left = dict(zip(refs, ids))
    while left:
        wait_s = None if deadline is None else max(0.0, deadline - time.monotonic())
        ready, _ = ray.wait(list(left), num_returns=1, timeout=wait_s)
        if not ready:
            raise GetTimeoutError(f"weight sync of version {version}: timed out waiting for the engines")
        RECORDER.add(f"engines/engine {left.pop(ready[0])}", "weight sync", began, RECORDER.now(), version=version)
    return ray.get(refs)


def _actor_lost(ref) -> bool:
    """Whether a finished call failed because its actor is gone (not because the call raised)."""
    try:
        ray.get(ref, timeout=0)
    except RayActorError:
        return True
    except Exception:  # noqa: BLE001 - the call itself failed (a broken group): the actor lives
        return False
    return False


class EngineFleet:
    def __init__(self, model_dir: str, cfg: FleetConfig | None = None, seed: int = 0, shared: Bundles | None = None,
                 wait: bool = True):
        """shared: colocated placement, engine i on bundle i; None: a placement group of its own.
        wait=False returns once the engines are launched; `wait_started()` waits until they are up."""
        self.model_dir, self.cfg, self.seed = model_dir, cfg or FleetConfig(), seed
        self.weight_version = 0
        self.source: WeightSource | None = None
        self.metrics = {"rollout/engine_restarts": 0, "rollout/weight_groups": 0}
        self.sent_digests: dict[str, str] = {}
        # The weight group: which source and engines it joins. Kept across syncs.
        self._group: GroupSpec | None = None
        self._group_source: WeightSource | None = None
        self._group_ids: list[int] = []
        # Rollout sessions, numbered in the order they open (VLLMEngine._take); the interruptible
        # ones open (session -> engine), and the version of the last interrupt (pending until a
        # sync moves weight_version past it: a session opened meanwhile pauses too).
        self._sessions, self._interruptible, self._interrupted_at = itertools.count(), {}, -1
        self._synced = threading.Condition()  # notified whenever weight_version moves
        tp = self.cfg.engine_tp  # vLLM's own workers take an engine's GPUs when TP > 1
        self.bundles = shared or Bundles.create(self.cfg.num_engines, self.cfg.cpus_per_engine, tp, float(tp == 1))
        self._own_bundles = shared is None
        self.engines = [self._start(i) for i in range(self.cfg.num_engines)]
        if wait:
            self.wait_started()

    def wait_started(self) -> None:
        ray.get([e.pid.remote() for e in self.engines])

    def _start(self, i: int):
        on_gpu = torch.cuda.is_available()
        env = {
            "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false",
            "VLLM_LOGGING_LEVEL": os.environ.get("VLLM_LOGGING_LEVEL", "WARNING"),
        }
        if not on_gpu:
            env["VLLM_CPU_KVCACHE_SPACE"] = str(self.cfg.kv_cache_gib)
        if self.cfg.batch_invariant:  # untested here: run_rules refuses it without a GPU
            env["VLLM_BATCH_INVARIANT"] = "1"
        engine_args = dict(self.cfg.engine_args)
        if self.cfg.engine_tp > 1:  # untested here: no GPU
            engine_args.update(tensor_parallel_size=self.cfg.engine_tp, distributed_executor_backend="ray")
        if self.cfg.sleep_mode and on_gpu:  # untested here: vllm-cpu has no sleep mode
            engine_args["enable_sleep_mode"] = True
        cls = ray.remote(concurrency_groups={"control": 1})(VLLMEngine)  # interrupt, beside a generation
        actor = cls.options(**self.bundles.options(i, self.cfg.cpus_per_engine, env))
        return actor.remote(self.model_dir, engine_args, self.seed + i, self.cfg.log_dir, self.cfg.adapter)

    # ---- colocated turns ---------------------------------------------------------------------
    def sleep(self) -> None:
        """Frees the engines' GPU memory (weights to CPU, KV cache dropped) for the roles' turn;
        a no-op where vLLM has no sleep mode (CPU) or the fleet was built without it."""
        if self.cfg.sleep_mode:
            ray.get([e.sleep.remote() for e in self.engines])

    def wake_up(self) -> None:
        """The engines' memory back, before the weight sync and the next rollout."""
        if self.cfg.sleep_mode:
            ray.get([e.wake_up.remote() for e in self.engines])

    def arm_fault(self, message: str) -> None:
        """trainer.fault: every engine raises at the start of its next generation (orz/faults.py)."""
        ray.get([e.arm_fault.remote(message) for e in self.engines])

    # ---- weights ---------------------------------------------------------------------------
    def sync(self, source: WeightSource, version: int, engine_ids: list[int] | None = None, _attempt: int = 0) -> dict:
        """Puts `source`'s weights into the engines (all by default) as `version`; returns timings.
        A collective sync that an engine does not finish within `sync_timeout_s` names the engine
        and the version, restarts that engine and syncs again, up to `max_restarts` times."""
        ids = list(range(len(self.engines))) if engine_ids is None else engine_ids
        engines = [self.engines[i] for i in ids]
        start = time.perf_counter()
        if self.cfg.transport == "collective":
            spec = self._weight_group(source, ids)
            began = RECORDER.now()
            pending = [e.receive_broadcast.remote(version, self.cfg.sync_check == "received") for e in engines]
            deadline = time.monotonic() + self.cfg.sync_timeout_s
            try:
                with RECORDER.span("sync/actor", "send", version=version):
                    sent = source.send(spec, self.cfg.bucket_bytes, self.cfg.sync_check != "off")
            except Exception as err:  # noqa: BLE001 - on the source's side
                if not _timed_out(err):  # its own failure (out of memory, a bug): no engine to blame
                    self._group_source = None
                    raise WeightSyncError(f"weight sync of version {version}: the source failed: {err}") from err
                return self._recover_sync(source, version, ids, pending, err, _attempt, deadline)
            try:
                received = _get_timed(pending, ids, began, version, max(0.0, deadline - time.monotonic()))
            except Exception as err:  # noqa: BLE001 - an engine timed out, died or failed
                return self._recover_sync(source, version, ids, pending, err, _attempt, deadline)
        elif self.cfg.transport == "object_store":
            with RECORDER.span("sync/actor", "put", version=version):
                refs, sent = source.put(self.cfg.bucket_bytes, self.cfg.sync_check != "off")
            began = RECORDER.now()
            received = _get_timed([e.receive_object_store.remote(refs, version, self.cfg.sync_check == "received")
                                   for e in engines], ids, began, version, None)
        else:
            raise ValueError(f"transport must be 'collective' or 'object_store', got {self.cfg.transport!r}")
        seconds = time.perf_counter() - start
        if self.cfg.sync_check == "held":
            received = ray.get([self.engines[i].held_digests.remote() for i in ids])
        if self.cfg.sync_check != "off":
            self._compare(ids, sent, received, self.cfg.sync_check)
        with self._synced:
            self.source, self.weight_version, self.sent_digests = source, version, sent
            self._synced.notify_all()
        return {"rollout/sync_seconds": seconds, "rollout/weight_version": version}

    def _weight_group(self, source: WeightSource, ids: list[int]) -> GroupSpec:
        """The group of `source` (rank 0) and engines `ids`: made once, and again only when the
        source or the engines change (a restart)."""
        if self._group is not None and self._group_source is source and self._group_ids == ids:
            return self._group
        self._close_group()
        ip, port = source.host_group()
        tp = self.cfg.engine_tp
        self.metrics["rollout/weight_groups"] += 1
        spec = GroupSpec("nccl" if torch.cuda.is_available() else "gloo", ip, port, 1 + len(ids) * tp,
                         f"orz-weights-{self.metrics['rollout/weight_groups']}", self.cfg.sync_timeout_s)
        for k, i in enumerate(ids):
            self.engines[i].init_weight_group.remote(spec.backend, ip, port, 1 + k * tp, spec.world_size,
                                                     spec.group_name, spec.timeout_s)
        self._group, self._group_source, self._group_ids = spec, source, list(ids)
        return spec

    def _close_group(self) -> None:
        if self._group is None:
            return
        closing = [self.engines[i].close_weight_group.remote() for i in self._group_ids]
        for ref in closing:
            try:
                ray.get(ref, timeout=30)
            except (RayActorError, GetTimeoutError):  # gone or hung: its restart replaces it
                pass
        self._group = self._group_source = None
        self._group_ids = []

    def _recover_sync(self, source, version: int, ids: list[int], pending: list, err: Exception, attempt: int,
                      deadline: float) -> dict:
        """After a failed collective sync: the engines that had not answered by its deadline (plus
        a grace for the others' own group timeouts to fire) are restarted; then every engine of
        the sync is synced again over a new group (the others may hold part of it)."""
        grace = min(30.0, self.cfg.sync_timeout_s)
        _, hung = ray.wait(pending, num_returns=len(pending), timeout=max(0.0, deadline - time.monotonic()) + grace)
        hung_ids = [i for i, ref in zip(ids, pending) if ref in hung or _actor_lost(ref)]
        what = f"weight sync of version {version}"
        self._group_source = None  # spent: the next sync closes it on every member and makes a new one
        if attempt >= self.cfg.max_restarts or not hung_ids:
            raise WeightSyncError(f"{what} failed (engines {hung_ids or ids}; attempt {attempt + 1}): {err}") from err
        log.warning("%s: engine(s) %s did not finish within %.0f s (%s); restarting them", what, hung_ids,
                    self.cfg.sync_timeout_s, err)
        for i in hung_ids:
            self._replace(i)
        return self.sync(source, version, ids, attempt + 1)

    def verify(self) -> None:
        """Reads back what every engine holds and compares it with the last sync's digests, on
        demand (bench_weight_sync checks that what it timed landed; a run checks in `sync`)."""
        if not self.sent_digests:
            raise WeightSyncError("no digests of the last sync to verify against: sync with sync_check != 'off'")
        ids = list(range(len(self.engines)))
        self._compare(ids, self.sent_digests, ray.get([e.held_digests.remote() for e in self.engines]), "held")

    @staticmethod
    def _compare(ids: list[int], sent: dict[str, str], got_by_engine: list[dict[str, str]], what: str) -> None:
        for i, got in zip(ids, got_by_engine):
            bad = sorted(n for n in sent.keys() | got.keys() if sent.get(n) != got.get(n))
            if bad:
                raise WeightSyncError(
                    f"engine {i}: {len(bad)} tensors it {what} differ from the trainer's weights, e.g. {bad[:3]}"
                )

    # ---- rollout sessions (orz.rollout.driver) ---------------------------------------------------
    @property
    def num_engines(self) -> int:
        return len(self.engines)

    def open_session(self, engine_id: int, sampling: SamplingConfig, min_version: int, interruptible: bool):
        """A new `serve` session on the engine: (session, its Ray stream), or None while an
        interrupt waits for the next sync (an interruptible session opened then would pause at once)."""
        with self._synced:
            if interruptible and self._interrupted_at == self.weight_version:
                return None
            session = next(self._sessions)
            if interruptible:
                self._interruptible[session] = engine_id
            stream = self.engines[engine_id].serve.options(num_returns="streaming").remote(
                session, asdict(sampling), min_version, interruptible)
        return session, stream

    def submit(self, engine_id: int, session: int, requests: list[Request]) -> None:
        self.engines[engine_id].submit.remote(session, requests)

    def close_session(self, engine_id: int, session: int, abort: bool = False) -> None:
        """Ends the session once what it holds has finished (at once when it holds nothing), or
        with `abort` at its next step, what it holds dropped."""
        with self._synced:
            self._interruptible.pop(session, None)
        if abort:
            self.engines[engine_id].interrupt.remote(session)
        self.engines[engine_id].submit.remote(session, None)

    def interrupt(self) -> None:
        """Partial rollout: every interruptible session open now, or opened before the next sync,
        stops at its engine's next step and hands back what its unfinished turns generated; its
        driver continues them once `resumable` (each token records its version)."""
        with self._synced:
            self._interrupted_at = self.weight_version
            ray.get([self.engines[e].interrupt.remote(session) for session, e in self._interruptible.items()])

    @property
    def interrupted_at(self) -> int:
        return self._interrupted_at

    def resumable(self) -> bool:
        """Whether the fleet holds weights newer than at the last interrupt."""
        return self.weight_version > self._interrupted_at

    def restart(self, engine_id: int) -> None:
        """Replaces an engine and brings it to the fleet's current weight version."""
        self._replace(engine_id)
        if self.weight_version > 0:
            if self.source is None:
                raise WeightSyncError(f"engine {engine_id} restarted but no weight source is known to re-sync it")
            self.sync(self.source, self.weight_version, engine_ids=[engine_id])

    def _replace(self, engine_id: int) -> None:
        """Kills an engine (dead, hung or stopped) and starts a fresh one in its place."""
        self._group_source = None  # a member is gone: the next sync closes the group and makes a new one
        ray.kill(self.engines[engine_id], no_restart=True)
        self.engines[engine_id] = self._start(engine_id)
        ray.get(self.engines[engine_id].pid.remote())
        self.metrics["rollout/engine_restarts"] += 1

    def shutdown(self) -> None:
        for e in self.engines:
            ray.kill(e, no_restart=True)
        if self._own_bundles:
            self.bundles.remove()
