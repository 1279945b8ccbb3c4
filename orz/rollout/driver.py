"""The rollout driver: the one place where rollout talks to the engines.

    for group in stream(fleet, prompt_ids, SamplingConfig(n=8)):   # each prompt's 8 as they finish
        ...
    samples = generate(fleet, prompt_ids, sampling)                # in prompt order

A client asks for turns and hears each one end; the driver does the rest:

    client.begin(driver)             driver.ask(key, group, context ids, seed, max tokens, stop) per turn
    client.turn_ended(key, turn)     a turn's whole response (a Sample), asked again or not as it decides
    client.ready() / finished()      what the driver yields, and when it is done

`Batch` here is the single-turn client: every sample a conversation of one turn.
orz.rollout.multiturn.AgentLoops is the multi-turn one; both reach the engines only through this.

Each engine runs one `serve` session at a time (VLLMEngine.serve). A turn goes to engine
group mod engines (a prompt's samples share an engine and its prefix cache). The driver
  - restarts an engine that dies, or holds turns and sends nothing for rollout.request_timeout_s
    (EngineFleet.restart re-syncs it), and asks the new one for the turns the old one held;
  - on an interrupt (partial rollout: EngineFleet.interrupt at the update's end), keeps what each
    unfinished turn generated and, once the fleet holds newer weights, asks for the rest: the
    prompt + tokens kept, from seed + 2^23·resumes, within what is left of its budget. Each token
    records its weight version, so a turn may span two. Turns asked meanwhile (an environment
    answered) wait for the new weights too.
"""
from __future__ import annotations

import logging
import queue
import threading
import time
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Iterator

import ray
from ray.exceptions import RayActorError

from orz.rollout.engine import Request, Sample, SamplingConfig
from orz.rollout.fleet import EngineFleet, WeightSyncError
from orz.timeline.record import RECORDER

_RESUME_SEED_STRIDE = 2**23  # a turn's k-th continuation samples from its seed + k·2^23
_POLL_S = 0.05  # how often an interrupted driver looks for the new weights
log = logging.getLogger(__name__)


class Client:
    """What the driver calls back (see the module docstring). A client puts what it has finished
    (a prompt's group) in `_ready`; the driver yields it once."""

    def __init__(self):
        self._ready: list = []

    def begin(self, driver: RolloutDriver) -> None:
        raise NotImplementedError

    def turn_ended(self, key: int, turn: Sample) -> None:
        raise NotImplementedError

    def finished(self) -> bool:
        raise NotImplementedError

    def ready(self) -> list:
        ready, self._ready = self._ready, []
        return ready


@dataclass
class _Turn:
    """A turn asked and not ended: its request, its engine, and what interrupts left of it."""

    request: Request
    engine: int
    parts: list[dict] = field(default_factory=list)  # Sample dicts of its interrupted requests

    def next_request(self) -> Request:
        """The request that finishes it: the first, or the continuation after the tokens kept."""
        kept = [i for part in self.parts for i in part["response_ids"]]
        r = self.request
        return replace(r, prompt_ids=r.prompt_ids + kept, seed=r.seed + _RESUME_SEED_STRIDE * len(self.parts),
                       max_tokens=r.max_tokens - len(kept))

    def whole(self, last: dict) -> Sample:
        """The turn's response: its parts' tokens, log-probs and versions joined."""
        parts = [*self.parts, last]
        ids, logprobs, versions = ([x for part in parts for x in part[name]]
                                   for name in ("response_ids", "logprobs", "token_versions"))
        return Sample(index=self.request.key, prompt_ids=self.request.prompt_ids, response_ids=ids, logprobs=logprobs,
                      finish_reason=last["finish_reason"], text="".join(part["text"] for part in parts),
                      weight_version=min(versions, default=parts[0]["weight_version"]), token_versions=versions,
                      routed_experts=last["routed_experts"])


