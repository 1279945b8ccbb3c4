"""Runs an untrusted program (a model's Python solution) under limits and isolation, leaving
nothing behind.

    sandbox = Sandbox(SandboxLimits(wall_s=5))
    result = sandbox.run([sandbox.python, "-I", "main.py"], {"main.py": code}, stdin="1 2\\n")

Layers; `Sandbox.isolation` records each one, or why it is unavailable here:
- limits: CPU time, address space, file size (stdout and stderr are files, so output is capped
  too), open files, processes (setrlimit); wall clock (the parent kills the process group);
- user: as root, the program runs as a dedicated unprivileged uid, one per concurrent run and
  locked across processes, so it can write nowhere but its own directory, and RLIMIT_NPROC counts
  only its own processes (the limit is per uid);
- namespaces: a new network namespace (nothing reachable, not even the host's loopback), a mount
  namespace with an empty read-only tmpfs over every world-writable directory and a fresh /proc,
  and a pid namespace, whose processes the kernel kills together when its first one dies;
- a private temporary directory owned by that uid, removed afterwards; a scrubbed environment.

The set-up between fork and exec runs in a launcher, sandbox_launch.py, executed by a fresh,
single-threaded interpreter, because `subprocess`'s preexec_fn is unsafe in the trainer's
threaded process.
"""
from __future__ import annotations

import contextlib
import fcntl
import marshal
import os
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field

