"""A device's peak FLOP/s, the denominator of MFU.

    peak = peak_flops_per_s(threads=2)     # GPU: the datasheet's bf16 dense peak; CPU: measured
    copy = measured_copy_bytes_per_s(1)    # CPU: the copy bandwidth (the planner's "this machine, measured")

On GPU the peak is the datasheet's (orz.plan.inputs.GPUS, by the device's name; None for a GPU
it does not list). On CPU it is a rate measured once: fp32 square matmuls (the dtype the roles
train in on CPU) on `threads` torch threads for about `seconds`, the best of its repeats. That is
what this machine's BLAS reaches on this budget, not a datasheet figure: MFU on CPU is against it.
"""
from __future__ import annotations

import time

import torch

from orz.plan.inputs import GPUS


def measured_matmul_flops_per_s(threads: int, size: int = 512, seconds: float = 0.3) -> float:
    """The best rate of (size × size) @ (size × size) fp32 on `threads` threads: 2·size³ per product."""
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        a, b = torch.randn(size, size), torch.randn(size, size)
        a @ b  # warm-up: BLAS's first call allocates
        best, deadline = 0.0, time.perf_counter() + seconds
        while time.perf_counter() < deadline:
            start = time.perf_counter()
            for _ in range(4):
                a @ b
            best = max(best, 4 * 2 * size**3 / (time.perf_counter() - start))
        return best
    finally:
        torch.set_num_threads(previous)


def measured_copy_bytes_per_s(threads: int, nbytes: int = 64 << 20, repeats: int = 5) -> float:
    """The best rate of copying `nbytes` into a tensor already touched, on `threads` threads (bytes/s):
    what decoding, which reads every weight once per step, is bound by on CPU."""
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        src = torch.randn(nbytes // 4)
        dst = torch.zeros_like(src)  # touched: no page faults while timed
        best = 0.0
        for _ in range(repeats):
            start = time.perf_counter()
            dst.copy_(src)
            best = max(best, nbytes / (time.perf_counter() - start))
        return best
    finally:
        torch.set_num_threads(previous)


def peak_flops_per_s(threads: int) -> float | None:
    """One worker's peak: its GPU's datasheet figure, or on CPU the measured rate on its threads."""
    if torch.cuda.is_available():  # untested here (no GPU)
        name = torch.cuda.get_device_name()
        known = [gpu for key, gpu in GPUS.items() if key in name]
        return known[0].tflops * 1e12 if known else None
    return measured_matmul_flops_per_s(threads)
