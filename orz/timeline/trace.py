"""timeline.json: the trainer's writer of the run's timeline, and a reader.

    timeline = Timeline(out / "timeline.json", resume=False)
    timeline.offsets["actor-0"] = offset_s(lambda: ray.get(worker.clock.remote()))
    timeline.add(events, process="actor-0")      # shifted onto the trainer's clock
    written = timeline.flush(iteration)           # the iteration's events, capped, appended to the file
    timeline.close()                              # the closing "]"
    events = load(path)                           # what a reader gets, also from a killed run's file

The file is Chrome's JSON array format, one event per line: "[", then `{...},` lines. A finished
run's file ends with an instant "run ended" and "]" (strict JSON); a killed run's does not (the format allows it: Perfetto and
chrome://tracing load it), and may end in a line the kill cut, which `load` skips. A resumed run
appends to the same file, its "]" and any cut line removed first: one timeline covers every part.

Lanes are "party/lane": the party is a Chrome process, the lane a thread. Spans of one lane that
overlap without nesting (a pool's parallel calls) go to sub-lanes "lane #2", "lane #3", ... so
that no lane overlaps itself. `ts` and `dur` are microseconds of the trainer's clock.

Bounded: per iteration, a lane keeps its first CAP_PER_LANE events; beyond them its spans of one
name merge into one span "name ×N" (args `calls`, `busy_s`) and its counters keep their last
value. The file grows by at most lanes × (CAP_PER_LANE + names) events per iteration.

Clocks: every process stamps events with its own wall clock. At start the trainer asks each
process for its clock (offset_s: the reading minus the midpoint of the call, from the call with the
shortest round trip, so within half of it) and subtracts that offset from what it collects.
Ray's own timeline does not: it writes each event at its own process's time.
"""
from __future__ import annotations

import json
import time
from collections import defaultdict
from pathlib import Path
from typing import Callable

from orz.timeline.record import COUNTER, INSTANT, SPAN

CAP_PER_LANE = 256


def offset_s(remote_now: Callable[[], float], clock: Callable[[], float] = time.time, tries: int = 3) -> float:
    """How far another process's clock runs ahead of `clock` (seconds)."""
    best = None
    for _ in range(tries):
        before = clock()
        remote = remote_now()
        after = clock()
        if best is None or after - before < best[0]:
            best = (after - before, remote - (before + after) / 2)
    return best[1]


def capped(events: list[tuple], cap: int = CAP_PER_LANE) -> list[tuple]:
    """Each lane's first `cap` events (by start); the rest merged as the module docstring says."""
    by_lane = defaultdict(list)
    for event in events:
        by_lane[event[1]].append(event)
    out = []
    for lane, lane_events in by_lane.items():
        lane_events.sort(key=lambda e: e[3])
        out += lane_events[:cap]
        spans, counters = defaultdict(list), {}
        for kind, _, name, start, seconds, args in lane_events[cap:]:
            if kind == SPAN:
                spans[name].append((start, seconds))
            elif kind == COUNTER:
                counters[name] = (kind, lane, name, start, seconds, args)
        for name, parts in spans.items():
            first, last = min(s for s, _ in parts), max(s + d for s, d in parts)
            out.append((SPAN, lane, f"{name} ×{len(parts)}", first, last - first,
                        {"calls": len(parts), "busy_s": sum(d for _, d in parts)}))
        out += counters.values()
    return out


