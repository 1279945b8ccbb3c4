"""`make test-as-avx2` runs the suite as on an AVX2-only CPU: torch.cpu reports no AVX-512 (so
vLLM loads its AVX2 kernels), torch's own kernels and oneDNN stop at AVX2 (so a bf16 matmul
is not oneDNN's). On an AVX2-only machine each holds already."""
import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PROBE = """
import torch
from vllm.platforms import current_platform
current_platform.import_kernels()
kernels = [line.rsplit("/", 1)[1].strip() for line in open("/proc/self/maps") if "/vllm/_C" in line]
print(torch.cpu._is_avx512_supported(), torch.backends.cpu.get_cpu_capability(),
      torch.ops.mkldnn._is_mkldnn_bf16_supported(), sorted(set(kernels)))
"""


def test_the_make_target_holds_torch_onednn_and_vllm_to_avx2():
    recipe = subprocess.run(["make", "-n", "-C", str(REPO), "test-as-avx2"], capture_output=True, text=True).stdout
    env = dict(re.findall(r"([A-Z_]+)=(\S+)", recipe.split("python -m pytest")[0]))
    assert set(env) == {"PYTHONPATH", "ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA", "MKL_ENABLE_INSTRUCTIONS"}
    probe = subprocess.run([sys.executable, "-c", PROBE], env={"PATH": "/usr/bin:/bin", **env}, cwd=REPO,
                           capture_output=True, text=True, timeout=300)
    assert probe.returncode == 0, probe.stderr[-2000:]
    assert probe.stdout.splitlines()[-1] == "False AVX2 False ['_C_AVX2.abi3.so']"
