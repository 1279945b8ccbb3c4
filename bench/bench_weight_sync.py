"""Weight-sync bandwidth: EngineFleet.sync of a ~100M-parameter fp32 Llama from this process into
one vLLM engine (a Ray actor), over both transports, against a plain in-memory copy of the same
bytes into a pre-allocated buffer, in one run.

    .venv/bin/python bench/bench_weight_sync.py [--hidden 768] [--layers 12] [--vocab 32000] [--syncs 5] [--smoke]

For each transport ("collective": gloo broadcast over a private group; "object_store": Ray
objects) and each check ("off", "received": blake3 digests of sent vs received), one warm-up sync
and then `--syncs` timed ones (median). Then the split of one collective sync, each part timed on
its own with the same bytes, buckets and processes:
- sender: packing tensors into the staging bucket (a copy) and digesting them (blake3), here;
- wire: a bare gloo broadcast of the same number of bytes in the same bucket size, nothing else;
- receiver, in the engine's worker: copying tensors out of the bucket (`_unpack`'s clone: the GPU
  path only; on CPU each bucket has its own buffer and vLLM gets views), digesting them, and
  vLLM's `reload_weights` on tensors already in memory;
- group: building and closing the private gloo group (rendezvous and the Ray calls around it).
Digests are computed only with sync_check="received". On CPU the receiver takes the next buckets off
the wire in a thread while vLLM loads the current one, so a sync costs about the larger of the
two, not their sum. Each sync also reports the CPU seconds of both processes and the memory it
touched for the first time (minor page faults x 4 KiB): the copy baseline touches none, and on
these VMs first touch costs several times the copy itself; what remains is vLLM's (its reload
allocates every layer afresh).

Threads: this process runs `--threads` torch threads (1 by default, the copy baseline too); the
engine runs one OMP thread (the fleet sets it). Prints ONE JSON line.

Fields: bench, settings.smoke, settings.bytes, copy.seconds, copy.gbps, sync.collective/off.seconds,
sync.collective/off.gbps, sync.collective/off.ratio_to_copy, sync.collective/received.gbps,
sync.object_store/off.gbps, sync.object_store/received.frac_copy_limit, verify_held_seconds,
split_collective_seconds.wire_broadcast, split_collective_seconds.sum_if_serial, limits.copy_gbps,
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
    GB, RAY_ADDRESS_HELP, SMOKE_LIMITS, best_limits, char_llama, emit, machine, machine_limits, median_seconds,
    parse_args, ray_session, set_threads,
)

from orz.models.parallel import host_store  # noqa: E402
from orz.rollout.fleet import EngineFleet, FleetConfig  # noqa: E402
from orz.rollout.weight_sync import (  # noqa: E402
    TensorSource, _pack, broadcast, buckets, destroy, digest, init_custom_process_group,
)


# ---- run inside the engine's worker (collective_rpc: fn(worker, *args)); self-contained ------
def worker_receiver_parts(worker, model_dir: str, repeats: int) -> dict:
    """Median seconds of the receiver's parts on tensors already in the worker's memory."""
    import statistics
    import time

    from safetensors.torch import load_file

    from orz.rollout.weight_sync import digest

    # Into ordinary memory first: the staging bucket _unpack copies from is not a file mapping.
    named = {name: t.clone() for name, t in load_file(os.path.join(model_dir, "model.safetensors")).items()}
    parts = {"unpack_clone": [], "digest": [], "reload_weights": []}
    for _ in range(repeats):
        start = time.perf_counter()
        clones = [(n, t.clone()) for n, t in named.items()]
        parts["unpack_clone"].append(time.perf_counter() - start)
        start = time.perf_counter()
        for _, t in clones:
            digest(t)
        parts["digest"].append(time.perf_counter() - start)
        start = time.perf_counter()
        worker.model_runner.reload_weights(weights_iterator=iter(clones))
        parts["reload_weights"].append(time.perf_counter() - start)
    return {k: statistics.median(v) for k, v in parts.items()}


def worker_raw_receive(worker, sizes: list[int], repeats: int) -> None:
    """Receives `repeats` x the bucket sizes over the weight group into one reused buffer."""
    from orz.rollout.weight_sync import broadcast

    buffer = torch.zeros(max(sizes), dtype=torch.uint8)
    for _ in range(repeats):
        for n in sizes:
            broadcast(worker._orz_group, buffer[:n])


def worker_profile(worker, action: str, top: int = 25) -> str | None:
    """Starts ("start") or stops and reports ("stop") a cProfile of the worker's thread."""
    import cProfile
    import io
    import pstats

    if action == "start":
        worker._orz_profile = cProfile.Profile()
        worker._orz_profile.enable()
        return None
    worker._orz_profile.disable()
    out = io.StringIO()
    pstats.Stats(worker._orz_profile, stream=out).sort_stats("tottime").print_stats(top)
    return out.getvalue()