class Timeline:
    def __init__(self, path: Path, resume: bool):
        """resume: append to the file a run before this one wrote (else start it anew)."""
        self.path = Path(path)
        self.offsets: dict[str, float] = {}  # process -> how far its clock runs ahead of the trainer's
        self.pending: list[tuple] = []
        self._ids: dict[str, tuple[int, int]] = {}  # lane (sub-lane included) -> (pid, tid)
        self._parties: dict[str, int] = {}
        self._open: dict[str, list[list[float]]] = {}  # lane -> per sub-lane, the ends of its open spans
        if resume and self.path.exists():
            text = self.path.read_text()
            whole = text[: text.rfind("\n") + 1]  # a line the kill cut has no newline
            if whole.endswith("}\n]\n"):  # a finished part: its last event takes the comma back
                whole = whole[:-3] + ",\n"
            self.path.write_text(whole or "[\n")
            for (pid, tid), lane in lanes(load(self.path)).items():  # the same pid and tid for a lane as before
                self._ids[lane] = pid, tid
                self._parties[lane.partition("/")[0]] = pid
        else:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self.path.write_text("[\n")

    def add(self, events: list[tuple], process: str = "") -> None:
        """Events from `process` (its clock offset measured; "" is the trainer's own)."""
        shift = self.offsets.get(process, 0.0)
        self.pending += [(kind, lane, name, start - shift, seconds, args)
                          for kind, lane, name, start, seconds, args in events]

    def flush(self, iteration: int) -> list[tuple]:
        """Appends what was added since the last flush, capped (the events returned, trainer's clock)."""
        events, self.pending = capped(self.pending), []
        events.sort(key=lambda e: (e[3], -e[4]))  # by start, the enclosing span first
        lines = []
        for kind, lane, name, start, seconds, args in events:
            lines += self._chrome(kind, self._sub_lane(lane, start, seconds) if kind == SPAN else lane,
                                  name, start, seconds, {**args, "iteration": iteration})
        with self.path.open("a") as f:
            f.write("".join(json.dumps(line) + ",\n" for line in lines))
        return events

    def close(self, clock=time.time) -> None:
        """A finished file, strict JSON: an instant "run ended", and the array closed (a resume reopens it)."""
        if self.pending:
            self.flush(-1)
        end = self._chrome(INSTANT, "trainer/run", "run ended", clock(), 0.0, {"iteration": -1})
        with self.path.open("a") as f:
            f.write("".join(json.dumps(line) + ",\n" for line in end[:-1]) + json.dumps(end[-1]) + "\n]\n")

    def _sub_lane(self, lane: str, start: float, seconds: float) -> str:
        """The first of the lane's sub-lanes where the span starts after, or nests within, what is open."""
        subs = self._open.setdefault(lane, [])
        end = start + seconds
        for i, ends in enumerate(subs + [[]]):
            while ends and ends[-1] <= start:
                ends.pop()
            if not ends or end <= ends[-1]:
                if i == len(subs):
                    subs.append(ends)
                ends.append(end)
                return lane if i == 0 else f"{lane} #{i + 1}"
        raise AssertionError("unreachable: a new sub-lane always fits")

    def _chrome(self, kind: str, lane: str, name: str, start: float, seconds: float, args: dict) -> list[dict]:
        """The Chrome event, after the metadata that names its process and thread the first time."""
        lines = []
        if lane not in self._ids:
            party, _, thread = lane.partition("/")
            if party not in self._parties:
                self._parties[party] = len(self._parties) + 1
                lines.append({"ph": "M", "name": "process_name", "pid": self._parties[party], "args": {"name": party}})
                lines.append({"ph": "M", "name": "process_sort_index", "pid": self._parties[party],
                              "args": {"sort_index": self._parties[party]}})
            pid = self._parties[party]
            self._ids[lane] = pid, 1 + max((t for p, t in self._ids.values() if p == pid), default=0)
            lines.append({"ph": "M", "name": "thread_name", "pid": pid, "tid": self._ids[lane][1],
                          "args": {"name": thread}})
        pid, tid = self._ids[lane]
        event = {"ph": kind, "name": name, "pid": pid, "tid": tid, "ts": round(start * 1e6, 1)}
        if kind == SPAN:
            event["dur"] = round(seconds * 1e6, 1)
        elif kind == COUNTER:
            event["name"] = f"{lane.partition('/')[2]}: {name}"
            args = {"value": args["value"]}
        elif kind == INSTANT:
            event["s"] = "t"
        return lines + [{**event, "args": args}]


def load(path: Path) -> list[dict]:
    """The file's events, up to the last whole one (a kill may cut the last line)."""
    events = []
    for line in Path(path).read_text().split("\n")[1:]:
        line = line.rstrip().rstrip(",")
        if line in ("", "]"):
            continue
        try:
            events.append(json.loads(line))
        except json.JSONDecodeError:
            break
    return events


def lanes(events: list[dict]) -> dict[tuple[int, int], str]:
    """(pid, tid) -> "party/lane", from the metadata events."""
    parties = {e["pid"]: e["args"]["name"] for e in events if e.get("name") == "process_name"}
    return {(e["pid"], e["tid"]): f"{parties[e['pid']]}/{e['args']['name']}"
            for e in events if e.get("name") == "thread_name"}