LAUNCH_FAILED = 125  # sandbox_launch.py's exit code when it cannot set the sandbox up
_LAUNCHER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "sandbox_launch.py")
_WORLD_WRITABLE = ("/tmp", "/var/tmp", "/dev/shm", "/run/lock", "/dev/mqueue")
_RUN = ("/run", "/var/run")  # hidden as an ordinary user (see _run_in)
_ROOT_WORKDIRS = "/run/orz-sandbox"  # as root: private directories, and the uid locks beside them
_ENV = {"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8", "HOME": "/nonexistent", "OMP_NUM_THREADS": "1",
        "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "PYTHONDONTWRITEBYTECODE": "1"}


@dataclass(frozen=True)
class SandboxLimits:
    wall_s: float = 10.0  # the parent kills the whole process group past this
    cpu_s: int = 5  # RLIMIT_CPU: SIGXCPU at this many CPU seconds, SIGKILL one second later
    memory_mb: int = 1024  # RLIMIT_AS: allocations past this fail (Python raises MemoryError)
    file_size_mb: int = 16  # RLIMIT_FSIZE: largest file, stdout and stderr included (SIGXFSZ)
    processes: int = 32  # RLIMIT_NPROC, threads included; counted per uid, hence dedicated uids
    open_files: int = 64  # RLIMIT_NOFILE


_PROBE_LIMITS = SandboxLimits(wall_s=30, cpu_s=10)  # generous: the machine may be busy


@dataclass(frozen=True)
class SandboxResult:
    returncode: int | None  # None when killed for the wall clock; -N when killed by signal N
    stdout: str
    stderr: str
    timed_out: bool
    wall_s: float
    cpu_s: float = 0.0  # user + system CPU of the program and every process it waited for

    @property
    def launch_failed(self) -> bool:
        """The sandbox could not be set up (the program never ran): not the program's fault."""
        return self.returncode == LAUNCH_FAILED and self.stderr.startswith("sandbox launcher:")


@dataclass
class _Isolation:
    """What the sandbox enforces on this machine; `reasons` says why a layer is off."""

    uids: tuple[int, int] | None = None  # [first, last) dedicated uids, or None
    namespaces: bool = False
    userns: bool = False  # not root: namespaces inside a user namespace, the program keeping our uid
    python: str = sys.executable
    reasons: dict[str, str] = field(default_factory=dict)


class Sandbox:
    """Runs programs in private directories under `limits`; safe to call from many threads."""

    def __init__(
        self,
        limits: SandboxLimits = SandboxLimits(),
        *,
        uid_range: tuple[int, int] = (3_800_000, 3_804_096),
        workdir_root: str | None = None,
        python_candidates: Sequence[str] = (sys.executable, "/usr/bin/python3"),
    ):
        self.limits = limits
        self._isolation = _Isolation(namespaces=True)
        if os.geteuid() == 0:
            self._isolation.uids = uid_range
            # Not under /tmp: the mount namespace hides the world-writable directories.
            self.workdir_root = workdir_root or _ROOT_WORKDIRS
            os.makedirs(self.workdir_root, mode=0o711, exist_ok=True)
        else:
            self._isolation.reasons["user"] = "not root: cannot switch to a dedicated uid"
            self._isolation.userns = True
            self.workdir_root = workdir_root or _private_workdirs()
        hides = (*_WORLD_WRITABLE, *(_RUN if self._isolation.userns else ()))
        hidden = [d for d in hides if _is_within(self.workdir_root, d)]
        if hidden and workdir_root is not None:
            raise ValueError(f"workdir_root {self.workdir_root} is under {hidden[0]}, which the sandbox hides")
        if hidden:  # not root, and no home outside the hidden directories
            self._isolation.namespaces = False
            self._isolation.reasons["namespaces"] = (f"no private work directory outside {hidden[0]} (give "
                                                     "the user a writable home: ~/.cache/orz-sandbox)")
        else:
            self._probe_namespaces()
        self._pick_python(python_candidates)

    @property
    def python(self) -> str:
        """An interpreter the sandboxed uid can execute (the venv's may sit in an unreadable home)."""
        return self._isolation.python

    @property
    def weak(self) -> list[str]:
        """Why no isolation beyond rlimits holds here (empty when a uid or namespaces do)."""
        iso = self._isolation
        return [] if iso.uids or iso.namespaces else [f"user: {iso.reasons['user']}",
                                                      f"namespaces: {iso.reasons['namespaces']}"]

    def refuse_weak(self, allowed: bool, what: str) -> None:
        """Raises unless a uid or namespaces isolate the code, or `allowed` (reward.code.allow_weak_sandbox):
        without either, the code could write wherever this user can and open sockets."""
        if self.weak and not allowed:
            raise RuntimeError(f"{what} refused: the sandbox has neither a uid of its own nor namespaces here "
                               f"({'; '.join(self.weak)}), so the code it runs could write anywhere this user can "
                               "and open sockets; run as root, allow user namespaces, or set "
                               "reward.code.allow_weak_sandbox=true")

    @property
    def isolation(self) -> dict[str, str]:
        """Each layer and how it is enforced here, or why not."""
        iso = self._isolation
        return {
            "limits": ", ".join(f"{k}={v}" for k, v in asdict(self.limits).items()),
            "user": f"dedicated uids {iso.uids[0]}..{iso.uids[1] - 1}" if iso.uids else
                    f"off: {iso.reasons['user']}",
            "namespaces": ("user (our own uid; the file system read-only but for the work dir), " if iso.userns else "")
                          + "network, mount (read-only tmpfs over world-writable dirs), pid"
                          if iso.namespaces else f"off: {iso.reasons['namespaces']}",
            "python": iso.python,
        }

    def run(
        self,
        argv: Sequence[str],
        files: Mapping[str, str | bytes] | None = None,
        stdin: str = "",
        limits: SandboxLimits | None = None,
    ) -> SandboxResult:
        """Runs argv in a fresh private directory holding `files` (relative names)."""
        limits = limits or self.limits
        with _UidLease(self._isolation.uids) as uid, tempfile.TemporaryDirectory() as io_dir:
            workdir = tempfile.mkdtemp(prefix="orz-sandbox-", dir=self.workdir_root)
            try:
                for name, content in (files or {}).items():
                    path = os.path.join(workdir, name)
                    mode = "wb" if isinstance(content, bytes) else "w"
                    with open(path, mode) as f:
                        f.write(content)
                    os.chmod(path, 0o644)
                if uid is not None:
                    os.chown(workdir, uid, uid)
                os.chmod(workdir, 0o700)
                return self._run_in(workdir, io_dir, uid, list(argv), stdin, limits)
            finally:
                if uid is not None:  # also a pid namespace still being torn down after a kill
                    _kill_uid(uid)
                _remove(workdir)

    def _run_in(self, workdir, io_dir, uid, argv, stdin, limits) -> SandboxResult:
        spec = {
            "argv": argv,
            "env": _ENV,
            "uid": uid,
            "namespaces": self._isolation.namespaces,
            "userns": self._isolation.userns,
            # As an ordinary user the program keeps our uid, so /run's sockets (systemd --user,
            # D-Bus, docker) would answer it: hidden too. As root, /run holds the work directories.
            "hide": _outermost(d for d in (*_WORLD_WRITABLE, *(_RUN if self._isolation.userns else ()))
                               if os.path.isdir(d)),
            "rlimits": {
                "RLIMIT_CPU": [limits.cpu_s, limits.cpu_s + 1],
                "RLIMIT_AS": [limits.memory_mb * 2**20] * 2,
                "RLIMIT_FSIZE": [limits.file_size_mb * 2**20] * 2,
                "RLIMIT_NOFILE": [limits.open_files] * 2,
                "RLIMIT_CORE": [0, 0],
            },
            "processes": limits.processes,
        }
        paths = {name: os.path.join(io_dir, name) for name in ("stdin", "stdout", "stderr")}
        with open(paths["stdin"], "w") as f:
            f.write(stdin)
        start = time.monotonic()
        with open(paths["stdin"], "rb") as fin, open(paths["stdout"], "wb") as fout, \
                open(paths["stderr"], "wb") as ferr:
            process = subprocess.Popen(
                [sys.executable, "-I", "-S", _LAUNCHER, marshal.dumps(spec).hex()],
                stdin=fin, stdout=fout, stderr=ferr, cwd=workdir, env={"PATH": _ENV["PATH"]},
                start_new_session=True,
            )
            try:
                returncode, cpu_s = _wait(process, limits.wall_s)
                timed_out = returncode is None
            finally:
                _kill_group(process)
        cap = limits.file_size_mb * 2**20
        return SandboxResult(
            returncode=returncode,
            stdout=_read(paths["stdout"], cap),
            stderr=_read(paths["stderr"], cap),
            timed_out=timed_out,
            wall_s=time.monotonic() - start,
            cpu_s=cpu_s,
        )

    def _probe_namespaces(self) -> None:
        """Turns namespaces off, with the reason, where this machine does not permit them."""
        result = self.run(["/bin/sh", "-c", "exit 0"], limits=_PROBE_LIMITS)
        if result.returncode != 0:
            self._isolation.namespaces = False
            self._isolation.reasons["namespaces"] = (result.stderr.strip() or f"exit code {result.returncode}")[:300]

    def _pick_python(self, candidates: Sequence[str]) -> None:
        """The first candidate interpreter that runs inside the sandbox."""
        failures = []
        for python in dict.fromkeys(candidates):
            result = self.run([python, "-I", "-c", "print(3)"], limits=_PROBE_LIMITS)
            if result.returncode == 0 and result.stdout.strip() == "3":
                self._isolation.python = python
                return
            failures.append(f"{python}: {result.stderr.strip()[-200:] or result.returncode}")
        raise RuntimeError(f"no Python interpreter runs inside the sandbox: {'; '.join(failures)}")


class _UidLease:
    """Holds one uid of the range for one run, locked with flock so that no other run, in this
    process or another, uses it at the same time. Yields None when uids are off."""

    def __init__(self, uids: tuple[int, int] | None):
        self.uids = uids
        self.lock_file = None

    def __enter__(self) -> int | None:
        if self.uids is None:
            return None
        lock_dir = os.path.join(_ROOT_WORKDIRS, "uid-locks")
        os.makedirs(lock_dir, mode=0o700, exist_ok=True)
        first, last = self.uids
        for uid in range(first, last):  # lowest free first: few lock files, few uids ever used
            lock_file = open(os.path.join(lock_dir, str(uid)), "w")
            try:
                fcntl.flock(lock_file, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                lock_file.close()
                continue
            self.lock_file = lock_file
            return uid
        raise RuntimeError(f"all sandbox uids {first}..{last - 1} are in use")

    def __exit__(self, *exc) -> None:
        if self.lock_file is not None:
            self.lock_file.close()


def _wait(process: subprocess.Popen, timeout_s: float) -> tuple[int | None, float]:
    """(exit code, CPU seconds) of the launcher once it exits; past `timeout_s` its session is
    killed and the code is None. os.wait4 reports the CPU time of the launcher and of what it
    waited for: the whole program (a killed one's too)."""
    pidfd = os.pidfd_open(process.pid)
    try:
        poller = select.poll()  # not select(): the trainer's descriptors may number over 1024
        poller.register(pidfd, select.POLLIN)
        timed_out = not poller.poll(timeout_s * 1000)
    finally:
        os.close(pidfd)
    if timed_out:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
    _, status, usage = os.wait4(process.pid, 0)
    process.returncode = os.waitstatus_to_exitcode(status)
    return None if timed_out else process.returncode, usage.ru_utime + usage.ru_stime


def _kill_group(process: subprocess.Popen) -> None:
    """Kills the launcher's process group (its session), then reaps the launcher. With a pid
    namespace the kernel takes every process inside down with the namespace's first process."""
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    process.wait()


def _kill_uid(uid: int, timeout_s: float = 5.0) -> None:
    """SIGKILLs every process of `uid` until none is left: ones that left the session when there
    is no pid namespace, or ones of a namespace the kernel is still tearing down after a kill."""
    deadline = time.monotonic() + timeout_s
    while (pids := _pids_of(uid)) and time.monotonic() < deadline:
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        time.sleep(0.01)


def _pids_of(uid: int) -> list[int]:
    """Live (not zombie) processes running as `uid` (the owner of /proc/PID is the euid)."""
    pids = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            if os.stat(f"/proc/{name}").st_uid != uid:
                continue
            with open(f"/proc/{name}/stat") as f:
                state = f.read().rsplit(")", 1)[1].split()[0]
        except (OSError, IndexError):
            continue
        if state != "Z":
            pids.append(int(name))
    return pids


def _private_workdirs() -> str:
    """Not root: work directories in the user's cache (made private to the user), outside every
    directory the sandbox hides; the temporary directory where there is no writable home (the
    namespace check then says why namespaces are off)."""
    path = os.path.join(os.path.expanduser("~"), ".cache", "orz-sandbox")
    try:
        os.makedirs(path, mode=0o700, exist_ok=True)
        return path
    except OSError:
        return tempfile.gettempdir()


def _outermost(directories) -> list[str]:
    """The directories (symlinks resolved) that lie inside no other one of them: hiding /run
    hides /run/lock."""
    real = sorted({os.path.realpath(d) for d in directories})
    return [d for d in real if not any(d != other and _is_within(d, other) for other in real)]


def _remove(directory: str) -> None:
    """Deletes a work directory whatever its program did to it: subdirectories it made
    unreadable (`chmod 0`) are made ours again first (symlinks are never followed)."""
    for root, subdirectories, _ in os.walk(directory):  # top-down: a directory is fixed before it is entered
        for name in subdirectories:
            path = os.path.join(root, name)
            if not os.path.islink(path):
                with contextlib.suppress(OSError):
                    os.chmod(path, 0o700)
    shutil.rmtree(directory, ignore_errors=True)


def _is_within(path: str, directory: str) -> bool:
    path, directory = os.path.realpath(path), os.path.realpath(directory)
    return os.path.commonpath([path, directory]) == directory


def _read(path: str, cap: int) -> str:
    with open(path, "rb") as f:
        return f.read(cap).decode("utf-8", errors="replace")
