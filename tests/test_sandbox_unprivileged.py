"""The sandbox as an ordinary user, the usual case on a Slurm cluster: user, network, mount and pid
namespaces (the program keeps the user's uid on a read-only file system but for its directory).
The escape battery of test_reward_code.py runs again as a user this test creates; each escape
scores 0 and leaves nothing behind, and a fork bomb in the sandbox does not stop that user's
other processes (the trainer, Ray, vLLM) from starting new ones."""
import json
import os
import pwd
import shutil
import socket
import subprocess
import textwrap
import time
import uuid
from pathlib import Path

import pytest

from test_reward_code import HOSTILE, ONE_TEST, fenced

REPO = Path(__file__).resolve().parent.parent
USER = "orz-sandbox-test"
ROOT = os.geteuid() == 0

MISSING = [what for what, there in (("root", ROOT), ("useradd", shutil.which("useradd")),
                                    ("/usr/bin/python3", os.path.exists("/usr/bin/python3"))) if not there]
pytestmark = pytest.mark.skipif(bool(MISSING), reason=(
    f"skipped here, for want of {' and '.join(MISSING)}: this suite creates a system user and runs the escape "
    "battery as it, which needs root, useradd and a system /usr/bin/python3 that user can run; as an ordinary "
    "user it always skips, so the unprivileged sandbox is tested only where the suite runs as root"))

# As that user: the controls (each escape as a plain process, outside the sandbox), the battery
# through CodeReward, then, while a fork bomb holds the sandbox at its process limit, Python
# processes started by this (the "trainer's") process, under a realistic `ulimit -u`.
SCRIPT = """
import json, os, resource, signal, subprocess, sys, threading, time
sys.path.insert(0, ".")
from orz.data.datasets import CodeTests
from orz.config import CodeScoringConfig
from orz.reward.code import CodeReward
from orz.reward.sandbox import SandboxLimits


def tasks():
    \"\"\"Threads of every process of this user, from /proc: what RLIMIT_NPROC counts.\"\"\"
    count = 0
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            if os.stat(f"/proc/{pid}").st_uid == os.getuid():
                count += len(os.listdir(f"/proc/{pid}/task"))
        except OSError:
            pass
    return count


def children():
    \"\"\"This process's child processes, from /proc.\"\"\"
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            stat = open(f"/proc/{pid}/stat").read()
        except OSError:
            continue
        if int(stat.rsplit(")", 1)[1].split()[1]) == os.getpid():
            found.append(int(pid))
    return found


job = json.load(open("job.json"))
controls = {name: subprocess.run([sys.executable, "-c", source], capture_output=True, text=True, timeout=30).stdout
            for name, source in job["controls"].items()}
tests = CodeTests(*job["tests"])
limits = SandboxLimits(wall_s=5.0, cpu_s=1, memory_mb=512, processes=16)
bomb_limits = SandboxLimits(wall_s=90.0, cpu_s=10, memory_mb=512, processes=16)  # alive through the starts
with CodeReward(CodeScoringConfig(max_parallel=8), limits=limits) as reward, \\
        CodeReward(CodeScoringConfig(max_parallel=1), limits=bomb_limits) as bomb_reward:
    isolation = reward.sandbox.isolation
    judgements = reward.judge(job["responses"], [tests] * len(job["responses"]))
    before = tasks()
    resource.setrlimit(resource.RLIMIT_NPROC, (before + 64, before + 64))  # the user's ulimit -u
    bomb = threading.Thread(target=bomb_reward.judge, args=([job["bomb"]], [tests]))
    bomb.start()
    # A loaded machine (the whole suite, at half the CPU) ramps the bomb up slowly: it once held none of
    # its processes 20 s on. Killed below once the starts are done, it never runs its 90 s.
    deadline = time.monotonic() + 60
    starts = []
    for _ in range(10):  # each once the bomb holds its limit: its tasks then, whether it still ran, what Python printed
        while tasks() - before < limits.processes and bomb.is_alive() and time.monotonic() < deadline:
            time.sleep(0.02)
        bomb_tasks, running = tasks() - before, bomb.is_alive()
        started = subprocess.run([sys.executable, "-c", "print(3)"], capture_output=True, text=True, timeout=30)
        starts.append([bomb_tasks, running and bomb.is_alive(), started.stdout])
    # Ended now, as its wall clock would end it (the launcher's session killed), not 90 s on: until
    # then its processes spin on fork and take every core the suite has.
    for pid in children():  # the bomb's launcher: the one sandbox still running
        try:
            os.killpg(pid, signal.SIGKILL)
        except ProcessLookupError:  # its wall clock came first (a machine slow enough)
            pass
    bomb.join()
    locked = reward.run_tests(job["locks_its_directory"], tests).score  # leaves a `chmod 0` directory
    left = os.listdir(reward.sandbox.workdir_root)
print(json.dumps({"isolation": isolation, "controls": controls, "scores": [j.score for j in judgements],
                  "starts_during_bomb": starts, "timeouts": sum(j.timeouts for j in judgements), "locked": locked,
                  "left_in_workdirs": left}))
"""
# A host service on a Unix socket under /run (where systemd --user and D-Bus listen), reached
# through libc, past the harness's audit hook: only hiding /run stops it.
UNIX_CONNECT = """
    import ctypes, struct
    libc = ctypes.CDLL(None, use_errno=True)
    fd = libc.socket(1, 1, 0)  # AF_UNIX, SOCK_STREAM
    address = struct.pack("=H", 1) + {unix!r}.encode().ljust(108, b"\\0")
    if libc.connect(fd, address, len(address)) == 0:
        print(3)
"""
LOCKS_ITS_DIRECTORY = """
import os
os.makedirs("a/b")
open("a/b/f", "w").write("x" * 1000)
os.chmod("a", 0)
print(3)
"""