# ---- this process -----------------------------------------------------------------------------
def process_counters(worker=None) -> tuple[float, int]:
    """(CPU seconds, minor page faults) of the calling process so far; as a collective_rpc function,
    of the engine's process (with the uni executor, the worker lives in it)."""
    import resource

    return time.process_time(), resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def timed_syncs(fleet: EngineFleet, source: TensorSource, transport: str, check: str, syncs: int) -> dict:
    """Wall seconds of each sync, CPU seconds and bytes of memory first touched (minor page faults
    x 4 KiB), both summed over this process and the engine's, after a warm-up. On a loaded machine
    the CPU time stays close to the work; the wall time also counts waiting for a core at each of
    the sync's hand-offs between the two processes."""
    import ray

    fleet.cfg.transport, fleet.cfg.sync_check = transport, check
    runs = {"wall": [], "cpu": [], "faulted_bytes": []}

    def engine_counters():
        return ray.get(fleet.engines[0].collective_rpc.remote(process_counters))[0]

    for _ in range(syncs + 1):  # the first is a warm-up
        engine_before, here_before = engine_counters(), process_counters()
        start = time.perf_counter()
        fleet.sync(source, version=fleet.weight_version + 1)
        runs["wall"].append(time.perf_counter() - start)
        here, engine = process_counters(), engine_counters()
        runs["cpu"].append(here[0] - here_before[0] + engine[0] - engine_before[0])
        runs["faulted_bytes"].append((here[1] - here_before[1] + engine[1] - engine_before[1]) * 4096)
    return {k: v[1:] for k, v in runs.items()}


def sender_parts(named: dict[str, torch.Tensor], bucket_bytes: int, repeats: int) -> dict:
    staging = torch.empty(bucket_bytes, dtype=torch.uint8)
    staging.zero_()
    return {
        "pack": median_seconds(lambda: [_pack(b, staging) for b in buckets(named.items(), bucket_bytes)], repeats),
        "digest": median_seconds(lambda: [digest(t) for t in named.values()], repeats),
    }


def wire_and_group(fleet: EngineFleet, sizes: list[int], repeats: int) -> dict:
    """A bare gloo broadcast of the sync's bucket sizes (no packing, digests or reload), and the
    cost of building and closing the group the way fleet.sync does."""
    import ray

    engine = fleet.engines[0]
    start = time.perf_counter()
    ip = ray.util.get_node_ip_address()
    store = host_store(ip)
    name = "bench-raw"
    engine.init_weight_group.remote("gloo", ip, store.port, 1, 2, name, 600.0)
    group = init_custom_process_group("gloo", store, 0, 2, name)
    group_open = time.perf_counter() - start
    buffer = torch.zeros(max(sizes), dtype=torch.uint8)
    received = engine.collective_rpc.remote(worker_raw_receive, (sizes, repeats + 1))
    times = []
    for _ in range(repeats + 1):
        start = time.perf_counter()
        for n in sizes:
            broadcast(group, buffer[:n])
        times.append(time.perf_counter() - start)
    ray.get(received)
    start = time.perf_counter()
    destroy(group)
    ray.get(engine.close_weight_group.remote())
    group_close = time.perf_counter() - start
    return {"wire_broadcast": statistics.median(times[1:]), "group_open": group_open, "group_close": group_close}


def profile_sync(fleet: EngineFleet, source: TensorSource, transport: str) -> str:
    """cProfile of one sync on both sides: the top of each side by own time, as text."""
    import cProfile
    import io
    import pstats

    import ray

    fleet.cfg.transport, fleet.cfg.sync_check = transport, "off"
    ray.get(fleet.engines[0].collective_rpc.remote(worker_profile, ("start",)))
    profile = cProfile.Profile()
    profile.enable()
    fleet.sync(source, version=fleet.weight_version + 1)
    profile.disable()
    engine_text = ray.get(fleet.engines[0].collective_rpc.remote(worker_profile, ("stop",)))[0]
    out = io.StringIO()
    pstats.Stats(profile, stream=out).sort_stats("tottime").print_stats(25)
    return f"==== {transport}: trainer side ====\n{out.getvalue()}\n==== {transport}: engine side ====\n{engine_text}"


