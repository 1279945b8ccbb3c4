"""The sandbox's launcher: run by a fresh interpreter (`python -I -S sandbox_launch.py SPEC`, SPEC
a hex-encoded marshal of a dict from sandbox.py), as the parent's user, in its own session. It
enters new namespaces (as an ordinary user, a user namespace first: the program keeps that user's uid
on a read-only file system but for its directory), applies limits, drops to the sandbox uid (as
root) and execs the program.

Single-threaded and short-lived, it is where the work between fork and exec can safely happen.
It imports as little as possible: it starts once per test case.
"""
import ctypes
import marshal
import os
import resource
import signal
import sys

_CLONE_NEWNS, _CLONE_NEWUSER, _CLONE_NEWPID, _CLONE_NEWNET = 0x00020000, 0x10000000, 0x20000000, 0x40000000
_SYS_MOUNT_SETATTR, _AT_FDCWD, _AT_RECURSIVE, _MOUNT_ATTR_RDONLY = 442, -100, 0x8000, 1
_MS_RDONLY, _MS_NOSUID, _MS_NODEV, _MS_NOEXEC, _MS_BIND, _MS_REC, _MS_PRIVATE = 1, 2, 4, 8, 0x1000, 0x4000, 0x40000
_PR_SET_PDEATHSIG, _PR_SET_NO_NEW_PRIVS = 1, 38
LAUNCH_FAILED = 125  # exit code when the sandbox cannot be set up; the reason goes to stderr (sandbox.py reads both)


def launch(spec: dict) -> None:
    """Host side, as the parent's user: becomes the program, or, with namespaces, enters new ones
    and waits for their first process, then exits the way the program did."""
    libc = ctypes.CDLL(None, use_errno=True)
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))  # no core files, the launcher's included
    if not spec["namespaces"]:
        _become_program(libc, spec)
    flags = _CLONE_NEWNET | _CLONE_NEWNS | _CLONE_NEWPID | (_CLONE_NEWUSER if spec["userns"] else 0)
    uid, gid = os.getuid(), os.getgid()  # before unshare: unmapped, they read as the overflow id
    if libc.unshare(flags) != 0:
        _fail(f"unshare: {os.strerror(ctypes.get_errno())}")
    if spec["userns"]:  # our own ids only (all an unprivileged user may map): no privilege gained
        for name, text in (("setgroups", "deny"), ("uid_map", f"{uid} {uid} 1"), ("gid_map", f"{gid} {gid} 1")):
            with open(f"/proc/self/{name}", "w") as f:
                f.write(text)
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
    if spec["userns"]:  # the program keeps the user's uid: nothing but its directory may be written
        workdir = os.getcwd().encode()
        _check(libc.mount(workdir, workdir, None, _MS_BIND, None), "bind the work directory")
        os.chdir(workdir)  # into the bind mount, which now covers the directory
        _set_read_only(libc, b"/", True, _AT_RECURSIVE)
        _set_read_only(libc, workdir, False, 0)
    program = os.fork()
    if program == 0:
        os.close(status_w)
        _become_program(libc, spec)
    while True:
        pid, status = os.wait()
        if pid == program:
            os.write(status_w, str(status).encode())
            os._exit(0)


class _MountAttr(ctypes.Structure):
    _fields_ = [("attr_set", ctypes.c_uint64), ("attr_clr", ctypes.c_uint64), ("propagation", ctypes.c_uint64),
                ("userns_fd", ctypes.c_uint64)]


def _set_read_only(libc, path: bytes, read_only: bool, flags: int) -> None:
    """mount_setattr(2) (Linux 5.12+): the mounts at `path` (and below, with AT_RECURSIVE)."""
    attr = _MountAttr(_MOUNT_ATTR_RDONLY if read_only else 0, 0 if read_only else _MOUNT_ATTR_RDONLY, 0, 0)
    long = ctypes.c_long  # syscall(2) is variadic: every argument a full register
    rc = libc.syscall(long(_SYS_MOUNT_SETATTR), long(_AT_FDCWD), path, long(flags), ctypes.byref(attr),
                      long(ctypes.sizeof(attr)))
    _check(rc, f"make {path.decode()} {'read-only' if read_only else 'writable'}")


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