@pytest.fixture(scope="module")
def unprivileged():
    """A fresh system user, its home outside the directories the sandbox hides, and the package
    copied where it can read it."""
    created = subprocess.run(["useradd", "--system", "--no-create-home", "--shell", "/usr/sbin/nologin", USER],
                             capture_output=True, text=True)
    assert created.returncode in (0, 9), created.stderr  # 9: already there (an earlier, killed run)
    user = pwd.getpwnam(USER)
    home = Path(f"/var/lib/{USER}-{uuid.uuid4().hex[:8]}")  # not under /tmp or /run, which the sandbox hides
    home.mkdir(mode=0o700)
    shutil.copytree(REPO / "orz", home / "orz", ignore=shutil.ignore_patterns("__pycache__"))
    for path in [home, *home.rglob("*")]:
        os.chown(path, user.pw_uid, user.pw_gid)
    yield user, home
    shutil.rmtree(home, ignore_errors=True)
    subprocess.run(["userdel", USER], capture_output=True)


def _places(home: Path):
    """Fresh places of each kind under a new tag: (for the escapes' .format, the two listeners, the
    Unix socket's directory)."""
    tag = uuid.uuid4().hex[:8]
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    listener.setblocking(False)
    unix_dir = Path(f"/run/orz-sandbox-test-socket-{tag}")
    unix_dir.mkdir(mode=0o755)
    unix = socket.socket(socket.AF_UNIX)
    unix.bind(str(unix_dir / "bus"))
    os.chmod(unix_dir / "bus", 0o777)  # anyone may connect, as to a session bus
    unix.listen()
    unix.setblocking(False)
    places = {"other": str(home / f"pwned-{tag}"), "tmp": f"/tmp/pwned-{tag}", "shm": f"/dev/shm/pwned-{tag}",
              "repo": str(home / "orz" / f"pwned-{tag}"), "port": listener.getsockname()[1],
              "unix": str(unix_dir / "bus")}
    return places, (listener, unix), unix_dir


@pytest.fixture(scope="module")
def outside(unprivileged):
    """What a solution must not touch: the user's own home (writable outside the sandbox), the
    shared temporary directories, a service on the host's loopback and one on a Unix socket in
    /run; and the same kinds of places for the controls, run as the user outside the sandbox."""
    _, home = unprivileged
    places, listeners, unix_dir = _places(home)
    control, control_listeners, control_unix_dir = _places(home)
    yield places, listeners, control, control_listeners
    for sock in (*listeners, *control_listeners):
        sock.close()
    for directory in (unix_dir, control_unix_dir):
        shutil.rmtree(directory, ignore_errors=True)
    for key in ("tmp", "shm"):
        Path(control[key]).unlink(missing_ok=True)