def main(args: argparse.Namespace) -> None:
    import ray
    from safetensors.torch import load_file

    threads = set_threads(args.threads)
    limit_sizes = SMOKE_LIMITS if args.smoke else {}
    limits_before = machine_limits(**limit_sizes)
    with tempfile.TemporaryDirectory() as model_dir, ray_session(num_cpus=2, address=args.ray_address):
        char_llama(model_dir, ["0123456789+-*= abcdefghijklmnopqrstuvwxyz?.\n"], vocab_size=args.vocab,
                   hidden_size=args.hidden, intermediate_size=args.intermediate, num_layers=args.layers,
                   num_heads=args.hidden // 64, num_kv_heads=args.kv_heads, seed=0)
        named = load_file(os.path.join(model_dir, "model.safetensors"))  # HF names, as the actor sends them
        params = sum(t.numel() for t in named.values())
        nbytes = sum(t.numel() * t.element_size() for t in named.values())
        sizes = [sum(t.numel() * t.element_size() for _, t in b) for b in buckets(named.items(), args.bucket_mb << 20)]

        # The peer: the same tensors copied into one pre-allocated (faulted-in) flat buffer.
        flat = torch.zeros(nbytes, dtype=torch.uint8)
        views, offset = [], 0
        for t in named.values():
            views.append((flat[offset : offset + t.numel() * t.element_size()].view(t.dtype).view(t.shape), t))
            offset += t.numel() * t.element_size()
        copy_s = median_seconds(lambda: [dst.copy_(src) for dst, src in views], args.syncs)
        cpu = time.process_time()
        median_seconds(lambda: [dst.copy_(src) for dst, src in views], args.syncs, warmup=0)
        copy_cpu_s = (time.process_time() - cpu) / args.syncs
        del flat, views

        started = time.perf_counter()
        fleet = EngineFleet(model_dir, FleetConfig(num_engines=1, engine_args={"max_model_len": 128},
                                                   kv_cache_gib=1, bucket_bytes=args.bucket_mb << 20))
        engine_start_s = time.perf_counter() - started
        source = TensorSource(named)
        try:
            runs = {f"{transport}/{check}": timed_syncs(fleet, source, transport, check, args.syncs)
                    for transport in ("collective", "object_store") for check in ("off", "received")}
            started = time.perf_counter()
            fleet.verify()  # an exact read-back (sync_check="held"): what was timed really landed
            verify_s = time.perf_counter() - started
            split = {
                **{f"sender_{k}": v for k, v in sender_parts(named, args.bucket_mb << 20, args.syncs).items()},
                **wire_and_group(fleet, sizes, args.syncs),
                **{f"receiver_{k}": v for k, v in ray.get(fleet.engines[0].collective_rpc.remote(
                    worker_receiver_parts, (model_dir, args.syncs)))[0].items()},
            }
            profiles = [profile_sync(fleet, source, t) for t in ("collective", "object_store")] if args.profile else []
        finally:
            fleet.shutdown()

    limits = best_limits(limits_before, machine_limits(**limit_sizes))
    copy_gbps = nbytes / copy_s / GB
    figures = {}
    for key, times in runs.items():
        seconds, cpu_seconds = statistics.median(times["wall"]), statistics.median(times["cpu"])
        gbps = nbytes / seconds / GB
        figures[key] = {"seconds": seconds, "all_seconds": times["wall"], "gbps": gbps,
                        "ratio_to_copy": seconds / copy_s, "frac_copy_limit": gbps / limits["copy_gbps"],
                        "cpu_seconds": cpu_seconds, "cpu_ratio_to_copy": cpu_seconds / copy_cpu_s,
                        "faulted_bytes": statistics.median(times["faulted_bytes"])}
    result = {
        "bench": "weight_sync",
        "settings": {"smoke": args.smoke, "params": params, "bytes": nbytes, "dtype": "float32", "hidden": args.hidden,
                     "layers": args.layers, "intermediate": args.intermediate, "vocab": args.vocab,
                     "kv_heads": args.kv_heads, "tensors": len(named), "bucket_bytes": args.bucket_mb << 20,
                     "buckets": len(sizes), "engines": 1, "engine_omp_threads": 1, "syncs": args.syncs,
                     "engine_start_s": engine_start_s},
        "copy": {"seconds": copy_s, "gbps": copy_gbps, "frac_copy_limit": copy_gbps / limits["copy_gbps"],
                 "cpu_seconds": copy_cpu_s},
        "sync": figures,
        "verify_held_seconds": verify_s,
        "split_collective_seconds": {**split, "sum_if_serial": sum(split.values())},
        "limits": limits,
        "threads": threads,
        "machine": machine(),
    }
    emit(result)
    if profiles:
        print(*profiles, sep="\n", file=sys.stderr)


def arguments() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--hidden", type=int, default=768, help="head_dim is 64: hidden/64 heads")
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--intermediate", type=int, default=1280)
    p.add_argument("--kv-heads", type=int, default=4)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--bucket-mb", type=int, default=64, help="the fleet's bucket size (its default is 64)")
    p.add_argument("--syncs", type=int, default=5, help="timed syncs per transport and check, after a warm-up")
    p.add_argument("--threads", type=int, default=1, help="torch threads in this process (sender, copy baseline)")
    p.add_argument("--profile", action="store_true", help="also cProfile one sync per transport on both sides (stderr)")
    p.add_argument("--ray-address", default="", help=RAY_ADDRESS_HELP)
    return parse_args(p, smoke={"hidden": 64, "layers": 1, "intermediate": 128, "kv_heads": 1, "vocab": 64,
                                "bucket_mb": 1, "syncs": 1})


if __name__ == "__main__":
    main(arguments())
