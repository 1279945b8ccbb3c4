"""Goodput and MFU of one iteration, from its spans (the events trace.Timeline.flush returns).

    busy = busy_seconds(events, "engines/engine 0", window)      # seconds the lane worked in the window
    figures = goodput(events, window, resources)                   # goodput/* of the iteration

Goodput of a resource is the share of the iteration's wall time W (the trainer's `step` span)
that it did useful work: an engine generating (its `busy` spans), a Megatron rank in a pass
(every span of its lane: forward, backward, optimizer step, log-probs). Overlapping spans count
once (their union). The machine's goodput weighs each resource by the devices it holds, d_r (GPUs;
on CPU the threads it computes with, so device-seconds are threads × wall time):
    goodput/machine = Σ_r d_r·busy_r / Σ_r d_r·W
MFU of a stage = the model FLOPs it did (the planner's FLOP model on the tokens it processed) over
Σ_r busy_r·peak_r of the resources that did them.
"""
from __future__ import annotations

from dataclasses import dataclass

from orz.timeline.record import SPAN


@dataclass(frozen=True)
class Resource:
    name: str  # the metric's name: goodput/<name>
    lanes: tuple[str, ...]  # its lanes: one per rank, or one engine's
    devices: float  # per lane: GPUs, or threads on CPU
    useful: tuple[str, ...] = ()  # the span names that count as work; () every span of its lanes


def union_seconds(spans: list[tuple[float, float]], window: tuple[float, float]) -> float:
    """Seconds of `window` that at least one (start, end) span covers."""
    clipped = sorted((max(a, window[0]), min(b, window[1])) for a, b in spans if b > window[0] and a < window[1])
    total, reach = 0.0, window[0]
    for a, b in clipped:
        if b > reach:
            total += b - max(a, reach)
            reach = b
    return total


def gaps(spans: list[tuple[float, float]], window: tuple[float, float]) -> list[tuple[float, float]]:
    """The parts of `window` no (start, end) span covers, in order."""
    out, reach = [], window[0]
    for a, b in sorted(spans):
        if a > reach and reach < window[1]:
            out.append((reach, min(a, window[1])))
        reach = max(reach, b)
    if reach < window[1]:
        out.append((reach, window[1]))
    return out


def busy_seconds(events: list[tuple], lane: str, window: tuple[float, float], useful: tuple[str, ...] = ()) -> float:
    """The union of `lane`'s spans (named in `useful`, or all) within `window`."""
    spans = [(start, start + seconds) for kind, l, name, start, seconds, _ in events
             if kind == SPAN and l == lane and (not useful or name in useful)]
    return union_seconds(spans, window)


def goodput(events: list[tuple], window: tuple[float, float], resources: list[Resource]) -> dict[str, float]:
    """goodput/<resource> (the mean over its lanes) and goodput/machine, as the module docstring says."""
    wall = window[1] - window[0]
    figures, done, held = {}, 0.0, 0.0
    for r in resources:
        busy = [busy_seconds(events, lane, window, r.useful) for lane in r.lanes]
        figures[f"goodput/{r.name}"] = sum(busy) / (len(busy) * wall)
        done += r.devices * sum(busy)
        held += r.devices * len(busy) * wall
    if held:
        figures["goodput/machine"] = done / held
    return figures


def mfu(flops: float, capacity: list[float]) -> float:
    """Model FLOPs over what the resources could have done while busy: F / Σ_r busy_r·peak_r
    (`capacity` holds each busy_r·peak_r)."""
    return flops / max(sum(capacity), 1e-12)