@pytest.fixture(scope="module")
def battery(unprivileged, outside):
    user, home = unprivileged
    places, _, control, _ = outside
    hostile = {**HOSTILE, "unix_socket_in_run": UNIX_CONNECT}
    names = list(hostile)
    responses = [fenced(hostile[n].format(**places)) for n in names] + [fenced("print(3)\n")]
    controls = {n: textwrap.dedent(hostile[n].format(**control)) for n in CONTROLLED}
    bomb = fenced(HOSTILE["ctypes_fork_bomb"])
    (home / "job.json").write_text(json.dumps({"responses": responses, "bomb": bomb, "controls": controls,
                                               "locks_its_directory": LOCKS_ITS_DIRECTORY,
                                               "tests": [ONE_TEST.inputs, ONE_TEST.outputs]}))
    (home / "run.py").write_text(textwrap.dedent(SCRIPT))
    result = subprocess.run(["/usr/bin/python3", "-I", "run.py"], user=user.pw_uid, group=user.pw_gid, extra_groups=[],
                            cwd=home, env={"HOME": str(home), "PATH": "/usr/bin:/bin"}, capture_output=True,
                            text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(result.stdout.splitlines()[-1])
    return dict(zip([*names, "correct"], report["scores"])), report


# The escapes whose harm can be seen from outside, and where: each does its harm when the user runs
# it as a plain process (the control), so that in the battery the sandbox is what stops it.
CONTROLLED = {"writes_other_dir": "other", "writes_tmp": "tmp", "writes_shm": "shm", "writes_repo": "repo",
              "opens_socket": 0, "raw_socket_via_ctypes": 0, "unix_socket_in_run": 1}


def test_each_escape_does_its_harm_as_the_user_outside_the_sandbox(battery, outside):
    _, report = battery
    _, _, control, control_listeners = outside
    assert report["controls"] == dict.fromkeys(CONTROLLED, "3\n")
    for name, where in CONTROLLED.items():
        if isinstance(where, str):
            assert Path(control[where]).read_text() == "x", name
    for listener, calls in zip(control_listeners, (2, 1)):  # loopback: Python's and libc's connect
        for _ in range(calls):
            connection, _ = listener.accept()
            connection.close()


def test_user_namespaces_are_on_for_an_ordinary_user(battery):
    _, report = battery
    assert report["isolation"]["user"].startswith("off: not root")
    assert report["isolation"]["namespaces"].startswith("user (our own uid; the file system read-only")


@pytest.mark.parametrize("name", [*(n for n in HOSTILE if n != "leaves_a_daemon"), "unix_socket_in_run"])
def test_escape_scores_zero_as_an_ordinary_user(battery, name):
    scores, _ = battery
    assert scores[name] == 0.0
    assert scores["correct"] == 1.0


def test_nothing_is_left_behind_as_an_ordinary_user(battery, unprivileged, outside):
    user, _ = unprivileged
    places, listeners, _, _ = outside
    for key in ("other", "tmp", "shm", "repo"):
        assert not os.path.exists(places[key]), key
    for listener in listeners:  # neither the loopback service nor the Unix socket was reached
        with pytest.raises(BlockingIOError):
            listener.accept()
    deadline = time.monotonic() + 5  # a namespace the kernel is still tearing down
    while (left := _processes_of(user.pw_uid)) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert left == []  # the pid namespaces took every sandboxed process down, the daemon included


def _processes_of(uid: int) -> list[str]:
    out = subprocess.run(["ps", "-u", str(uid), "-o", "stat=,args="], capture_output=True, text=True).stdout
    return [line for line in out.splitlines() if not line.strip().startswith("Z")]


def test_a_locked_directory_is_removed_too(battery):
    _, report = battery
    assert report["locked"] == 1.0 and report["left_in_workdirs"] == []


def test_a_fork_bomb_does_not_stop_the_users_other_processes(battery):
    """RLIMIT_NPROC counts every process of the user: the sandbox's own limit is what the user runs
    now plus `processes`, so a bomb stops there, below the user's ulimit -u. Each Python process
    the trainer's side starts is started while the bomb runs with its processes, and prints."""
    _, report = battery
    starts = report["starts_during_bomb"]
    assert len(starts) == 10
    # The bomb's processes were there at every start. Its limit counts from the user's processes when
    # its sandbox started, which other work moves, so the count beside `before` is not always 16.
    assert min(bomb_tasks for bomb_tasks, _, _ in starts) > 0
    assert all(running for _, running, _ in starts)
    assert [stdout for _, _, stdout in starts] == ["3\n"] * 10