class RolloutDriver:
    """Drives one client's turns through the fleet's engines (see the module docstring)."""

    def __init__(self, fleet: EngineFleet, sampling: SamplingConfig, min_version: int | None = None,
                 interruptible: bool = False):
        self.fleet, self.sampling, self.interruptible = fleet, sampling, interruptible
        self.min_version = fleet.weight_version if min_version is None else min_version
        n = fleet.num_engines
        self.events: queue.Queue = queue.Queue()
        self.turns: dict[int, _Turn] = {}  # asked and not ended
        self.held = [0] * n  # how many of them each engine holds (kept: `_busy` runs on every ask and event)
        self.outbox: list[list[int]] = [[] for _ in range(n)]  # keys asked since the last flush
        self.sessions: list[int | None] = [None] * n  # each engine's open session; None: paused (interrupted)
        self.heard = [time.monotonic()] * n  # when each engine last sent turns (or was given work)
        self.paused_at: float | None = None  # when an interrupt first paused an engine
        self.restarts = 0
        self.busy_spans = [0] * n  # the timeline: each engine's open `busy` span (RECORDER.begin), 0: none

    # ---- for clients -------------------------------------------------------------------------
    def ask(self, key: int, group: int, context: list[int], seed: int, max_tokens: int, stop: list[str]) -> None:
        """Asks for a turn: one response to `context`; `client.turn_ended(key, ...)` hears it."""
        engine = group % len(self.sessions)
        if self.sessions[engine] is not None and not self._busy(engine):
            self.heard[engine] = time.monotonic()  # idle until now: its clock starts with this turn
        self.turns[key] = _Turn(Request(key, list(context), seed, max_tokens, tuple(stop)), engine)
        self.held[engine] += 1
        self.outbox[engine].append(key)
        self._mark(engine)

    def call_soon(self, function: Callable[[], Any]) -> None:
        """Runs `function` in the driver's loop (from any thread: an environment's answer)."""
        self.events.put(("call", None, function))

    # ---- the loop ----------------------------------------------------------------------------
    def run(self, client: Client) -> Iterator:
        """What `client.ready()` holds after each event, until `client.finished()`."""
        try:
            for engine in range(len(self.sessions)):
                self._open(engine)
            client.begin(self)
            while True:
                if self.events.empty():  # else more asks may come first: one call per engine for all
                    self._flush()
                yield from client.ready()
                if client.finished():
                    return
                self._next_event(client)
        finally:  # a rollout abandoned part-way (an exception) leaves nothing generating behind
            # A generator the collector finalises after a stopped run shut Ray down has no engine left
            # to stop (and a Ray call then would start a new cluster).
            for engine, session in enumerate(self.sessions if ray.is_initialized() else []):
                if session is not None:
                    self.fleet.close_session(engine, session, abort=not client.finished())
            self.sessions = [None] * len(self.sessions)
            for engine in range(len(self.sessions)):
                self._mark(engine)

    def _next_event(self, client: Client) -> None:
        """Handles what arrived first; with nothing waiting, first the new weights an interrupted
        engine waits for, and the engines past request_timeout_s. Never the other way round: the
        loop may have been held up (a restart), and what is already in the queue came in time."""
        if self.events.empty():
            self._resume_paused()
            self._watch_engines()
            self._flush()  # what they asked again
        try:
            kind, who, value = self.events.get(timeout=self._wait_s())
        except queue.Empty:
            return
        if kind == "call":
            return value()
        engine, session = who
        if session != self.sessions[engine]:
            return  # a session since replaced (restarted, or interrupted)
        if kind == "turns":
            self.heard[engine] = time.monotonic()
            for part in value:
                self._part(client, part)
        elif kind == "ended":
            self._ended(engine)
        else:
            self._failed(engine, value)

    def _wait_s(self) -> float | None:
        """Until the next engine that may be declared hung, or the next poll."""
        timeout = self.fleet.cfg.request_timeout_s
        deadlines = [self.heard[e] + timeout for e in range(len(self.sessions)) if self._busy(e)]
        if self.paused_at is not None:
            deadlines.append(time.monotonic() + _POLL_S)
        return max(0.0, min(deadlines) - time.monotonic()) if deadlines else None

    def _part(self, client: Client, part: dict) -> None:
        turn = self.turns.get(part["index"])
        if turn is None:
            return  # a turn asked of an engine since restarted, answered twice
        if part["finish_reason"] is None:  # interrupted: continued later
            turn.parts.append(part)
            return
        del self.turns[part["index"]]
        self.held[turn.engine] -= 1
        self._mark(turn.engine)
        client.turn_ended(part["index"], turn.whole(part))

    # ---- sessions ----------------------------------------------------------------------------
    def _open(self, engine: int) -> None:
        """Opens a session on `engine` (none while an interrupt waits for new weights) and a thread
        that forwards what it yields; every turn it holds is asked (again)."""
        opened = self.fleet.open_session(engine, self.sampling, self.min_version, self.interruptible)
        if opened is None:  # interrupted before it opened: paused until the new weights
            self.sessions[engine] = None
            self.paused_at = self.paused_at or time.monotonic()
            return
        session, stream = opened
        self.sessions[engine] = session
        self.heard[engine] = time.monotonic()
        self.outbox[engine] = [key for key, turn in self.turns.items() if turn.engine == engine]
        self._mark(engine)

        def forward():
            try:
                for ref in stream:
                    self.events.put(("turns", (engine, session), ray.get(ref)))
                self.events.put(("ended", (engine, session), None))
            except Exception as err:  # noqa: BLE001 - the loop decides: restart, or raise
                self.events.put(("failed", (engine, session), err))

        threading.Thread(target=forward, name=f"orz-serve-{engine}", daemon=True).start()

    def _flush(self) -> None:
        """Sends each open session the turns asked of it since the last flush (one call per engine)."""
        for engine, keys in enumerate(self.outbox):
            if keys and self.sessions[engine] is not None:
                self.fleet.submit(engine, self.sessions[engine], [self.turns[k].next_request() for k in keys])
                self.outbox[engine] = []

    def _ended(self, engine: int) -> None:
        """A session ends before the driver closes it only when interrupted: paused until the new weights."""
        if not self.interruptible:
            raise RuntimeError(f"engine {engine} ended a rollout session with turns unfinished")
        self.fleet.close_session(engine, self.sessions[engine])
        self.sessions[engine] = None
        self._mark(engine)
        self.paused_at = self.paused_at or time.monotonic()

    def _resume_paused(self) -> None:
        """Once the fleet holds weights newer than at the interrupt, reopens the paused engines."""
        if self.paused_at is None:
            return
        if not self.fleet.resumable():
            if time.monotonic() - self.paused_at > self.fleet.cfg.sync_timeout_s:
                raise WeightSyncError(f"an interrupted rollout waited {self.fleet.cfg.sync_timeout_s} s for weights "
                                      f"newer than version {self.fleet.interrupted_at}")
            return
        self.paused_at = None
        self.min_version = self.fleet.weight_version
        for engine, session in enumerate(self.sessions):
            if session is None:
                self._open(engine)

    # ---- failures ----------------------------------------------------------------------------
    def _busy(self, engine: int) -> bool:
        """Whether the engine has an open session holding turns (only those can hang; they generate)."""
        return self.sessions[engine] is not None and self.held[engine] > 0

    def _mark(self, engine: int) -> None:
        """The timeline: the engine's turns in flight (a counter), and a `busy` span from when it
        got its first to when it held none, or was paused (interrupted) or closed."""
        lane = f"engines/engine {engine}"
        RECORDER.count(lane, "turns in flight", self.held[engine] if self.sessions[engine] is not None else 0)
        if self._busy(engine) and not self.busy_spans[engine]:
            self.busy_spans[engine] = RECORDER.begin(lane, "busy")
        elif not self._busy(engine):
            self._end_busy(engine)

    def _end_busy(self, engine: int) -> None:
        RECORDER.end(self.busy_spans[engine])
        self.busy_spans[engine] = 0

    def _failed(self, engine: int, err: Exception) -> None:
        """A dead engine is restarted; any other failure (raised inside it) ends the rollout."""
        if not isinstance(err, RayActorError):
            raise err
        self._restart(engine, err)

    def _watch_engines(self) -> None:
        """An engine that holds turns and has sent nothing for rollout.request_timeout_s is hung: restarted."""
        timeout = self.fleet.cfg.request_timeout_s
        for engine in range(len(self.sessions)):
            if self._busy(engine) and time.monotonic() - self.heard[engine] > timeout:
                self._restart(engine, TimeoutError(f"engine {engine} sent nothing for {timeout} s"))

    def _restart(self, engine: int, cause: Exception) -> None:
        """Restarts and re-syncs the engine (EngineFleet.restart); the new session is asked for the
        turns the old one held, from what they kept."""
        self.restarts += 1
        if self.restarts > self.fleet.cfg.max_restarts:
            raise RuntimeError(f"engine {engine} failed; gave up after {self.fleet.cfg.max_restarts} restarts") from cause
        log.warning("rollout: engine %d failed (%s); restarting it", engine, cause)
        RECORDER.instant(f"engines/engine {engine}", "restart", cause=str(cause)[:200])
        self._end_busy(engine)
        self.fleet.restart(engine)
        self._open(engine)


