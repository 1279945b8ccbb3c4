"""A persistent pool of worker processes that maps one function over items, each item under a
hard wall-clock limit enforced by killing its worker.

Why not `multiprocessing.Pool` or a SIGALRM: a pool cannot kill one stuck task, and signals only
reach the main thread; the trainer calls rewards from Ray actors and helper threads. Here the
parent watches every in-flight item and SIGKILLs the worker whose item overruns, then starts a
fresh one.

Workers are forked by a zygote: a clean, single-threaded interpreter, started once per pool, that
imports fn's module and nothing else, then forks a worker on request and passes its socket back.
So the trainer's threads (Ray, torch) are never forked, a restart costs a fork rather than an
import, and, unlike multiprocessing's spawn and forkserver, no worker re-imports the trainer's
main script (with torch and Megatron behind it). Workers die with the zygote (PR_SET_PDEATHSIG),
the zygote exits when the pool's process goes, so nothing outlives the trainer.

Protocol: the parent sends a worker a chunk `[(index, item), ...]`; the worker answers one message
per item, `(index, status, value, seconds, cpu_seconds)`, so the parent knows which item is running and restarts
its clock after every answer. An item whose worker dies (segfault, `os._exit`) is retried once on a
fresh worker, then reported as "crash"; the rest of that chunk is requeued without penalty.
"""
from __future__ import annotations

import contextlib
import ctypes
import gc
import multiprocessing.connection as mp_connection
import os
import pickle
import resource
import select
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

Status = Literal["ok", "error", "timeout", "crash"]
_PR_SET_PDEATHSIG = 1
_STARTUP_FAILURES_ALLOWED = 3  # consecutive worker deaths before "ready" that mean a broken setup
_STARTUP_TIMEOUT_S = 120.0  # a worker that has not said "ready" by then is killed and replaced
# A chunk queued behind a running one must fit the socket's buffer (set to _SOCKET_BUFFER_BYTES),
# or sending it would block the parent until the worker finishes its current chunk.
_QUEUE_AHEAD_BYTES = 256 * 1024
_SOCKET_BUFFER_BYTES = 1024 * 1024


@dataclass(frozen=True)
class ItemResult:
    """What became of one item. `value` is fn's return value when ok, the error text when "error"."""

    status: Status
    value: Any = None
    seconds: float = 0.0  # wall time the item ran (the limit itself for a timeout)
    cpu_seconds: float = 0.0  # CPU time the worker spent on it (0 for a timeout or a crash)


