"""The trainer's side of the run's timeline (orz/timeline): it collects every process's spans once
per iteration, appends them to output_dir/timeline.json and derives the goodput/* and mfu/*
figures from them, so that the file and the metrics agree by construction.

    timeline = RunTimeline(out, on=True, resume=False, restarts=0)
    timeline.start(groups, specs, cfg)               # clock offsets, resources, the peak FLOP/s
    figures = timeline.collect(iteration, window, generated_tokens, mean_seq)   # after each step
    timeline.close()                                 # the file closed, timeline.png drawn

Resources and their devices (goodput/machine weighs by them): each Megatron rank holds one GPU,
or on CPU its role's `threads`; each engine holds rollout.engine_tp GPUs, or on CPU one thread
(its OMP_NUM_THREADS). MFU per stage: the planner's forward_flops on the tokens each span reports,
divided over the rank's TP·PP·CP share (×3 for an update, ×4 with recompute), over Σ busy·peak.
Generation: forward_flops of the batch's prompt and response tokens over the engines' busy time
(the batch generated ahead is another batch; with staleness k the two are alike in size).
"""
from __future__ import annotations

import time
from pathlib import Path

import ray
import torch

from orz.config import ExperimentConfig
from orz.models.checkpoint import HFCheckpoint
from orz.plan.inputs import head_of
from orz.plan.timing import forward_flops
from orz.run import placement
from orz.run.role_spec import RoleSpec
from orz.timeline.figures import Resource, busy_seconds, gaps, goodput, mfu
from orz.timeline.peak import measured_copy_bytes_per_s, peak_flops_per_s
from orz.timeline.picture import draw
from orz.timeline.record import RECORDER, SPAN
from orz.timeline.trace import Timeline, offset_s

NO_GRAD_PASSES = ("log-probs", "teacher log-probs", "values", "scores")
PASSES = ("update", *NO_GRAD_PASSES)  # a rank's useful work (its checkpoint saves are not)
ENGINE_WORK = ("busy",)  # an engine's: generating


