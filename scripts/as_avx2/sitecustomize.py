"""Run Python as on a CPU with AVX2 and no AVX-512 (`make test-as-avx2`), to find tests that
depend on the CPU from a machine that has AVX-512.

The Makefile also sets ATEN_CPU_CAPABILITY=avx2 (torch's own kernels), ONEDNN_MAX_CPU_ISA=AVX2
(oneDNN: vLLM's linear layers, torch's bf16 matmul, which then takes torch's slow path as on an
AVX2 CPU) and MKL_ENABLE_INSTRUCTIONS=AVX2 (fp32 GEMM). What no variable reaches is vLLM's choice
of its compiled kernels (vllm/platforms/cpu.py reads torch.cpu's capabilities): this hides the
AVX-512 and AMX entries from torch.cpu.get_capabilities, so it loads vllm._C_AVX2. Not the same
as an AVX2 machine (its clock, caches and MKL's choices on AMD differ), but the same kernels.
"""
import importlib.abc
import importlib.machinery
import sys
from types import MappingProxyType

HIDDEN = ("avx512", "avx10", "amx")


class _TorchCpuFinder(importlib.abc.MetaPathFinder):
    """Wraps torch.cpu.get_capabilities once torch.cpu is imported."""

    def find_spec(self, name, path, target=None):
        if name != "torch.cpu":
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        execute = spec.loader.exec_module

        def exec_module(module):
            execute(module)
            detected = module.get_capabilities

            def get_capabilities():
                return MappingProxyType({key: False if key.startswith(HIDDEN) else value
                                         for key, value in detected().items()})

            module.get_capabilities = get_capabilities

        spec.loader.exec_module = exec_module
        return spec


sys.meta_path.insert(0, _TorchCpuFinder())
