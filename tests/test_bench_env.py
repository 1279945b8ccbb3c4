"""`make bench-env` (the TRL peer's venv for `make bench-trl`) installs on top of the core venv
without touching it: afterwards TRL imports there, and the core venv still imports transformers."""
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow
REPO = Path(__file__).resolve().parents[1]


def test_bench_env_installs_trl_beside_the_core_venv():
    core = subprocess.run([sys.executable, "-m", "pip", "freeze"], capture_output=True, text=True).stdout
    make = subprocess.run(["make", "-C", str(REPO), "bench-env"], capture_output=True, text=True, timeout=1200)
    assert make.returncode == 0, make.stdout[-2000:] + make.stderr[-2000:]
    bench_python = REPO / ".venv-bench/bin/python"
    check = subprocess.run([str(bench_python), "-c", "import trl, transformers, orz; from transformers import LlamaConfig; "
                            "print(trl.__version__)"], capture_output=True, text=True)
    assert check.returncode == 0 and check.stdout.strip() == "1.16.0", check.stderr[-2000:]
    after = subprocess.run([sys.executable, "-m", "pip", "freeze"], capture_output=True, text=True).stdout
    assert after == core  # nothing installed into, or removed from, the venv the tests use
    assert subprocess.run([sys.executable, "-c", "from transformers import LlamaConfig"]).returncode == 0