class RunTimeline:
    def __init__(self, out: Path, on: bool, resume: bool, restarts: int):
        """resume: a run before this one wrote the file (a resume, a restart): append to it."""
        RECORDER.on = on
        RECORDER.drain()  # what an earlier trainer in this process left (a restart)
        self.path = out / "timeline.json"
        self.file = Timeline(self.path, resume) if on else None
        self.resources: list[Resource] = []
        self.peaks: dict[str, float] = {}  # lane -> its peak FLOP/s
        self.roles: dict[str, tuple] = {}  # role -> (arch, head, its share of a pass, passes per update)
        self.engine_arch = None
        RECORDER.instant("trainer/run", "run started", resumed=resume)  # where each part of a resumed run begins
        if restarts:
            RECORDER.instant("trainer/faults", f"restart {restarts}", cause="a lost worker: roles rebuilt")

    def start(self, groups: dict, specs: dict[str, RoleSpec], cfg: ExperimentConfig, num_engines: int) -> dict:
        """Every worker records or not; their clocks' offsets; the resources and their peaks.
        Returns the figures measured once: on CPU perf/peak_flops_per_thread and
        perf/copy_gbps_per_thread (what `orz plan --against` takes for "this machine, measured")."""
        on_gpu = torch.cuda.is_available()
        for group in groups.values():
            ray.get([w.record_timeline.remote(self.file is not None) for w in group.workers])
        if self.file is None:
            return {}
        roles = placement.roles(cfg)
        per_thread = None if on_gpu else peak_flops_per_s(roles["actor"].threads) / roles["actor"].threads
        for name, group in groups.items():
            lanes = tuple(f"{name}/rank {rank}" for rank in range(len(group.workers)))
            for lane, worker in zip(lanes, group.workers):
                self.file.offsets[lane] = offset_s(lambda w=worker: ray.get(w.clock.remote()), RECORDER.now)
            devices = 1 if on_gpu else roles[name].threads
            self.resources.append(Resource(name, lanes, devices, useful=PASSES))
            peak = peak_flops_per_s(1) if on_gpu else per_thread * devices
            self.peaks |= {lane: peak for lane in lanes}
            spec = specs[name]
            sizes = spec.model.sizes
            self.roles[name] = (HFCheckpoint(spec.model_path).arch, head_of(name), sizes.tp * sizes.pp * sizes.cp,
                                4 if spec.model.recompute else 3)
        engine_devices = cfg.rollout.engine_tp if on_gpu else 1
        for i in range(num_engines):
            lane = f"engines/engine {i}"
            self.resources.append(Resource(f"engine_{i}", (lane,), engine_devices, useful=ENGINE_WORK))
            self.peaks[lane] = (peak_flops_per_s(1) or 0.0) * engine_devices if on_gpu else per_thread
        self.engine_arch = HFCheckpoint(cfg.model.path).arch
        if per_thread is None:
            return {}
        return {"perf/peak_flops_per_thread": per_thread, "perf/copy_gbps_per_thread": measured_copy_bytes_per_s(1) / 1e9}

    def collect(self, iteration: int, window: tuple[float, float], groups: dict, generated: tuple[float, float]) -> dict:
        """Appends every process's spans as `iteration`'s; its goodput/* and mfu/* figures.
        window: the iteration's `step` span; generated: (tokens, mean sequence length) of its batch."""
        if self.file is None:
            return {}
        began = time.perf_counter()
        self._gather(groups)
        self.file.add(self._idle(window))
        events = self.file.flush(iteration)
        figures = goodput(events, window, self.resources) | self._mfu(events, window, generated)
        # The timeline's own cost in this process: gathering every worker's events, writing, figures.
        return figures | {"perf/timeline_s": time.perf_counter() - began}

    def _gather(self, groups: dict) -> None:
        """Every worker's events and this process's, into the file's pending events."""
        pending = {name: group.timeline_events_async() for name, group in groups.items()}
        for name, refs in pending.items():
            for rank, events in enumerate(ray.get(refs)):
                self.file.add(events, process=f"{name}/rank {rank}")
        self.file.add(RECORDER.drain())

    def _idle(self, window: tuple[float, float]) -> list[tuple]:
        """Each engine's `idle` spans: the step's seconds it neither generated nor took weights."""
        pending = [(e[1], e[3], e[3] + e[4]) for e in self.file.pending if e[0] == SPAN and e[2] in ("busy", "weight sync")]
        return [(SPAN, lane, "idle", a, b - a, {}) for r in self.resources if r.useful == ENGINE_WORK for lane in r.lanes
                for a, b in gaps([(s, e) for l, s, e in pending if l == lane], window)]

    def _mfu(self, events: list[tuple], window: tuple[float, float], generated: tuple[float, float]) -> dict:
        """mfu/update, mfu/logprobs, mfu/generation: model FLOPs over Σ busy·peak (module docstring)."""
        stages = {"update": ([], []), "logprobs": ([], [])}  # (flops, busy·peak) per span
        for kind, lane, name, start, seconds, args in events:
            role = lane.partition("/")[0]
            if kind != SPAN or role not in self.roles or name not in PASSES:
                continue
            arch, head, share, passes = self.roles[role]
            stage = "update" if name == "update" else "logprobs"
            tokens, seq = args["tokens"], generated[1]
            flops = forward_flops(arch, tokens, seq, head) / share * (passes if stage == "update" else 1)
            stages[stage][0].append(flops)
            stages[stage][1].append(seconds * self.peaks[lane])
        figures = {f"mfu/{stage}": mfu(sum(flops), capacity) for stage, (flops, capacity) in stages.items() if flops}
        engines = [r for r in self.resources if r.useful == ENGINE_WORK]
        busy = [busy_seconds(events, r.lanes[0], window, r.useful) * self.peaks[r.lanes[0]] for r in engines]
        if engines and sum(busy) > 0:
            figures["mfu/generation"] = mfu(forward_flops(self.engine_arch, generated[0], generated[1], "lm"), busy)
        return figures

    def close(self, groups: dict, last: int = 3) -> Path | None:
        """The file closed (with what came after the last iteration: its evaluation, the last
        checkpoint, the export), and timeline.png of the last iterations beside it."""
        if self.file is None:
            return None
        self._gather(groups)
        self.file.close(RECORDER.now)
        out = self.path.with_name("timeline.png")
        try:
            draw(self.path, out, last)
        except ValueError:  # no iteration ran (a run resumed at its end, or of no iterations): no picture
            return None
        return out
