"""What the end-to-end tests read back from a run's output directory."""
import json
from pathlib import Path

# Timings differ from run to run; everything else must not.
NONDETERMINISTIC = ("timing/", "throughput/", "reward/verify_", "cpu_s", "sync_seconds", "wall_s")


def history(out) -> list[dict]:
    """metrics.jsonl, a dict per line (step 0: the evaluation before training)."""
    return [json.loads(line) for line in (Path(out) / "metrics.jsonl").read_text().splitlines()]


def deterministic(row: dict) -> dict:
    """A metrics row without the figures that depend on the machine's speed."""
    return {k: v for k, v in row.items() if not any(part in k for part in NONDETERMINISTIC)}
