"""Every bench/bench_*.py still runs: each in --smoke mode (the same code path on a tiny workload)
prints its ONE JSON line, with every field its docstring lists under "Fields:".

    .venv/bin/python -m pytest -q tests/test_bench_smoke.py

The benchmarks share the suite's Ray cluster (--ray-address) and one pre-trained tiny base model,
and run in two lanes at once: the RL runs (bench_e2e, then bench_async, which finds the base that
bench_e2e built) beside the rest. bench/vs_trl.py needs .venv-bench and stays out.
"""
import ast
import json
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow
REPO = Path(__file__).resolve().parents[1]
BENCHES = sorted(path.stem.removeprefix("bench_") for path in (REPO / "bench").glob("bench_*.py"))
LANES = [["e2e", "async", "distill"], [name for name in BENCHES if name not in ("e2e", "async", "distill")]]
NEEDS_RAY = {"rollout", "weight_sync", "e2e", "async", "multiturn", "distill", "lora"}
NEEDS_BASE = {"e2e", "async", "distill"}
SMOKE_ARGS = {"multiturn": ["--vary-latency", "--repeats", "2"]}  # beside --smoke: what a test below checks


def documented_fields(name: str) -> list[str]:
    """The dotted paths after "Fields:" in the benchmark's module docstring, up to the closing period."""
    docstring = ast.get_docstring(ast.parse((REPO / "bench" / f"bench_{name}.py").read_text()))
    found = re.search(r"^Fields: (.*?)\.$", docstring, re.DOTALL | re.MULTILINE)
    assert found, f"bench_{name}.py's docstring lists no 'Fields:'"
    return [field.strip() for field in found.group(1).split(",")]


def printed_record(done: subprocess.CompletedProcess) -> dict:
    """The one JSON line a benchmark printed."""
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    assert len(lines) == 1, done.stdout[-3000:]
    return json.loads(lines[0])


def has_field(record: dict, path: str) -> bool:
    for key in path.split("."):
        if not isinstance(record, dict) or key not in record:
            return False
        record = record[key]
    return True


@pytest.fixture(scope="module")
def smoke_runs(ray_cluster, tmp_path_factory):
    """{name: (completed process, seconds)} of every benchmark run with --smoke."""
    address = ray_cluster.get_runtime_context().gcs_address
    base_root = tmp_path_factory.mktemp("demo_base")
    runs = {}

    def lane(names):
        for name in names:
            command = [sys.executable, str(REPO / "bench" / f"bench_{name}.py"), "--smoke"]
            command += ["--ray-address", address] if name in NEEDS_RAY else []
            command += ["--base-root", str(base_root)] if name in NEEDS_BASE else []
            command += SMOKE_ARGS.get(name, [])
            start = time.perf_counter()
            done = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=600)
            runs[name] = (done, time.perf_counter() - start)
            print(f"bench_{name}.py --smoke: exit {done.returncode} after {runs[name][1]:.0f} s", flush=True)

    threads = [threading.Thread(target=lane, args=(names,)) for names in LANES]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return runs


def test_every_benchmark_is_in_a_lane():
    assert sorted(sum(LANES, [])) == BENCHES and len(BENCHES) == 11


@pytest.mark.parametrize("name", BENCHES)
def test_bench_smoke_prints_its_json_line_with_the_documented_fields(smoke_runs, name):
    done, seconds = smoke_runs[name]
    assert done.returncode == 0, f"bench_{name}.py --smoke failed after {seconds:.0f} s:\n{done.stderr[-3000:]}"
    record = printed_record(done)
    fields = documented_fields(name)
    missing = [path for path in fields if not has_field(record, path)]
    assert not missing, f"bench_{name}.py's JSON line lacks {missing}"
    undocumented = set(record) - {path.split(".")[0] for path in fields}
    assert not undocumented, f"bench_{name}.py prints fields its docstring does not list: {sorted(undocumented)}"
    assert record["bench"] and (record.get("settings") or record.get("workload"))["smoke"] is True


def test_bench_rollout_smoke_generates_every_target_token(smoke_runs):
    """--smoke: 4 prompts x 2 samples x 8 tokens = 64 fixed-length tokens on each side. The variable
    workload's per-sample targets (per-request max_tokens in vLLM) give both sides the same tokens,
    and they differ within a transformers batch (padding: fewer real tokens than computed slots)."""
    record = printed_record(smoke_runs["rollout"][0])
    assert record["fixed"]["orz"]["tokens"] == record["fixed"]["transformers"]["tokens"] == 4 * 2 * 8
    assert record["variable"]["orz"]["tokens"] == record["variable"]["transformers"]["tokens"]
    assert record["variable"]["transformers"]["tokens"] < record["variable"]["transformers"]["computed_slots"]


def test_bench_multiturn_vary_latency_gives_each_repeat_its_own_draws(smoke_runs):
    """--vary-latency --repeats 2: repeat r waits for the tool latencies of seed + r, so the two
    repeats' slowest samples (their critical paths, from those draws) differ."""
    record = printed_record(smoke_runs["multiturn"][0])
    assert record["settings"]["latency"]["seeds"] == [0, 1]
    first, second = record["bound"]["critical_path_s_per_repeat"]
    assert first != second
    assert len(record["ratio_per_repeat"]) == 2
