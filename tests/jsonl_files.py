"""Rows written as the data files a user hands orz: one JSON object per line."""
import json
from pathlib import Path


def write_jsonl(path, rows) -> Path:
    """`rows` (dicts) into `path`, a JSON object per line; returns the path."""
    path = Path(path)
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path
