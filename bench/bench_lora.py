"""LoRA against full-weight training of the same ~100M-parameter Llama (rank 16 on every linear layer
of every transformer layer, alpha 32), in one run: the actor's update, its memory, and the weight sync.

    .venv/bin/python bench/bench_lora.py [--hidden 768] [--layers 12] [--vocab 32000] [--steps 4] [--smoke]

- update: a Megatron actor (TP 1, fp32 on CPU, one process per side, `--threads` torch threads)
  takes `--steps` optimizer steps on one batch (`--rows` rows of `--tokens` tokens, a token-mean
  NLL); the median step after the first.
- memory: the process's peak resident set (VmHWM, what `perf/peak_memory_gib` reads) from before
  the model was built to the end of those steps: weights, gradient buffers, Adam's moments and
  activations (full), or frozen weights, the adapters with theirs and activations (LoRA), and on
  both sides the HF checkpoint's pages while it loads. LoRA shrinks the states, not the
  activations: the same again for one row of `--small-tokens` (`small_batch_*`), where the states
  dominate as they do for a large model on GPUs.
- sync: `EngineFleet.sync` into one vLLM engine (collective transport, digests of what each engine
  received): the whole model's fp32 weights into an engine that reloads them, against the adapter's
  tensors into an engine that serves them (its worker writes a PEFT directory). vLLM loads an
  adapter from a directory, lazily, with the first request that names its version: that fixed
  cost is `adapter_first_request_seconds` (a one-token request right after the sync, less the same
  request once the adapter is loaded), reported beside the sync and added to it in the ratio.
- bf16 merge: the share of a LoRA update that a merged refit in bf16 would lose. After the LoRA
  side's steps (lr 1e-5, RL's scale), ΔW = (alpha/r)·B·A of every adapted layer, merged into the
  bf16 weights: the share of ΔW's elements with bf16(W + ΔW) = bf16(W), and ‖bf16(W+ΔW) − bf16(W) − ΔW‖/‖ΔW‖.

Targets (the issue's): sync bytes ≤ 5% of full, sync time ≤ 20%, the peak above the start
≤ 0.6× full's, update time ≤ 1.0× full. Prints ONE JSON line.

Fields: bench, settings.smoke, settings.params, settings.rank, update.full_seconds, update.lora_seconds,
update.ratio, update.full_frac_matmul_limit, memory.full_gib, memory.lora_gib, memory.ratio,
memory.small_batch_full_gib, memory.small_batch_lora_gib, memory.small_batch_ratio, sync.full_bytes,
sync.adapter_bytes, sync.bytes_ratio, sync.full_seconds, sync.adapter_seconds, sync.adapter_first_request_seconds,
sync.time_ratio, bf16_merge.elements_lost, bf16_merge.relative_error, targets_met, limits.matmul_fp32_gflops,
threads.torch_threads, machine.cpu, machine.vector_flags.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import (  # noqa: E402
    RAY_ADDRESS_HELP, SMOKE_LIMITS, best_limits, char_llama, emit, machine, machine_limits, param_count, parse_args, ray_session,
    set_threads,
)

from orz.models.local_world import run_world  # noqa: E402

RANK, ALPHA = 16, 32.0


def _actor_side(rank, world, model_dir: str, lora: bool, steps: int, rows: int, tokens: int, threads: int) -> dict:
    """One side's update time, its peak memory above the start and (LoRA) the bf16 merge's losses."""
    from orz.models.checkpoint import HFCheckpoint
    from orz.models.lora import adapter_layers
    from orz.models.megatron_model import MegatronModel, ModelInputs
    from orz.models.parallel import init_model_parallel
    from orz.models.spec import LoraSpec, ModelSpec, OptimSpec
    from orz.ppo.workers import peak_memory_gib, reset_peak_memory

    torch.set_num_threads(threads)
    init_model_parallel()
    reset_peak_memory()
    start_gib = peak_memory_gib()
    ckpt = HFCheckpoint(model_dir)
    model = MegatronModel(ckpt.arch, ModelSpec(optim=OptimSpec(lr=1e-5),
                                               lora=LoraSpec(rank=RANK, alpha=ALPHA) if lora else None))
    model.load_hf(ckpt)
    batch = torch.randint(0, ckpt.arch.vocab_size, (rows, tokens), generator=torch.Generator().manual_seed(0))

    def nll(hidden, b):
        return -model.next_token_logprobs(hidden, b.input_ids).sum() / b.input_ids[:, 1:].numel(), {}

    seconds = []
    for _ in range(steps):
        began = time.perf_counter()
        model.train_step([ModelInputs(batch)], nll)
        seconds.append(time.perf_counter() - began)
    out = {"seconds": statistics.median(seconds[1:]), "peak_gib": peak_memory_gib() - start_gib}
    if lora:
        lost, total, err, norm = 0, 0, 0.0, 0.0
        with torch.no_grad():
            for _, layer in adapter_layers(model.module):
                delta = layer.lora_scaling * (layer.lora_B @ layer.lora_A)
                base = layer.weight.to(torch.bfloat16)
                realised = (layer.weight + delta).to(torch.bfloat16).float() - base.float()
                lost += int(((realised == 0) & (delta != 0)).sum())
                total += int((delta != 0).sum())
                err += float((realised - delta).square().sum())
                norm += float(delta.square().sum())
        out |= {"elements_lost": lost / max(total, 1), "relative_error": (err / max(norm, 1e-30)) ** 0.5}
    return out


def _adapter_tensors(model_dir: str) -> dict[str, torch.Tensor]:
    """A rank-16 adapter in PEFT's names and shapes for every linear layer of the model (random B)."""
    from orz.models.checkpoint import HFCheckpoint
    from orz.models.convert import Layout, hf_shape, param_rules
    from orz.models.peft_format import HF_MODULES, peft_name

    arch = HFCheckpoint(model_dir).arch
    g = torch.Generator().manual_seed(0)
    modules = {m for ms in HF_MODULES.values() for m in ms}
    out = {}
    for rule in param_rules(arch, Layout()):
        for name in rule.hf:
            if name.endswith(".weight") and name.split(".")[-2] in modules:
                rows, cols = hf_shape(name, arch)
                out[peft_name(name, "lora_A")] = torch.randn(RANK, cols, generator=g) / cols ** 0.5
                out[peft_name(name, "lora_B")] = torch.randn(rows, RANK, generator=g) * 1e-3
    return out


