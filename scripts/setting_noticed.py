"""Does any test notice when a setting is ignored? For each config key: a scratch copy of the tree
in which every read of the key outside orz/config.py and orz/run/run_rules.py returns the field's
default (whatever the config says: the setting is "ignored where it is read"), and the tests that
mention the key run there. A key whose tests all still pass is one no test notices.

    .venv/bin/python scripts/setting_noticed.py rollout.top_p algorithm.kl_coef     # one JSON line per key
    .venv/bin/python scripts/setting_noticed.py --sections rollout,algorithm --list  # the keys, no run

Not part of `make test`: each key runs its tests once (minutes for a key that end-to-end tests
mention). Reads by config.py (serialisation, overrides) and by the refusal rules keep the real
value, so that a key counts as noticed by what it does, not by a refusal of a bad value. A field
of RoleConfig (actor.*, critic.*, ref.*) is ignored on every role at once, since the roles share
the class. Processes the tests start (`orz train`, Ray's workers) import the scratch copy through
PYTHONPATH.
"""
from __future__ import annotations

import argparse
import ast
import dataclasses
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import typing
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from orz.config import ExperimentConfig  # noqa: E402

# Appended to the scratch copy's orz/config.py: the field becomes a property that returns its
# default to every reader but config.py itself, run_rules.py and dataclasses (replace, asdict).
IGNORE = '''

def _ignored_where_read(cls, name, default):
    import sys as _sys
    keep = (__file__, __file__.replace("config.py", "run/run_rules.py"), dataclasses.__file__)

    def read(self):
        if _sys._getframe(1).f_code.co_filename in keep:
            return self.__dict__[name]
        return default()

    def write(self, value):
        self.__dict__[name] = value

    setattr(cls, name, property(read, write))


_ignored_where_read({cls}, {name!r}, {default})
'''


def field_of(key: str) -> tuple[type, dataclasses.Field]:
    """The dataclass and field a dotted key names (`reward.model.path` → RewardModelConfig.path)."""
    cls, parts = ExperimentConfig, key.split(".")
    for i, part in enumerate(parts):
        fields = {f.name: f for f in dataclasses.fields(cls)}
        if part not in fields:
            raise SystemExit(f"error: {key}: no field {part!r} in {cls.__name__} (fields: {', '.join(fields)})")
        if i == len(parts) - 1:
            return cls, fields[part]
        cls = typing.get_type_hints(cls)[part]


def keys_of(sections: list[str]) -> list[str]:
    """Every leaf key under these sections."""
    out = []

    def walk(cls, prefix):
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            kind = hints[f.name]
            if dataclasses.is_dataclass(kind):
                walk(kind, f"{prefix}{f.name}.")
            else:
                out.append(f"{prefix}{f.name}")

    for section in sections:
        walk(typing.get_type_hints(ExperimentConfig)[section], f"{section}.")
    return out


def tests_mentioning(key: str, tests: Path) -> list[str]:
    """Node ids of the test functions whose source names the key (or its last part, quoted, or as
    `key=`), so that fixtures and runs they share are built once."""
    leaf = key.split(".")[-1]
    needles = (key, f"{leaf}=", f'"{leaf}"', f"'{leaf}'", f".{leaf}")
    ids = []
    for path in sorted(tests.glob("test_*.py")):
        text = path.read_text()
        if not any(n in text for n in needles):
            continue
        for node in ast.parse(text).body:
            if isinstance(node, ast.FunctionDef) and node.name.startswith("test_"):
                source = ast.get_source_segment(text, node) or ""
                if any(n in source for n in needles):
                    ids.append(f"tests/{path.name}::{node.name}")
    return ids


def scratch_copy(key: str) -> Path:
    """The tracked tree copied into a temporary directory, the key ignored where it is read."""
    cls, f = field_of(key)
    scratch = Path(tempfile.mkdtemp(prefix=f"orz-ignored-{key}-"))
    files = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout.split()
    for name in files:
        (scratch / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / name, scratch / name)
    value = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
    with open(scratch / "orz/config.py", "a") as config:  # a fresh copy of the default for each read
        config.write(IGNORE.format(cls=cls.__name__, name=f.name, default=f"lambda: {value!r}"))
    return scratch


def check(key: str, timeout_s: int) -> dict:
    tests = tests_mentioning(key, ROOT / "tests")
    result = {"key": key, "tests": len(tests), "noticed": None, "failed": [], "seconds": 0.0}
    if not tests:
        return result
    scratch = scratch_copy(key)
    start = time.time()
    env = os.environ | {"PYTHONPATH": os.pathsep.join([str(scratch), str(scratch / "tests")])}
    try:
        run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rf", *tests],
                             cwd=scratch, env=env, capture_output=True, text=True, timeout=timeout_s)
        failed = [line.split(" ")[1] for line in run.stdout.splitlines() if line.startswith("FAILED ")]
        result |= {"noticed": run.returncode != 0, "failed": failed}
    except subprocess.TimeoutExpired:
        result |= {"noticed": None, "failed": [f"timed out after {timeout_s} s"]}
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    result["seconds"] = round(time.time() - start, 1)
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("keys", nargs="*", help="config keys, e.g. rollout.top_p")
    parser.add_argument("--sections", default="", help="every key of these sections, comma-separated")
    parser.add_argument("--list", action="store_true", help="print the keys and their tests; run nothing")
    parser.add_argument("--timeout", type=int, default=3600, help="seconds per key")
    args = parser.parse_args(argv)
    keys = list(args.keys) + (keys_of(args.sections.split(",")) if args.sections else [])
    for key in keys:
        field_of(key)  # every key named exists, before anything runs
    for key in keys:
        if args.list:
            print(json.dumps({"key": key, "tests": tests_mentioning(key, ROOT / "tests")}))
        else:
            print(json.dumps(check(key, args.timeout)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
