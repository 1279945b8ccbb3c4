"""The sandbox's launcher: run by a fresh interpreter (`python -I -S sandbox_launch.py SPEC`, SPEC
a hex-encoded marshal of a dict from sandbox.py), as the parent's user, in its own session. It
enters new namespaces, applies limits, drops to the sandbox uid and execs the program.

Single-threaded and short-lived, it is where the work between fork and exec can safely happen.
It imports as little as possible: it starts once per test case.
"""
import ctypes
import marshal
import os
import resource
import signal
import sys

_CLONE_NEWNS, _CLONE_NEWPID, _CLONE_NEWNET = 0x00020000, 0x20000000, 0x40000000
_MS_RDONLY, _MS_NOSUID, _MS_NODEV, _MS_NOEXEC, _MS_REC, _MS_PRIVATE = 1, 2, 4, 8, 0x4000, 0x40000
_PR_SET_PDEATHSIG, _PR_SET_NO_NEW_PRIVS = 1, 38
LAUNCH_FAILED = 125  # exit code when the sandbox cannot be set up; the reason goes to stderr


def launch(spec: dict) -> None:
    """Host side, as the parent's user: becomes the program, or, with namespaces, enters new ones
    and waits for their first process, then exits the way the program did."""
    libc = ctypes.CDLL(None, use_errno=True)
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))  # no core files, the launcher's included
    if not spec["namespaces"]:
        _become_program(libc, spec)
    if libc.unshare(_CLONE_NEWNET | _CLONE_NEWNS | _CLONE_NEWPID) != 0:
        _fail(f"unshare: {os.strerror(ctypes.get_errno())}")
    status_r, status_w = os.pipe()
    init = os.fork()
    if init == 0:
        os.close(status_r)
        _namespace_init(libc, spec, status_w)
    os.close(status_w)
    _, init_status = os.waitpid(init, 0)
    reported = os.read(status_r, 32)
    _exit_like(int(reported) if reported else init_status)


def _namespace_init(libc, spec: dict, status_w: int) -> None:
    """Pid 1 of the new namespace: sets up mounts, starts the program, reaps orphans until the
    program ends, then reports its wait status. Its exit takes the namespace down. The program is
    not pid 1 itself because pid 1 ignores signals it has no handler for (SIGXCPU included)."""
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    _check(libc.mount(None, b"/", None, _MS_REC | _MS_PRIVATE, None), "make / private")
    for path in spec["hide"]:
        flags = _MS_RDONLY | _MS_NOSUID | _MS_NODEV | _MS_NOEXEC
        _check(libc.mount(b"tmpfs", path.encode(), b"tmpfs", flags, b"size=4k"), f"hide {path}")
    _check(libc.mount(b"proc", b"/proc", b"proc", _MS_NOSUID | _MS_NODEV | _MS_NOEXEC, None), "mount /proc")
    program = os.fork()
    if program == 0:
        os.close(status_w)
        _become_program(libc, spec)
    while True:
        pid, status = os.wait()
        if pid == program:
            os.write(status_w, str(status).encode())
            os._exit(0)


def _become_program(libc, spec: dict) -> None:
    """Applies the limits, drops to the sandbox uid and execs the program."""
    for name, (soft, hard) in spec["rlimits"].items():
        resource.setrlimit(getattr(resource, name), (soft, hard))
    uid = spec["uid"]
    if uid is not None:
        resource.setrlimit(resource.RLIMIT_NPROC, (spec["processes"],) * 2)
        os.setgroups([])
        os.setgid(uid)
        os.setuid(uid)
    else:  # RLIMIT_NPROC counts all of this user's processes: allow ours on top of those
        allowed = _threads_of(os.getuid()) + spec["processes"]
        resource.setrlimit(resource.RLIMIT_NPROC, (allowed, allowed))
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)  # after setuid, which clears it
    libc.prctl(_PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0)  # setuid binaries cannot give privileges back
    try:
        os.execve(spec["argv"][0], spec["argv"], spec["env"])
    except OSError as error:
        _fail(f"exec {spec['argv'][0]}: {error}")


def _exit_like(status: int) -> None:
    """Exits with the program's code, or dies of its signal, so the parent sees the same
    returncode with or without namespaces."""
    if os.WIFSIGNALED(status):
        sig = os.WTERMSIG(status)
        if sig not in (signal.SIGKILL, signal.SIGSTOP):
            signal.signal(sig, signal.SIG_DFL)
        os.kill(os.getpid(), sig)
    os._exit(os.waitstatus_to_exitcode(status))


def _threads_of(uid: int) -> int:
    count = 0
    for name in os.listdir("/proc"):
        try:
            with open(f"/proc/{name}/status") as f:
                status = dict(line.split(":", 1) for line in f if ":" in line)
            if int(status["Uid"].split()[0]) == uid:
                count += int(status["Threads"])
        except (OSError, KeyError, ValueError):
            continue
    return count


def _check(rc: int, what: str) -> None:
    if rc != 0:
        _fail(f"{what}: {os.strerror(ctypes.get_errno())}")


def _fail(message: str) -> None:
    sys.stderr.write(f"sandbox launcher: {message}\n")
    os._exit(LAUNCH_FAILED)


if __name__ == "__main__":
    launch(marshal.loads(bytes.fromhex(sys.argv[1])))