class KillablePool:
    """Maps `fn` over items in `num_workers` processes; no item runs longer than `item_timeout_s`.

    `fn`, `initializer` and the items must be picklable (module-level functions, plain data).
    `map` may be called from any thread; calls are serialised. Use as a context manager or call
    `close()`; workers also die with the process that owns the pool.
    """

    def __init__(
        self,
        fn: Callable[[Any], Any],
        num_workers: int,
        item_timeout_s: float,
        *,
        initializer: Callable[[], None] | None = None,
        chunk_size: int = 32,
        memory_limit_mb: int | None = None,
    ):
        if num_workers < 1 or item_timeout_s <= 0 or chunk_size < 1:
            raise ValueError(
                f"need num_workers >= 1, item_timeout_s > 0, chunk_size >= 1; got "
                f"{num_workers=}, {item_timeout_s=}, {chunk_size=}"
            )
        self.fn = fn
        self.num_workers = num_workers
        self.item_timeout_s = item_timeout_s
        self.chunk_size = chunk_size
        self.initializer = initializer
        self.memory_limit_mb = memory_limit_mb
        self.restarts = 0  # workers replaced after a timeout or a crash, over the pool's life
        self._lock = threading.Lock()
        self._closed = False
        self._zygote = _Zygote(fn, initializer, memory_limit_mb)
        self._workers = [self._start_worker() for _ in range(num_workers)]

    def map(self, items: Sequence[Any]) -> list[ItemResult]:
        """Runs fn on every item; results come back in item order."""
        with self._lock:
            if self._closed:
                raise RuntimeError("KillablePool is closed")
            return self._map_locked(items)

    def close(self) -> None:
        with self._lock:
            self._closed = True
            for worker in self._workers:
                worker.stop()
            self._workers = []
            self._zygote.close()

    def __enter__(self) -> KillablePool:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _start_worker(self) -> _Worker:
        try:
            pid, conn = self._zygote.fork_worker()
        except (OSError, RuntimeError):  # the zygote was killed from outside: start another
            self._zygote.close()
            self._zygote = _Zygote(self.fn, self.initializer, self.memory_limit_mb)
            pid, conn = self._zygote.fork_worker()
        return _Worker(pid, conn, self.item_timeout_s)

    def _replace(self, slot: int) -> None:
        """Kills the worker in `slot` (whatever it is doing) and starts a fresh one there."""
        self._workers[slot].stop(kill=True)
        self._workers[slot] = self._start_worker()
        self.restarts += 1

    def _map_locked(self, items: Sequence[Any]) -> list[ItemResult]:
        run = _MapRun(items)
        while run.remaining:
            self._dispatch(run)
            busy = [w.deadline for w in self._workers if w.in_flight]
            wait_s = max(0.0, min(busy) - time.monotonic()) if busy else self.item_timeout_s
            waitables = [w.conn for w in self._workers] + [w.pidfd for w in self._workers]
            signalled = set(mp_connection.wait(waitables, timeout=wait_s))
            for slot, worker in enumerate(self._workers):
                if not self._collect(worker, run, signalled):
                    self._after_death(slot, run)
                elif not worker.ready and time.monotonic() > worker.started + _STARTUP_TIMEOUT_S:
                    self._after_death(slot, run)  # a hung initializer counts as a failed start
                elif worker.in_flight and time.monotonic() >= worker.deadline:
                    current, *rest = worker.forget_all()
                    run.finish(current, ItemResult("timeout", None, self.item_timeout_s))
                    run.requeue(rest)
                    self._replace(slot)
        return run.results  # type: ignore[return-value]

    def _dispatch(self, run: _MapRun) -> None:
        """Hands chunks to workers: one to an idle worker, and a small second one to a busy worker
        with a single chunk left, so that it never waits for the parent between chunks. Chunks
        shrink near the end so that workers finish together."""
        for worker in self._workers:
            while run.pending and worker.ready and len(worker.chunks) < 2:
                size = max(1, min(self.chunk_size, len(run.pending) // (2 * self.num_workers)))
                chunk = [run.pending.popleft() for _ in range(min(size, len(run.pending)))]
                message = pickle.dumps([(i, run.items[i]) for i in chunk])
                if worker.chunks and len(message) > _QUEUE_AHEAD_BYTES:  # might block: wait until idle
                    run.requeue(chunk)
                    break
                try:
                    worker.send(chunk, message)
                except OSError:  # it has died; its pidfd tells the loop, which handles what it held
                    run.requeue(chunk)
                    break

    def _collect(self, worker: _Worker, run: _MapRun, signalled: set) -> bool:
        """Reads the worker's messages; False when it has died."""
        if worker.conn in signalled:
            try:
                while worker.conn.poll():
                    message = worker.conn.recv()
                    if message == "ready":
                        worker.ready = True
                        run.startup_failures = 0
                        continue
                    index, *outcome = message
                    run.finish(index, ItemResult(*outcome))
                    worker.finish_one()
            except (EOFError, OSError):
                return False
        return not (worker.pidfd in signalled and not worker.conn.poll())

    def _after_death(self, slot: int, run: _MapRun) -> None:
        """Retries the item a dead worker was running once, requeues the rest of what it held."""
        worker = self._workers[slot]
        if not worker.ready:
            run.startup_failures += 1
            if run.startup_failures >= _STARTUP_FAILURES_ALLOWED:
                raise RuntimeError(
                    "pool workers die before they are ready; does the initializer fail? (see stderr)"
                )
        if worker.in_flight:
            current, *rest = worker.forget_all()
            run.crashes[current] = run.crashes.get(current, 0) + 1
            if run.crashes[current] > 1:
                run.finish(current, ItemResult("crash", "the worker died"))
            else:
                rest = [current, *rest]
            run.requeue(rest)
        self._replace(slot)


class _MapRun:
    """Book-keeping of one `map` call."""

    def __init__(self, items: Sequence[Any]):
        self.items = items
        self.results: list[ItemResult | None] = [None] * len(items)
        self.pending = deque(range(len(items)))
        self.remaining = len(items)
        self.crashes: dict[int, int] = {}  # item index -> workers it has taken down
        self.startup_failures = 0

    def finish(self, index: int, result: ItemResult) -> None:
        self.results[index] = result
        self.remaining -= 1

    def requeue(self, indices: Sequence[int]) -> None:
        self.pending.extendleft(reversed(indices))


class _Worker:
    """The parent's view of one worker: its pid (and pidfd, to wait on and kill it without pid
    reuse races), its socket, and the items it holds, in order (the first one is running)."""

    def __init__(self, pid: int, conn: mp_connection.Connection, timeout_s: float):
        self.pid = pid
        self.pidfd = os.pidfd_open(pid)
        self.conn = conn
        self.timeout_s = timeout_s
        self.ready = False
        self.started = time.monotonic()
        self.in_flight: deque[int] = deque()
        self.chunks: deque[int] = deque()  # items still unanswered in each chunk sent
        self.deadline = float("inf")  # when the item it is running overruns

    def send(self, indices: list[int], message: bytes) -> None:
        self.conn.send_bytes(message)
        if not self.in_flight:
            self.deadline = time.monotonic() + self.timeout_s
        self.in_flight.extend(indices)
        self.chunks.append(len(indices))

    def finish_one(self) -> None:
        self.in_flight.popleft()
        self.chunks[0] -= 1
        if not self.chunks[0]:
            self.chunks.popleft()
        self.deadline = time.monotonic() + self.timeout_s if self.in_flight else float("inf")

    def forget_all(self) -> list[int]:
        """Gives up the items it holds (it is being replaced); returns them in order."""
        items = list(self.in_flight)
        self.in_flight.clear()
        self.chunks.clear()
        return items

    def stop(self, kill: bool = False) -> None:
        """Asks the worker to exit (or kills it), waits until it has, and frees its handles."""
        if not kill:
            try:
                self.conn.send(None)
            except OSError:
                pass
        poller = select.poll()  # not select(): descriptors may number over 1024 in a trainer
        poller.register(self.pidfd, select.POLLIN)
        if kill or not poller.poll(1000):
            with contextlib.suppress(ProcessLookupError):  # already dead
                signal.pidfd_send_signal(self.pidfd, signal.SIGKILL)
            poller.poll()
        os.close(self.pidfd)
        self.conn.close()


class _Zygote:
    """The clean process that forks workers: started with `python -c`, it gets fn and the
    initializer pickled (importing their module), then forks a worker per request."""

    def __init__(self, fn, initializer, memory_limit_mb: int | None):
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        bootstrap = (f"import sys; sys.path[:0] = {sys.path!r}; "
                     f"from orz.reward.pool import _zygote_main; _zygote_main({theirs.fileno()})")
        self.process = subprocess.Popen([sys.executable, "-c", bootstrap], pass_fds=[theirs.fileno()],
                                        stdin=subprocess.DEVNULL)
        theirs.close()
        self.socket = ours
        config = pickle.dumps((fn, initializer, memory_limit_mb))
        ours.sendall(struct.pack("!Q", len(config)) + config)

    def fork_worker(self) -> tuple[int, mp_connection.Connection]:
        self.socket.sendall(b"F")
        message, fds, _, _ = socket.recv_fds(self.socket, 8, 1)
        if not fds:
            raise RuntimeError(f"the pool's zygote died (exit code {self.process.wait()}); see stderr")
        channel = socket.socket(fileno=fds[0])
        channel.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, _SOCKET_BUFFER_BYTES)
        return struct.unpack("!q", message)[0], mp_connection.Connection(channel.detach())

    def close(self) -> None:
        self.socket.close()  # the zygote exits on end of file
        self.process.wait()


def _zygote_main(fd: int) -> None:
    """Zygote loop: one forked worker per b"F" request, until the pool's socket closes."""
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # the kernel reaps dead workers
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the trainer's to handle
    control = socket.socket(fileno=fd)
    (size,) = struct.unpack("!Q", _recv_exactly(control, 8))
    fn, initializer, memory_limit_mb = pickle.loads(_recv_exactly(control, size))
    gc.freeze()  # the imported modules: never scanned by the workers' collections, never copied by them
    zygote_pid = os.getpid()
    while control.recv(1) == b"F":
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        pid = os.fork()
        if pid == 0:
            control.close()
            ours.close()
            signal.signal(signal.SIGCHLD, signal.SIG_DFL)
            _worker_main(mp_connection.Connection(theirs.detach()), zygote_pid, fn, initializer, memory_limit_mb)
            os._exit(0)
        theirs.close()
        socket.send_fds(control, [struct.pack("!q", pid)], [ours.fileno()])
        ours.close()


def _recv_exactly(sock: socket.socket, size: int) -> bytes:
    data = b""
    while len(data) < size:
        chunk = sock.recv(size - len(data))
        if not chunk:
            raise EOFError("the pool's process closed the zygote's socket")
        data += chunk
    return data


def _worker_main(
    conn: mp_connection.Connection,
    zygote_pid: int,
    fn: Callable[[Any], Any],
    initializer: Callable[[], None] | None,
    memory_limit_mb: int | None,
) -> None:
    """Worker loop: set up, say "ready", then answer item by item until told to stop (None) or
    until the pool's process is gone (end of file)."""
    ctypes.CDLL(None).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)  # dies with the zygote, even in C code
    if os.getppid() != zygote_pid:  # the zygote died before the line above
        os._exit(0)
    if memory_limit_mb is not None:
        limit = memory_limit_mb * 2**20
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    if initializer is not None:
        initializer()
    conn.send("ready")
    while chunk := _recv_or_none(conn):
        for index, item in chunk:
            start, start_cpu = time.monotonic(), time.process_time()
            try:
                status, value = "ok", fn(item)
            except BaseException as error:  # MemoryError and RecursionError included
                status, value = "error", f"{type(error).__name__}: {error}"[:500]
            conn.send((index, status, value, time.monotonic() - start, time.process_time() - start_cpu))


def _recv_or_none(conn: mp_connection.Connection) -> Any:
    """The next chunk; None when told to stop or when the pool's process is gone."""
    try:
        return conn.recv()
    except EOFError:
        return None
