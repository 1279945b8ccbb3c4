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


def _wandb_log_records(path: Path):
    """The protobuf payloads of a .wandb file: LevelDB's log format (32 KiB blocks of records, each
    a 7-byte header — checksum, little-endian length, type: full, first, middle, last) after a
    7-byte ':W&B' header. wandb 0.31 ships no Python reader of its own (wandb-core writes it)."""
    data, block = path.read_bytes(), 32768
    assert data[:4] == b":W&B", path
    pos, parts = 7, []
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's tail too short for a header is padding
            pos += block - pos % block
            continue
        length, kind = int.from_bytes(data[pos + 4:pos + 6], "little"), data[pos + 6]
        payload, pos = data[pos + 7:pos + 7 + length], pos + 7 + length
        if kind == 0:  # zero padding at the end of a block
            continue
        parts.append(payload)
        if kind in (1, 4):  # a full record, or the last part of one
            yield b"".join(parts)
            parts = []


def wandb_records(out):
    """(run ids, display names, config, history steps) from every offline run under out/wandb."""
    from wandb.proto import wandb_internal_pb2

    ids, names, config, steps = set(), set(), {}, []
    for path in sorted(Path(out).glob("wandb/offline-run-*/run-*.wandb")):
        for data in _wandb_log_records(path):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(data)
            kind = record.WhichOneof("record_type")
            if kind == "run":
                ids.add(record.run.run_id)
                names.add(record.run.display_name)
                config |= {item.key: json.loads(item.value_json) for item in record.run.config.update}
            elif kind == "config":
                config |= {item.key: json.loads(item.value_json) for item in record.config.update}
            elif kind == "history":
                steps.append(record.history.step.num)
    return ids, names, config, steps
