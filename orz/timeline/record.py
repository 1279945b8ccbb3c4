"""What one process records for the run's timeline: spans, counters and instants on its own clock.

    from orz.timeline.record import RECORDER
    with RECORDER.span("actor/rank 0", "forward"):       # a lane ("party/lane"), a name
        ...
    RECORDER.count("engines/engine 0", "requests in flight", 3)
    RECORDER.instant("trainer/faults", "restart 1", cause="...")
    events = RECORDER.drain()                            # the trainer collects them (trace.py)

Every process (the trainer, each Megatron worker) has one RECORDER. Its clock is the wall clock
(`time.time`, seconds): a run resumed on another node stays in order. The trainer measures each
process's offset from its own clock at start (trace.offset_s) and shifts what it collects. An event
is a plain tuple, cheap to make and to send: (kind, lane, name, start, seconds, args).
Off (`RECORDER.on = False`, trainer.timeline=false), nothing is kept.
"""
from __future__ import annotations

import contextlib
import threading
import time

SPAN, COUNTER, INSTANT = "X", "C", "i"  # Chrome's phase letters


class Recorder:
    def __init__(self):
        self.clock = time.time  # seconds; replaceable, so that a test can skew one process's clock
        self.on = True
        self._events: list[tuple] = []
        self._lock = threading.Lock()  # drain swaps the list while threads append

    def now(self) -> float:
        return self.clock()

    @contextlib.contextmanager
    def span(self, lane: str, name: str, **args):
        """Records [enter, exit) of the block, also when it raises."""
        start = self.clock()
        try:
            yield
        finally:
            self.add(lane, name, start, self.clock(), **args)

    def add(self, lane: str, name: str, start: float, end: float, **args) -> None:
        """A span measured elsewhere, on this process's clock."""
        if self.on:
            self._append((SPAN, lane, name, start, end - start, args))

    def count(self, lane: str, name: str, value: float, at: float | None = None) -> None:
        if self.on:
            self._append((COUNTER, lane, name, self.clock() if at is None else at, 0.0, {"value": value}))

    def instant(self, lane: str, name: str, **args) -> None:
        if self.on:
            self._append((INSTANT, lane, name, self.clock(), 0.0, args))

    def _append(self, event: tuple) -> None:
        with self._lock:
            self._events.append(event)

    def drain(self) -> list[tuple]:
        """Everything recorded since the last drain."""
        with self._lock:
            events, self._events = self._events, []
        return events


RECORDER = Recorder()