# ---- single turn ---------------------------------------------------------------------------
class Batch(Client):
    """The single-turn client: `sampling.n` one-turn samples per prompt; sample j of prompt i is
    key i·n + j and samples from seed + i·n + j. Yields each prompt's group once all n ended."""

    def __init__(self, prompts: list[list[int]], sampling: SamplingConfig):
        super().__init__()
        self.prompts, self.sampling, self.n = prompts, sampling, sampling.n
        self.samples: dict[int, Sample] = {}
        self.left = {i: self.n for i in range(len(prompts))}

    def begin(self, driver: RolloutDriver) -> None:
        s = self.sampling
        for i, prompt in enumerate(self.prompts):
            for j in range(self.n):
                driver.ask(i * self.n + j, i, prompt, s.seed + i * self.n + j, s.max_new_tokens, s.stop)

    def turn_ended(self, key: int, turn: Sample) -> None:
        i = key // self.n
        self.samples[key] = replace(turn, index=i)
        self.left[i] -= 1
        if not self.left[i]:
            self._ready.append([self.samples.pop(i * self.n + j) for j in range(self.n)])

    def finished(self) -> bool:
        return not any(self.left.values())


def stream(fleet: EngineFleet, prompts: list[list[int]], sampling: SamplingConfig, min_version: int | None = None,
           interruptible: bool = False) -> Iterator[list[Sample]]:
    """Each prompt's `sampling.n` samples as soon as they have all finished, in no fixed order.
    interruptible: EngineFleet.interrupt may pause it until the next sync (partial rollout)."""
    return RolloutDriver(fleet, sampling, min_version, interruptible).run(Batch(prompts, sampling))


def generate(fleet: EngineFleet, prompts: list[list[int]], sampling: SamplingConfig,
             min_version: int | None = None) -> list[Sample]:
    """Samples `sampling.n` responses per prompt, in prompt order (see stream)."""
    groups = sorted(stream(fleet, prompts, sampling, min_version), key=lambda group: group[0].index)
    return [sample for group in groups for sample in group]

