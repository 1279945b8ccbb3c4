"""Where output goes: orz's own lines and progress to the terminal, everything else to a log file.

    with output_to(out / "logs" / "driver.log"):  # everything this process prints, C++ too
        ray.init(...)
    with quiet_driver(out / "logs"):    # the trainer's process: warnings and library loggers to driver.log
    to_log_file(log_dir, "actor-0")     # a Ray worker: its stdout and stderr (C++ included) to actor-0.log

`trainer.verbose=true` skips both and streams every worker's output to the terminal, as Ray does by
default. Errors still reach the terminal in full either way: a failing role's exception travels
back to the trainer with its traceback.
"""
from __future__ import annotations

import contextlib
import logging
import os
import sys
from pathlib import Path
from typing import Iterator

THIRD_PARTY_LOGGERS = ("ray", "vllm", "megatron", "transformers", "torch", "urllib3", "filelock", "py.warnings")


def _point(fds: tuple[int, ...], path: Path) -> None:
    """These file descriptors (1: stdout, 2: stderr) of this process, C++ writers included, append to `path`."""
    path.parent.mkdir(parents=True, exist_ok=True)
    sys.stdout.flush()
    sys.stderr.flush()
    log = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    for fd in fds:
        os.dup2(log, fd)
    os.close(log)


def to_log_file(log_dir: str, name: str) -> None:
    """Points this process's stdout and stderr at log_dir/name.log for good ("" keeps them)."""
    if log_dir:
        _point((1, 2), Path(log_dir) / f"{name}.log")


@contextlib.contextmanager
def output_to(path: Path, fds: tuple[int, ...] = (1, 2)) -> Iterator[None]:
    """While it lasts, these file descriptors of this process (stdout and stderr) go to `path`:
    for calls that print from C++ or reset the loggers, like `ray.init`; processes started
    meanwhile inherit them."""
    saved = [os.dup(fd) for fd in fds]
    _point(fds, path)
    try:
        yield
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        for fd, original in zip(fds, saved):
            os.dup2(original, fd)
            os.close(original)


@contextlib.contextmanager
def quiet_driver(log_dir: Path) -> Iterator[Path]:
    """While it lasts, Python warnings and third-party loggers of this process go to
    log_dir/driver.log, not the terminal; yields that file's path."""
    log_dir.mkdir(parents=True, exist_ok=True)
    path = log_dir / "driver.log"
    handler = logging.FileHandler(path)
    handler.setFormatter(logging.Formatter("%(asctime)s %(name)s %(levelname)s %(message)s"))
    loggers = [logging.getLogger(name) for name in THIRD_PARTY_LOGGERS]
    saved = [(logger.handlers[:], logger.propagate) for logger in loggers]
    logging.captureWarnings(True)
    for logger in loggers:
        logger.handlers, logger.propagate = [handler], False
    try:
        yield path
    finally:
        logging.captureWarnings(False)
        for logger, (handlers, propagate) in zip(loggers, saved):
            logger.handlers, logger.propagate = handlers, propagate
        handler.close()