def _syncs(model_dir: str, named: dict, adapter: dict | None, repeats: int) -> tuple[float, float]:
    """(median sync seconds, first-request load seconds: 0 for full weights) into a fresh one-engine fleet."""
    from orz.rollout.driver import generate
    from orz.rollout.engine import SamplingConfig
    from orz.rollout.fleet import EngineFleet, FleetConfig
    from orz.rollout.weight_sync import TensorSource

    fleet = EngineFleet(model_dir, FleetConfig(num_engines=1, engine_args={"max_model_len": 64}, kv_cache_gib=1,
                                               adapter=adapter))
    one_token = SamplingConfig(temperature=0.0, max_new_tokens=1)
    try:
        source, seconds, loads = TensorSource(named), [], []
        for version in range(1, repeats + 2):
            began = time.perf_counter()
            fleet.sync(source, version)
            seconds.append(time.perf_counter() - began)
            first = time.perf_counter()
            generate(fleet, [[1, 2, 3]], one_token)
            loaded = time.perf_counter()
            generate(fleet, [[1, 2, 3]], one_token)
            loads.append((loaded - first) - (time.perf_counter() - loaded))
        return statistics.median(seconds[1:]), statistics.median(loads[1:]) if adapter else 0.0
    finally:
        fleet.shutdown()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--hidden", type=int, default=768)
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--steps", type=int, default=4, help="optimizer steps per side (the first is not timed)")
    parser.add_argument("--rows", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--syncs", type=int, default=3, help="timed syncs per side, after a warm-up")
    parser.add_argument("--small-tokens", type=int, default=128, help="the memory's second batch: one row of these")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--ray-address", default="", help=RAY_ADDRESS_HELP)
    args = parse_args(parser, {"hidden": 64, "layers": 2, "vocab": 256, "steps": 2, "rows": 2, "tokens": 16,
                               "syncs": 1, "small_tokens": 8}, argv)
    threads = set_threads(args.threads)
    before = machine_limits(**(SMOKE_LIMITS if args.smoke else {}))
    with tempfile.TemporaryDirectory() as root:
        model_dir = os.path.join(root, "model")
        char_llama(model_dir, ["0123456789+-*= abcdefghijklmnopqrstuvwxyz?.\n"], vocab_size=args.vocab,
                   hidden_size=args.hidden, intermediate_size=4 * args.hidden, num_layers=args.layers,
                   num_heads=max(args.hidden // 64, 2), num_kv_heads=max(args.hidden // 64, 2), head_dim=64 if
                   args.hidden >= 128 else 32)
        sides = {name: run_world(_actor_side, 1, model_dir, name == "lora", args.steps, args.rows, args.tokens,
                                 args.threads, timeout=3600)[0] for name in ("full", "lora")}
        # the states' share: one row of `--small-tokens`, where activations are small beside them
        small = {name: run_world(_actor_side, 1, model_dir, name == "lora", 2, 1, args.small_tokens, args.threads,
                                 timeout=3600)[0]["peak_gib"] for name in ("full", "lora")}
        from orz.models.checkpoint import HFCheckpoint
        from orz.models.peft_format import adapter_config
        from orz.models.spec import LoraSpec

        ckpt = HFCheckpoint(model_dir)
        full = {name: ckpt.get(name) for name in ckpt.keys()}
        adapter = _adapter_tensors(model_dir)
        with ray_session(address=args.ray_address):
            full_seconds, _ = _syncs(model_dir, full, None, args.syncs)
            adapter_seconds, load = _syncs(model_dir, adapter, adapter_config(LoraSpec(rank=RANK, alpha=ALPHA),
                                                                             model_dir), args.syncs)
        params = param_count(model_dir)
    limits = best_limits(before, machine_limits(**(SMOKE_LIMITS if args.smoke else {})))
    nbytes = {name: sum(t.numel() * t.element_size() for t in tensors.values()) for name, tensors in
              (("full", full), ("adapter", adapter))}
    update_flops = 6 * params * args.rows * args.tokens  # forward + backward of every weight, per step
    record = {
        "bench": "lora", "settings": {"smoke": args.smoke, "params": params, "rank": RANK, "alpha": ALPHA,
                                      "steps": args.steps, "rows": args.rows, "tokens": args.tokens},
        "update": {"full_seconds": sides["full"]["seconds"], "lora_seconds": sides["lora"]["seconds"],
                   "ratio": sides["lora"]["seconds"] / sides["full"]["seconds"],
                   "full_frac_matmul_limit": update_flops / sides["full"]["seconds"] / 1e9
                   / limits["matmul_fp32_gflops"]},
        "memory": {"full_gib": sides["full"]["peak_gib"], "lora_gib": sides["lora"]["peak_gib"],
                   "ratio": sides["lora"]["peak_gib"] / sides["full"]["peak_gib"],
                   "small_batch_full_gib": small["full"], "small_batch_lora_gib": small["lora"],
                   "small_batch_ratio": small["lora"] / small["full"]},
        "sync": {"full_bytes": nbytes["full"], "adapter_bytes": nbytes["adapter"],
                 "bytes_ratio": nbytes["adapter"] / nbytes["full"], "full_seconds": full_seconds,
                 "adapter_seconds": adapter_seconds, "adapter_first_request_seconds": load,
                 "time_ratio": (adapter_seconds + load) / full_seconds},
        "bf16_merge": {k: sides["lora"][k] for k in ("elements_lost", "relative_error")},
    }
    record["targets_met"] = {"sync_bytes_le_5pct": record["sync"]["bytes_ratio"] <= 0.05,
                             "sync_time_le_20pct": record["sync"]["time_ratio"] <= 0.2,
                             "memory_le_0.6x": record["memory"]["ratio"] <= 0.6,
                             "memory_small_batch_le_0.6x": record["memory"]["small_batch_ratio"] <= 0.6,
                             "update_le_1x": record["update"]["ratio"] <= 1.0}
    emit(record | {"limits": limits, "threads": threads, "machine": machine()})


if __name__ == "__main__":
    main()
