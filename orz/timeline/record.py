"""What one process records for the run's timeline: spans, counters and instants on its own clock.

    from orz.timeline.record import RECORDER
    with RECORDER.span("actor/rank 0", "forward"):       # a lane ("party/lane"), a name
        ...
    token = RECORDER.begin("engines/engine 0", "busy")   # a span left open across calls ...
    RECORDER.end(token)                                  # ... and closed
    RECORDER.count("engines/engine 0", "turns in flight", 3)
    RECORDER.instant("trainer/faults", "restart 1", cause="...")
    events = RECORDER.drain()                            # the trainer collects them (trace.py)

A span still open when drained is cut there: its part so far is drained, and it goes on from then,
so that each iteration's figures hold all of its time and no span crosses two iterations.

Every process (the trainer, each Megatron worker) has one RECORDER. Its clock is the wall clock
(`time.time`, seconds): a run resumed on another node stays in order. The trainer measures each
process's offset from its own clock at start (trace.offset_s) and shifts what it collects. An event
is a plain tuple, cheap to make and to send: (kind, lane, name, start, seconds, args).
Off (`RECORDER.on = False`, trainer.timeline=false), nothing is kept.
"""
from __future__ import annotations

import contextlib
import itertools
import threading
import time

SPAN, COUNTER, INSTANT = "X", "C", "i"  # Chrome's phase letters


class Recorder:
    def __init__(self):
        self.clock = time.time  # seconds; replaceable, so that a test can skew one process's clock
        self.on = True
        self._events: list[tuple] = []
        self._open: dict[int, list] = {}  # token -> [lane, name, start, args]
        self._tokens = itertools.count(1)
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

    def begin(self, lane: str, name: str, **args) -> int:
        """Opens a span; `end(token)` closes it (0: recording is off)."""
        if not self.on:
            return 0
        token = next(self._tokens)
        with self._lock:
            self._open[token] = [lane, name, self.clock(), args]
        return token

    def end(self, token: int) -> None:
        with self._lock:
            opened = self._open.pop(token, None)
        if opened is not None:
            lane, name, start, args = opened
            self.add(lane, name, start, self.clock(), **args)

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
        """Everything recorded since the last drain, open spans cut at now."""
        with self._lock:
            now = self.clock()
            for opened in self._open.values():
                lane, name, start, args = opened
                self._events.append((SPAN, lane, name, start, now - start, args))
                opened[2] = now
            events, self._events = self._events, []
        return events


RECORDER = Recorder()
