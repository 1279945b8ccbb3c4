"""Log-probs and entropy of long responses: memory and time of one forward plus backward from the
final hidden states and the LM head weight, chunk by chunk (orz/models/logprobs.py, what the
trainer runs) against the path from whole logits that the trainer used until 2026-12-05.

    .venv/bin/python bench/bench_long_logprobs.py [--hidden 1024] [--vocab 151936] [--tokens 1024 2048 4096 8192] [--smoke]

Each (path, tokens) runs in a process of its own, at one thread and float32, with the loss
Σ log p(y) + Σ H. Memory is the process's peak resident set during the first forward and backward
(VmHWM, reset through /proc/self/clear_refs once the weights and inputs are loaded) minus what it
held then: the extra memory of the pass. Time is the median of --repeats passes after it. The whole-logits path runs
under an address-space limit (--memory-gib) and is reported as not fitting where it exceeds it.
Useful work: the three matmuls of a pass with whole logits, 6·T·H·V FLOPs (the chunked path does
a fourth, the backward's recompute, which is not counted), as a fraction of the fp32 matmul limit.

Fields: bench, settings.smoke, settings.hidden, settings.vocab, settings.chunk_tokens, runs,
chunked_peak_growth, chunked_over_whole_peak_at_2048, chunked_over_whole_time, limits.matmul_fp32_gflops,
threads.torch_threads, machine.cpu, machine.vector_flags.
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import SMOKE_LIMITS, best_limits, emit, machine, machine_limits, median_seconds, parse_args, set_threads  # noqa: E402

from orz.models.logprobs import default_chunk_tokens, logprobs_from_logits, token_logprobs  # noqa: E402


def _peak_kib() -> int:
    return int(next(line for line in open("/proc/self/status") if line.startswith("VmHWM")).split()[1])


def _one_pass(path: str, hidden: torch.Tensor, weight: torch.Tensor, tokens: torch.Tensor, chunk: int) -> None:
    h, w = hidden.detach().requires_grad_(True), weight.detach().requires_grad_(True)
    if path == "chunked":
        logp, entropy = token_logprobs(h, w, tokens, chunk_tokens=chunk)
    else:
        logp, entropy = logprobs_from_logits((h @ w.t())[None], tokens[None])
    (logp.sum() + entropy.sum()).backward()


def worker(path: str, tokens: int, hidden: int, vocab: int, chunk: int, repeats: int, memory_gib: float) -> dict:
    """One (path, tokens) in this process: its extra peak memory and median seconds."""
    set_threads(1)
    if path == "whole":  # a clean MemoryError instead of the machine's OOM killer
        limit = int(memory_gib * 2**30)
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    g = torch.Generator().manual_seed(0)
    h, w = torch.randn(tokens, hidden, generator=g) * 0.1, torch.randn(vocab, hidden, generator=g) * 0.1
    ids = torch.randint(0, vocab, (tokens,), generator=g)
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # VmHWM := the resident set now: weights, inputs, torch
    baseline = _peak_kib()
    try:
        _one_pass(path, h, w, ids, chunk)
    except (MemoryError, RuntimeError) as err:  # RuntimeError: torch's own allocation failure
        return {"path": path, "tokens": tokens, "fits": False, "error": str(err).splitlines()[0][:200]}
    extra_gib = (_peak_kib() - baseline) / 2**20
    seconds = median_seconds(lambda: _one_pass(path, h, w, ids, chunk), repeats, warmup=0)
    return {"path": path, "tokens": tokens, "fits": True, "extra_peak_gib": extra_gib, "seconds": seconds}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--vocab", type=int, default=151936)
    parser.add_argument("--tokens", type=int, nargs="+", default=[1024, 2048, 4096, 8192])
    parser.add_argument("--chunk-tokens", type=int, default=0, help="0: the trainer's default for this vocabulary")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--memory-gib", type=float, default=18.0, help="address-space limit of the whole-logits path")
    parser.add_argument("--worker", nargs=2, metavar=("PATH", "TOKENS"), help=argparse.SUPPRESS)
    args = parse_args(parser, {"hidden": 64, "vocab": 1000, "tokens": [128, 2048], "repeats": 1}, argv)
    chunk = args.chunk_tokens or default_chunk_tokens(args.vocab)
    if args.worker:
        print(json.dumps(worker(args.worker[0], int(args.worker[1]), args.hidden, args.vocab, chunk, args.repeats,
                                args.memory_gib)))
        return
    threads = set_threads(1)
    before = machine_limits(**(SMOKE_LIMITS if args.smoke else {}))
    runs = []
    for tokens in args.tokens:
        for path in ("whole", "chunked"):
            command = [sys.executable, os.path.abspath(__file__), "--worker", path, str(tokens), "--hidden",
                       str(args.hidden), "--vocab", str(args.vocab), "--chunk-tokens", str(chunk), "--repeats",
                       str(args.repeats), "--memory-gib", str(args.memory_gib)]
            done = subprocess.run(command, capture_output=True, text=True)
            lines = done.stdout.strip().splitlines()
            runs.append(json.loads(lines[-1]) if done.returncode == 0 and lines else
                        {"path": path, "tokens": tokens, "fits": False, "error": f"exit {done.returncode}: {done.stderr[-200:]}"})
            print(f"bench_long_logprobs: {runs[-1]}", file=sys.stderr, flush=True)
    limits = best_limits(before, machine_limits(**(SMOKE_LIMITS if args.smoke else {})))
    for run in runs:
        if run["fits"]:
            flops = 6 * run["tokens"] * args.hidden * args.vocab
            run["frac_matmul_limit"] = flops / run["seconds"] / 1e9 / limits["matmul_fp32_gflops"]
    at = {(r["path"], r["tokens"]): r for r in runs}
    chunked = [at["chunked", t] for t in args.tokens]
    emit({"bench": "long_logprobs",
          "settings": {"smoke": args.smoke, "hidden": args.hidden, "vocab": args.vocab, "chunk_tokens": chunk,
                       "tokens": args.tokens, "repeats": args.repeats, "dtype": "float32",
                       "memory_gib_whole": args.memory_gib},
          "runs": runs,
          # extra peak at the longest over the shortest: flat in the length (target <= 1.2)
          "chunked_peak_growth": chunked[-1]["extra_peak_gib"] / chunked[0]["extra_peak_gib"],
          "chunked_over_whole_peak_at_2048": (at["chunked", 2048]["extra_peak_gib"] / at["whole", 2048]["extra_peak_gib"]
                                              if ("whole", 2048) in at and at["whole", 2048]["fits"] else None),
          "chunked_over_whole_time": {str(t): at["chunked", t]["seconds"] / at["whole", t]["seconds"]
                                      for t in args.tokens if at["whole", t]["fits"]},
          "limits": limits, "threads": threads, "machine": machine()})


if __name__ == "__main__":
    main()
