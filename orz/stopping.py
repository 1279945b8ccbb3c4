"""How a run stops on SIGINT (Ctrl-C) and SIGTERM: orz.train.run installs StopSignals for
the run's length; the first signal raises Stopped in the main thread, the run shuts every role and
its own Ray cluster down, and `orz train` prints one line and exits 128 + the signal (130, 143).

    signals = StopSignals(); signals.install()
    try: ...                                  # the run
    except KeyboardInterrupt: signals.caught(); raise Stopped(signals.signum, ...)
    finally: signals.restore()
"""
from __future__ import annotations

import signal
import sys
import threading


class Stopped(KeyboardInterrupt):
    """SIGINT (Ctrl-C) or SIGTERM stopped the run; every role and the run's own Ray cluster are shut
    down. A KeyboardInterrupt: Ray's blocking calls pass one raised while they wait on as their
    own, and no `except Exception` takes it for a failure."""

    def __init__(self, signum: int, iterations: int | None = None, checkpoint: str | None = None):
        super().__init__(signum, iterations, checkpoint)
        self.signum, self.iterations, self.checkpoint = signum, iterations, checkpoint

    def __str__(self) -> str:
        name = "Ctrl-C (SIGINT)" if self.signum == signal.SIGINT else signal.Signals(self.signum).name
        done = ("while starting" if self.iterations is None
                else f"after {self.iterations} iteration{'' if self.iterations == 1 else 's'}")
        kept = (f"the last checkpoint is {self.checkpoint} (the same command resumes from it)" if self.checkpoint
                else "no checkpoint was written (the same command starts over)")
        return f"stopped by {name} {done}; {kept}"


class StopSignals:
    """SIGINT and SIGTERM while `main` runs. The first raises Stopped in the main thread, and raises
    it again every second until the run has caught it: Python runs a signal's handler at whatever
    bytecode the main thread reaches next, and an exception raised in a `__del__` there (Ray's
    ObjectRefGenerator has one, dropped in this thread by every engine stream that ends) is printed
    as "Exception ignored" and lost; the run then went on to its end and exited 0. Such a lost one
    is not printed here (the quiet console). Once caught, further signals do not interrupt the
    shutdown of the roles and Ray; the first is kept in `signum`, so that a run that finished and
    was shutting down still ends as stopped (exit 143 for SIGTERM)."""

    def __init__(self):
        self.signum = 0  # the first signal received
        self._caught = threading.Event()
        self._previous: dict[int, object] = {}
        self._unraisable = sys.unraisablehook

    def install(self) -> None:
        """Again after ray.init, which sets a SIGTERM handler of its own."""
        for signum in (signal.SIGINT, signal.SIGTERM):
            previous = signal.signal(signum, self._handle)
            self._previous.setdefault(signum, previous)
        sys.unraisablehook = self._unraisable_unless_stopped

    def restore(self) -> None:
        self._caught.set()
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)
        sys.unraisablehook = self._unraisable

    def _unraisable_unless_stopped(self, unraisable) -> None:
        if not isinstance(unraisable.exc_value, Stopped):  # a lost Stopped is raised again by _repeat
            self._unraisable(unraisable)

    def caught(self) -> None:
        """The run has the exception: no more of it, let the shutdown finish."""
        self._caught.set()

    def _handle(self, signum, frame):
        if self._caught.is_set():  # kept: a finished run's shutdown still ends as stopped (orz.train.run)
            self.signum = self.signum or signum
            return
        if not self.signum:
            self.signum = signum
            threading.Thread(target=self._repeat, name="orz-stop", daemon=True).start()
        raise Stopped(self.signum)

    def _repeat(self) -> None:
        main_thread = threading.main_thread().ident
        while not self._caught.wait(1.0):
            signal.pthread_kill(main_thread, self.signum)  # a real signal: it also wakes a blocking wait
