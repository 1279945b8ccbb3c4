"""Runs a function on every rank of a fresh torch.distributed world of local processes.

    results = run_world(fn, 4, arg)   # fn(rank, world_size, arg) on ranks 0..3; their returns

Used by `python -m orz.convert verify`, the demo's pre-training and the multi-rank tests (the
trainer's roles are Ray actors instead, see orz.ppo.workers). The ranks find each other through
MASTER_ADDR/MASTER_PORT on loopback, at a rendezvous this process hosts for them (torchrun's
way: TORCHELASTIC_USE_AGENT_STORE makes every rank, rank 0 too, a client of it);
`init_model_parallel` then joins them.
"""
import multiprocessing as mp
import os
import tempfile
import traceback
from pathlib import Path

import torch


# The ranks fork from one server process that imported these once (megatron-core: ~5 s of CPU,
# which every rank spawned afresh paid again); each rank then imports what its function needs.
# Nothing in them runs a thread pool or a process group, so forking after them is safe. The
# server keeps this process's environment as it was when it started: a rank sets what it needs (_entry).
_PRELOAD = ["__main__", "torch", "megatron.core"]


def _entry(fn, rank, world_size, port, out_dir, args):
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world_size), OMP_NUM_THREADS="1", TORCHELASTIC_USE_AGENT_STORE="True",
    )
    torch.set_num_threads(1)
    try:
        result = fn(rank, world_size, *args)
        torch.save({"ok": result}, Path(out_dir) / f"{rank}.pt")
    except BaseException:
        torch.save({"error": traceback.format_exc()}, Path(out_dir) / f"{rank}.pt")
    finally:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()


def run_world(fn, world_size: int, *args, timeout: float = 180.0) -> list:
    """Returns fn's result on each rank; raises with every failing rank's traceback."""
    from orz.models.parallel import host_store

    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(_PRELOAD)  # taken when this process starts its server, once
    store = host_store("127.0.0.1", timeout)  # held until every rank is done
    with tempfile.TemporaryDirectory() as out_dir:
        procs = [ctx.Process(target=_entry, args=(fn, r, world_size, store.port, out_dir, args)) for r in range(world_size)]
        for p in procs:
            p.start()
        for p in procs:
            p.join(timeout)
        hung = [r for r, p in enumerate(procs) if p.is_alive()]
        for p in procs:
            if p.is_alive():
                p.kill()
        results = {}
        for r in range(world_size):
            path = Path(out_dir) / f"{r}.pt"
            results[r] = torch.load(path, weights_only=False) if path.exists() else {"error": "no result (crashed)"}
    errors = {r: v["error"] for r, v in results.items() if "error" in v}
    if hung or errors:
        raise RuntimeError(f"hung ranks {hung}; errors: " + "\n".join(f"[rank {r}] {e}" for r, e in errors.items()))
    return [results[r]["ok"] for r in range(world_size)]
