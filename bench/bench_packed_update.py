"""The actor's update on long-tailed batches: packed passes (`actor.pack=true`) against padded ones
under the same token budget (`actor.micro_batch_tokens`), one after the other in one process.

    .venv/bin/python bench/bench_packed_update.py [--rows 64] [--median 256] [--sigma 1.0] [--cap 2048] [--smoke]

A random Llama (--hidden, --layers, --vocab) in one Megatron rank at one thread, float32, takes
one GRPO optimizer step on --rows rows whose response lengths are drawn as bench_rollout.py draws
them (lognormal around --median, clipped to [8, --cap]; prompts of 32 tokens), split into passes of
at most --budget tokens: padded rows × the longest, or packed real tokens. Each side's time is the
median of --repeats steps after a warm-up step, the two sides' steps interleaved in one process
(at lr 1e-6 the weights hardly move between them, and a step's time does not depend on them). The ideal saving of packing is the padded time ×
perf/padding_frac (the share of its token slots that pad); `saving_over_ideal` is what packing
saved of it (target ≥ 0.7). Useful work: 6 × parameters per real token.

Fields: bench, settings.smoke, settings.rows, settings.budget, padded.seconds, padded.padding_frac,
packed.seconds, packed.padding_frac, padded.frac_matmul_limit, packed_over_padded_time, saving_over_ideal,
limits.matmul_fp32_gflops, threads.torch_threads, machine.cpu, machine.vector_flags.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
from dataclasses import replace

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import SMOKE_LIMITS, best_limits, emit, machine, machine_limits, parse_args, set_threads  # noqa: E402

from orz.config import AlgorithmConfig, ExperimentConfig, RoleConfig  # noqa: E402
from orz.models.local_world import run_world  # noqa: E402


def _batch(rows: int, median: float, sigma: float, cap: int, vocab: int, seed: int = 0):
    from orz.ppo.experience import MiniBatch, experience_from_rollouts

    rng = np.random.default_rng(seed)
    lengths = np.clip(np.rint(rng.lognormal(np.log(median), sigma, rows)), 8, cap).astype(int).tolist()
    prompts = [rng.integers(1, vocab, 32).tolist() for _ in range(rows)]
    responses = [rng.integers(1, vocab, n).tolist() for n in lengths]
    exp = experience_from_rollouts(prompts, responses, [[-5.0] * n for n in lengths])
    mask = exp.response_mask
    advantages = torch.tensor(rng.standard_normal(rows), dtype=torch.float32)[:, None] * mask
    exp = replace(exp, old_logprobs=torch.full(mask.shape, -5.0) * mask, advantages=advantages)
    return MiniBatch.of(exp, rows=torch.arange(rows)), sum(lengths) + 32 * rows


def _updates(rank, world, model, batch, budget, repeats):
    """{side: (median seconds of a step, its padding_frac)}: both sides' workers in this rank, their
    steps interleaved (a warm-up step each first), so that the machine's drift falls on both alike."""
    import time

    from orz.ppo.workers import ActorSettings, MegatronWorker
    from orz.run.role_spec import RoleSpec, model_spec

    settings = ActorSettings(AlgorithmConfig(advantage="grpo"), 1.0, 0.0, 0.0)
    workers, seconds, padding = {}, {"padded": [], "packed": []}, {}
    for side, pack in (("padded", False), ("packed", True)):
        role = RoleConfig(lr=1e-6, micro_batch_tokens=budget, pack=pack)
        spec = RoleSpec(name="actor", model_path=model, model=model_spec(ExperimentConfig(), "actor", role), cfg=role,
                        total_steps=repeats + 1)
        workers[side] = MegatronWorker(spec, 0, 1)
        workers[side].setup((os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])))
    for repeat in range(repeats + 1):
        for side, worker in workers.items():
            start = time.perf_counter()
            padding[side] = worker.train_actor([batch], settings).metrics["perf/padding_frac"]
            if repeat:  # the first is the warm-up
                seconds[side].append(time.perf_counter() - start)
    return {side: (statistics.median(seconds[side]), padding[side]) for side in workers}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", type=int, default=64)
    parser.add_argument("--median", type=float, default=256)
    parser.add_argument("--sigma", type=float, default=1.0)
    parser.add_argument("--cap", type=int, default=2048)
    parser.add_argument("--budget", type=int, default=4096, help="tokens per pass (actor.micro_batch_tokens)")
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=1024)
    parser.add_argument("--repeats", type=int, default=7)
    args = parse_args(parser, {"rows": 8, "median": 16, "cap": 64, "budget": 128, "hidden": 32, "layers": 1,
                               "vocab": 64, "repeats": 1}, argv)
    from transformers import AutoModelForCausalLM

    from orz.models.tiny import make_tiny_hf

    threads = set_threads(1)
    before = machine_limits(**(SMOKE_LIMITS if args.smoke else {}))
    batch, real_tokens = _batch(args.rows, args.median, args.sigma, args.cap, args.vocab)
    with tempfile.TemporaryDirectory() as tmp:
        model = str(make_tiny_hf(tmp, vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=4 * args.hidden,
                                 num_heads=4, num_kv_heads=2, num_layers=args.layers,
                                 max_position_embeddings=32 + args.cap))
        params = sum(p.numel() for p in AutoModelForCausalLM.from_pretrained(model).parameters())
        sides = run_world(_updates, 1, model, batch, args.budget, args.repeats, timeout=3600)[0]
    limits = best_limits(before, machine_limits(**(SMOKE_LIMITS if args.smoke else {})))
    (padded, padding), (packed, packed_padding) = sides["padded"], sides["packed"]
    emit({"bench": "packed_update",
          "settings": {"smoke": args.smoke, "rows": args.rows, "median": args.median, "sigma": args.sigma,
                       "cap": args.cap, "budget": args.budget, "hidden": args.hidden, "layers": args.layers,
                       "vocab": args.vocab, "params": params, "real_tokens": real_tokens, "dtype": "float32",
                       "repeats": args.repeats},
          "padded": {"seconds": padded, "padding_frac": padding,
                     "frac_matmul_limit": 6 * params * real_tokens / padded / 1e9 / limits["matmul_fp32_gflops"]},
          "packed": {"seconds": packed, "padding_frac": packed_padding,
                     "frac_matmul_limit": 6 * params * real_tokens / packed / 1e9 / limits["matmul_fp32_gflops"]},
          "packed_over_padded_time": packed / padded,
          "saving_over_ideal": (padded - packed) / (padded * padding) if padding else None,
          "limits": limits, "threads": threads, "machine": machine()})


if __name__ == "__main__":
    main()
